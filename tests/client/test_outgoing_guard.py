"""The guard and the mailbox's own messages, against a real coordinator on a real etcd and the fake Nylas: an
outgoing message is never handed to the user's code, the agent's own reply is recognised when it comes back, and
a person answering from "Gmail" stops the agent that is drafting (docs/design.md#replies-written-outside)."""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from coordinator.ops.server import CoordinatorServer
from examples.agent.fake_nylas import FakeNylas
from inbox_claims import (
    AsyncCoordinator,
    ClaimLost,
    Coordinator,
    OutgoingMessage,
    Subject,
    SubjectState,
    nylas,
)
from inbox_claims.types import EventType, HolderKind, LossReason, OutgoingOutcome, WatchEvent
from tests.conftest import StartCoordinator

API_KEY = "nyk_outgoing_test"
MAILBOX = "grant-outgoing"
SHOP = "support@shop.example"
# Message dates, unix seconds: the customer writes at 10:00, Ana answers from Gmail at 10:05.
ASKED, ANSWERED = 1_700_000_000, 1_700_000_300


def event(
    message_id: str,
    thread_id: str,
    *,
    date: int = ASKED,
    folders: tuple[str, ...] = ("INBOX",),
    sender: tuple[str, str] = ("Bea Costa", "bea@example.org"),
    kind: str = "message.created",
) -> dict[str, Any]:
    """A Nylas v3 message notification, as the handler's ``json.loads(body)`` gives it."""
    return {
        "specversion": "1.0",
        "type": kind,
        "id": f"notif-{uuid.uuid4().hex[:12]}",
        "time": date + 2,
        "data": {
            "application_id": "app-1",
            "object": {
                "id": message_id,
                "grant_id": MAILBOX,
                "thread_id": thread_id,
                "object": "message",
                "subject": "Where is my order?",
                "from": [{"name": sender[0], "email": sender[1]}],
                "folders": list(folders),
                "date": date,
            },
        },
    }


def from_gmail(message_id: str, thread_id: str, date: int = ANSWERED) -> dict[str, Any]:
    """Ana's reply from Gmail, in the thread: Google labels it SENT."""
    return event(message_id, thread_id, date=date, folders=("SENT",), sender=("Ana Lima", "ana@shop.example"))


def new_id(name: str = "msg") -> str:
    return f"{name}-{uuid.uuid4().hex[:10]}"


def draft(message_id: str) -> dict[str, Any]:
    return {"reply_to_message_id": message_id, "to": [{"email": "bea@example.org"}], "subject": "Re", "body": "x"}


@pytest.fixture
async def server(start_coordinator: StartCoordinator) -> CoordinatorServer:
    return await start_coordinator()


@pytest.fixture
def fake() -> Iterator[FakeNylas]:
    with FakeNylas(API_KEY) as endpoint:
        yield endpoint


@pytest.fixture
async def agent(server: CoordinatorServer) -> AsyncIterator[AsyncCoordinator]:
    async with AsyncCoordinator(server.address, principal="agent-a", mailbox_addresses=[SHOP]) as client:
        yield client


@pytest.fixture
async def webhook(server: CoordinatorServer) -> AsyncIterator[AsyncCoordinator]:
    """Another replica of the agent, which receives the person's notification."""
    async with AsyncCoordinator(server.address, principal="agent-b", mailbox_addresses=[SHOP]) as client:
        yield client


async def test_an_outgoing_message_never_reaches_the_handler_and_is_recorded(
    agent: AsyncCoordinator, webhook: AsyncCoordinator, caplog: pytest.LogCaptureFixture
) -> None:
    ran: list[str] = []

    @webhook.guard
    async def answer(received: dict[str, Any]) -> None:
        ran.append(received["data"]["object"]["id"])

    thread = new_id("thread")
    customer = new_id()
    caplog.set_level(logging.INFO, logger="inbox_claims")
    async with agent.reply_to(event(customer, thread), ttl=30) as claim:
        await answer(from_gmail(new_id("gmail"), thread))  # in SENT: outgoing
        # From the mailbox's own address, in a folder the rules do not know (a Microsoft id): outgoing too.
        await answer(event(new_id("outlook"), thread, date=ANSWERED, folders=("AAMk-sent",), sender=("", SHOP)))
        assert ran == []
        status = await agent.status(claim.subject)
    assert status.state is SubjectState.REPLIED
    assert status.replied_outside
    assert (status.holder, status.holder_kind) == ("Ana Lima <ana@shop.example>", HolderKind.HUMAN)
    assert status.outside_reply is not None
    assert (status.outside_reply.stopped_holder, status.outside_reply.recorded_by) == ("agent-a", "agent-b")
    lines = [record.getMessage() for record in caplog.records if "it is outgoing" in record.getMessage()]
    assert len(lines) == 2
    assert "it is in the sent folder 'SENT'" in lines[0]
    assert customer in lines[0]  # what it answered
    assert f"it is from the mailbox's own address {SHOP!r}" in lines[1]
    # reply_to itself refuses an outgoing message, as a refusal (ClaimNotGranted) with what was recorded.
    with pytest.raises(OutgoingMessage) as refused:
        async with webhook.reply_to(from_gmail(new_id("gmail"), new_id("thread"))):
            ran.append("never")
    assert refused.value.result is not None
    assert refused.value.result.outcome is OutgoingOutcome.ANSWERED_OUTSIDE
    assert ran == []


async def test_the_agents_own_reply_coming_back_is_recognised_and_not_answered(
    agent: AsyncCoordinator, fake: FakeNylas
) -> None:
    thread, customer = new_id("thread"), new_id()
    async with (
        httpx.AsyncClient(base_url=fake.api_base, headers={"Authorization": f"Bearer {API_KEY}"}) as http,
        agent.reply_to(event(customer, thread)) as claim,
    ):
        sent_id = await claim.send(nylas.send, http, MAILBOX, draft(customer), idempotency_key=claim.idempotency_key)
    assert sent_id is not None
    echo = event(sent_id, thread, date=ASKED + 5, folders=("SENT",), sender=("Shop", SHOP))
    with pytest.raises(OutgoingMessage) as refused:
        async with agent.reply_to(echo):
            pass
    assert refused.value.result is not None
    assert refused.value.result.outcome is OutgoingOutcome.OWN_REPLY
    assert [status.subject for status in refused.value.result.subjects] == [claim.subject]
    after = await agent.status(claim.subject)
    assert (after.state, after.replied_outside, after.holder) == (SubjectState.REPLIED, False, "agent-a")
    assert len(fake.sends) == 1


async def test_a_person_answering_from_gmail_stops_the_agent_drafting(
    agent: AsyncCoordinator, webhook: AsyncCoordinator, fake: FakeNylas
) -> None:
    thread, customer = new_id("thread"), new_id()
    events: list[WatchEvent] = []
    watching = asyncio.Event()

    async def watch() -> None:
        async for item in agent.watch(MAILBOX):
            watching.set()
            if isinstance(item, WatchEvent) and item.status.subject.id == customer:
                events.append(item)

    watcher = asyncio.create_task(watch())
    await asyncio.wait_for(watching.wait(), 10)
    sends: list[str] = []

    def record_send() -> str:
        sends.append("sent")
        return "never"

    claim = agent.reply_to(event(customer, thread), ttl=3, cancel_on_loss=True)

    async def draft_and_send() -> None:
        async with claim:
            with pytest.raises(OutgoingMessage):
                async with webhook.reply_to(from_gmail(new_id("gmail"), thread)):
                    pass
            await asyncio.sleep(10)  # drafting; the renewal (every second) learns it and cancels this
            await claim.send(record_send)

    with pytest.raises(ClaimLost) as lost:
        await draft_and_send()
    assert lost.value.reason is LossReason.ANSWERED_OUTSIDE
    assert "someone answered it from the mailbox: Ana Lima <ana@shop.example>" in str(lost.value)
    assert sends == []
    assert claim.lost.is_set()
    for _ in range(100):
        if any(event.type is EventType.ANSWERED_OUTSIDE for event in events):
            break
        await asyncio.sleep(0.05)
    watcher.cancel()
    answered = [event for event in events if event.type is EventType.ANSWERED_OUTSIDE]
    assert [(event.previous_holder, event.previous_token) for event in answered] == [("agent-a", claim.token)]
    assert answered[0].status.outside_reply is not None
    assert answered[0].status.outside_reply.sent_at is not None
    assert int(answered[0].status.outside_reply.sent_at.timestamp()) == ANSWERED
    assert fake.sends == []


async def test_the_blocking_guard_stops_too_and_answers_a_later_question(server: CoordinatorServer) -> None:
    # The coordinator serves in this test's event loop: the blocking clients run in a thread beside it.
    await asyncio.to_thread(_blocking_guard_stops, server.address)


def _blocking_guard_stops(address: str) -> None:
    thread, customer, later = new_id("thread"), new_id(), new_id()
    with (
        Coordinator(address, principal="agent-a") as agent,
        Coordinator(address, principal="agent-b") as other,
    ):
        ran: list[str] = []

        @other.guard
        def answer(received: dict[str, Any]) -> None:
            ran.append(received["data"]["object"]["id"])

        found = threading.Event()
        claim = agent.reply_to(event(customer, thread), ttl=3)

        def draft() -> None:
            with claim:
                answer(from_gmail(new_id("gmail"), thread))
                assert claim.lost.wait(5)
                found.set()
                claim.raise_if_lost()

        with pytest.raises(ClaimLost) as lost:
            draft()
        assert found.is_set()
        assert lost.value.reason is LossReason.ANSWERED_OUTSIDE
        # The same message again (message.updated) is answered already; a question asked after the reply is new.
        answer(event(customer, thread, kind="message.updated"))
        answer(event(later, thread, date=ANSWERED + 60))
        assert ran == [later]
        assert agent.status(Subject.message(MAILBOX, customer)).replied_outside
