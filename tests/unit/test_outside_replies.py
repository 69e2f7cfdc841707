"""Replies written outside the coordinator (docs/design.md#replies-written-outside), through the engine, on the
memory store and on etcd (the contract): RecordOutgoing tells the mailbox's own replies from replies written
elsewhere, and a reply written elsewhere in a thread ends what it answered, in one transaction with its record."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from coordinator.api.service import event_out
from coordinator.core import engine as engine_module
from coordinator.core.commands import (
    AbortSend,
    BeginSend,
    ClaimReply,
    ConfirmSent,
    RecordOutgoing,
    ReleaseClaim,
    RenewClaim,
)
from coordinator.core.domain import (
    Caller,
    ClaimResult,
    EventType,
    FenceResult,
    HolderKind,
    OutgoingResult,
    OutsideReply,
    State,
    Subject,
    SubjectKind,
    ThreadLink,
    new_claim,
)
from coordinator.core.engine import Engine, Event, OutgoingOutcome, Snapshot
from coordinator.core.errors import InvalidArgument
from coordinator.core.storage import Store
from coordinator.ops.server import wall_clock_ms
from inbox_wire.v1 import coordinator_pb2 as pb
from tests.conftest import test_rules

AGENT = Caller("agent-a", HolderKind.AGENT)
OTHER = Caller("agent-b", HolderKind.AGENT)
REPORTER = Caller("agent-c", HolderKind.AGENT)
ANA = "Ana Lima <ana@shop.example>"
# Provider times (message dates), in ms: a customer writes at 10:00, Ana answers at 10:05, the customer again at 10:07.
ASKED, ANSWERED, ASKED_AGAIN = 1_700_000_000_000, 1_700_000_300_000, 1_700_000_420_000


@pytest.fixture
def engine(store: Store) -> Engine:
    return Engine(store, test_rules(), wall_clock_ms)


def _rid() -> str:
    return uuid.uuid4().hex


def _box() -> str:
    return f"box-{uuid.uuid4().hex[:8]}"


async def _claim(
    engine: Engine,
    caller: Caller,
    subject: Subject,
    thread: str,
    received_ms: int,
    notification_id: str = "",
) -> tuple[ClaimResult, int]:
    outcome = await engine.claim_reply(
        caller,
        ClaimReply(
            request_id=_rid(),
            subject=subject,
            notification_id=notification_id,
            ttl_seconds=60,
            note="drafting",
            thread_id=thread if subject.kind is SubjectKind.MESSAGE else "",
            received_ms=received_ms,
        ),
    )
    return outcome.result, outcome.stored.token if outcome.stored is not None else 0


async def _outgoing(
    engine: Engine,
    mailbox: str,
    thread: str,
    message_id: str,
    sent_ms: int = ANSWERED,
    *,
    notification_id: str = "",
    request_id: str | None = None,
    caller: Caller = REPORTER,
) -> OutgoingOutcome:
    return await engine.record_outgoing(
        caller,
        RecordOutgoing(
            request_id=request_id or _rid(),
            mailbox=mailbox,
            notification_id=notification_id,
            message_id=message_id,
            thread_id=thread,
            sent_ms=sent_ms,
            sender=ANA,
        ),
    )


async def test_a_reply_written_outside_ends_a_claim_on_a_message_it_answered(engine: Engine) -> None:
    mailbox = _box()
    subject = Subject(mailbox, SubjectKind.MESSAGE, "m-1")
    result, token = await _claim(engine, AGENT, subject, "t-1", ASKED)
    assert result is ClaimResult.GRANTED

    outcome = await _outgoing(engine, mailbox, "t-1", "gmail-1")

    assert outcome.result is OutgoingResult.ANSWERED_OUTSIDE
    assert [subject for subject, _ in outcome.subjects] == [subject]
    after = await engine.status(AGENT, subject)
    assert after is not None
    record = after.record
    assert (record.state, record.replied_outside, record.holder, record.holder_kind) == (
        State.REPLIED,
        True,
        ANA,
        HolderKind.HUMAN,
    )
    assert record.outside_reply is not None
    assert (record.outside_reply.stopped_holder, record.outside_reply.recorded_by) == ("agent-a", "agent-c")
    assert (record.sent_message_id, record.sent_ms) == ("gmail-1", ANSWERED)
    assert after.token == token  # the same key: its token is stale because a person answered, not because it moved
    # The holder learns it at its next renewal, and its commit point refuses it.
    renewed, status = await engine.renew(
        AGENT, RenewClaim(request_id=_rid(), subject=subject, token=token, ttl_seconds=60)
    )
    assert renewed is FenceResult.STALE_TOKEN
    assert status is not None
    assert status.record.replied_outside
    begun, _, _ = await engine.begin_send(AGENT, BeginSend(request_id=_rid(), subject=subject, token=token))
    assert begun is FenceResult.STALE_TOKEN
    released, _ = await engine.release(AGENT, ReleaseClaim(request_id=_rid(), subject=subject, token=token))
    assert released is FenceResult.STALE_TOKEN
    # A later notification of the message (message.updated) finds it answered.
    assert (await _claim(engine, OTHER, subject, "t-1", ASKED, notification_id="n-2"))[0] is (
        ClaimResult.ALREADY_REPLIED
    )


async def test_messages_received_before_the_reply_are_answered_and_later_ones_are_new_questions(
    engine: Engine,
) -> None:
    mailbox = _box()
    await _outgoing(engine, mailbox, "t-1", "gmail-1")
    # Its notification was late: the person answered before the agent ever saw the customer's message.
    early = Subject(mailbox, SubjectKind.MESSAGE, "asked-before")
    result, _ = await _claim(engine, AGENT, early, "t-1", ASKED, notification_id="n-early")
    assert result is ClaimResult.ALREADY_REPLIED
    recorded = await engine.status(AGENT, early)
    assert recorded is not None
    assert recorded.record.state is State.REPLIED
    assert recorded.record.replied_outside
    assert (await _claim(engine, OTHER, early, "t-1", ASKED, notification_id="n-early"))[0] is (
        ClaimResult.DUPLICATE_DELIVERY
    )
    # Received at the reply's very second: the person saw it.
    same_time = Subject(mailbox, SubjectKind.MESSAGE, "asked-at-the-same-time")
    assert (await _claim(engine, AGENT, same_time, "t-1", ANSWERED))[0] is ClaimResult.ALREADY_REPLIED
    later = Subject(mailbox, SubjectKind.MESSAGE, "asked-after")
    result, token = await _claim(engine, AGENT, later, "t-1", ASKED_AGAIN)
    assert result is ClaimResult.GRANTED
    begin = BeginSend(request_id=_rid(), subject=later, token=token)
    assert (await engine.begin_send(AGENT, begin))[0] is FenceResult.OK
    # Another thread of the mailbox is untouched.
    elsewhere = Subject(mailbox, SubjectKind.MESSAGE, "other-thread")
    assert (await _claim(engine, AGENT, elsewhere, "t-2", ASKED))[0] is ClaimResult.GRANTED


async def test_a_copy_arriving_before_the_confirmation_is_the_sends_own(engine: Engine) -> None:
    mailbox = _box()
    sending = Subject(mailbox, SubjectKind.MESSAGE, "sending")
    _, token = await _claim(engine, AGENT, sending, "t-1", ASKED)
    await engine.begin_send(AGENT, BeginSend(request_id=_rid(), subject=sending, token=token))
    drafting = Subject(mailbox, SubjectKind.MESSAGE, "drafting")
    _, held = await _claim(engine, OTHER, drafting, "t-1", ASKED)

    echo = await _outgoing(engine, mailbox, "t-1", "sent-1")

    assert echo.result is OutgoingResult.OWN_REPLY
    assert [subject for subject, _ in echo.subjects] == [sending]
    assert (await _outgoing(engine, mailbox, "t-1", "sent-1", notification_id="n-again")).result is (
        OutgoingResult.OWN_REPLY
    )
    # Nothing else of the thread was touched, and the send confirms as usual.
    renewal = RenewClaim(request_id=_rid(), subject=drafting, token=held, ttl_seconds=60)
    assert (await engine.renew(OTHER, renewal))[0] is FenceResult.OK
    result, replied = await engine.confirm_sent(
        AGENT, ConfirmSent(request_id=_rid(), subject=sending, token=token, sent_message_id="sent-1")
    )
    assert result is FenceResult.OK
    assert replied is not None
    assert (replied.record.echo, replied.record.outside_reply) == (None, None)


async def test_a_send_in_flight_keeps_its_state_and_both_replies_are_recorded(engine: Engine) -> None:
    mailbox = _box()
    sending = Subject(mailbox, SubjectKind.MESSAGE, "sending")
    _, token = await _claim(engine, AGENT, sending, "t-1", ASKED)
    await engine.begin_send(AGENT, BeginSend(request_id=_rid(), subject=sending, token=token))
    drafting = Subject(mailbox, SubjectKind.MESSAGE, "drafting")
    _, held = await _claim(engine, OTHER, drafting, "t-1", ASKED)
    await _outgoing(engine, mailbox, "t-1", "sent-1")  # the send's copy, before its ConfirmSent

    outcome = await _outgoing(engine, mailbox, "t-1", "gmail-1")  # a second message: someone else's

    assert outcome.result is OutgoingResult.ANSWERED_OUTSIDE
    statuses = dict(outcome.subjects)
    marked, ended = statuses[sending], statuses[drafting]
    assert marked is not None
    assert ended is not None
    assert marked.record.state is State.SENDING
    assert marked.record.outside_reply is not None
    assert marked.record.outside_reply.message_id == "gmail-1"
    assert ended.record.replied_outside
    assert (await engine.begin_send(OTHER, BeginSend(request_id=_rid(), subject=drafting, token=held)))[0] is (
        FenceResult.STALE_TOKEN
    )
    # The send still completes; its reply record says what happened beside it.
    result, after = await engine.confirm_sent(
        AGENT, ConfirmSent(request_id=_rid(), subject=sending, token=token, sent_message_id="sent-1")
    )
    assert result is FenceResult.OK
    assert after is not None
    assert (after.record.state, after.record.replied_outside) == (State.REPLIED, False)
    assert after.record.outside_reply is not None
    assert after.record.outside_reply.message_id == "gmail-1"


async def test_the_confirmation_settles_a_copy_that_was_someone_elses(engine: Engine) -> None:
    mailbox = _box()
    confirmed = Subject(mailbox, SubjectKind.MESSAGE, "confirmed")
    _, token = await _claim(engine, AGENT, confirmed, "t-1", ASKED)
    await engine.begin_send(AGENT, BeginSend(request_id=_rid(), subject=confirmed, token=token))
    await _outgoing(engine, mailbox, "t-1", "gmail-1")  # taken for the send's copy
    _, after = await engine.confirm_sent(
        AGENT, ConfirmSent(request_id=_rid(), subject=confirmed, token=token, sent_message_id="sent-1")
    )
    assert after is not None
    assert after.record.outside_reply is not None  # the send went out, and so did someone's reply
    assert after.record.outside_reply.message_id == "gmail-1"
    assert not after.record.replied_outside

    aborted = Subject(mailbox, SubjectKind.MESSAGE, "aborted")
    _, token = await _claim(engine, AGENT, aborted, "t-2", ASKED)
    await engine.begin_send(AGENT, BeginSend(request_id=_rid(), subject=aborted, token=token))
    await _outgoing(engine, mailbox, "t-2", "gmail-2")
    request_id = _rid()
    result, status = await engine.abort_send(
        AGENT, AbortSend(request_id=request_id, subject=aborted, token=token, reason="bounced")
    )
    # The send never went out, so the message taken for its copy was someone's answer: answered, not free.
    assert result is FenceResult.OK
    assert status is not None
    assert (status.record.state, status.record.replied_outside) == (State.REPLIED, True)
    assert status.record.outside_reply is not None
    assert status.record.outside_reply.stopped_holder == "agent-a"
    retried, _ = await engine.abort_send(
        AGENT, AbortSend(request_id=request_id, subject=aborted, token=token, reason="bounced")
    )
    assert retried is FenceResult.OK


async def test_the_mailboxs_own_reply_changes_nothing(engine: Engine) -> None:
    mailbox = _box()
    answered = Subject(mailbox, SubjectKind.MESSAGE, "answered")
    _, token = await _claim(engine, AGENT, answered, "t-1", ASKED)
    await engine.begin_send(AGENT, BeginSend(request_id=_rid(), subject=answered, token=token))
    await engine.confirm_sent(
        AGENT, ConfirmSent(request_id=_rid(), subject=answered, token=token, sent_message_id="sent-1")
    )
    drafting = Subject(mailbox, SubjectKind.MESSAGE, "drafting")
    _, other = await _claim(engine, OTHER, drafting, "t-1", ASKED)

    outcome = await _outgoing(engine, mailbox, "t-1", "sent-1")

    assert outcome.result is OutgoingResult.OWN_REPLY
    assert [subject for subject, _ in outcome.subjects] == [answered]
    still = await engine.status(OTHER, drafting)
    assert still is not None
    assert still.record.state is State.CLAIMED
    begin = BeginSend(request_id=_rid(), subject=drafting, token=other)
    assert (await engine.begin_send(OTHER, begin))[0] is FenceResult.OK
    # Its echo again (message.updated: another notification id) is still the mailbox's own.
    again = await _outgoing(engine, mailbox, "t-1", "sent-1", notification_id="n-updated")
    assert again.result is OutgoingResult.OWN_REPLY
    # A person answers after the agents' replies went out: both went out, and the reply records say so.
    await engine.confirm_sent(
        OTHER, ConfirmSent(request_id=_rid(), subject=drafting, token=other, sent_message_id="sent-2")
    )
    late = await _outgoing(engine, mailbox, "t-1", "gmail-1")
    assert sorted(subject.id for subject, _ in late.subjects) == ["answered", "drafting"]
    assert late.result is OutgoingResult.ANSWERED_OUTSIDE
    replied = dict(late.subjects)[answered]
    assert replied is not None
    assert (replied.record.state, replied.record.replied_outside, replied.record.holder) == (
        State.REPLIED,
        False,
        "agent-a",
    )
    assert replied.record.outside_reply is not None
    assert replied.record.outside_reply.message_id == "gmail-1"


async def test_a_thread_claim_is_ended_like_a_message_claim(engine: Engine) -> None:
    mailbox = _box()
    thread = Subject(mailbox, SubjectKind.THREAD, "t-1")
    _, token = await _claim(engine, AGENT, thread, "t-1", ASKED)
    outcome = await _outgoing(engine, mailbox, "t-1", "gmail-1")
    assert [subject for subject, _ in outcome.subjects] == [thread]
    assert (await engine.begin_send(AGENT, BeginSend(request_id=_rid(), subject=thread, token=token)))[0] is (
        FenceResult.STALE_TOKEN
    )
    # A thread claim made for a message asked after the reply is a new question.
    other_mailbox = _box()
    later = Subject(other_mailbox, SubjectKind.THREAD, "t-1")
    await _outgoing(engine, other_mailbox, "t-1", "gmail-1")
    assert (await _claim(engine, AGENT, later, "t-1", ASKED_AGAIN))[0] is ClaimResult.GRANTED


async def test_redeliveries_retries_and_reused_request_ids(engine: Engine) -> None:
    mailbox = _box()
    subject = Subject(mailbox, SubjectKind.MESSAGE, "m-1")
    await _claim(engine, AGENT, subject, "t-1", ASKED)
    request_id = _rid()
    first = await _outgoing(engine, mailbox, "t-1", "gmail-1", notification_id="n-1", request_id=request_id)
    assert first.result is OutgoingResult.ANSWERED_OUTSIDE
    retried = await _outgoing(engine, mailbox, "t-1", "gmail-1", notification_id="n-1", request_id=request_id)
    assert (retried.result, [s for s, _ in retried.subjects]) == (first.result, [s for s, _ in first.subjects])
    redelivered = await _outgoing(engine, mailbox, "t-1", "gmail-1", notification_id="n-1", caller=OTHER)
    assert redelivered.result is OutgoingResult.DUPLICATE_DELIVERY
    assert redelivered.delivery is not None
    assert redelivered.delivery.recorded_by == "agent-c"
    with pytest.raises(InvalidArgument) as refused:
        await _outgoing(engine, mailbox, "t-1", "gmail-2", notification_id="n-1", request_id=request_id)
    assert refused.value.reason == "REQUEST_ID_REUSED"
    # Another notification of the same reply (no dedup on it) records it again and changes nothing more.
    again = await _outgoing(engine, mailbox, "t-1", "gmail-1", notification_id="n-2")
    assert (again.result, [s for s, _ in again.subjects]) == (OutgoingResult.ANSWERED_OUTSIDE, [subject])


async def test_an_older_outside_reply_arriving_late_keeps_the_later_one(engine: Engine) -> None:
    mailbox = _box()
    await _outgoing(engine, mailbox, "t-1", "gmail-late", sent_ms=ANSWERED)
    await _outgoing(engine, mailbox, "t-1", "gmail-early", sent_ms=ASKED - 1000)  # delivered out of order
    between = Subject(mailbox, SubjectKind.MESSAGE, "between")
    assert (await _claim(engine, AGENT, between, "t-1", ASKED))[0] is ClaimResult.ALREADY_REPLIED
    status = await engine.status(AGENT, between)
    assert status is not None
    assert status.record.outside_reply is not None
    assert status.record.outside_reply.message_id == "gmail-late"


async def test_watchers_see_the_claim_it_ended(engine: Engine) -> None:
    mailbox = _box()
    subject = Subject(mailbox, SubjectKind.MESSAGE, "m-1")
    stream = engine.watch(AGENT, mailbox)
    assert isinstance(await asyncio.wait_for(anext(stream), 10), Snapshot)
    _, token = await _claim(engine, AGENT, subject, "t-1", ASKED)
    await _outgoing(engine, mailbox, "t-1", "gmail-1")
    events: list[Event] = []
    while len(events) < 2:
        item = await asyncio.wait_for(anext(stream), 10)
        assert isinstance(item, Event)
        events.append(item)
    assert [event.type for event in events] == [EventType.CLAIMED, EventType.ANSWERED_OUTSIDE]
    change = events[1].change
    assert change.previous is not None
    assert (change.previous.record.holder, change.previous.token) == ("agent-a", token)
    assert change.now is not None
    assert change.now.record.replied_outside
    # On the wire: the ended claim is named as a deletion's, and the status says who answered, and when.
    wire = event_out(events[1])
    assert (wire.type, wire.previous_holder, wire.previous_token) == (pb.EVENT_TYPE_ANSWERED_OUTSIDE, "agent-a", token)
    assert wire.status.replied_outside
    assert (wire.status.outside_reply.sender, wire.status.outside_reply.stopped_holder) == (ANA, "agent-a")
    assert wire.status.outside_reply.sent_at.ToMilliseconds() == ANSWERED
    await stream.aclose()


async def test_concurrent_claims_and_a_reply_written_outside_leave_no_claim_that_can_commit(engine: Engine) -> None:
    """Whichever commits first, a message received before the reply ends REPLIED (answered outside): claimed
    before the reply and ended by it, or claimed after and refused."""
    mailbox = _box()
    subjects = [Subject(mailbox, SubjectKind.MESSAGE, f"m-{n:02d}") for n in range(20)]
    callers = [Caller(f"agent-{n}", HolderKind.AGENT) for n in range(len(subjects))]
    claims = [_claim(engine, caller, subject, "t-1", ASKED) for caller, subject in zip(callers, subjects, strict=True)]
    reply = asyncio.ensure_future(_outgoing(engine, mailbox, "t-1", "gmail-1"))
    outcomes = await asyncio.gather(*claims)
    await reply
    for caller, subject, (result, token) in zip(callers, subjects, outcomes, strict=True):
        status = await engine.status(caller, subject)
        assert status is not None
        assert status.record.state is State.REPLIED, (subject, result)
        assert status.record.replied_outside
        if result is ClaimResult.GRANTED:
            begun, _, _ = await engine.begin_send(caller, BeginSend(request_id=_rid(), subject=subject, token=token))
            assert begun is FenceResult.STALE_TOKEN


async def test_a_thread_with_more_subjects_than_one_transaction_takes_is_answered_whole(engine: Engine) -> None:
    mailbox = _box()
    count = engine_module.OUTGOING_WRITES_PER_TXN + 20
    subjects = [Subject(mailbox, SubjectKind.MESSAGE, f"m-{n:03d}") for n in range(count)]
    await asyncio.gather(*(_claim(engine, AGENT, subject, "t-1", ASKED) for subject in subjects))
    outcome = await _outgoing(engine, mailbox, "t-1", "gmail-1")
    assert sorted(subject.id for subject, _ in outcome.subjects) == [subject.id for subject in subjects]
    for subject in subjects:
        status = await engine.status(AGENT, subject)
        assert status is not None
        assert status.record.replied_outside, subject


async def test_a_claim_and_a_reply_recorded_in_one_group_commit_never_both_land(store: Store) -> None:
    """The store alone: a claim entering the thread and a RecordOutgoing decided on the thread without it, sent
    together (etcd's group commit puts calls of one pass of the event loop in one transaction, where every
    compare sees the state before any write). At most one may land, else the claim was never ended."""
    rules = test_rules()
    mailbox = _box()
    outside = OutsideReply(ANA, ANSWERED, "gmail-1", "agent-c")
    for round_ in range(5):
        thread = f"t-{round_}"
        subject = Subject(mailbox, SubjectKind.MESSAGE, f"m-{round_}")
        view = await store.read_thread(mailbox, thread, None)
        claim = ClaimReply(request_id=_rid(), subject=subject, ttl_seconds=60)
        record = new_claim(rules, AGENT, claim, now_ms=wall_clock_ms())
        attempt, written = await asyncio.gather(
            store.claim(
                subject, record, None, 0, thread=ThreadLink(thread, ASKED), thread_expires_ms=wall_clock_ms() + 60_000
            ),
            store.commit_outgoing(mailbox, thread, view, (), outside, wall_clock_ms() + 60_000, None, 0),
        )
        assert attempt.created is None or written is None, "the claim landed beside a reply that never saw it"


async def test_a_send_for_a_later_question_is_not_taken_for_the_copy_of_an_earlier_reply(engine: Engine) -> None:
    """A person answers the first question at 10:05; the customer asks again at 10:07 and an agent's answer to
    that is in flight when the person's notification, late, arrives: the message dated 10:05 cannot be the copy
    of an answer to a question asked at 10:07, so it is the person's, and it ends the claim on the first."""
    mailbox = _box()
    first, later = Subject(mailbox, SubjectKind.MESSAGE, "first"), Subject(mailbox, SubjectKind.MESSAGE, "later")
    _, held = await _claim(engine, AGENT, first, "t-1", ASKED)
    _, token = await _claim(engine, OTHER, later, "t-1", ASKED_AGAIN)
    await engine.begin_send(OTHER, BeginSend(request_id=_rid(), subject=later, token=token))
    outcome = await _outgoing(engine, mailbox, "t-1", "gmail-1", ANSWERED)
    assert (outcome.result, [subject for subject, _ in outcome.subjects]) == (OutgoingResult.ANSWERED_OUTSIDE, [first])
    begin = BeginSend(request_id=_rid(), subject=first, token=held)
    assert (await engine.begin_send(AGENT, begin))[0] is FenceResult.STALE_TOKEN
    sending = await engine.status(OTHER, later)
    assert sending is not None
    assert (sending.record.state, sending.record.outside_reply) == (State.SENDING, None)
