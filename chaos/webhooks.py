"""The harness as Nylas: signed webhook deliveries of the workload's notifications to the agents, on the seeded
plan, as redeliveries during a fault, and in the final round; every attempt is recorded for the checker. And as
the people who answer from Gmail: their replies go straight to the sink, on the plan (their notifications are
deliveries like any other)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

from inbox_claims import Subject
from inbox_claims.testing import sign_nylas
from inbox_claims.types import SubjectKind

from .agent import post_reply
from .common import http_request
from .processes import AgentHandle, Processes
from .sink import MESSAGES_PREFIX
from .workload import OUTSIDE_SENDER, Notification, OutsideReply, Workload, envelope, message_object


class Webhooks:
    def __init__(self, workload: Workload, processes: Processes) -> None:
        self._workload = workload
        self._processes = processes
        self.notifications: dict[str, Notification] = {n.notification_id: n for n in workload.notifications}
        self.attempts: dict[str, int] = {}
        self.deliveries: list[dict[str, Any]] = []
        self.t0 = time.time()
        """The run's start: messages' dates count from it."""
        self.outside_errors: list[str] = []
        self.stored: set[str] = set()
        self.outside_notifications = {n.message.message_id: n for n in workload.notifications if n.outgoing}

    async def deliver(self, notification_id: str, agent: AgentHandle, *, reason: str) -> int:
        """POSTs one delivery attempt, signed like Nylas; 1 if the agent answered 200."""
        attempt = self.attempts.get(notification_id, 0) + 1
        self.attempts[notification_id] = attempt
        notification = self.notifications[notification_id]
        await self.store(notification)
        body = envelope(notification, attempt, sent_at=int(time.time()), t0=self.t0)
        headers = {"Content-Type": "application/json", "x-nylas-signature": sign_nylas(body, self._processes.secret)}
        at = time.time()
        error = ""
        try:
            status, _ = await http_request(agent.address, "POST", "/webhook", body=body, headers=headers, within=2.0)
            ok = status == 200
            error = "" if ok else f"HTTP {status}"
        except (OSError, TimeoutError) as failure:
            ok, error = False, type(failure).__name__
        self.deliveries.append(
            {
                "t": at,
                "nid": notification_id,
                "attempt": attempt,
                "agent": agent.name,
                "ok": ok,
                "phase": reason,
                "error": error,
            }
        )
        return int(ok)

    async def store(self, notification: Notification) -> None:
        """Gives the mail API (the sink) the message before its first notification: what the agents read with
        its headers (the sink never fails; a failure here is the harness's)."""
        message = notification.message
        if message.message_id in self.stored:
            return
        path = f"{MESSAGES_PREFIX}{message.mailbox}/{message.message_id}"
        body = json.dumps(message_object(notification, self.t0)).encode()
        status, _ = await http_request(self._processes.sink_address, "PUT", path, body=body, within=5.0)
        if status != 200:
            raise RuntimeError(f"the sink answered {status} to {path}")
        self.stored.add(message.message_id)

    async def run_arrivals(self, t0: float) -> None:
        """Each inbound message is in the mailbox (the sink) when it arrives, before its notification: what an
        agent's look before its send can find."""
        self.t0 = t0
        firsts = {n.message.message_id: n for n in reversed(self._workload.notifications) if not n.outgoing}
        for notification in sorted(firsts.values(), key=lambda n: n.message.arrives_at):
            await asyncio.sleep(max(t0 + notification.message.arrives_at - time.time(), 0.0))
            try:
                await self.store(notification)
            except (OSError, TimeoutError, RuntimeError) as error:
                self.outside_errors.append(f"{notification.message.message_id}: {type(error).__name__}: {error}")

    async def run_plan(self, t0: float) -> None:
        """The main phase's deliveries, each at its planned time after ``t0`` to its planned agent."""
        self.t0 = t0
        pending: set[asyncio.Task[int]] = set()
        agents = self._processes.agents
        for delivery in self._workload.deliveries:
            await asyncio.sleep(max(t0 + delivery.at - time.time(), 0.0))
            task = asyncio.create_task(self.deliver(delivery.notification_id, agents[delivery.agent], reason="main"))
            pending.add(task)
            task.add_done_callback(pending.discard)
        if pending:
            await asyncio.wait(pending)

    async def run_outside(self, t0: float) -> None:
        """The people's replies from Gmail, each straight to the sink at its planned time (Gmail always sends)."""

        async def send(reply: OutsideReply) -> None:
            await asyncio.sleep(max(t0 + reply.at - time.time(), 0.0))
            answered = reply.answers
            subject = Subject(answered.mailbox, SubjectKind(answered.kind), answered.id)
            try:
                await post_reply(
                    self._processes.sink_address, subject, 0, OUTSIDE_SENDER, mode="outside", sent_id=reply.message_id
                )
                await self.store(self.outside_notifications[reply.message_id])  # in the thread from now on
            except (OSError, TimeoutError, RuntimeError) as error:
                self.outside_errors.append(f"{reply.message_id}: {type(error).__name__}: {error}")

        await asyncio.gather(*(send(reply) for reply in self._workload.outside))

    async def deliver_new(self, notification: Notification, rng: random.Random) -> None:
        """A notification made during the run (a correspondent's answer): to a live agent, trying others on
        failure, as the final round does."""
        self.notifications[notification.notification_id] = notification
        for _ in range(3):
            if await self.deliver(
                notification.notification_id, rng.choice(self._processes.live_agents()), reason="storm"
            ):
                return
            await asyncio.sleep(0.5)

    async def final_round(self, rng: random.Random) -> None:
        """Every notification once more, as Nylas's last attempt: to a live agent, trying others on failure."""
        order = list(self.notifications)
        rng.shuffle(order)
        spread = max(5.0, len(order) / 20)  # about 20 deliveries a second
        start = time.time()

        async def one(index: int, nid: str) -> None:
            await asyncio.sleep(max(start + spread * index / len(order) - time.time(), 0.0))
            for _ in range(3):
                if await self.deliver(nid, rng.choice(self._processes.live_agents()), reason="final"):
                    return
                await asyncio.sleep(0.5)

        await asyncio.gather(*(one(i, nid) for i, nid in enumerate(order)))
