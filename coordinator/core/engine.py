"""The use cases: each call validates its input, asks the domain what to do and has the store do it.

Nothing here knows etcd (that is the store) or protobuf (that is the service).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator
from dataclasses import dataclass

from coordinator.core import domain, limits, work
from coordinator.core.commands import (
    AbortSend,
    AdvanceCursor,
    BeginSend,
    ClaimReply,
    ConfirmSent,
    MarkReplied,
    RecordDelivery,
    RecordIncoming,
    RecordOutgoing,
    ReleaseClaim,
    RenewClaim,
    ResolveInDoubt,
    TakeCursorRange,
    Takeover,
    UndoOutsideReply,
)
from coordinator.core.domain import (
    AdvanceResult,
    Caller,
    ClaimResult,
    CursorView,
    DeliveryRecord,
    EndMark,
    EventType,
    FenceResult,
    OutgoingResult,
    OutsideReply,
    Rules,
    State,
    Stored,
    Subject,
    SubjectKind,
    Summary,
    TakeoverResult,
    TakeResult,
    ThreadLink,
    Transition,
)
from coordinator.core.errors import InvalidArgument, SlowConsumer, StoreConflict, StoreUnavailable, WatcherBehind
from coordinator.core.memo import LastConverted
from coordinator.core.storage import Change, FeedLost, Store, encode_cursor
from coordinator.core.storms import Inbound, Refusal, RefusalKind, Stopped, normalised_correspondent

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClaimOutcome:
    result: ClaimResult
    stored: Stored | None
    delivery: DeliveryRecord | None = None


@dataclass(frozen=True)
class OutgoingOutcome:
    result: OutgoingResult
    subjects: tuple[tuple[Subject, Stored | None], ...] = ()
    delivery: DeliveryRecord | None = None


@dataclass(frozen=True)
class IncomingOutcome:
    """RecordIncoming's answer: whether it was recorded (False: a duplicate delivery), the message's subject
    as it is now, and the delivery record (the first one, for a duplicate)."""

    recorded: bool
    subject: Subject
    stored: Stored | None
    delivery: DeliveryRecord | None


@dataclass(frozen=True)
class TakeCursorOutcome:
    """TakeCursorRange's answer: the result, the cursor as read, the range's token (TAKEN) and, for BUSY, the
    other range (in ``view``)."""

    result: TakeResult
    view: CursorView
    token: int = 0
    taken: domain.CursorRange | None = None


@dataclass(frozen=True)
class TakeoverOutcome:
    result: TakeoverResult
    stored: Stored | None
    previous_holder: str = ""
    previous_token: int = 0


@dataclass(frozen=True)
class UndoOutcome:
    """The subject after an undo (FREE, or as a later call left it) and the end mark that records the undo."""

    stored: Stored | None
    end: EndMark | None


@dataclass(frozen=True)
class Snapshot:
    subjects: list[tuple[Subject, Stored]]
    revision: int


@dataclass(frozen=True)
class Event:
    type: EventType
    change: Change


@dataclass(frozen=True)
class Recent:
    """ListRecentMessages: the deliveries found, why agents leave those automated, where agents are stopped."""

    messages: list[DeliveryRecord]
    automated: dict[Subject, str]
    stopped: list[Stopped]


@dataclass(frozen=True)
class Page:
    subjects: list[tuple[Subject, Stored]]
    next_token: str | None
    revision: int


def _matches(wanted: str, summary: Summary | None, subject: Subject) -> bool:
    """Whether a message's subject line, sender or id contains ``wanted`` (casefolded; empty: all)."""
    if not wanted:
        return True
    summary = summary or Summary()
    return any(wanted in text.casefold() for text in (summary.subject_line, summary.sender, subject.id))


def _check_subject(caller: Caller, subject: Subject) -> None:
    limits.check_text("subject.mailbox", subject.mailbox, limits.MAILBOX_MAX_BYTES, required=True)
    limits.check_text("subject.id", subject.id, limits.SUBJECT_ID_MAX_BYTES, required=True)
    domain.authorize_mailbox(caller, subject.mailbox)


def _check_mailbox(caller: Caller, mailbox: str) -> None:
    limits.check_text("mailbox", mailbox, limits.MAILBOX_MAX_BYTES, required=True)
    domain.authorize_mailbox(caller, mailbox)


def _check_request_id(request_id: str) -> None:
    limits.check_text("request_id", request_id, limits.REQUEST_ID_MAX_BYTES, required=True)


def _checked_summary(summary: Summary | None, now_ms: int) -> Summary | None:
    """The summary as it is stored: within its limits, and without invisible formatting (see limits); None when
    it says nothing, as a request without one does."""
    if not summary:
        return None
    limits.check_text(
        "summary.subject_line", summary.subject_line, limits.SUMMARY_SUBJECT_LINE_MAX_BYTES, required=False
    )
    limits.check_text("summary.sender", summary.sender, limits.SUMMARY_SENDER_MAX_BYTES, required=False)
    limits.check_time_ms("summary.received_at", summary.received_ms, required=False, now_ms=now_ms)
    subject_line = limits.without_invisible_formatting(summary.subject_line)
    sender = limits.without_invisible_formatting(summary.sender)
    if (subject_line, sender) == (summary.subject_line, summary.sender):
        return summary
    return dataclasses.replace(summary, subject_line=subject_line, sender=sender)


def _thread_link(
    caller: Caller, subject: Subject, thread_id: str, received_ms: int | None, now_ms: int
) -> ThreadLink | None:
    """ClaimReply's thread and received time, both or neither; a thread subject is its own thread."""
    limits.check_text("thread_id", thread_id, limits.THREAD_ID_MAX_BYTES, required=False)
    limits.check_time_ms("received_at", received_ms, required=False, now_ms=now_ms)
    if subject.kind is SubjectKind.THREAD:
        if thread_id and thread_id != subject.id:
            raise InvalidArgument("thread_id", "names another thread than the thread subject; leave it empty")
        if received_ms is None and not thread_id:
            return None  # a thread claim without the time of the message it was made for is in no thread
        thread_id = subject.id
    if not thread_id and received_ms is None:
        return None
    if received_ms is None:
        raise InvalidArgument(
            "received_at",
            "is required with thread_id: a reply written outside the coordinator answers the messages of its "
            "thread received before it",
        )
    if not thread_id:
        raise InvalidArgument("thread_id", "is required with received_at (the message's thread)")
    return ThreadLink(thread_id, received_ms, caller.principal, domain.reports_mail(caller))


def _require_reporter(caller: Caller, call: str) -> None:
    """What the mailbox received and sent is told by its reporters: an outside reply ends claims, and a cursor moved
    past a message leaves it unread (docs/design.md#replies-written-outside, #cursors)."""
    domain.require_role(
        caller,
        domain.REPORT_ROLE,
        call,
        "the operator grants it to the principals that report a mailbox's mail (its webhook workers)",
    )


def _check_fenced_call(
    caller: Caller, command: RenewClaim | ReleaseClaim | BeginSend | ConfirmSent | AbortSend | MarkReplied
) -> None:
    """What every call carrying a fencing token checks first, in the order its errors name the fields."""
    _check_request_id(command.request_id)
    _check_subject(caller, command.subject)
    if command.token <= 0:
        raise InvalidArgument("fencing_token", "is required: pass the token ClaimReply granted (a positive number)")


def _statuses(
    view: domain.ThreadView, subjects: Iterable[Subject], written: dict[Subject, Stored]
) -> tuple[tuple[Subject, Stored | None], ...]:
    """The answer's subjects, as written now or as the view read them."""
    read = {entry.subject: entry.stored for entry in view.entries}
    return tuple((subject, written[subject] if subject in written else read.get(subject)) for subject in subjects)


def _events(changes: Iterable[Change]) -> Iterator[Event]:
    for change in changes:
        event_type = domain.classify_change(change.previous, change.now, change.end)
        if event_type is not None:
            yield Event(event_type, change)


# Records searched between two turns of other calls (ListRecentMessages with a query).
_SEARCHED_PER_TURN = 256
# How often a takeover takes over again when an agent claimed between its two steps.
_TAKEOVER_ROUNDS = 3
# How often a ClaimReply decides again when the thread's latest outside reply changed under it.
_CLAIM_ROUNDS = 4
# How often a cursor call reads and decides again when the cursor changed under it.
_CURSOR_ROUNDS = 16
# How often RecordOutgoing reads and decides again when its thread changed under it.
_OUTGOING_ROUNDS = 32
# Subjects rewritten per RecordOutgoing transaction, within etcd's 128 operations per transaction; a thread with
# more is answered in several, each deciding on what the one before left.
OUTGOING_WRITES_PER_TXN = 100


class Engine:
    def __init__(self, store: Store, rules: Rules, clock: Callable[[], int]) -> None:
        self.store = store
        self.rules = rules
        # Every watcher of a mailbox gets the same batch from the feed: its events are made once, for all.
        self._shared_events: LastConverted[list[Change], list[Event]] = LastConverted(lambda b: list(_events(b)))
        self._clock = clock

    # --- deliveries and claims -----------------------------------------------------------------------------

    async def record_delivery(self, caller: Caller, command: RecordDelivery) -> tuple[bool, DeliveryRecord]:
        """(True, the new record) on a first sighting; (False, the first record) for a duplicate."""
        _check_request_id(command.request_id)
        _check_mailbox(caller, command.mailbox)
        limits.check_text("notification_id", command.notification_id, limits.NOTIFICATION_ID_MAX_BYTES, required=True)
        now = self._clock()
        record = domain.new_delivery(
            self.rules,
            caller,
            mailbox=command.mailbox,
            notification_id=command.notification_id,
            request_id=command.request_id,
            now_ms=now,
            subject=None,
        )
        earlier = await self.store.record_delivery(record, self.rules.delivery_expiry(now))
        if earlier is None or domain.is_own_delivery(earlier, caller, command.request_id):
            return True, earlier or record
        return False, earlier

    async def claim_reply(self, caller: Caller, command: ClaimReply) -> ClaimOutcome:
        _check_request_id(command.request_id)
        subject, notification_id = command.subject, command.notification_id
        _check_subject(caller, subject)
        limits.check_text("notification_id", notification_id, limits.NOTIFICATION_ID_MAX_BYTES, required=False)
        limits.check_text("note", command.note, limits.NOTE_MAX_BYTES, required=False)
        now = self._clock()
        summary = _checked_summary(command.summary, now)
        link = _thread_link(caller, subject, command.thread_id, command.received_ms, now)
        limits.check_text("correspondent", command.correspondent, limits.CORRESPONDENT_MAX_BYTES, required=False)
        # Normalised before it is fingerprinted (by the claim record), as every retry of it will be.
        command = dataclasses.replace(command, ttl_seconds=self.rules.limits.ttl(command.ttl_seconds), summary=summary)
        record = domain.new_claim(
            self.rules,
            caller,
            command,
            now_ms=now,
            summary=summary,
            received_ms=link.received_ms if link is not None else None,
            thread_id=link.thread_id if link is not None else "",
            correspondent=normalised_correspondent(command.correspondent),
        )
        delivery = (
            domain.new_delivery(
                self.rules,
                caller,
                mailbox=subject.mailbox,
                notification_id=notification_id,
                request_id=command.request_id,
                now_ms=now,
                subject=subject,
                summary=summary,
            )
            if notification_id
            else None
        )
        candidate = record
        outside_revision = 0
        for _ in range(_CLAIM_ROUNDS):
            attempt = await self.store.claim(
                subject,
                candidate,
                delivery,
                self.rules.delivery_expiry(now),
                thread=link,
                # As long as a delivery record: past that no copy of the claim's send comes back, and a claim
                # does not stay CLAIMED for a day; the thread's record of an outside reply lasts longer.
                thread_expires_ms=self.rules.delivery_expiry(now),
                outside_revision=outside_revision,
                inbound=(self._inbound(subject, link), self.rules.inbound_expiry(now)) if link is not None else None,
            )
            if attempt.created is not None:
                answered = attempt.created.record.replied_outside
                if link is not None and not attempt.inbound_recorded:
                    await self._record_inbound(subject, link, unless_automated=True)
                return ClaimOutcome(ClaimResult.ALREADY_REPLIED if answered else ClaimResult.GRANTED, attempt.created)
            if attempt.delivery is not None and domain.is_duplicate_delivery(
                attempt.delivery, command, attempt.current, attempt.end, caller, attempt.delivery_revision
            ):
                return ClaimOutcome(ClaimResult.DUPLICATE_DELIVERY, None, attempt.delivery)
            if attempt.current is not None:
                conflict = domain.claim_conflict(attempt.current, caller, command)
                if link is not None and conflict is ClaimResult.HELD:
                    await self._record_inbound(subject, link, unless_automated=True)
                return ClaimOutcome(conflict, attempt.current)
            if link is not None and attempt.outside_revision != outside_revision:
                # The thread's latest reply written outside is not the one decided on: did it answer this message?
                outside_revision = attempt.outside_revision
                mark = attempt.outside
                answered_by = mark if mark is not None and domain.answered_before(mark, link) else None
                if answered_by is not None and not link.vouched:
                    # The thread is this caller's word alone (it does not report the mailbox's mail): it is told
                    # the message was answered, by the reply it points at, and nothing is recorded for others.
                    told = domain.answered_outside(self.rules, None, answered_by, now, summary)
                    assert told is not None
                    return ClaimOutcome(ClaimResult.ALREADY_REPLIED, Stored(told, token=0, revision=outside_revision))
                candidate = (
                    record
                    if answered_by is None
                    else domain.answered_outside(self.rules, None, answered_by, now, summary) or record
                )
                continue
            # The delivery is recorded but the subject is free: either our own retry whose first answer was
            # lost, or a redelivery after the claim it led to lapsed (its holder crashed). Claim again.
            delivery = None
        raise StoreConflict(f"the thread of {subject.id!r} kept changing while this ClaimReply ran; retry it")

    @staticmethod
    def _inbound(subject: Subject, link: ThreadLink) -> Inbound:
        """The claimed message as its thread's inbound message. A thread subject's message has no id of its own:
        its time says it all."""
        return Inbound(subject.id if subject.kind is SubjectKind.MESSAGE else "", link.received_ms)

    async def _record_inbound(self, subject: Subject, link: ThreadLink, *, unless_automated: bool = False) -> None:
        """The thread's newest inbound message, for BeginSend's check that the conversation did not move on
        (docs/design.md#reply-storms). Automated mail never moves a conversation on: an out-of-office arriving
        after the customer's message must not stop the reply to the customer. ``unless_automated``: a claim of
        a message RecordIncoming said is automated (a person answering it) is not recorded either."""
        if unless_automated and subject.kind is SubjectKind.MESSAGE and await self.store.automated(subject):
            return
        await self.store.record_inbound(
            subject.mailbox, link.thread_id, self._inbound(subject, link), self.rules.inbound_expiry(self._clock())
        )

    async def record_incoming(self, caller: Caller, command: RecordIncoming) -> IncomingOutcome:
        """An inbound message nobody claims: automated mail agents leave, or a customer's newer message found
        by looking at the thread before a send (docs/design.md#reply-storms)."""
        request_id, mailbox, notification_id = command.request_id, command.mailbox, command.notification_id
        _check_request_id(request_id)
        _check_mailbox(caller, mailbox)
        _require_reporter(caller, "RecordIncoming")
        limits.check_text("notification_id", notification_id, limits.NOTIFICATION_ID_MAX_BYTES, required=False)
        limits.check_text("message_id", command.message_id, limits.MESSAGE_ID_MAX_BYTES, required=True)
        limits.check_text("thread_id", command.thread_id, limits.THREAD_ID_MAX_BYTES, required=True)
        now = self._clock()
        received = limits.check_time_ms("received_at", command.received_ms, required=True, now_ms=now)
        assert received is not None
        limits.check_text("automated", command.automated, limits.AUTOMATED_REASON_MAX_BYTES, required=False)
        summary = _checked_summary(command.summary, now)
        subject = Subject(mailbox, SubjectKind.MESSAGE, command.message_id)
        delivery = None
        if notification_id:
            record = domain.new_delivery(
                self.rules,
                caller,
                mailbox=mailbox,
                notification_id=notification_id,
                request_id=request_id,
                now_ms=now,
                subject=subject,
                summary=summary,
                fingerprint=command.fingerprint,
            )
            earlier = await self.store.record_delivery(record, self.rules.delivery_expiry(now))
            if earlier is not None and not domain.is_own_delivery(earlier, caller, request_id):
                return IncomingOutcome(False, subject, await self.store.status(subject), earlier)
            if earlier is not None:
                domain.is_retry(earlier.request_id, earlier.fingerprint, command)
            delivery = earlier or record
        if not command.automated:
            # Automated mail does not move the conversation on (docs/design.md#reply-storms).
            await self._record_inbound(subject, ThreadLink(command.thread_id, received, caller.principal))
        else:
            # For people asking about it later (GetStatus, inboxctl), as long as its delivery is remembered.
            await self.store.record_automated(
                subject, limits.without_invisible_formatting(command.automated), self.rules.delivery_expiry(now)
            )
        return IncomingOutcome(True, subject, await self.store.status(subject), delivery)

    async def record_outgoing(self, caller: Caller, command: RecordOutgoing) -> OutgoingOutcome:
        """A message the mailbox sent: the mailbox's own reply, or one written outside the coordinator, which
        answers the messages of its thread received before it (docs/design.md#replies-written-outside)."""
        request_id, mailbox, thread_id = command.request_id, command.mailbox, command.thread_id
        notification_id, message_id = command.notification_id, command.message_id
        _check_request_id(request_id)
        _check_mailbox(caller, mailbox)
        _require_reporter(caller, "RecordOutgoing")
        limits.check_text("notification_id", notification_id, limits.NOTIFICATION_ID_MAX_BYTES, required=False)
        limits.check_text("message_id", message_id, limits.MESSAGE_ID_MAX_BYTES, required=True)
        limits.check_text("thread_id", thread_id, limits.THREAD_ID_MAX_BYTES, required=True)
        now = self._clock()
        sent = limits.check_time_ms("sent_at", command.sent_ms, required=True, now_ms=now)
        assert sent is not None
        limits.check_text("sender", command.sender, limits.SENDER_MAX_BYTES, required=False)
        limits.check_position("claim_token", command.claim_token)
        reply = OutsideReply(command.sender, sent, message_id, caller.principal, thread_id=thread_id)
        first_result: OutgoingResult | None = None
        for _ in range(_OUTGOING_ROUNDS):
            view = await self.store.read_thread(mailbox, thread_id, notification_id or None)
            seen = view.delivery
            if seen is not None:
                if seen.outgoing is None or not domain.is_own_delivery(seen, caller, request_id):
                    return OutgoingOutcome(OutgoingResult.DUPLICATE_DELIVERY, (), seen)
                domain.is_retry(seen.request_id, seen.fingerprint, command)
                if first_result is None:  # a retry: its first attempt's answer, from what that attempt left
                    subjects = domain.recorded_answer(view, seen.outgoing, message_id)
                    return OutgoingOutcome(seen.outgoing, _statuses(view, subjects, {}))
            plan = domain.plan_outgoing(self.rules, view, reply, now, command.claim_token)
            result = first_result or plan.result  # once a round committed, its answer is the call's
            writes = plan.writes[:OUTGOING_WRITES_PER_TXN]
            delivery = (
                domain.new_delivery(
                    self.rules,
                    caller,
                    mailbox=mailbox,
                    notification_id=notification_id,
                    request_id=request_id,
                    now_ms=now,
                    subject=None,
                    outgoing=result,
                    fingerprint=command.fingerprint,
                )
                if notification_id and seen is None
                else None
            )
            if not writes and plan.mark is None and delivery is None:
                return OutgoingOutcome(result, _statuses(view, plan.subjects, {}))
            written = await self.store.commit_outgoing(
                mailbox,
                thread_id,
                view,
                writes,
                plan.mark,
                self.rules.reply_expiry(now),
                delivery,
                self.rules.delivery_expiry(now),
            )
            if written is None:
                log.debug("RecordOutgoing on thread %r of %r lost a race; deciding again", thread_id, mailbox)
                continue
            if len(plan.writes) <= len(writes):
                return OutgoingOutcome(result, _statuses(view, plan.subjects, written))
            # More subjects than one transaction takes: the next round decides on what this one left.
            first_result = result
        raise StoreConflict(f"the thread {thread_id!r} kept changing while this RecordOutgoing ran; retry it")

    # --- calls with a fencing token ------------------------------------------------------------------------

    # --- cursors (docs/design.md#cursors): a reporter's calls, authorized as RecordOutgoing is ------------------

    async def get_cursor(self, caller: Caller, mailbox: str, name: str) -> CursorView:
        _check_mailbox(caller, mailbox)
        return await self.store.read_cursor(mailbox, limits.check_cursor_name(name))

    async def take_cursor_range(self, caller: Caller, command: TakeCursorRange) -> TakeCursorOutcome:
        _check_request_id(command.request_id)
        _check_mailbox(caller, command.mailbox)
        _require_reporter(caller, "TakeCursorRange")
        limits.check_cursor_name(command.name)
        limits.check_position("through_position", command.through_position)
        # Normalised before it is fingerprinted, as every retry of it will be.
        command = dataclasses.replace(command, ttl_seconds=self.rules.limits.ttl(command.ttl_seconds))
        for _ in range(_CURSOR_ROUNDS):
            view = await self.store.read_cursor(command.mailbox, command.name)
            expires = self.rules.claim_expiry(self._clock(), command.ttl_seconds)
            result, taken = domain.take_cursor_range(view, caller, command, expires_ms=expires)
            if taken is None:
                return TakeCursorOutcome(result, view, view.range_token if result is TakeResult.TAKEN else 0)
            token = await self.store.take_cursor_range(command.mailbox, command.name, view, taken, expires)
            if token is not None:
                return TakeCursorOutcome(result, view, token, taken)
        raise StoreConflict(f"the cursor {command.name!r} of {command.mailbox!r} kept changing; retry")

    async def advance_cursor(self, caller: Caller, command: AdvanceCursor) -> tuple[AdvanceResult, CursorView]:
        _check_request_id(command.request_id)
        _check_mailbox(caller, command.mailbox)
        _require_reporter(caller, "AdvanceCursor")
        limits.check_cursor_name(command.name)
        limits.check_position("position", command.position)
        if len(command.value.encode("utf-8", "surrogatepass")) > limits.CURSOR_VALUE_MAX_BYTES:
            raise InvalidArgument("value", f"is over the limit of {limits.CURSOR_VALUE_MAX_BYTES} bytes")
        limits.check_text("value", command.value, limits.CURSOR_VALUE_MAX_BYTES, required=False)
        if command.range_token <= 0:
            raise InvalidArgument("range_token", "is required: pass the token TakeCursorRange answered")
        for _ in range(_CURSOR_ROUNDS):
            view = await self.store.read_cursor(command.mailbox, command.name)
            result, cursor = domain.advance_cursor(view, caller, command)
            if cursor is None:
                return result, view
            if await self.store.advance_cursor(command.mailbox, command.name, view, cursor):
                return result, CursorView(cursor, 0, None, 0)
        raise StoreConflict(f"the cursor {command.name!r} of {command.mailbox!r} kept changing; retry")

    async def renew(self, caller: Caller, command: RenewClaim) -> tuple[FenceResult, Stored | None]:
        _check_fenced_call(caller, command)
        # Normalised before it is fingerprinted, as every retry of it will be.
        command = dataclasses.replace(command, ttl_seconds=self.rules.limits.ttl(command.ttl_seconds))
        return await self._apply(
            command.subject,
            lambda current, _end: domain.renew(self.rules, current, caller, command, now_ms=self._clock()),
            from_recent_write=True,
        )

    async def release(self, caller: Caller, command: ReleaseClaim) -> tuple[FenceResult, Stored | None]:
        _check_fenced_call(caller, command)
        return await self._apply(
            command.subject,
            lambda current, end: domain.release(current, end, caller, command, now_ms=self._clock()),
        )

    async def begin_send(self, caller: Caller, command: BeginSend) -> tuple[FenceResult, Stored | None, Refusal | None]:
        """The commit point; for an agent's claim also the reply rules (docs/design.md#reply-storms): REFUSED
        with why, or the send counted against its budgets in the same transaction as the move to SENDING."""
        _check_fenced_call(caller, command)
        now = self._clock()
        transition, after = await self.store.apply_guarded(
            command.subject,
            lambda current, _end, guard: domain.begin_send(
                self.rules, current, caller, command, now_ms=now, guard=guard
            ),
            self.rules.end_mark_expiry(now),
            send_marker_expires_ms=self.rules.send_marker_expiry(now),
            from_recent_write=True,
        )
        refusal = transition.refusal
        if refusal is not None and refusal.kind is RefusalKind.REPLY_BUDGET_SPENT and after is not None:
            # Kept until the budget frees, past the claim (the client releases it at once): people see where
            # agents stopped (board, inboxctl) and look (docs/design.md#reply-storms).
            record = after.record
            stopped = Stopped(command.subject, record.thread_id, refusal, record.holder, now, record.summary)
            await self.store.record_stopped(stopped)
        return transition.result, after, refusal

    async def confirm_sent(self, caller: Caller, command: ConfirmSent) -> tuple[FenceResult, Stored | None]:
        _check_fenced_call(caller, command)
        limits.check_text("sent_message_id", command.sent_message_id, limits.SENT_MESSAGE_ID_MAX_BYTES, required=False)
        return await self._apply(
            command.subject,
            lambda current, _end: domain.confirm_sent(self.rules, current, caller, command, now_ms=self._clock()),
            from_recent_write=True,
        )

    async def mark_replied(self, caller: Caller, command: MarkReplied) -> tuple[FenceResult, Stored | None]:
        _check_fenced_call(caller, command)
        limits.check_text("sent_message_id", command.sent_message_id, limits.SENT_MESSAGE_ID_MAX_BYTES, required=False)
        limits.check_text("note", command.note, limits.NOTE_MAX_BYTES, required=False)
        return await self._apply(
            command.subject,
            lambda current, _end: domain.mark_replied(self.rules, current, caller, command, now_ms=self._clock()),
            from_recent_write=True,
        )

    async def abort_send(self, caller: Caller, command: AbortSend) -> tuple[FenceResult, Stored | None]:
        _check_fenced_call(caller, command)
        limits.check_text("reason", command.reason, limits.NOTE_MAX_BYTES, required=False)
        now = self._clock()
        transition, after = await self.store.apply_guarded(
            command.subject,
            lambda current, end, guard: domain.abort_send(
                self.rules, current, end, caller, command, now_ms=now, guard=guard
            ),
            self.rules.end_mark_expiry(now),
        )
        return transition.result, after

    async def _apply(
        self,
        subject: Subject,
        decide: Callable[[Stored | None, EndMark | None], Transition],
        *,
        from_recent_write: bool = False,
    ) -> tuple[FenceResult, Stored | None]:
        transition, after = await self.store.apply(
            subject, decide, self._end_mark_expiry(), from_recent_write=from_recent_write
        )
        return transition.result, after

    def _end_mark_expiry(self) -> int:
        return self.rules.end_mark_expiry(self._clock())

    # --- reads ---------------------------------------------------------------------------------------------

    async def status(self, caller: Caller, subject: Subject) -> Stored | None:
        _check_subject(caller, subject)
        return await self.store.status(subject)

    async def automated(self, caller: Caller, subject: Subject) -> str:
        """Why agents leave this message, when RecordIncoming said so (docs/design.md#reply-storms); empty: no word."""
        _check_subject(caller, subject)
        return await self.store.automated(subject)

    async def list_claims(
        self, caller: Caller, *, mailbox: str, states: frozenset[State], page_size: int, page_token: str | None
    ) -> Page:
        """``page_token``: an opaque cursor the store issued (INVALID_ARGUMENT when it is not this mailbox's)."""
        _check_mailbox(caller, mailbox)
        size = limits.check_page_size(page_size)
        wanted = states or frozenset(State) - {State.FREE}
        # Unfiltered, every subject read is listed: one range of the page's size. Filtered, most may not be, so
        # the mailbox is read in ranges of LIST_RANGE_SUBJECTS, at most LIST_RANGES_PER_PAGE of them a page (one
        # subject per round trip took 4.7 s for page_size 1 on 6,000 subjects); a page that ends on that bound
        # holds fewer than ``size`` (none, even) and a token that goes on from the last subject read.
        limit = max(size, limits.LIST_RANGE_SUBJECTS) if states else size
        found: list[tuple[Subject, Stored]] = []
        cursor = page_token
        revision = 0
        for _ in range(limits.LIST_RANGES_PER_PAGE):
            items, last, revision = await self.store.list_subjects(
                mailbox, cursor=cursor, limit=limit, revision=revision, states=states
            )
            for index, item in enumerate(items):
                if item[1].record.state in wanted:
                    found.append(item)
                    if len(found) == size:
                        more = last is not None or index < len(items) - 1
                        return Page(found, encode_cursor(item[0]) if more else None, revision)
            if last is None:
                return Page(found, None, revision)
            cursor = last
        return Page(found, cursor, revision)

    async def recent_messages(self, caller: Caller, *, mailbox: str, query: str, page_size: int) -> Recent:
        """The mailbox's recently delivered messages, newest first, one per subject, whose summary or id contains
        ``query`` (case-insensitive): the deliveries ClaimReply recorded, among the newest
        RECENT_DELIVERIES_READ_MAX of them; why agents leave those that are automated; and the conversations
        where agents are stopped (docs/design.md#reply-storms), matching ``query`` the same way."""
        _check_mailbox(caller, mailbox)
        limits.check_text("query", query, limits.RECENT_QUERY_MAX_BYTES, required=False)
        size = limits.check_page_size(page_size, limits.RECENT_PAGE_SIZE_DEFAULT, limits.RECENT_PAGE_SIZE_MAX)
        wanted = query.casefold()
        seen: set[Subject] = set()
        found: list[DeliveryRecord] = []
        searched = 0
        newest = await self.store.recent_deliveries(mailbox, limits.RECENT_DELIVERIES_READ_MAX, containing=wanted)
        for delivery in newest:
            if wanted:
                # Each record searched is work too (coordinator/core/work.py); a long search gives others turns.
                searched += 1
                work.spend(1)
                if searched % _SEARCHED_PER_TURN == 0:
                    await asyncio.sleep(0)
            subject = delivery.subject
            if subject is None or subject in seen:
                continue
            seen.add(subject)
            if not _matches(wanted, delivery.summary, subject):
                continue
            found.append(delivery)
            if len(found) == size:
                break
        automated = await self.store.automated_of([d.subject for d in found if d.subject is not None])
        stopped = [
            known
            for known in await self.store.stopped(mailbox, limits.RECENT_DELIVERIES_READ_MAX)
            if _matches(wanted, known.summary, known.subject)
        ][:size]
        return Recent(found, automated, stopped)

    # --- humans --------------------------------------------------------------------------------------------

    async def takeover(self, caller: Caller, command: Takeover) -> TakeoverOutcome:
        domain.require_human(caller)
        domain.require_role(caller, "takeover", "Takeover")
        _check_request_id(command.request_id)
        subject, from_person = command.subject, command.from_person
        _check_subject(caller, subject)
        limits.check_text("note", command.note, limits.NOTE_MAX_BYTES, required=False)
        limits.check_text("from_person", from_person, limits.PRINCIPAL_MAX_BYTES, required=False)
        # Normalised before it is fingerprinted, as every retry of it will be.
        command = dataclasses.replace(
            command,
            ttl_seconds=self.rules.limits.ttl(command.ttl_seconds),
            summary=_checked_summary(command.summary, self._clock()),
        )
        summary = command.summary
        if not summary:
            # A person taking over from a terminal rarely knows the subject line; the agent's claim does. Read from
            # the store, so not the call's argument: the command (and its fingerprint) keeps what the caller sent.
            before = await self.store.status(subject)
            summary = before.record.summary if before is not None else None
        record = domain.new_claim(self.rules, caller, command, now_ms=self._clock(), summary=summary)
        previous: EndMark | None = None
        outcome: TakeoverOutcome | None = None
        # Two steps, because etcd refuses to delete and create one key in one transaction, and the new token must
        # be a new create revision. An agent may claim in between: then its claim is taken over too, a few times
        # at most; a human who claims in between keeps it (HELD), unless it is the colleague named in from_person.
        for _ in range(_TAKEOVER_ROUNDS):
            retried = False

            def decide(current: Stored | None, end: EndMark | None) -> Transition:
                # A retry of this request: its claim stands (answer it again), or only its first step landed.
                nonlocal previous, retried
                holds, own_end = domain.own_takeover(current, end, caller, command)
                previous = previous or own_end
                retried = holds
                if holds:
                    return Transition(FenceResult.OK)
                return domain.takeover_release(current, caller, command, now_ms=self._clock())

            transition, current = await self.store.apply(subject, decide, self._end_mark_expiry())
            previous = previous or transition.end
            holder, token = (previous.previous_holder, previous.token) if previous else ("", 0)
            if retried:
                result = TakeoverResult.TAKEN_OVER if previous else TakeoverResult.GRANTED
                return TakeoverOutcome(result, current, holder, token)
            if transition.end is None and current is not None:
                refusal = domain.takeover_refusal(current, caller, from_person)
                return TakeoverOutcome(refusal or TakeoverResult.HELD, current, holder, token)
            attempt = await self.store.claim(subject, record, None, 0)
            if attempt.created is not None:
                result = TakeoverResult.TAKEN_OVER if previous else TakeoverResult.GRANTED
                return TakeoverOutcome(result, attempt.created, holder, token)
            assert attempt.current is not None
            refusal = domain.takeover_refusal(attempt.current, caller, from_person)
            outcome = TakeoverOutcome(refusal or TakeoverResult.HELD, attempt.current, holder, token)
            if refusal is not None:
                return outcome
        assert outcome is not None
        return outcome

    async def resolve_in_doubt(self, caller: Caller, command: ResolveInDoubt) -> Stored | None:
        domain.require_role(caller, "resolve", "ResolveInDoubt")
        _check_request_id(command.request_id)
        _check_subject(caller, command.subject)
        limits.check_text("sent_message_id", command.sent_message_id, limits.SENT_MESSAGE_ID_MAX_BYTES, required=False)
        limits.check_text("note", command.note, limits.NOTE_MAX_BYTES, required=False)
        _, after = await self.store.apply(
            command.subject,
            lambda current, end: domain.resolve_in_doubt(
                self.rules, current, caller, command, now_ms=self._clock(), last_end=end
            ),
            self._end_mark_expiry(),
        )
        return after

    async def undo_outside_reply(self, caller: Caller, command: UndoOutsideReply) -> UndoOutcome:
        """A person undoes a reply recorded as written outside that did not answer the message (domain.
        undo_outside_reply): the subject becomes FREE, and the thread's record of that reply is withdrawn."""
        domain.require_human(caller, "UndoOutsideReply")
        domain.require_role(caller, "resolve", "UndoOutsideReply")
        _check_request_id(command.request_id)
        _check_subject(caller, command.subject)
        limits.check_text("note", command.note, limits.NOTE_MAX_BYTES, required=False)
        last_end: EndMark | None = None

        def decide(current: Stored | None, end: EndMark | None) -> Transition:
            nonlocal last_end
            last_end = end  # a retry answers from the end mark its first attempt left
            return domain.undo_outside_reply(current, end, caller, command, now_ms=self._clock())

        transition, after = await self.store.apply(command.subject, decide, self._end_mark_expiry())
        end = transition.end or last_end
        if transition.end is not None:
            undone = transition.end.undone
            log.warning(
                "outside reply undone on %r in mailbox %r by %r; it had been recorded by %r (its sender field: %r)",
                command.subject.id,
                command.subject.mailbox,
                caller.principal,
                undone.recorded_by if undone is not None else "",
                transition.end.previous_holder,
            )
        return UndoOutcome(after, end)

    # --- watch and upkeep ----------------------------------------------------------------------------------

    async def watch(
        self, caller: Caller, mailbox: str, after_revision: int = 0, *, max_lag_s: float = 10.0
    ) -> AsyncGenerator[Snapshot | Event, None]:
        """A snapshot, then every transition; with ``after_revision`` (a reconnecting watcher's last revision),
        the transitions since then instead of the snapshot, while etcd still has them. A watcher that has more
        changes waiting every time it takes one, for ``max_lag_s``, is not keeping up: SlowConsumer."""
        _check_mailbox(caller, mailbox)
        if after_revision < 0:
            raise InvalidArgument("after_revision", "must be 0 (start with a snapshot) or a revision the stream sent")
        async with self.store.subscribe(mailbox) as queue:
            # Subscribed first: every change after the revision read below reaches the queue.
            history = await self.store.changes_since(mailbox, after_revision) if after_revision else None
            if history is not None:
                changes, revision = history
                for event in _events(changes):
                    yield event
            else:
                subjects, revision = await self.store.snapshot(mailbox)
                yield Snapshot(subjects, revision)
            loop = asyncio.get_running_loop()
            behind_since: float | None = None
            while True:
                batch = await queue.get()
                if isinstance(batch, FeedLost):
                    if batch.slow_subscriber:
                        raise SlowConsumer(str(batch))
                    raise StoreUnavailable(f"the watch of mailbox {mailbox!r} ended: {batch}; watch again")
                # Monotonic time, not the injected clock: how far behind a stream is is this process's business.
                if queue.empty():
                    behind_since = None
                elif behind_since is None:
                    behind_since = loop.time()
                elif loop.time() - behind_since > max_lag_s:
                    log.warning(
                        "Watch of mailbox %r by %r stayed behind its changes for %g s; cut off",
                        mailbox,
                        caller.principal,
                        max_lag_s,
                    )
                    raise WatcherBehind(max_lag_s)
                if batch[0].revision > revision:
                    events: Iterable[Event] = self._shared_events(batch)
                else:  # (what is not newer is in the snapshot or the history already)
                    events = list(_events(change for change in batch if change.revision > revision))
                for event in events:
                    yield event

    async def sweep_in_doubt(self) -> int:
        """Moves every SENDING subject whose send marker etcd expired to IN_DOUBT; returns how many it moved."""
        moved = 0
        due, swept_revision = await self.store.due_sends()
        for subject in due:
            transition, _ = await self.store.apply(
                subject,
                lambda current, _end: domain.mark_in_doubt(current, swept_revision=swept_revision),
                self._end_mark_expiry(),
                marker_gone=True,
            )
            moved += transition.result is FenceResult.OK
        return moved

    async def run_sweeper(self, interval_s: float = 1.0) -> None:
        # Sleeps first: the sweep's read (one etcd transaction) stays off the start-up path, and a send whose
        # marker expired while no replica ran is reported one interval later, well inside the stated bound.
        while True:
            await asyncio.sleep(interval_s)
            try:
                moved = await self.sweep_in_doubt()
                if moved:
                    log.warning("marked %d subject(s) IN_DOUBT: a send began and was never confirmed", moved)
            except StoreUnavailable as error:
                log.warning("IN_DOUBT sweep skipped: %s", error)
