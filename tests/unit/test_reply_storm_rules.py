"""The reply rules' decisions (coordinator/core/storms.py, docs/design.md#reply-storms) and the rolling window,
on the in-memory store with a clock the test moves (its leases are expiry instants on that clock, as etcd's are on
etcd's): a send leaves its window when its lease ends, and the unit is free again. The rules on etcd, across
replicas: tests/server/test_reply_storms.py."""

from __future__ import annotations

import uuid

from coordinator.core.commands import BeginSend, ClaimReply, ConfirmSent
from coordinator.core.domain import Caller, FenceResult, HolderKind, Subject, SubjectKind
from coordinator.core.engine import Engine
from coordinator.core.storms import (
    Budget,
    Counting,
    GuardView,
    Inbound,
    Refusal,
    RefusalKind,
    ReplyBudgets,
    check_send,
    give_back,
    window_words,
)
from coordinator.store.memory import MemoryStore
from tests.conftest import test_rules

AGENT = Caller("agent-a", HolderKind.AGENT)
START = 1_796_220_000_000
MINUTE = 60_000


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> int:
        return self.now


def _check(guard: GuardView, budgets: ReplyBudgets, received_ms: int = START) -> Refusal | Counting:
    return check_send(
        guard, budgets, received_ms=received_ms, message_id="m-1", token=7, now_ms=START, expiry=lambda w: START + w
    )


def test_the_window_in_words_and_the_refusals_fields() -> None:
    assert [window_words(ms) for ms in (60_000, 1_800_000, 3_600_000, 7_200_000, 86_400_000, 604_800_000)] == [
        "minute",
        "30 minutes",
        "hour",
        "2 hours",
        "day",
        "7 days",
    ]
    sends = ((START - 50 * MINUTE, 1), (START - 10 * MINUTE, 2))
    guard = GuardView("t-1", "ana@example.com", thread_sends=sends, correspondent_sends=sends)
    refused = _check(guard, ReplyBudgets(thread=Budget(2, 60 * MINUTE)))
    assert isinstance(refused, Refusal)
    assert (refused.kind, refused.scope, refused.counted, refused.limit) == (
        RefusalKind.REPLY_BUDGET_SPENT,
        "thread",
        2,
        2,
    )
    assert refused.frees_ms == START + 10 * MINUTE  # the oldest leaves the hour then
    single = _check(guard, ReplyBudgets(thread=None, correspondent=Budget(1, 1440 * MINUTE)))
    assert isinstance(single, Refusal)
    assert single.reason == "agents stopped: 1 agent reply to ana@example.com in the last day — a person should look"
    # Off: counted nowhere, refused by nothing; the moved-on rule still holds.
    off = _check(guard, ReplyBudgets(None, None))
    assert off == Counting((START, 7), 0, 0)
    moved = _check(GuardView("t-1", "", latest=Inbound("m-2", START + 1)), ReplyBudgets(None, None))
    assert isinstance(moved, Refusal)
    assert (moved.kind, moved.newer_message_id) == (RefusalKind.CONVERSATION_MOVED_ON, "m-2")
    # The claim's own message, or one received at the same time, is not newer.
    assert isinstance(_check(GuardView("t-1", "", latest=Inbound("m-1", START + 5)), ReplyBudgets()), Counting)
    assert isinstance(_check(GuardView("t-1", "", latest=Inbound("m-3", START)), ReplyBudgets()), Counting)
    assert give_back(guard, 2) == Counting(give_back=2)
    assert give_back(guard, 99) is None


async def test_a_send_leaves_the_window_when_its_lease_ends() -> None:
    clock = Clock()
    budgets = ReplyBudgets(thread=Budget(2, 60 * MINUTE), correspondent=None)
    engine = Engine(MemoryStore(clock), test_rules(reply_budgets=lambda _mailbox: budgets), clock)

    async def send(name: str) -> FenceResult:
        subject = Subject("box", SubjectKind.MESSAGE, name)
        claimed = await engine.claim_reply(
            AGENT,
            ClaimReply(request_id=uuid.uuid4().hex, subject=subject, thread_id="t-1", received_ms=START - MINUTE),
        )
        assert claimed.stored is not None
        token = claimed.stored.token
        result, _, _ = await engine.begin_send(
            AGENT, BeginSend(request_id=uuid.uuid4().hex, subject=subject, token=token)
        )
        if result is FenceResult.OK:
            await engine.confirm_sent(
                AGENT, ConfirmSent(request_id=uuid.uuid4().hex, subject=subject, token=token, sent_message_id="s")
            )
        return result

    assert await send("m-1") is FenceResult.OK
    clock.now += 30 * MINUTE
    assert await send("m-2") is FenceResult.OK
    assert await send("m-3") is FenceResult.REFUSED
    (stopped,) = (await engine.recent_messages(AGENT, mailbox="box", query="", page_size=0)).stopped
    assert (stopped.subject.id, stopped.thread_id, stopped.stopped_holder) == ("m-3", "t-1", AGENT.principal)
    assert stopped.refusal.frees_ms == START + 60 * MINUTE
    clock.now += 31 * MINUTE  # the first send left the hour (its lease, rounded up to the 1 s bucket, ended)
    # Agents are no longer stopped there: the record went with the budget's freeing.
    assert (await engine.recent_messages(AGENT, mailbox="box", query="", page_size=0)).stopped == []
    assert await send("m-4") is FenceResult.OK
    assert await send("m-5") is FenceResult.REFUSED
