"""Reply storms through the Python client, against real coordinators on a real etcd (docs/design.md#reply-storms):
automated mail recorded for people and never handed to the handler; the commit point's refusals (the reply budget
spent, the conversation moved on) raised as ReplyBudgetSpent / ConversationMovedOn with the coordinator's words,
the claim released not redeliverable, nothing sent; the guard absorbing them in one log line; the correspondent
sent from the facts, so the budget per correspondent holds across threads and replicas."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from coordinator.ops.server import CoordinatorServer
from inbox_claims import (
    AsyncClaim,
    AsyncCoordinator,
    Coordinator,
    ReplyRefused,
    Subject,
    SubjectState,
    current_claim,
)
from inbox_claims.errors import AutomatedMessage, ConversationMovedOn, ReplyBudgetSpent
from inbox_claims.providers import MessageFacts
from inbox_claims.providers._seam import Automated
from inbox_claims.types import IncomingOutcome, RefusalKind
from tests.client.test_outgoing_guard import event as nylas_event
from tests.conftest import StartCoordinator

pytestmark = pytest.mark.etcd

ASKED = datetime(2026, 12, 2, 14, 3, tzinfo=UTC)
CUSTOMER = "Bea@Example.org"


def new_id(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:10]}"


def facts(
    mailbox: str,
    thread: str,
    *,
    message_id: str | None = None,
    at: datetime = ASKED,
    sender: str = CUSTOMER,
    automated: Automated | None = None,
) -> MessageFacts:
    """A provider's facts of one customer message (what Graph or Gmail would give the guard)."""
    message_id = message_id or new_id("msg")
    return MessageFacts(
        provider="graph",
        event="message.created",
        mailbox=mailbox,
        dedup_key=f"{message_id}@1",
        message_id=message_id,
        thread_id=thread,
        received_at=at,
        sender=f"Bea Costa <{sender}>",
        subject_line="Where is my order?",
        from_addresses=(sender,),
        automated=automated,
    )


@pytest.fixture
async def replicas(start_coordinator: StartCoordinator) -> tuple[CoordinatorServer, CoordinatorServer]:
    return await start_coordinator(), await start_coordinator()


@pytest.fixture
async def agent(replicas: tuple[CoordinatorServer, CoordinatorServer]) -> AsyncIterator[AsyncCoordinator]:
    async with AsyncCoordinator(replicas[0].address, principal="agent-a") as client:
        yield client


@pytest.fixture
async def other_agent(replicas: tuple[CoordinatorServer, CoordinatorServer]) -> AsyncIterator[AsyncCoordinator]:
    """Another agent on the other replica."""
    async with AsyncCoordinator(replicas[1].address, principal="agent-b") as client:
        yield client


class Outbox:
    """A send function that counts what it was asked to send: a refused send never reaches it."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    async def send(self, message_id: str) -> str:
        self.sent.append(message_id)
        return f"sent-{message_id}"


async def answer(client: AsyncCoordinator, message: MessageFacts, outbox: Outbox) -> str | None:
    async with client.reply_to(message) as claim:
        result: str | None = await claim.send(outbox.send, message.message_id)
        return result


# -- automated mail ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("why", "message_of"),
    [
        (
            "Auto-Submitted: auto-replied",
            lambda mailbox, thread: facts(mailbox, thread, automated=Automated(True, "Auto-Submitted: auto-replied")),
        ),
        # A Nylas event carries no headers: the sender's rules still hold.
        (
            "no-reply sender notifications-noreply@social.example",
            lambda mailbox, thread: nylas_event(
                new_id("msg"), thread, sender=("Social", "notifications-noreply@social.example")
            ),
        ),
    ],
    ids=["provider headers", "nylas event, sender rule"],
)
async def test_automated_mail_is_recorded_for_people_and_never_reaches_the_handler(
    why: str,
    message_of: Any,
    agent: AsyncCoordinator,
    mailbox: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ran: list[Any] = []

    @agent.guard
    async def handle(received: Any) -> bool:
        ran.append(received)
        return True

    thread = new_id("thread")
    message = message_of(mailbox, thread)
    if isinstance(message, dict):  # the Nylas event names its grant: the test's mailbox is another
        message = dataclasses_replace_mailbox(message, mailbox)
    caplog.set_level(logging.INFO, logger="inbox_claims")

    assert await handle(message) is None

    assert ran == []
    assert f"automated message ({why}): agents leave it; recorded for people to see" in caplog.text
    # Recorded with its notification (a second report of it is a duplicate delivery); nobody holds it.
    if isinstance(message, MessageFacts):
        message_id, notification_id = message.message_id, message.dedup_key
    else:
        message_id, notification_id = message["data"]["object"]["id"], message["id"]
    again = await agent.record_incoming(mailbox, message_id, thread, ASKED, notification_id=notification_id)
    assert again.outcome is IncomingOutcome.DUPLICATE_DELIVERY
    assert (await agent.status(Subject.message(mailbox, message_id))).state is SubjectState.FREE


def dataclasses_replace_mailbox(event: dict[str, Any], mailbox: str) -> dict[str, Any]:
    event["data"]["object"]["grant_id"] = mailbox
    return event


async def test_automated_mail_raises_with_reply_to_and_a_person_may_still_answer_it(
    agent: AsyncCoordinator, replicas: tuple[CoordinatorServer, CoordinatorServer], mailbox: str
) -> None:
    message = facts(mailbox, new_id("thread"), automated=Automated(True, "List-Id"))
    outbox = Outbox()
    with pytest.raises(AutomatedMessage) as refused:
        await answer(agent, message, outbox)
    assert refused.value.why == "List-Id"
    recorded = refused.value.result
    assert recorded is not None
    assert recorded.outcome is IncomingOutcome.RECORDED
    assert recorded.status is not None
    assert recorded.status.automated == "List-Id"
    async with AsyncCoordinator(replicas[1].address, principal="ana", kind="human") as person:
        assert await answer(person, message, outbox) == f"sent-{message.message_id}"
    assert outbox.sent == [message.message_id]
    status = await agent.status(Subject.message(mailbox, message.message_id))
    assert (status.state, status.holder) == (SubjectState.REPLIED, "ana")


async def test_a_message_marked_auto_submitted_no_is_answered(agent: AsyncCoordinator, mailbox: str) -> None:
    message = facts(mailbox, new_id("thread"), automated=Automated(False))
    outbox = Outbox()
    assert await answer(agent, message, outbox) == f"sent-{message.message_id}"
    assert outbox.sent == [message.message_id]


# -- the reply budget --------------------------------------------------------------------------------------------


async def test_the_fourth_agent_reply_in_a_thread_is_refused_in_words_and_released_not_redeliverable(
    agent: AsyncCoordinator, other_agent: AsyncCoordinator, mailbox: str
) -> None:
    thread = new_id("thread")
    outbox = Outbox()
    # Three replies to three messages of one thread (each message newer than the last), by agents on two replicas.
    for n, client in enumerate((agent, other_agent, agent)):
        message = facts(mailbox, thread, at=ASKED + timedelta(minutes=n))
        assert await answer(client, message, outbox) is not None
    fourth = facts(mailbox, thread, at=ASKED + timedelta(minutes=3))

    with pytest.raises(ReplyBudgetSpent) as refused:
        await answer(other_agent, fourth, outbox)

    error = refused.value
    assert isinstance(error, ReplyRefused)
    assert (error.kind, error.scope, error.limit, error.window_seconds, error.counted) == (
        RefusalKind.REPLY_BUDGET_SPENT,
        "thread",
        3,
        3600,
        3,
    )
    assert error.reason.startswith("agents stopped: 3 agent replies to this conversation in the last hour")
    assert "a person should look" in error.reason
    assert error.frees_at is not None
    assert error.frees_at > datetime.now(UTC)
    assert len(outbox.sent) == 3  # the fourth never reached the send function
    status = await agent.status(Subject.message(mailbox, fourth.message_id))
    assert status.state is SubjectState.FREE  # released on leaving the block
    # Not redeliverable: the refusal is a decision, so a redelivery of its notification is a duplicate.
    again = await agent.claim(Subject.message(mailbox, fourth.message_id), notification_id=fourth.dedup_key)
    assert again.outcome.name == "DUPLICATE_DELIVERY"


async def test_the_budget_per_correspondent_spans_threads_compared_without_case(
    agent: AsyncCoordinator, other_agent: AsyncCoordinator, mailbox: str
) -> None:
    outbox = Outbox()
    for n in range(10):
        sender = CUSTOMER if n % 2 else CUSTOMER.lower()
        client = agent if n % 2 else other_agent
        assert await answer(client, facts(mailbox, new_id("thread"), sender=sender), outbox) is not None

    with pytest.raises(ReplyBudgetSpent) as refused:
        await answer(agent, facts(mailbox, new_id("thread"), sender=CUSTOMER.upper()), outbox)

    assert (refused.value.scope, refused.value.limit, refused.value.counted) == ("correspondent", 10, 10)
    assert "agent replies to bea@example.org in the last day" in refused.value.reason.lower()
    assert len(outbox.sent) == 10
    # Another customer is not stopped.
    assert await answer(agent, facts(mailbox, new_id("thread"), sender="carl@example.net"), outbox) is not None


async def test_a_person_is_never_refused_by_the_budget(
    agent: AsyncCoordinator, replicas: tuple[CoordinatorServer, CoordinatorServer], mailbox: str
) -> None:
    thread = new_id("thread")
    outbox = Outbox()
    for n in range(3):
        assert await answer(agent, facts(mailbox, thread, at=ASKED + timedelta(minutes=n)), outbox) is not None
    async with AsyncCoordinator(replicas[1].address, principal="ana", kind="human") as person:
        message = facts(mailbox, thread, at=ASKED + timedelta(minutes=5))
        assert await answer(person, message, outbox) == f"sent-{message.message_id}"


# -- a conversation that moved on --------------------------------------------------------------------------------


async def test_a_newer_customer_message_refuses_the_older_draft_as_conversation_moved_on(
    agent: AsyncCoordinator, other_agent: AsyncCoordinator, mailbox: str
) -> None:
    thread = new_id("thread")
    first = facts(mailbox, thread)
    newer = facts(mailbox, thread, at=ASKED + timedelta(seconds=40))
    outbox = Outbox()

    async def draft_while_the_customer_writes_again() -> None:
        # While this agent drafts, the customer writes again: another agent's notification claims it.
        async with agent.reply_to(first) as claim, other_agent.reply_to(newer):
            await claim.send(outbox.send, first.message_id)

    with pytest.raises(ConversationMovedOn) as refused:
        await draft_while_the_customer_writes_again()
    assert refused.value.newer_message_id == newer.message_id
    assert refused.value.newer_received_at == newer.received_at
    assert refused.value.reason == "the customer wrote again; draft again with the new message"
    assert outbox.sent == []
    assert (await agent.status(Subject.message(mailbox, first.message_id))).state is SubjectState.FREE


async def test_record_incoming_moves_the_conversation_on(agent: AsyncCoordinator, mailbox: str) -> None:
    thread = new_id("thread")
    first = facts(mailbox, thread)
    outbox = Outbox()

    async def draft_after_a_newer_message_is_recorded() -> None:
        async with agent.reply_to(first) as claim:
            recorded = await agent.record_incoming(mailbox, "msg-newer", thread, ASKED + timedelta(seconds=5))
            assert recorded.outcome is IncomingOutcome.RECORDED
            await claim.send(outbox.send, first.message_id)

    with pytest.raises(ConversationMovedOn):
        await draft_after_a_newer_message_is_recorded()
    assert outbox.sent == []


async def test_the_guard_absorbs_a_refusal_in_one_log_line(
    agent: AsyncCoordinator, mailbox: str, caplog: pytest.LogCaptureFixture
) -> None:
    thread = new_id("thread")
    outbox = Outbox()

    @agent.guard
    async def handle(message: MessageFacts) -> str | None:
        await agent.record_incoming(mailbox, new_id("msg"), thread, ASKED + timedelta(seconds=5))
        claim = current_claim()
        assert isinstance(claim, AsyncClaim)
        result: str | None = await claim.send(outbox.send, message.message_id)
        return result

    caplog.set_level(logging.INFO, logger="inbox_claims")
    assert await handle(facts(mailbox, thread)) is None
    assert outbox.sent == []
    assert "the customer wrote again; draft again with the new message" in caplog.text


async def test_the_blocking_client_raises_the_same_refusal(
    replicas: tuple[CoordinatorServer, CoordinatorServer], mailbox: str
) -> None:
    thread = new_id("thread")
    sent: list[str] = []

    def blocking() -> None:  # in a thread: the coordinators run on this test's event loop
        with Coordinator(replicas[0].address, principal="agent-a") as client:
            for n in range(3):
                message = facts(mailbox, thread, at=ASKED + timedelta(minutes=n))
                with client.reply_to(message) as claim:
                    claim.send(sent.append, message.message_id)
            fourth = facts(mailbox, thread, at=ASKED + timedelta(minutes=4))
            with pytest.raises(ReplyBudgetSpent), client.reply_to(fourth) as claim:
                claim.send(sent.append, fourth.message_id)

    await asyncio.to_thread(blocking)
    assert len(sent) == 3


async def test_concurrent_agents_racing_the_thread_budgets_last_unit_let_exactly_one_through(
    replicas: tuple[CoordinatorServer, CoordinatorServer], mailbox: str
) -> None:
    thread = new_id("thread")
    outbox = Outbox()
    async with AsyncCoordinator(replicas[0].address, principal="agent-a") as first:
        for n in range(2):
            assert await answer(first, facts(mailbox, thread, at=ASKED + timedelta(minutes=n)), outbox) is not None
    # Eight agents on two replicas, each with its own message of the thread, all received at the same time (so
    # none moved the conversation on past another): one unit is left.
    clients = [AsyncCoordinator(replicas[n % 2].address, principal=f"agent-{n}") for n in range(8)]
    try:
        messages = [facts(mailbox, thread, at=ASKED + timedelta(minutes=9)) for _ in clients]
        results = await asyncio.gather(
            *(answer(client, message, outbox) for client, message in zip(clients, messages, strict=True)),
            return_exceptions=True,
        )
    finally:
        for client in clients:
            await client.close()
    through = [r for r in results if isinstance(r, str)]
    refused = [r for r in results if isinstance(r, ReplyBudgetSpent)]
    assert (len(through), len(refused)) == (1, 7), results
    assert len(outbox.sent) == 3
