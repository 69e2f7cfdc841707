"""The same behaviour tests against the in-memory store and the real etcd store, through the engine: what the
fast loop learns from the fake holds on etcd too (the etcd parameter carries the etcd marker), and etcd's
suite (tests/server) stays the authority."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from coordinator.core import domain, work
from coordinator.core.commands import (
    AbortSend,
    AdvanceCursor,
    BeginSend,
    ClaimReply,
    ConfirmSent,
    MarkReplied,
    RecordDelivery,
    ReleaseClaim,
    RenewClaim,
    ResolveInDoubt,
    TakeCursorRange,
    Takeover,
)
from coordinator.core.domain import (
    AdvanceResult,
    Caller,
    ClaimResult,
    EndMark,
    EventType,
    FenceResult,
    HolderKind,
    ResolveOutcome,
    Rules,
    State,
    Stored,
    Subject,
    SubjectKind,
    Summary,
    TakeoverResult,
    TakeResult,
    Transition,
)
from coordinator.core.engine import Engine, Event, Snapshot
from coordinator.core.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from coordinator.core.storage import Store
from coordinator.ops.server import wall_clock_ms
from tests.conftest import test_rules

AGENT = Caller("agent-a", HolderKind.AGENT)
OTHER = Caller("agent-b", HolderKind.AGENT)
HUMAN = Caller("ana", HolderKind.HUMAN)


@pytest.fixture
def engine(store: Store) -> Engine:
    return Engine(store, test_rules(), wall_clock_ms)


def _subject(name: str = "m-1", mailbox: str = "box") -> Subject:
    return Subject(mailbox, SubjectKind.MESSAGE, name)


def _rid() -> str:
    return uuid.uuid4().hex


async def _claim(
    engine: Engine, caller: Caller, subject: Subject, notification_id: str = "", summary: Summary | None = None
) -> tuple[ClaimResult, int]:
    outcome = await engine.claim_reply(
        caller,
        ClaimReply(
            request_id=_rid(),
            subject=subject,
            notification_id=notification_id,
            ttl_seconds=60,
            note="",
            summary=summary,
        ),
    )
    return outcome.result, outcome.stored.token if outcome.stored is not None else 0


async def test_a_claim_is_granted_once_and_held_for_the_others(engine: Engine) -> None:
    subject = _subject()
    result, token = await _claim(engine, AGENT, subject)
    assert result is ClaimResult.GRANTED
    assert token > 0
    assert (await _claim(engine, OTHER, subject))[0] is ClaimResult.HELD
    status = await engine.status(AGENT, subject)
    assert status is not None
    assert status.token == token
    assert status.record.holder == "agent-a"


async def test_concurrent_claims_grant_exactly_one(engine: Engine) -> None:
    subject = _subject("contended")
    callers = [Caller(f"agent-{n}", HolderKind.AGENT) for n in range(20)]
    results = await asyncio.gather(*(_claim(engine, caller, subject) for caller in callers))
    assert [result for result, _ in results].count(ClaimResult.GRANTED) == 1


async def test_the_send_path_is_fenced_and_a_reply_blocks_later_claims(engine: Engine) -> None:
    subject = _subject()
    _, token = await _claim(engine, AGENT, subject)
    begin = BeginSend(request_id=_rid(), subject=subject, token=token + 1)
    assert (await engine.begin_send(AGENT, begin))[0] is FenceResult.STALE_TOKEN
    result, sending, _refusal = await engine.begin_send(
        AGENT, BeginSend(request_id=_rid(), subject=subject, token=token)
    )
    assert result is FenceResult.OK
    assert sending is not None
    assert sending.record.state is State.SENDING
    with pytest.raises(FailedPrecondition):
        await engine.renew(AGENT, RenewClaim(request_id=_rid(), subject=subject, token=token, ttl_seconds=60))
    result, replied = await engine.confirm_sent(
        AGENT, ConfirmSent(request_id=_rid(), subject=subject, token=token, sent_message_id="sent-1")
    )
    assert result is FenceResult.OK
    assert replied is not None
    assert replied.record.state is State.REPLIED
    assert (await _claim(engine, OTHER, subject))[0] is ClaimResult.ALREADY_REPLIED


async def test_a_released_subject_is_claimed_again_with_a_larger_token(engine: Engine) -> None:
    subject = _subject()
    _, first = await _claim(engine, AGENT, subject)
    release = ReleaseClaim(request_id=_rid(), subject=subject, token=first)
    assert (await engine.release(AGENT, release))[0] is FenceResult.OK
    assert (await engine.release(AGENT, ReleaseClaim(request_id=_rid(), subject=subject, token=first)))[0] is (
        FenceResult.STALE_TOKEN
    )
    result, second = await _claim(engine, OTHER, subject)
    assert result is ClaimResult.GRANTED
    assert second > first


async def test_a_notification_has_one_effect(engine: Engine) -> None:
    result, _ = await _claim(engine, AGENT, _subject("a"), notification_id="n-1")
    assert result is ClaimResult.GRANTED
    assert (await _claim(engine, OTHER, _subject("a"), notification_id="n-1"))[0] is ClaimResult.DUPLICATE_DELIVERY
    first, record = await engine.record_delivery(
        AGENT, RecordDelivery(request_id=_rid(), mailbox="box", notification_id="n-2")
    )
    again, earlier = await engine.record_delivery(
        OTHER, RecordDelivery(request_id=_rid(), mailbox="box", notification_id="n-2")
    )
    assert first
    assert not again
    assert earlier == record


async def test_a_takeover_fences_the_agent_off(engine: Engine) -> None:
    subject = _subject()
    _, token = await _claim(engine, AGENT, subject)
    outcome = await engine.takeover(HUMAN, Takeover(request_id=_rid(), subject=subject, ttl_seconds=60, note="mine"))
    assert outcome.result is TakeoverResult.TAKEN_OVER
    assert outcome.previous_token == token
    assert outcome.stored is not None
    assert outcome.stored.token > token
    begin = BeginSend(request_id=_rid(), subject=subject, token=token)
    assert (await engine.begin_send(AGENT, begin))[0] is FenceResult.STALE_TOKEN


async def test_a_person_takes_a_message_from_the_colleague_they_name_and_no_other(engine: Engine) -> None:
    subject, bo, carla = _subject("from-bo"), Caller("bo", HolderKind.HUMAN), Caller("carla", HolderKind.HUMAN)
    _, token = await _claim(engine, bo, subject)
    for named in ("", "carla", "ana"):  # nobody, another person, oneself: the colleague's claim stands
        refused = await engine.takeover(
            HUMAN, Takeover(request_id=_rid(), subject=subject, ttl_seconds=60, note="", from_person=named)
        )
        assert (refused.result, refused.stored and refused.stored.record.holder) == (TakeoverResult.HELD, "bo")
    taken = await engine.takeover(
        HUMAN, Takeover(request_id=_rid(), subject=subject, ttl_seconds=60, note="", from_person="bo")
    )
    assert (taken.result, taken.previous_holder, taken.previous_token) == (TakeoverResult.TAKEN_OVER, "bo", token)
    assert taken.stored is not None
    assert (taken.stored.record.holder, taken.stored.token > token) == ("ana", True)
    # Bo's token is stale at once: "I replied" from his screen records nothing over Ana's claim.
    late = await engine.mark_replied(
        bo, MarkReplied(request_id=_rid(), subject=subject, token=token, sent_message_id="", note="")
    )
    assert late[0] is FenceResult.STALE_TOKEN
    # And naming Ana does not let Carla take it back from her without her being the one named.
    again = await engine.takeover(
        carla, Takeover(request_id=_rid(), subject=subject, ttl_seconds=60, note="", from_person="bo")
    )
    assert again.result is TakeoverResult.HELD


async def test_a_settled_send_names_who_settled_it(engine: Engine) -> None:
    rules = Rules(test_rules().limits, send_timeout_ms=1_000)
    engine = Engine(engine.store, rules, wall_clock_ms)
    subject = _subject(f"settled-{uuid.uuid4().hex}")
    _, token = await _claim(engine, AGENT, subject)
    await engine.begin_send(AGENT, BeginSend(request_id=_rid(), subject=subject, token=token))
    # The send deadline passes unconfirmed: the sweeper reports it IN_DOUBT.
    for _ in range(100):
        await engine.sweep_in_doubt()
        status = await engine.status(HUMAN, subject)
        if status is not None and status.record.state is State.IN_DOUBT:
            break
        await asyncio.sleep(0.1)
    settled = await engine.resolve_in_doubt(
        HUMAN,
        ResolveInDoubt(
            request_id=_rid(), subject=subject, outcome=ResolveOutcome.SENT, sent_message_id="", note="in Sent"
        ),
    )
    assert settled is not None
    assert (settled.record.state, settled.record.holder, settled.record.settled_by) == (State.REPLIED, "agent-a", "ana")
    stored = await engine.status(HUMAN, subject)
    assert stored is not None
    assert stored.record.settled_by == "ana"


async def test_recent_messages_are_the_deliveries_claimed_newest_first_with_their_summaries(engine: Engine) -> None:
    mailbox = f"recent-{uuid.uuid4().hex}"
    lines = ["Refund for order 1182?", "Where is my parcel?", "Refund for order 1182?"]
    for n, line in enumerate(lines):
        summary = Summary(line, f"Bea {n} <bea@example.org>", 1_700_000_000_000 + n)
        result, token = await _claim(engine, AGENT, _subject(f"m-{n}", mailbox), f"n-{n}", summary)
        assert result is ClaimResult.GRANTED
        if n == 0:  # released since: still a recent message, what a person may want to answer themselves
            await engine.release(AGENT, ReleaseClaim(request_id=_rid(), subject=_subject("m-0", mailbox), token=token))
    # A redelivery of the same message, and a claim without a notification, add no entry.
    assert (await _claim(engine, OTHER, _subject("m-2", mailbox), "n-2"))[0] is ClaimResult.DUPLICATE_DELIVERY
    await _claim(engine, AGENT, _subject("no-notification", mailbox))
    recent = (await engine.recent_messages(AGENT, mailbox=mailbox, query="", page_size=0)).messages
    assert [delivery.subject.id for delivery in recent if delivery.subject] == ["m-2", "m-1", "m-0"]
    assert [delivery.summary.subject_line for delivery in recent if delivery.summary] == lines[::-1]
    assert recent[0].recorded_by == "agent-a"
    found = (await engine.recent_messages(AGENT, mailbox=mailbox, query="REFUND", page_size=0)).messages
    assert [delivery.subject.id for delivery in found if delivery.subject] == ["m-2", "m-0"]
    assert len((await engine.recent_messages(AGENT, mailbox=mailbox, query="bea 1 <", page_size=0)).messages) == 1
    assert len((await engine.recent_messages(AGENT, mailbox=mailbox, query="", page_size=2)).messages) == 2
    with pytest.raises(InvalidArgument, match="page_size"):
        await engine.recent_messages(AGENT, mailbox=mailbox, query="", page_size=101)
    with pytest.raises(InvalidArgument, match="query"):
        await engine.recent_messages(AGENT, mailbox=mailbox, query="x" * 257, page_size=0)
    assert (await engine.recent_messages(AGENT, mailbox=f"other-{mailbox}", query="", page_size=0)).messages == []


async def test_recent_messages_keep_no_summary_where_summaries_are_not_stored(engine: Engine) -> None:
    private = Engine(engine.store, Rules(test_rules().limits, store_summaries=False), wall_clock_ms)
    mailbox = f"private-{uuid.uuid4().hex}"
    await _claim(private, AGENT, _subject("m-1", mailbox), "n-1", Summary("Secret subject", "x@example.org"))
    recent = (await private.recent_messages(AGENT, mailbox=mailbox, query="", page_size=0)).messages
    assert [(d.subject.id if d.subject else "", d.summary) for d in recent] == [("m-1", None)]
    assert (await private.recent_messages(AGENT, mailbox=mailbox, query="secret", page_size=0)).messages == []


async def test_listing_pages_with_opaque_cursors_and_filters_by_state(engine: Engine) -> None:
    mailbox = f"list-{uuid.uuid4().hex}"
    tokens = {}
    for n in range(7):
        tokens[n] = (await _claim(engine, AGENT, _subject(f"m-{n}", mailbox)))[1]
    await engine.begin_send(AGENT, BeginSend(request_id=_rid(), subject=_subject("m-3", mailbox), token=tokens[3]))
    await _claim(engine, AGENT, _subject("elsewhere", mailbox + "-other"))
    seen: list[str] = []
    cursor = None
    while True:
        page = await engine.list_claims(AGENT, mailbox=mailbox, states=frozenset(), page_size=3, page_token=cursor)
        seen.extend(subject.id for subject, _ in page.subjects)
        cursor = page.next_token
        if cursor is None:
            break
        assert cursor.startswith("v1:")
    assert seen == [f"m-{n}" for n in range(7)]
    sending = await engine.list_claims(
        AGENT, mailbox=mailbox, states=frozenset({State.SENDING}), page_size=10, page_token=None
    )
    assert [subject.id for subject, _ in sending.subjects] == ["m-3"]
    first = await engine.list_claims(AGENT, mailbox=mailbox, states=frozenset(), page_size=1, page_token=None)
    with pytest.raises(InvalidArgument, match="does not belong"):
        await engine.list_claims(
            AGENT, mailbox=mailbox + "-other", states=frozenset(), page_size=1, page_token=first.next_token
        )
    with pytest.raises(InvalidArgument, match="start without one"):
        await engine.list_claims(AGENT, mailbox=mailbox, states=frozenset(), page_size=1, page_token="garbage")


async def test_a_listing_filtered_by_state_reads_without_listing_and_its_cursor_goes_on_from_the_last_read(
    engine: Engine,
) -> None:
    """The store lists only the states asked for (the others are read, not decoded), and a range of which it
    lists none still hands on a cursor past what it read; every subject read is work of the call."""
    mailbox = f"filtered-{uuid.uuid4().hex}"
    tokens = {n: (await _claim(engine, AGENT, _subject(f"m-{n}", mailbox)))[1] for n in range(6)}
    await engine.begin_send(AGENT, BeginSend(request_id=_rid(), subject=_subject("m-5", mailbox), token=tokens[5]))
    store, sending = engine.store, frozenset({State.SENDING})
    with work.metered() as meter:
        listed, cursor, _ = await store.list_subjects(mailbox, cursor=None, limit=3, states=sending)
    assert (listed, meter.units) == ([], 3)
    assert cursor is not None
    listed, cursor, _ = await store.list_subjects(mailbox, cursor=cursor, limit=3, states=sending)
    assert [subject.id for subject, _ in listed] == ["m-5"]
    assert cursor is None
    everything, _, _ = await store.list_subjects(mailbox, cursor=None, limit=10)
    assert len(everything) == 6


async def test_recent_deliveries_containing_a_text_keep_every_record_that_holds_it(engine: Engine) -> None:
    mailbox = f"contains-{uuid.uuid4().hex}"
    for n, (line, sender) in enumerate([("Rückerstattung", "Zoë <z@example.org>"), ("Parcel", "Bo <b@example.org>")]):
        await _claim(engine, AGENT, _subject(f"m-{n}", mailbox), f"n-{n}", Summary(line, sender))
    for text, found in (("rück", ["m-0"]), ("zoë <", ["m-0"]), ("PARCEL".casefold(), ["m-1"]), ("m-1", ["m-1"])):
        records = await engine.store.recent_deliveries(mailbox, 10, containing=text)
        assert {d.subject.id for d in records if d.subject} >= set(found), text
    with work.metered() as meter:
        await engine.recent_messages(AGENT, mailbox=mailbox, query="nothing like it", page_size=0)
    assert meter.units >= 2  # the deliveries read (etcd sorts them all: counted twice there) and searched


async def _next_events(stream: AsyncIterator[Snapshot | Event], count: int) -> list[Event]:
    events: list[Event] = []
    while len(events) < count:
        item = await asyncio.wait_for(anext(stream), 10)
        assert isinstance(item, Event)
        events.append(item)
    return events


async def test_a_watch_sends_a_snapshot_then_each_transition(engine: Engine) -> None:
    mailbox = f"watch-{uuid.uuid4().hex}"
    _, held = await _claim(engine, AGENT, _subject("before", mailbox))
    stream = engine.watch(AGENT, mailbox)
    snapshot = await asyncio.wait_for(anext(stream), 10)
    assert isinstance(snapshot, Snapshot)
    assert [(subject.id, stored.token) for subject, stored in snapshot.subjects] == [("before", held)]
    subject = _subject("during", mailbox)
    _, token = await _claim(engine, AGENT, subject)
    await engine.begin_send(AGENT, BeginSend(request_id=_rid(), subject=subject, token=token))
    await engine.abort_send(AGENT, AbortSend(request_id=_rid(), subject=subject, token=token, reason="bounced"))
    events = await _next_events(stream, 3)
    assert [event.type for event in events] == [EventType.CLAIMED, EventType.SENDING, EventType.ABORTED]
    assert all(event.change.subject == subject for event in events)
    assert events[0].change.revision < events[1].change.revision < events[2].change.revision
    await stream.aclose()


async def test_a_watch_resumed_after_a_revision_gets_what_changed_since(engine: Engine) -> None:
    mailbox = f"resume-{uuid.uuid4().hex}"
    stream = engine.watch(AGENT, mailbox)
    snapshot = await asyncio.wait_for(anext(stream), 10)
    assert isinstance(snapshot, Snapshot)
    await stream.aclose()
    subject = _subject("m", mailbox)
    _, token = await _claim(engine, AGENT, subject)
    await engine.release(AGENT, ReleaseClaim(request_id=_rid(), subject=subject, token=token))
    _, again = await _claim(engine, OTHER, subject)
    resumed = engine.watch(AGENT, mailbox, after_revision=snapshot.revision)
    (event,) = await _next_events(resumed, 1)
    assert event.type is EventType.CLAIMED
    assert event.change.now is not None
    assert event.change.now.token == again
    await resumed.aclose()


async def test_records_written_before_fingerprint_version_1_still_answer_retries_and_refuse_reuses(
    engine: Engine, store: Store
) -> None:
    """A claim record and an end mark as a release before version 1 wrote them, with the legacy fingerprint
    (coordinator/core/commands.py): the same call retried after the upgrade gets its first answer; the same
    request id with another argument is REQUEST_ID_REUSED."""
    subject = _subject(f"m-{_rid()}")
    claim = ClaimReply(request_id=_rid(), subject=subject, ttl_seconds=60, note="drafting")
    written_before = replace(
        domain.new_claim(engine.rules, AGENT, claim, now_ms=wall_clock_ms()), fingerprint=claim.legacy_fingerprint()
    )
    first = await store.claim(subject, written_before, None, 0)
    assert first.created is not None
    retried = await engine.claim_reply(AGENT, claim)
    assert retried.result is ClaimResult.GRANTED
    assert retried.stored is not None
    assert retried.stored.token == first.created.token
    with pytest.raises(InvalidArgument) as refused:
        await engine.claim_reply(AGENT, replace(claim, note="another"))
    assert refused.value.reason == "REQUEST_ID_REUSED"

    release = ReleaseClaim(request_id=_rid(), subject=subject, token=first.created.token)
    fingerprint = release.legacy_fingerprint()
    assert fingerprint is not None

    def released_before(current: Stored | None, end: EndMark | None) -> Transition:
        transition = domain.release(current, end, AGENT, release, now_ms=wall_clock_ms())
        assert transition.end is not None
        return replace(transition, end=replace(transition.end, fingerprint=fingerprint))

    await store.apply(subject, released_before, engine.rules.end_mark_expiry(wall_clock_ms()))
    assert (await engine.release(AGENT, release))[0] is FenceResult.OK
    with pytest.raises(InvalidArgument) as refused:
        await engine.release(AGENT, replace(release, redeliverable=True))
    assert refused.value.reason == "REQUEST_ID_REUSED"


# --- cursors (docs/design.md#cursors) ------------------------------------------------------------------------


def _take(through: int = 0, request_id: str = "", mailbox: str = "box") -> TakeCursorRange:
    return TakeCursorRange(
        request_id=request_id or _rid(), mailbox=mailbox, name="gmail-history", through_position=through, ttl_seconds=60
    )


def _advance(token: int, position: int, mailbox: str = "box") -> AdvanceCursor:
    return AdvanceCursor(
        request_id=_rid(),
        mailbox=mailbox,
        name="gmail-history",
        range_token=token,
        value=str(position),
        position=position,
    )


async def test_a_cursor_range_is_taken_once_advanced_by_its_holder_only_and_never_back(engine: Engine) -> None:
    start = await engine.get_cursor(AGENT, "box", "gmail-history")
    assert (start.value, start.position, start.range) == ("", 0, None)
    request_id = _rid()
    taken = await engine.take_cursor_range(AGENT, _take(1005, request_id))
    assert (taken.result, taken.view.value, taken.view.position) == (TakeResult.TAKEN, "", 0)
    assert taken.token > 0
    retried = await engine.take_cursor_range(AGENT, _take(1005, request_id))
    assert (retried.result, retried.token) == (TakeResult.TAKEN, taken.token)  # a retry answers its own range
    busy = await engine.take_cursor_range(OTHER, _take(1005))
    assert busy.result is TakeResult.BUSY
    assert busy.view.range is not None
    assert busy.view.range.holder == "agent-a"
    with pytest.raises(PermissionDenied):
        await engine.advance_cursor(OTHER, _advance(taken.token, 1005))
    result, view = await engine.advance_cursor(AGENT, _advance(taken.token, 1005))
    assert result is AdvanceResult.OK
    assert (view.value, view.position) == ("1005", 1005)
    covered = await engine.take_cursor_range(OTHER, _take(1003))  # a late or redelivered push
    assert covered.result is TakeResult.COVERED
    again = await engine.take_cursor_range(OTHER, _take(0))  # a periodic check: never covered
    assert again.result is TakeResult.TAKEN
    assert again.view.position == 1005
    with pytest.raises(InvalidArgument):
        await engine.advance_cursor(OTHER, _advance(again.token, 1004))
    stale, _ = await engine.advance_cursor(AGENT, _advance(taken.token, 1010))
    assert stale is AdvanceResult.STALE_RANGE  # its range was advanced, and another taken since
    final = await engine.get_cursor(AGENT, "box", "gmail-history")
    assert (final.position, final.range is not None) == (1005, True)


async def test_a_range_given_back_unmoved_is_taken_again_and_a_lapsed_one_advances_only_if_untaken(
    engine: Engine,
) -> None:
    first = await engine.take_cursor_range(AGENT, _take(10))
    gave_back, _ = await engine.advance_cursor(AGENT, _advance(first.token, 0))
    assert gave_back is AdvanceResult.OK
    second = await engine.take_cursor_range(OTHER, _take(10))
    assert second.result is TakeResult.TAKEN
    assert second.token > first.token
    late, _ = await engine.advance_cursor(AGENT, _advance(first.token, 10))
    assert late is AdvanceResult.STALE_RANGE  # the cursor was written since its range was taken


async def test_concurrent_takes_of_one_cursor_give_one_range(engine: Engine) -> None:
    callers = [Caller(f"worker-{n}", HolderKind.AGENT) for n in range(16)]
    outcomes = await asyncio.gather(*(engine.take_cursor_range(caller, _take(7)) for caller in callers))
    results = [outcome.result for outcome in outcomes]
    assert results.count(TakeResult.TAKEN) == 1
    assert results.count(TakeResult.BUSY) == 15
