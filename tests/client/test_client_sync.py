"""The blocking client against a real coordinator on a real etcd.

The coordinator fixtures serve on the test's event loop, so each scenario runs the blocking client in a worker
thread (``asyncio.to_thread``) while the loop keeps serving: exactly how a threaded web app would use it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from coordinator.ops.server import CoordinatorServer
from inbox_claims import (
    AlreadyReplied,
    Claim,
    ClaimLost,
    Coordinator,
    DuplicateDelivery,
    Notification,
    ReplyHeld,
    SendOutcomeUnknown,
    SendRejected,
    Subject,
    SubjectState,
)
from inbox_claims.errors import InvalidRequest, Unauthenticated
from inbox_claims.types import ClaimOutcome, EventType, LossReason, TakeoverOutcome, WatchEvent, WatchSnapshot
from tests.client.support import HUMAN, SendLog, nylas_notification
from tests.conftest import StartCoordinator

Connect = Callable[..., Coordinator]


@pytest.fixture
def connect() -> Iterator[Connect]:
    """Opens blocking clients (closed after the test): ``connect(address, principal, kind=..., **options)``."""
    opened: list[Coordinator] = []

    def open_client(address: str, principal: str | None = None, **options: Any) -> Coordinator:
        client = Coordinator(address, principal=principal, **options)
        opened.append(client)
        return client

    yield open_client
    for client in opened:
        client.close()


@pytest.fixture
def agent(coordinator: CoordinatorServer, connect: Connect) -> Coordinator:
    return connect(coordinator.address, "agent-a")


@pytest.fixture
def other(coordinator: CoordinatorServer, connect: Connect) -> Coordinator:
    return connect(coordinator.address, "agent-b")


@pytest.fixture
def human(coordinator: CoordinatorServer, connect: Connect) -> Coordinator:
    return connect(coordinator.address, HUMAN, kind="human")


def wait_for_state(client: Coordinator, subject: Subject, state: SubjectState, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while client.status(subject).state is not state:
        assert time.monotonic() < deadline, f"{subject} never became {state.name}"
        time.sleep(0.05)


async def test_every_rpc_through_the_blocking_client(
    start_coordinator: StartCoordinator, connect: Connect, mailbox: str
) -> None:
    server = await start_coordinator(send_timeout_ms=300)
    agent, human = connect(server.address, "agent-a"), connect(server.address, HUMAN, kind="human")

    def scenario() -> None:
        assert agent.record_delivery(mailbox, "notif-1").is_new
        assert not human.record_delivery(mailbox, "notif-1").is_new

        watch = human.watch(mailbox)
        snapshot = next(watch)
        assert isinstance(snapshot, WatchSnapshot)
        assert snapshot.subjects == ()

        replied = Subject.message(mailbox, "replied")
        granted = agent.claim(replied, ttl=30, notification_id="notif-2")
        assert granted.outcome is ClaimOutcome.GRANTED
        assert agent.renew(replied, granted.token, ttl=40).ok
        assert agent.begin_send(replied, granted.token).ok
        confirmed = agent.confirm_sent(replied, granted.token, "sent-1")
        assert (confirmed.status.state, confirmed.status.sent_message_id) == (SubjectState.REPLIED, "sent-1")
        events = [next(watch) for _ in range(4)]
        assert all(isinstance(event, WatchEvent) for event in events)
        assert [event.type for event in events if isinstance(event, WatchEvent)] == [
            EventType.CLAIMED,
            EventType.RENEWED,
            EventType.SENDING,
            EventType.REPLIED,
        ]
        watch.close()  # ends the stream

        released = Subject.message(mailbox, "released")
        token = agent.claim(released, ttl=30).token
        assert agent.release(released, token).status.state is SubjectState.FREE
        aborted = Subject.message(mailbox, "aborted")
        token = agent.claim(aborted, ttl=30).token
        assert agent.begin_send(aborted, token).ok
        assert agent.abort_send(aborted, token, "refused").status.state is SubjectState.FREE

        taken = Subject.message(mailbox, "taken")
        token = agent.claim(taken, ttl=30).token
        takeover = human.takeover(taken, note="mine now")
        assert takeover.outcome is TakeoverOutcome.TAKEN_OVER
        assert takeover.previous_token == token
        assert agent.renew(taken, token).stale

        doubtful = Subject.message(mailbox, "doubtful")
        token = agent.claim(doubtful, ttl=30).token
        assert agent.begin_send(doubtful, token).ok
        wait_for_state(human, doubtful, SubjectState.IN_DOUBT)
        resolved = human.resolve_in_doubt(doubtful, sent=True, sent_message_id="found-it")
        assert (resolved.state, resolved.sent_message_id) == (SubjectState.REPLIED, "found-it")

        page = agent.list_claims(mailbox, page_size=2)
        assert len(page.subjects) == 2
        assert page.next_page_token
        everything = list(agent.iter_claims(mailbox, page_size=2))
        assert [s.subject.id for s in everything] == ["doubtful", "replied", "taken"]
        assert [s.subject.id for s in agent.iter_claims(mailbox, states=[SubjectState.CLAIMED])] == ["taken"]
        assert agent.status(released).state is SubjectState.FREE

        with pytest.raises(InvalidRequest, match="ttl_seconds"):
            agent.claim(Subject.message(mailbox, "x"), ttl=99999)
        with pytest.raises(Unauthenticated):
            connect(server.address).status(released)

    await asyncio.to_thread(scenario)


async def test_reply_to_sends_once_and_drops_redeliveries(agent: Coordinator, other: Coordinator, mailbox: str) -> None:
    def scenario() -> None:
        notification = nylas_notification(mailbox, "msg-1")
        sends = SendLog()
        with agent.reply_to(notification, ttl=30) as claim:
            assert claim.subject == Subject.message(mailbox, "msg-1")
            assert claim.token > 0
            assert claim.idempotency_key == claim.subject.idempotency_key
            assert claim.send(sends.send, "Hello") == "sent-1"
        assert claim.replied
        for client in (agent, other, other):
            with pytest.raises(DuplicateDelivery), client.reply_to(notification):
                pytest.fail("a redelivery was claimed")
        updated = nylas_notification(mailbox, "msg-1", type_="message.updated")
        with pytest.raises(AlreadyReplied) as replied, other.reply_to(updated):
            pytest.fail("replied twice")
        assert replied.value.sent_message_id == "sent-1"
        assert sends.calls == ["Hello"]
        status = other.status(claim.subject)
        assert (status.state, status.holder, status.sent_message_id) == (SubjectState.REPLIED, "agent-a", "sent-1")

    await asyncio.to_thread(scenario)


async def test_a_second_agent_is_told_who_holds_the_message(
    agent: Coordinator, other: Coordinator, mailbox: str
) -> None:
    def scenario() -> None:
        with agent.reply_to(mailbox=mailbox, message_id="msg-1", ttl=30) as claim:
            with pytest.raises(ReplyHeld) as held, other.reply_to(mailbox=mailbox, message_id="msg-1"):
                pytest.fail("two agents held one message")
            assert held.value.holder == "agent-a"
            assert held.value.expires_at == claim.expires_at

    await asyncio.to_thread(scenario)


async def test_renewal_thread_keeps_the_claim_past_its_ttl(
    agent: Coordinator, other: Coordinator, mailbox: str
) -> None:
    def scenario() -> None:
        with agent.reply_to(mailbox=mailbox, message_id="slow", ttl=2) as claim:
            time.sleep(4)  # past the TTL and the lease bucket: only renewals keep it
            assert not claim.lost.is_set()
            status = other.status(claim.subject)
            assert (status.state, status.holder, status.fencing_token) == (SubjectState.CLAIMED, "agent-a", claim.token)
            claim.send(lambda: "sent-slowly")
        assert other.status(claim.subject).state is SubjectState.REPLIED

    await asyncio.to_thread(scenario)


async def test_a_takeover_sets_lost_calls_on_lost_and_fences_the_send(
    agent: Coordinator, human: Coordinator, mailbox: str
) -> None:
    noticed: list[tuple[Claim, str]] = []

    def on_lost(claim: Claim) -> None:
        noticed.append((claim, threading.current_thread().name))

    def scenario() -> None:
        sends = SendLog()
        with agent.reply_to(mailbox=mailbox, message_id="msg-1", ttl=3, on_lost=on_lost) as claim:
            assert human.takeover(claim.subject).outcome is TakeoverOutcome.TAKEN_OVER
            assert claim.lost.wait(5)
            assert claim.loss is not None
            assert claim.loss.reason is LossReason.TAKEN_OVER
            with pytest.raises(ClaimLost):
                claim.send(sends.send)
        assert sends.calls == []
        assert noticed == [(claim, f"inbox-claims renewal {claim.token}")]  # called once, from the renewal thread
        assert human.status(claim.subject).holder == HUMAN

    await asyncio.to_thread(scenario)


async def test_send_rejected_aborts_and_an_unknown_failure_ends_in_doubt(
    start_coordinator: StartCoordinator, connect: Connect, mailbox: str
) -> None:
    server = await start_coordinator(send_timeout_ms=500)
    agent = connect(server.address, "agent-a")

    def refuse() -> str:
        raise SendRejected("400 Bad Request")

    def connection_reset() -> str:
        raise ConnectionResetError("connection reset by peer")

    def scenario() -> None:
        with pytest.raises(SendRejected), agent.reply_to(mailbox=mailbox, message_id="refused") as refused:
            refused.send(refuse)
        assert agent.status(refused.subject).state is SubjectState.FREE

        with pytest.raises(SendOutcomeUnknown) as unknown, agent.reply_to(mailbox=mailbox, message_id="reset") as claim:
            claim.send(connection_reset)
        assert isinstance(unknown.value.__cause__, ConnectionResetError)
        assert agent.status(claim.subject).state is SubjectState.SENDING
        wait_for_state(agent, claim.subject, SubjectState.IN_DOUBT)

    await asyncio.to_thread(scenario)


async def test_leaving_without_sending_releases_and_a_coroutine_is_never_sent(
    agent: Coordinator, other: Coordinator, mailbox: str
) -> None:
    async def async_send() -> str:
        return "never"

    def scenario() -> None:
        with agent.reply_to(mailbox=mailbox, message_id="skipped"):
            pass
        assert other.status(Subject.message(mailbox, "skipped")).state is SubjectState.FREE
        with pytest.raises(KeyError), agent.reply_to(mailbox=mailbox, message_id="crashed"):
            raise KeyError("the draft template")
        assert other.status(Subject.message(mailbox, "crashed")).state is SubjectState.FREE

        # A coroutine function given to the blocking client cannot run: nothing was sent, so it aborts.
        with pytest.raises(TypeError, match="awaitable"), agent.reply_to(mailbox=mailbox, message_id="async") as claim:
            claim.send(async_send)  # type: ignore[arg-type]  # what mypy would catch, at run time
        assert other.status(claim.subject).state is SubjectState.FREE

    await asyncio.to_thread(scenario)


async def test_guarded_decorator_and_threads_racing_for_one_message(
    coordinator: CoordinatorServer, connect: Connect, mailbox: str
) -> None:
    clients = [connect(coordinator.address, f"agent-{i}") for i in range(4)]
    sends = SendLog()
    handlers = []
    for client in clients:

        @client.guarded(ttl=30)
        def handle(notification: Notification, claim: Claim, draft: str) -> str | None:
            return claim.send(sends.send, draft)

        handlers.append(handle)

    notification = nylas_notification(mailbox, "msg-1")

    def attempt(i: int) -> str:
        try:
            handlers[i % 4](notification, f"draft {i}")
            return "sent"
        except (DuplicateDelivery, ReplyHeld, AlreadyReplied) as refusal:
            return type(refusal).__name__

    def scenario() -> list[str]:
        with ThreadPoolExecutor(max_workers=12) as pool:
            return list(pool.map(attempt, range(12)))

    results = await asyncio.to_thread(scenario)
    assert results.count("sent") == 1
    assert len(sends.calls) == 1
    assert set(results) <= {"sent", "DuplicateDelivery", "ReplyHeld", "AlreadyReplied"}


async def test_a_blocking_claim_marked_replied_by_hand_stops_the_agents(
    agent: Coordinator, other: Coordinator, human: Coordinator, mailbox: str
) -> None:
    def scenario() -> None:
        with human.reply_to(nylas_notification(mailbox, "vip")) as claim:
            claim.mark_replied(sent_message_id="gmail-3", note="answered from Gmail")
            assert claim.replied
        status = other.status(claim.subject)
        assert (status.state, status.replied_by_hand, status.sent_message_id) == (SubjectState.REPLIED, True, "gmail-3")
        updated = nylas_notification(mailbox, "vip", type_="message.updated")
        with pytest.raises(AlreadyReplied), agent.reply_to(updated):
            pytest.fail("a message answered by hand was claimed again")

    await asyncio.to_thread(scenario)
