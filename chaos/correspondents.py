"""The correspondents that answer every reply (issue 33's storm actors): they read what went out (the sink's log)
and, a moment after each reply to one of their threads, write back in that thread; the harness, as Nylas,
delivers the answer's notification like any other.

An out-of-office auto-responder marks its answers ``Auto-Submitted: auto-replied`` (agents must leave them); an
auto-responder that marks nothing, and another company's agent that marks nothing, look like people: only the
reply budget stops the ping-pong (docs/design.md#reply-storms). They answer every reply, a person's too, and stop
answering when the main phase ends (so that the run can drain), or after :data:`MAX_ANSWERS` in a thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from .common import JsonlTail
from .workload import Actor, Message, Notification, Workload

ANSWER_DELAY_S = (1.2, 4.0)
"""Seconds from a reply going out to the answer arriving: over a second, so that the answer's date (whole seconds,
as Nylas gives it) is after the reply it answers."""
MAX_ANSWERS = 40
"""A thread's answers at most: the negative control's storm must end too."""
DeliverFn = Callable[[Notification], Awaitable[object]]
MARKS: dict[Actor, tuple[tuple[str, str], ...]] = {"ooo": (("Auto-Submitted", "auto-replied"),)}


class Correspondents:
    def __init__(self, workload: Workload, sink_log: Path, seed: int) -> None:
        self.rng = random.Random(f"correspondents/{seed}")
        self.kinds: dict[str, Actor] = dict(workload.responders)
        self.first: dict[str, Message] = {m.thread_id: m for m in workload.messages if m.thread_id in self.kinds}
        self.thread_of: dict[str, str] = {m.message_id: m.thread_id for m in workload.messages}
        self.tail = JsonlTail(sink_log)
        self.messages: list[Message] = []
        self.notifications: list[Notification] = []
        self.answers: dict[str, int] = {}

    async def run(self, t0: float, stop_at: float, deliver: DeliverFn) -> None:
        """Until ``stop_at``: every reply that went out in a responder's thread is answered, its notification
        delivered to an agent (and sometimes again, as Nylas redelivers)."""
        pending: set[asyncio.Task[None]] = set()
        while time.time() < stop_at:
            for send in self.tail.new_records():
                if send.get("ev") != "send" or not send.get("sent"):
                    continue
                thread = self.thread_of.get(str(send.get("subject_id")), "")
                if thread not in self.kinds or self.answers.get(thread, 0) >= MAX_ANSWERS:
                    continue
                self.answers[thread] = self.answers.get(thread, 0) + 1
                task = asyncio.create_task(self.answer(thread, t0, stop_at, deliver))
                pending.add(task)
                task.add_done_callback(pending.discard)
            await asyncio.sleep(0.2)
        if pending:
            await asyncio.wait(pending)

    async def answer(self, thread: str, t0: float, stop_at: float, deliver: DeliverFn) -> None:
        await asyncio.sleep(self.rng.uniform(*ANSWER_DELAY_S))
        if time.time() >= stop_at:
            return
        kind = self.kinds[thread]
        first = self.first[thread]
        number = len(self.messages) + 1
        message = dataclasses.replace(
            first,
            message_id=f"auto-{number:05d}",
            arrives_at=time.time() - t0,
            actor=kind,
            headers=MARKS.get(kind, ()),
        )
        self.thread_of[message.message_id] = thread
        notification = Notification(f"ntf-s{number:05d}", "message.created", message, message.arrives_at)
        self.messages.append(message)
        self.notifications.append(notification)
        await deliver(notification)
        if self.rng.random() < 0.3:  # Nylas redelivers now and then
            await asyncio.sleep(self.rng.uniform(0.2, 5.0))
            await deliver(notification)
