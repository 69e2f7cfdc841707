"""The asyncio client against a real coordinator on a real etcd: every RPC, then the send-path guard."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

import grpc
import pytest

from coordinator.ops.server import CoordinatorServer, ServerSettings
from coordinator.store.etcd.process import EtcdServer, free_port
from coordinator.store.etcd.settings import EtcdSettings
from inbox_claims import (
    AlreadyReplied,
    AsyncClaim,
    AsyncCoordinator,
    ClaimLost,
    ClaimNotGranted,
    CoordinatorUnavailable,
    DuplicateDelivery,
    Notification,
    ReplyHeld,
    RetryPolicy,
    SendOutcomeUnknown,
    SendRejected,
    Subject,
    SubjectState,
)
from inbox_claims.errors import FailedPrecondition, InvalidRequest, PermissionDenied, Unauthenticated
from inbox_claims.types import (
    ClaimOutcome,
    EventType,
    HolderKind,
    LossReason,
    MessageSummary,
    TakeoverOutcome,
    WatchEvent,
    WatchSnapshot,
)
from inbox_claims.webhooks import parse_notification
from tests.client.support import HUMAN, SendLog, nylas_notification, wait_for_event, watching
from tests.conftest import StartCoordinator, test_rules

Connect = Callable[..., AsyncCoordinator]


@pytest.fixture
async def connect() -> AsyncIterator[Connect]:
    """Opens clients (closed after the test): ``connect(address, principal, kind=..., **options)``."""
    opened: list[AsyncCoordinator] = []

    def open_client(address: str, principal: str | None = None, **options: Any) -> AsyncCoordinator:
        client = AsyncCoordinator(address, principal=principal, **options)
        opened.append(client)
        return client

    yield open_client
    for client in opened:
        await client.close()


@pytest.fixture
def agent(coordinator: CoordinatorServer, connect: Connect) -> AsyncCoordinator:
    return connect(coordinator.address, "agent-a")


@pytest.fixture
def other(coordinator: CoordinatorServer, connect: Connect) -> AsyncCoordinator:
    return connect(coordinator.address, "agent-b")


@pytest.fixture
def human(coordinator: CoordinatorServer, connect: Connect) -> AsyncCoordinator:
    return connect(coordinator.address, HUMAN, kind="human")


async def eventually_state(client: AsyncCoordinator, subject: Subject, state: SubjectState) -> None:
    async with asyncio.timeout(10):
        while True:
            if (await client.status(subject)).state is state:
                return
            await asyncio.sleep(0.05)


# ----------------------------------------------------------------------------------------------- the RPCs


async def test_record_delivery_and_every_claim_outcome(
    agent: AsyncCoordinator, other: AsyncCoordinator, mailbox: str
) -> None:
    first = await agent.record_delivery(mailbox, "notif-1")
    assert first.is_new
    assert first.first.recorded_by == "agent-a"
    assert first.first.notification_id == "notif-1"
    again = await other.record_delivery(mailbox, "notif-1")
    assert not again.is_new
    assert again.first.recorded_by == "agent-a"

    subject = Subject.message(mailbox, "msg-1")
    granted = await agent.claim(subject, ttl=30, notification_id="notif-2", note="drafting")
    assert granted.outcome is ClaimOutcome.GRANTED
    assert granted.granted
    assert granted.token > 0
    assert granted.status is not None
    assert (granted.status.holder, granted.status.holder_kind, granted.status.note) == (
        "agent-a",
        HolderKind.AGENT,
        "drafting",
    )
    assert granted.status.state is SubjectState.CLAIMED
    assert granted.status.ttl_seconds == 30
    assert granted.status.expires_at is not None
    assert granted.status.expires_at > datetime.now(UTC)

    held = await other.claim(subject, ttl=30)
    assert held.outcome is ClaimOutcome.HELD
    assert not held.granted
    assert held.token == 0
    assert held.status is not None
    assert held.status.holder == "agent-a"

    duplicate = await other.claim(Subject.message(mailbox, "msg-2"), notification_id="notif-2")
    assert duplicate.outcome is ClaimOutcome.DUPLICATE_DELIVERY
    assert duplicate.status is None
    assert duplicate.delivery is not None
    assert duplicate.delivery.recorded_by == "agent-a"
    assert duplicate.delivery.subject == subject


async def test_fenced_calls_take_a_subject_through_its_states(
    agent: AsyncCoordinator, other: AsyncCoordinator, mailbox: str
) -> None:
    subject = Subject.message(mailbox, "msg-1")
    token = (await agent.claim(subject, ttl=30)).token
    renewed = await agent.renew(subject, token, ttl=60)
    assert renewed.ok
    assert not renewed.stale
    assert renewed.status.ttl_seconds == 60
    assert renewed.status.fencing_token == token

    began = await agent.begin_send(subject, token)
    assert began.ok
    assert began.status.state is SubjectState.SENDING
    assert began.status.send_deadline is not None
    with pytest.raises(FailedPrecondition) as wrong_state:
        await agent.renew(subject, token)
    assert wrong_state.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert "SENDING" in wrong_state.value.details
    with pytest.raises(PermissionDenied):
        await other.confirm_sent(subject, token, "not-mine")
    confirmed = await agent.confirm_sent(subject, token, "sent-1")
    assert confirmed.ok
    assert confirmed.status.state is SubjectState.REPLIED
    assert confirmed.status.sent_message_id == "sent-1"
    assert confirmed.status.sent_at is not None
    assert (await other.claim(subject)).outcome is ClaimOutcome.ALREADY_REPLIED

    released_subject = Subject.message(mailbox, "msg-2")
    token = (await agent.claim(released_subject, ttl=30)).token
    released = await agent.release(released_subject, token)
    assert released.ok
    assert released.status.state is SubjectState.FREE
    stale = await agent.renew(released_subject, token)
    assert stale.stale
    assert stale.status.state is SubjectState.FREE

    aborted_subject = Subject.thread(mailbox, "thread-3")
    token = (await agent.claim(aborted_subject, ttl=30)).token
    assert (await agent.begin_send(aborted_subject, token)).ok
    aborted = await agent.abort_send(aborted_subject, token, "mail API said 422")
    assert aborted.ok
    assert aborted.status.state is SubjectState.FREE
    status = await other.status(aborted_subject)
    assert status.state is SubjectState.FREE
    assert status.subject == aborted_subject


async def test_list_claims_pages_and_iter_claims_reads_them_all(agent: AsyncCoordinator, mailbox: str) -> None:
    subjects = [Subject.message(mailbox, f"msg-{i}") for i in range(5)]
    tokens = [(await agent.claim(subject, ttl=30)).token for subject in subjects]
    assert (await agent.begin_send(subjects[0], tokens[0])).ok

    page = await agent.list_claims(mailbox, page_size=2)
    assert [s.subject for s in page.subjects] == subjects[:2]
    assert page.next_page_token
    assert page.revision > 0
    second = await agent.list_claims(mailbox, page_size=2, page_token=page.next_page_token)
    assert [s.subject for s in second.subjects] == subjects[2:4]

    assert [s.subject async for s in agent.iter_claims(mailbox, page_size=2)] == subjects
    sending = [s async for s in agent.iter_claims(mailbox, states=[SubjectState.SENDING])]
    assert [(s.subject, s.state) for s in sending] == [(subjects[0], SubjectState.SENDING)]


async def test_takeover_and_resolve_in_doubt(
    start_coordinator: StartCoordinator, connect: Connect, mailbox: str
) -> None:
    server = await start_coordinator(send_timeout_ms=300)
    agent, human = connect(server.address, "agent-a"), connect(server.address, HUMAN, kind="human")
    subject = Subject.message(mailbox, "msg-1")
    token = (await agent.claim(subject, ttl=30)).token

    with pytest.raises(PermissionDenied):
        await agent.takeover(subject)
    taken = await human.takeover(subject, ttl=30, note="I'll call her")
    assert taken.outcome is TakeoverOutcome.TAKEN_OVER
    assert taken.holds
    assert (taken.previous_holder, taken.previous_token) == ("agent-a", token)
    assert taken.status.holder == HUMAN
    assert taken.status.holder_kind is HolderKind.HUMAN
    assert taken.status.fencing_token > token
    assert taken.status.note == "I'll call her"
    assert (await agent.renew(subject, token)).stale
    free = await human.takeover(Subject.message(mailbox, "msg-free"))
    assert free.outcome is TakeoverOutcome.GRANTED
    assert free.previous_holder == ""

    for message_id, sent in (("doubt-sent", True), ("doubt-not-sent", False)):
        doubtful = Subject.message(mailbox, message_id)
        token = (await agent.claim(doubtful, ttl=30)).token
        assert (await agent.begin_send(doubtful, token)).ok
        await eventually_state(human, doubtful, SubjectState.IN_DOUBT)
        resolved = await human.resolve_in_doubt(
            doubtful, sent=sent, sent_message_id="found" if sent else "", note="checked"
        )
        assert resolved.state is (SubjectState.REPLIED if sent else SubjectState.FREE)
        assert resolved.sent_message_id == ("found" if sent else "")
        assert (resolved.holder, resolved.settled_by) == (("agent-a", HUMAN) if sent else ("", ""))
    with pytest.raises(FailedPrecondition):
        await human.resolve_in_doubt(Subject.message(mailbox, "never-claimed"), sent=False)


async def test_a_person_takes_over_from_the_colleague_named_and_finds_recent_messages(
    agent: AsyncCoordinator, human: AsyncCoordinator, connect: Connect, coordinator: CoordinatorServer, mailbox: str
) -> None:
    colleague = connect(coordinator.address, "bo", kind="human")
    subject = Subject.message(mailbox, "msg-bo")
    token = (await colleague.claim(subject, ttl=30)).token
    assert (await human.takeover(subject)).outcome is TakeoverOutcome.HELD
    taken = await human.takeover(subject, from_person="bo")
    assert (taken.outcome, taken.previous_holder, taken.previous_token) == (TakeoverOutcome.TAKEN_OVER, "bo", token)

    summary = MessageSummary("Where is my parcel?", "Carl <carl@example.net>")
    await agent.claim(Subject.message(mailbox, "msg-parcel"), ttl=30, notification_id="n-parcel", summary=summary)
    (recent,) = await human.recent_messages(mailbox, query="parcel")
    assert (recent.subject, recent.summary, recent.seen_by) == (
        Subject.message(mailbox, "msg-parcel"),
        summary,
        "agent-a",
    )
    assert recent.first_seen_at is not None


async def test_watch_sends_a_snapshot_then_typed_events(agent: AsyncCoordinator, mailbox: str) -> None:
    before = Subject.message(mailbox, "before")
    await agent.claim(before, ttl=30, note="already here")
    stream = agent.watch(mailbox)
    snapshot = await anext(stream)
    assert isinstance(snapshot, WatchSnapshot)
    assert [(s.subject, s.note) for s in snapshot.subjects] == [(before, "already here")]

    subject = Subject.message(mailbox, "after")
    token = (await agent.claim(subject, ttl=30)).token
    await agent.renew(subject, token, ttl=40)
    await agent.release(subject, token)
    events: list[WatchEvent] = []
    async with asyncio.timeout(10):
        while len(events) < 3:
            item = await anext(stream)
            assert isinstance(item, WatchEvent)
            events.append(item)
    await stream.aclose()
    assert [e.type for e in events] == [EventType.CLAIMED, EventType.RENEWED, EventType.RELEASED]
    assert all(e.status.subject == subject for e in events)
    assert events[2].status.state is SubjectState.FREE
    assert events[2].previous_token == token
    assert events[0].revision < events[1].revision < events[2].revision


async def test_errors_come_back_as_typed_exceptions(
    coordinator: CoordinatorServer, connect: Connect, agent: AsyncCoordinator, mailbox: str
) -> None:
    anonymous = connect(coordinator.address)
    with pytest.raises(Unauthenticated) as unauthenticated:
        await anonymous.status(Subject.message(mailbox, "m"))
    assert unauthenticated.value.code is grpc.StatusCode.UNAUTHENTICATED
    assert unauthenticated.value.method == "GetStatus"
    assert "x-inbox-principal" in str(unauthenticated.value)
    with pytest.raises(InvalidRequest, match="ttl_seconds"):
        await agent.claim(Subject.message(mailbox, "m"), ttl=7200)
    with pytest.raises(InvalidRequest, match=r"subject\.id"):
        await agent.claim(Subject.message(mailbox, ""))
    with pytest.raises(ValueError, match="fencing token"):
        await agent.renew(Subject.message(mailbox, "m"), 0)


# ---------------------------------------------------------------------------------------------- the guard


async def test_reply_to_sends_once_and_records_the_reply(agent: AsyncCoordinator, mailbox: str) -> None:
    notification = nylas_notification(mailbox, "msg-1")
    sends = SendLog()
    async with watching(agent, mailbox) as events:
        async with agent.reply_to(notification, ttl=30, note="drafting a reply") as claim:
            assert claim.subject == Subject.message(mailbox, "msg-1")
            assert claim.token > 0
            assert claim.notification_id == notification.notification_id
            assert claim.ttl == 30
            assert claim.expires_at is not None
            assert claim.expires_at > datetime.now(UTC)
            assert claim.idempotency_key == Subject.message(mailbox, "msg-1").idempotency_key
            assert claim.idempotency_key.startswith("ic1-")
            assert len(claim.idempotency_key) == 68
            sent = await claim.send(sends.send_async, "Hello Ana")
        assert sent == "sent-1"
        assert claim.replied
        assert claim.sent_message_id == "sent-1"
        await wait_for_event(events, EventType.REPLIED)
        await asyncio.sleep(0.3)  # anything after the reply (a stray release, a second confirm) would show up
    assert [e.type for e in events] == [EventType.CLAIMED, EventType.SENDING, EventType.REPLIED]
    assert sends.calls == ["Hello Ana"]
    status = await agent.status(claim.subject)
    assert (status.state, status.holder, status.sent_message_id) == (SubjectState.REPLIED, "agent-a", "sent-1")
    assert status.note == "drafting a reply"


async def test_three_redeliveries_send_once(agent: AsyncCoordinator, other: AsyncCoordinator, mailbox: str) -> None:
    notification = nylas_notification(mailbox, "msg-1")
    sends = SendLog()
    outcomes: list[str | DuplicateDelivery] = []
    for client in (agent, other, agent, other):
        try:
            async with client.reply_to(notification) as claim:
                await claim.send(sends.send_async)
            outcomes.append("sent")
        except DuplicateDelivery as duplicate:
            outcomes.append(duplicate)
    assert outcomes[0] == "sent"
    assert len(sends.calls) == 1
    duplicates = [outcome for outcome in outcomes[1:] if isinstance(outcome, DuplicateDelivery)]
    assert len(duplicates) == 3
    for refusal in duplicates:
        assert refusal.notification_id == notification.notification_id
        assert refusal.recorded_by == "agent-a"
        assert refusal.recorded_at is not None
        assert refusal.first is not None
        assert refusal.first.subject == Subject.message(mailbox, "msg-1")


async def test_a_second_agent_is_told_who_holds_the_message(
    agent: AsyncCoordinator, other: AsyncCoordinator, mailbox: str
) -> None:
    created = nylas_notification(mailbox, "msg-1")
    updated = nylas_notification(mailbox, "msg-1", type_="message.updated")
    async with agent.reply_to(created, ttl=30) as claim:
        with pytest.raises(ReplyHeld) as held:
            async with other.reply_to(updated):
                pytest.fail("two agents held one message")
        assert isinstance(held.value, ClaimNotGranted)
        assert (held.value.holder, held.value.holder_kind) == ("agent-a", HolderKind.AGENT)
        assert held.value.expires_at == claim.expires_at
        assert held.value.subject == claim.subject


async def test_a_replied_message_raises_already_replied(
    agent: AsyncCoordinator, other: AsyncCoordinator, mailbox: str
) -> None:
    async with agent.reply_to(nylas_notification(mailbox, "msg-1")) as claim:
        await claim.send(lambda: "sent-9")  # a plain function works in the async client too
    with pytest.raises(AlreadyReplied) as replied:
        async with other.reply_to(nylas_notification(mailbox, "msg-1", type_="message.updated")):
            pytest.fail("replied twice")
    assert (replied.value.state, replied.value.holder) == (SubjectState.REPLIED, "agent-a")
    assert replied.value.sent_message_id == "sent-9"
    assert replied.value.sent_at is not None


async def test_renewal_keeps_the_claim_past_its_ttl(
    agent: AsyncCoordinator, other: AsyncCoordinator, mailbox: str
) -> None:
    sends = SendLog()
    async with agent.reply_to(mailbox=mailbox, message_id="slow", ttl=2) as claim:
        first_expiry = claim.expires_at
        await asyncio.sleep(5)  # a slow LLM: more than twice the TTL
        assert not claim.lost.is_set()
        assert claim.loss is None
        assert claim.expires_at is not None
        assert first_expiry is not None
        assert claim.expires_at > first_expiry
        status = await other.status(claim.subject)
        assert (status.state, status.holder, status.fencing_token) == (SubjectState.CLAIMED, "agent-a", claim.token)
        with pytest.raises(ReplyHeld):
            async with other.reply_to(mailbox=mailbox, message_id="slow"):
                pytest.fail("the claim was not renewed")
        await claim.send(sends.send_async)
    assert (await other.status(claim.subject)).state is SubjectState.REPLIED


async def test_a_takeover_while_drafting_sets_lost_and_fences_the_send(
    agent: AsyncCoordinator, human: AsyncCoordinator, mailbox: str
) -> None:
    sends = SendLog()
    noticed: list[AsyncClaim] = []
    async with agent.reply_to(nylas_notification(mailbox, "msg-1"), ttl=3, on_lost=noticed.append) as claim:
        taken = await human.takeover(claim.subject, note="I'll answer this one")
        assert taken.outcome is TakeoverOutcome.TAKEN_OVER
        await asyncio.wait_for(claim.lost.wait(), 5)  # the renewal (every second) finds the token stale
        assert claim.loss is not None
        assert claim.loss.reason is LossReason.TAKEN_OVER
        assert claim.loss.status is not None
        assert claim.loss.status.holder == HUMAN
        with pytest.raises(ClaimLost) as lost:
            await claim.send(sends.send_async)
        assert lost.value.reason is LossReason.TAKEN_OVER
        assert lost.value.token == claim.token
        with pytest.raises(ClaimLost):
            claim.raise_if_lost()
    assert sends.calls == []
    assert noticed == [claim]
    status = await human.status(claim.subject)  # leaving the block did not touch the human's claim
    assert (status.state, status.holder) == (SubjectState.CLAIMED, HUMAN)


async def test_a_takeover_the_renewal_did_not_see_yet_is_refused_at_the_commit_point(
    agent: AsyncCoordinator, human: AsyncCoordinator, mailbox: str
) -> None:
    sends = SendLog()
    async with agent.reply_to(mailbox=mailbox, message_id="msg-1", ttl=60) as claim:
        await human.takeover(claim.subject)
        assert not claim.lost.is_set()  # the next renewal is 20 s away
        with pytest.raises(ClaimLost) as lost:
            await claim.send(sends.send_async)
        assert lost.value.reason is LossReason.TAKEN_OVER
        assert claim.lost.is_set()
    assert sends.calls == []


async def test_cancel_on_loss_cancels_the_drafting_body(
    agent: AsyncCoordinator, human: AsyncCoordinator, mailbox: str
) -> None:
    finished_drafting = False
    started = time.monotonic()

    async def take_over_soon(subject: Subject) -> None:
        await asyncio.sleep(0.3)
        await human.takeover(subject)

    async def handle() -> None:
        nonlocal finished_drafting
        async with agent.reply_to(mailbox=mailbox, message_id="msg-1", ttl=3, cancel_on_loss=True) as claim:
            helpers.append(asyncio.create_task(take_over_soon(claim.subject)))
            await asyncio.sleep(30)  # the LLM call that must not run to its end
            finished_drafting = True

    helpers: list[asyncio.Task[None]] = []
    with pytest.raises(ClaimLost) as lost:
        await handle()
    await asyncio.gather(*helpers)
    assert not finished_drafting
    assert time.monotonic() - started < 5
    assert lost.value.reason is LossReason.TAKEN_OVER
    assert isinstance(lost.value.__cause__, asyncio.CancelledError)
    current = asyncio.current_task()
    assert current is not None
    assert current.cancelling() == 0


async def test_send_rejected_aborts_and_frees_the_subject(
    agent: AsyncCoordinator, other: AsyncCoordinator, mailbox: str
) -> None:
    class MailApiRefused(SendRejected):
        pass

    async def refuse() -> str:
        raise MailApiRefused("422 Unprocessable Entity:\ninvalid recipient")

    async with watching(agent, mailbox) as events:
        with pytest.raises(MailApiRefused):
            async with agent.reply_to(nylas_notification(mailbox, "msg-1")) as claim:
                await claim.send(refuse)
        aborted = await wait_for_event(events, EventType.ABORTED)
    assert aborted.reason == "422 Unprocessable Entity: invalid recipient"  # control characters flattened
    assert (await other.status(claim.subject)).state is SubjectState.FREE
    assert not claim.replied
    sends = SendLog()
    async with other.reply_to(nylas_notification(mailbox, "msg-1", type_="message.updated")) as retry:
        await retry.send(sends.send_async)
    assert sends.calls == ["draft"]


async def test_an_unknown_send_failure_leaves_sending_then_in_doubt(
    start_coordinator: StartCoordinator, connect: Connect, mailbox: str
) -> None:
    server = await start_coordinator(send_timeout_ms=500)
    agent, other = connect(server.address, "agent-a"), connect(server.address, "agent-b")

    async def times_out() -> str:
        raise TimeoutError("the mail API did not answer in 30 s")

    with pytest.raises(SendOutcomeUnknown) as unknown:
        async with agent.reply_to(nylas_notification(mailbox, "msg-1")) as claim:
            await claim.send(times_out)
    assert isinstance(unknown.value.__cause__, TimeoutError)
    assert unknown.value.token == claim.token
    assert (await agent.status(claim.subject)).state is SubjectState.SENDING  # not released, not aborted
    await eventually_state(agent, claim.subject, SubjectState.IN_DOUBT)
    with pytest.raises(AlreadyReplied) as replied:
        async with other.reply_to(nylas_notification(mailbox, "msg-1")):
            pytest.fail("an in-doubt message was answered again")
    assert replied.value.state is SubjectState.IN_DOUBT


async def test_leaving_without_sending_releases_the_claim(
    agent: AsyncCoordinator, other: AsyncCoordinator, mailbox: str
) -> None:
    async with agent.reply_to(mailbox=mailbox, message_id="not-for-me") as claim:
        pass
    assert (await other.status(claim.subject)).state is SubjectState.FREE

    with pytest.raises(RuntimeError, match="the LLM failed"):
        async with agent.reply_to(mailbox=mailbox, message_id="broken") as claim:
            raise RuntimeError("the LLM failed")
    assert (await other.status(claim.subject)).state is SubjectState.FREE
    async with other.reply_to(mailbox=mailbox, message_id="broken") as claim:
        assert claim.token > 0
    with pytest.raises(RuntimeError, match="once"):
        await claim.send(lambda: "too late")


async def test_a_failed_block_leaves_its_notification_redeliverable(
    agent: AsyncCoordinator, other: AsyncCoordinator, mailbox: str
) -> None:
    """Leaving the block on purpose settles the notification; leaving it by an exception does not, so that the
    provider's redelivery (or a replay) can get the message answered by someone."""
    declined = nylas_notification(mailbox, "declined")
    async with agent.reply_to(declined):
        pass  # looked at it, nothing to say
    with pytest.raises(DuplicateDelivery):
        async with other.reply_to(declined):
            pytest.fail("a declined notification was claimed again")

    failed = nylas_notification(mailbox, "failed")
    with pytest.raises(RuntimeError, match="the LLM failed"):
        async with agent.reply_to(failed):
            raise RuntimeError("the LLM failed")
    sends = SendLog()
    async with other.reply_to(failed) as claim:
        await claim.send(sends.send_async)
    assert len(sends.calls) == 1


async def test_thread_scope_claims_the_conversation(
    agent: AsyncCoordinator, other: AsyncCoordinator, mailbox: str
) -> None:
    first = nylas_notification(mailbox, "msg-1", thread_id="thread-1")
    second = nylas_notification(mailbox, "msg-2", thread_id="thread-1")
    async with agent.reply_to(first, scope="thread") as claim:
        assert claim.subject == Subject.thread(mailbox, "thread-1")
        with pytest.raises(ReplyHeld):
            async with other.reply_to(second, scope="thread"):
                pytest.fail("two replies in one thread")
        async with other.reply_to(second) as message_claim:  # the message itself is another subject
            assert message_claim.subject == Subject.message(mailbox, "msg-2")


async def test_guarded_decorator_runs_the_handler_inside_reply_to(agent: AsyncCoordinator, mailbox: str) -> None:
    sends = SendLog()

    @agent.guarded(ttl=30)
    async def handle(notification: Notification, claim: AsyncClaim, draft: str) -> str | None:
        assert claim.subject.id == notification.message_id
        return await claim.send(sends.send_async, draft)

    notification = nylas_notification(mailbox, "msg-1")
    assert await handle(notification, "Hi") == "sent-1"
    with pytest.raises(DuplicateDelivery):
        await handle(notification, "Hi again")
    assert handle.__name__ == "handle"
    assert sends.calls == ["Hi"]


async def test_thirty_concurrent_handlers_on_one_message_send_once(
    coordinator: CoordinatorServer, connect: Connect, mailbox: str
) -> None:
    clients = [connect(coordinator.address, f"agent-{i}") for i in range(5)]
    redelivered = nylas_notification(mailbox, "msg-1")
    sends = SendLog()

    async def handler(i: int) -> str:
        # Half are redeliveries of one notification, half are other notifications about the same message.
        notification = redelivered if i % 2 else nylas_notification(mailbox, "msg-1", type_="message.updated")
        try:
            async with clients[i % 5].reply_to(notification, ttl=30) as claim:
                await asyncio.sleep(0.05)
                await claim.send(sends.send_async)
                return "sent"
        except DuplicateDelivery:
            return "duplicate"
        except ReplyHeld:
            return "held"
        except AlreadyReplied:
            return "replied"

    results = await asyncio.gather(*(handler(i) for i in range(30)))
    assert results.count("sent") == 1
    assert len(sends.calls) == 1
    # Redeliveries get DUPLICATE_DELIVERY only when their notification is the one that won: a notification
    # whose claim was refused had no effect, so it was not recorded.
    assert set(results) <= {"sent", "duplicate", "held", "replied"}


async def test_a_claim_that_cannot_be_renewed_past_its_ttl_is_lost(
    etcd: EtcdServer, prefix: str, connect: Connect, mailbox: str
) -> None:
    settings = ServerSettings(EtcdSettings([etcd.endpoint], prefix=prefix), listen="127.0.0.1:0", rules=test_rules())
    server = CoordinatorServer(settings)
    await server.start()
    agent = connect(server.address, "agent-a", timeout=0.5, retry=RetryPolicy(attempts=2, initial_backoff=0.05))
    sends = SendLog()
    async with agent.reply_to(mailbox=mailbox, message_id="msg-1", ttl=2) as claim:
        await server.stop(grace=0)
        await asyncio.wait_for(claim.lost.wait(), 6)
        assert claim.loss is not None
        assert claim.loss.reason is LossReason.RENEWAL_FAILED
        assert claim.loss.status is None
        with pytest.raises(ClaimLost):
            await claim.send(sends.send_async)
    assert sends.calls == []  # and leaving the block, whose release fails, raised nothing


async def test_reply_to_raises_coordinator_unavailable_when_nothing_listens(connect: Connect, mailbox: str) -> None:
    agent = connect(f"127.0.0.1:{free_port()}", "agent-a", retry=RetryPolicy(attempts=2, initial_backoff=0.05))
    with pytest.raises(CoordinatorUnavailable) as unavailable:
        async with agent.reply_to(mailbox=mailbox, message_id="msg-1"):
            pytest.fail("claimed without a coordinator")
    assert unavailable.value.attempts == 2
    assert unavailable.value.method == "ClaimReply"


async def test_a_claim_marked_replied_by_hand_answers_later_notifications(
    agent: AsyncCoordinator, other: AsyncCoordinator, human: AsyncCoordinator, mailbox: str
) -> None:
    async with human.reply_to(nylas_notification(mailbox, "vip")) as claim:
        await claim.mark_replied(sent_message_id="gmail-9", note="answered from Gmail")
        assert claim.replied
        assert claim.status is not None
        assert claim.status.replied_by_hand
    assert (await other.status(claim.subject)).state is SubjectState.REPLIED  # not released on exit
    with pytest.raises(AlreadyReplied):
        async with agent.reply_to(mailbox=mailbox, message_id=claim.subject.id, notification_id="updated-1"):
            pytest.fail("a message answered by hand was claimed again")

    async with agent.reply_to(mailbox=mailbox, message_id="taken") as lost_claim:
        assert (await human.takeover(lost_claim.subject)).holds
        with pytest.raises(ClaimLost):
            await lost_claim.mark_replied(note="too late")
    assert (await other.status(lost_claim.subject)).holder == HUMAN


async def test_reply_to_describes_the_email_from_the_notification(
    agent: AsyncCoordinator, human: AsyncCoordinator, mailbox: str
) -> None:
    document = {
        "specversion": "1.0",
        "type": "message.created",
        "id": "notif-summary-1",
        "data": {
            "object": {
                "id": "msg-described",
                "grant_id": mailbox,
                "object": "message",
                "subject": "Where is my order?\r\n" + "x" * 600,
                "from": [{"name": "Bea Costa", "email": "bea@example.org"}],
                "date": 1796000000,
            }
        },
    }
    async with agent.reply_to(parse_notification(document)) as claim:
        held = await human.status(claim.subject)
    assert held.summary is not None
    assert held.summary.subject_line.startswith("Where is my order?  xxx")
    assert len(held.summary.subject_line.encode()) == 512  # cut to the coordinator's limit, never refused
    assert held.summary.sender == "Bea Costa <bea@example.org>"
    assert held.summary.received_at == datetime.fromtimestamp(1796000000, tz=UTC)

    # A notification without those fields (or with odd ones) claims as before, with no summary.
    document["id"], document["data"]["object"] = (  # type: ignore[index]
        "notif-summary-2",
        {"id": "msg-bare", "grant_id": mailbox, "from": "not-a-list", "date": "yesterday"},
    )
    async with agent.reply_to(parse_notification(document)) as claim:
        assert (await human.status(claim.subject)).summary is None

    summary = MessageSummary("Invoice", "carl@example.net")
    taken = await human.takeover(Subject.message(mailbox, "msg-by-hand"), summary=summary)
    assert taken.status.summary == summary
