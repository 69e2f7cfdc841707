"""The claim state machine (docs/design.md#states-of-a-subject): pure rules, no I/O, the clock passed in.

Every transition is a function from what is stored now (``Stored | None``) to a ``Transition`` that says
what to write. The store applies it with a compare-and-swap on the subject's revision, so a decision made
on a stale read never lands: it is taken again on a fresh one.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from coordinator.core.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from coordinator.core.limits import Limits
from coordinator.core.storms import Counting, GuardView, Refusal, RefusalKind, ReplyBudgets, check_send, give_back
from coordinator.core.values import ResolveOutcome as ResolveOutcome
from coordinator.core.values import Subject as Subject
from coordinator.core.values import SubjectKind as SubjectKind
from coordinator.core.values import Summary as Summary

if TYPE_CHECKING:  # the rules read the commands' fields; the commands are made of coordinator.core.values
    from coordinator.core.commands import (
        AbortSend,
        AdvanceCursor,
        BeginSend,
        ClaimReply,
        Command,
        ConfirmSent,
        MarkReplied,
        ReleaseClaim,
        RenewClaim,
        ResolveInDoubt,
        TakeCursorRange,
        Takeover,
        UndoOutsideReply,
    )


class HolderKind(enum.Enum):
    AGENT = "agent"
    HUMAN = "human"


class State(enum.Enum):
    FREE = "free"
    CLAIMED = "claimed"
    SENDING = "sending"
    REPLIED = "replied"
    IN_DOUBT = "in_doubt"


class EndReason(enum.Enum):
    """Why a subject key was deleted by a call (a deletion without one is a lease running out)."""

    RELEASED = "released"
    ABORTED = "aborted"
    TAKEN_OVER = "taken_over"
    RESOLVED_NOT_SENT = "resolved_not_sent"
    # A person found a reply recorded as written outside to be wrong: the message is answerable again.
    OUTSIDE_REPLY_UNDONE = "outside_reply_undone"


class EventType(enum.Enum):
    CLAIMED = "claimed"
    RENEWED = "renewed"
    RELEASED = "released"
    EXPIRED = "expired"
    SENDING = "sending"
    REPLIED = "replied"
    ABORTED = "aborted"
    TAKEN_OVER = "taken_over"
    IN_DOUBT = "in_doubt"
    RESOLVED_NOT_SENT = "resolved_not_sent"
    RETENTION_ENDED = "retention_ended"
    MARKED_REPLIED = "marked_replied"
    ANSWERED_OUTSIDE = "answered_outside"
    OUTSIDE_REPLY_UNDONE = "outside_reply_undone"


class ClaimResult(enum.Enum):
    GRANTED = "granted"
    HELD = "held"
    ALREADY_REPLIED = "already_replied"
    DUPLICATE_DELIVERY = "duplicate_delivery"


class FenceResult(enum.Enum):
    OK = "ok"
    STALE_TOKEN = "stale_token"
    # BeginSend of an agent's claim only: the mailbox's reply rules stop it (docs/design.md#reply-storms).
    REFUSED = "refused"


class TakeoverResult(enum.Enum):
    TAKEN_OVER = "taken_over"
    GRANTED = "granted"
    HELD = "held"
    ALREADY_REPLIED = "already_replied"


class OutgoingResult(enum.Enum):
    """RecordOutgoing's answers (docs/design.md#replies-written-outside)."""

    OWN_REPLY = "own_reply"
    ANSWERED_OUTSIDE = "answered_outside"
    DUPLICATE_DELIVERY = "duplicate_delivery"


class Grants:
    """What a principal may do besides holding its own claims. This base grants everything: it is the
    development mode without authentication; ``coordinator.api.auth`` narrows it per principal."""

    def may_access(self, mailbox: str) -> bool:
        return True

    def has_role(self, role: str) -> bool:
        return True


UNRESTRICTED = Grants()


@dataclass(frozen=True)
class Caller:
    """The authenticated principal making a call: the only source of a claim's holder."""

    principal: str
    kind: HolderKind
    grants: Grants = UNRESTRICTED


def authorize_mailbox(caller: Caller, mailbox: str) -> None:
    if not caller.grants.may_access(mailbox):
        # Names only what the caller asked for: nothing about who else uses the mailbox, or whether it exists.
        raise PermissionDenied(
            f"principal {caller.principal!r} is not granted mailbox {mailbox!r}", reason="MAILBOX_NOT_GRANTED"
        )


# The role of the principals that report a mailbox's mail to the coordinator (its webhook workers): they may say
# a message was sent from the mailbox (RecordOutgoing), and the thread they name for a message they claim is taken
# as the provider's word (docs/design.md#replies-written-outside, "What a reporter vouches for").
REPORT_ROLE = "report"


def require_role(caller: Caller, role: str, call: str, who_has_it: str = "") -> None:
    if not caller.grants.has_role(role):
        raise PermissionDenied(
            f"{call} needs the role {role!r}, which principal {caller.principal!r} does not have"
            + (f": {who_has_it}" if who_has_it else ""),
            reason="ROLE_MISSING",
        )


def reports_mail(caller: Caller) -> bool:
    """Whether the caller reports its mailboxes' mail (the role ``report``): its word on a message's thread is the
    provider's. Checked with the mailbox grant, which every call checks first."""
    return caller.grants.has_role(REPORT_ROLE)


@dataclass(frozen=True)
class ThreadLink:
    """Which thread a claimed message belongs to and when it was received, both as the provider says: a reply
    written outside the coordinator in that thread after ``received_ms`` answered it (ClaimReply's
    ``thread_id`` and ``received_at``). ``entered_by``: the principal that said so; ``vouched``: whether it
    reports the mailbox's mail (``reports_mail``), so that its word on the thread is the provider's."""

    thread_id: str
    received_ms: int
    entered_by: str = ""
    vouched: bool = True


@dataclass(frozen=True)
class OutsideReply:
    """A reply written outside the coordinator (a person in Gmail, a helpdesk), as RecordOutgoing recorded it.
    ``sent_ms`` is the message's date as the provider gives it: compared with the provider's received times,
    never with a coordinator's clock (invariant 7)."""

    sender: str
    sent_ms: int
    message_id: str
    recorded_by: str
    # The principal whose claim this reply ended (the subject was CLAIMED); empty when nobody held one.
    stopped_holder: str = ""
    # Its thread: what an undo withdraws it from (empty on records written before undoing existed).
    thread_id: str = ""


@dataclass(frozen=True)
class SubjectRecord:
    """What the store keeps under a subject's key while it is not FREE."""

    state: State
    holder: str
    holder_kind: HolderKind
    acquired_ms: int
    ttl_seconds: int
    # CLAIMED: when the lease frees it; REPLIED: when the retention ends; otherwise None (no lease).
    expires_ms: int | None
    note: str = ""
    # The ClaimReply (or Takeover) request that created the claim, and the fingerprint of its arguments, so
    # that its retry gets the same grant and a reuse of its id for other arguments is refused.
    request_id: str = ""
    fingerprint: str = ""
    # The same for the last call that changed the record since (RenewClaim, BeginSend, ResolveInDoubt): the
    # evidence of a retry lives in what the transition writes anyway, in etcd. A ConfirmSent's REPLIED record
    # keeps neither (about 57 B of each reply record, which etcd's quota is sized by): its state is the evidence.
    last_request_id: str = ""
    last_fingerprint: str = ""
    send_started_ms: int | None = None
    send_deadline_ms: int | None = None
    sent_ms: int | None = None
    sent_message_id: str = ""
    # REPLIED by MarkReplied (a person answered outside the coordinator), not through BeginSend. Its retry is
    # recognised by last_request_id and last_fingerprint, which a reply record by hand keeps.
    replied_by_hand: bool = False
    # Kept from the claim to its reply record, so that every row a person sees names its email.
    summary: Summary | None = None
    # REPLIED because someone answered in the subject's thread outside the coordinator: ``outside_reply`` says
    # who; the holder's token is stale from then on (``_check_token``).
    replied_outside: bool = False
    # A reply written outside in the subject's thread: with ``replied_outside``, the reply that answered it; on
    # a SENDING or IN_DOUBT subject (past its commit point when the reply was recorded), both replies happened.
    outside_reply: OutsideReply | None = None
    # When the claimed message was received, as the provider says (ClaimReply's ``received_at`` with a thread).
    received_ms: int | None = None
    # SENDING or IN_DOUBT: an outgoing message of the thread taken for this send's copy, arriving before the
    # send's ConfirmSent. The confirmation settles it (``_replied``, ``abort_send``).
    echo: OutsideReply | None = None
    # REPLIED by ResolveInDoubt(SENT): the person who found the send had gone out (the holder's send it was).
    settled_by: str = ""
    # The claimed message's thread and correspondent (ClaimReply), whose agents' reply budgets and newest
    # inbound message BeginSend looks at (docs/design.md#reply-storms); not kept on a reply record.
    thread_id: str = ""
    correspondent: str = ""
    # CLAIMED: the refusal BeginSend last gave this claim because a reply budget is spent (a person should look).
    agents_stopped: Refusal | None = None


@dataclass(frozen=True)
class Stored:
    """A record as read from the store. ``token`` is the key's create revision: the fencing token."""

    record: SubjectRecord
    token: int
    revision: int


@dataclass(frozen=True)
class EndMark:
    """Written beside a deletion so that watchers and retries learn why the subject was freed."""

    reason: EndReason
    by: str
    token: int
    previous_holder: str
    request_id: str
    at_ms: int
    detail: str = ""
    # False when the call ended the claim without deciding about the message (ReleaseClaim or AbortSend with
    # `redeliverable`): the notification that led to it may then claim again.
    settles_delivery: bool = True
    fingerprint: str = ""  # of the ending call's arguments, as SubjectRecord.fingerprint
    # OUTSIDE_REPLY_UNDONE: the reply written outside that the person undid (for watchers and the retry's answer).
    undone: OutsideReply | None = None


@dataclass(frozen=True)
class DeliveryRecord:
    mailbox: str
    notification_id: str
    recorded_by: str
    recorded_ms: int
    request_id: str
    subject: Subject | None = None
    # Recorded by RecordOutgoing: what it answered, and its arguments' fingerprint, so that its retry gets the
    # first answer and a reuse of its request id for another message is refused.
    outgoing: OutgoingResult | None = None
    fingerprint: str = ""
    # Which email it was, as the ClaimReply that recorded it said (Rules.store_summaries): what a person finds
    # a message to answer by among the mailbox's recent ones.
    summary: Summary | None = None


@dataclass(frozen=True)
class Transition:
    """What a call decided. At most one of ``write`` and ``end`` is set; neither means no change. ``withdraw``:
    in the same write, the thread's latest reply written outside is deleted if it is still this reply (an undo)."""

    result: FenceResult
    write: SubjectRecord | None = None
    end: EndMark | None = None
    withdraw: OutsideReply | None = None
    # BeginSend REFUSED: why. ``counting``: in the same write, the claim's guard records (reply budgets) become
    # these, compared unchanged since they were read (docs/design.md#reply-storms).
    refusal: Refusal | None = None
    counting: Counting | None = None


@dataclass(frozen=True)
class Rules:
    """The configurable numbers of the state machine."""

    limits: Limits
    # Claims share one etcd lease per bucket of this width: a claim frees between its TTL and its TTL plus
    # this width after its last renewal, never earlier.
    claim_bucket_ms: int = 1_000
    # Reply and delivery records live hours; a wider bucket keeps the number of leases small.
    record_bucket_ms: int = 10_000
    reply_retention_ms: int = 72 * 3600 * 1000
    delivery_retention_ms: int = 24 * 3600 * 1000
    # How long BeginSend gives the holder to confirm or abort before the subject is reported IN_DOUBT: the TTL
    # of the etcd lease of its send marker.
    send_timeout_ms: int = 120_000
    # Whether a claim keeps the caller's summary of its email (subject line, sender): personal data.
    store_summaries: bool = True
    # Each mailbox's agents' reply budgets (docs/design.md#reply-storms, set in coordinator/ops/config.py).
    reply_budgets: Callable[[str], ReplyBudgets] = lambda _mailbox: ReplyBudgets()

    def inbound_expiry(self, now_ms: int) -> int:
        # A thread's newest inbound message is looked at while claims on older ones live: a delivery's life at most.
        return self.delivery_expiry(now_ms)

    def claim_expiry(self, now_ms: int, ttl_seconds: int) -> int:
        return _round_up(now_ms + ttl_seconds * 1000, self.claim_bucket_ms)

    def reply_expiry(self, now_ms: int) -> int:
        return _round_up(now_ms + self.reply_retention_ms, self.record_bucket_ms)

    def delivery_expiry(self, now_ms: int) -> int:
        return _round_up(now_ms + self.delivery_retention_ms, self.record_bucket_ms)

    def send_marker_expiry(self, now_ms: int) -> int:
        # Only the distance from now becomes the lease's TTL, so this replica's clock offset does not matter.
        return _round_up(now_ms + self.send_timeout_ms, self.claim_bucket_ms)

    def end_mark_expiry(self, now_ms: int) -> int:
        # As long as a delivery record: whether its claim ended deliberately must be known while it lives.
        return self.delivery_expiry(now_ms)


def _round_up(value: int, step: int) -> int:
    return math.ceil(value / step) * step


def state_of(stored: Stored | None) -> State:
    return State.FREE if stored is None else stored.record.state


# --- Retries --------------------------------------------------------------------------------------------


def is_retry(recorded_id: str, recorded_fingerprint: str, command: Command) -> bool:
    """Whether ``command`` is a retry of the call recorded (same request id, same arguments: its fingerprint, of
    any version still recognised); a reuse of the id with other arguments is refused, because answering it as
    the first call would hide that it was never made. Records written before fingerprints were kept have none:
    their id alone decides."""
    request_id = command.request_id
    if not request_id or recorded_id != request_id:
        return False
    if recorded_fingerprint and not command.recognises(recorded_fingerprint):
        raise InvalidArgument(
            "request_id",
            f"{request_id!r} was already used for a different call on this subject ({command.rpc} with other "
            "arguments, or another RPC); a retry must repeat its call exactly, and a new call needs a new request id",
            reason="REQUEST_ID_REUSED",
        )
    return True


# --- ClaimReply -----------------------------------------------------------------------------------------


def new_claim(
    rules: Rules,
    caller: Caller,
    command: ClaimReply | Takeover,
    *,
    now_ms: int,
    summary: Summary | None = None,
    received_ms: int | None = None,
    thread_id: str = "",
    correspondent: str = "",
) -> SubjectRecord:
    """The claim ``command`` makes. The summary is passed apart: a Takeover's may come from the claim it takes
    over, which is not the call's argument (nor in its fingerprint)."""
    return SubjectRecord(
        summary=summary if summary and rules.store_summaries else None,
        received_ms=received_ms,
        thread_id=thread_id,
        correspondent=correspondent,
        state=State.CLAIMED,
        holder=caller.principal,
        holder_kind=caller.kind,
        acquired_ms=now_ms,
        ttl_seconds=command.ttl_seconds,
        expires_ms=rules.claim_expiry(now_ms, command.ttl_seconds),
        note=command.note,
        request_id=command.request_id,
        fingerprint=command.fingerprint,
    )


def new_delivery(
    rules: Rules,
    caller: Caller,
    *,
    mailbox: str,
    notification_id: str,
    request_id: str,
    now_ms: int,
    subject: Subject | None,
    outgoing: OutgoingResult | None = None,
    fingerprint: str = "",
    summary: Summary | None = None,
) -> DeliveryRecord:
    return DeliveryRecord(
        mailbox=mailbox,
        notification_id=notification_id,
        recorded_by=caller.principal,
        recorded_ms=now_ms,
        request_id=request_id,
        subject=subject,
        outgoing=outgoing,
        fingerprint=fingerprint,
        summary=summary if summary and rules.store_summaries else None,
    )


def is_own_delivery(delivery: DeliveryRecord, caller: Caller, request_id: str) -> bool:
    """A delivery recorded by this very request (a retry whose first answer was lost)."""
    return delivery.recorded_by == caller.principal and delivery.request_id == request_id


def is_duplicate_delivery(
    delivery: DeliveryRecord,
    command: ClaimReply,
    current: Stored | None,
    end: EndMark | None,
    caller: Caller,
    delivery_revision: int,
) -> bool:
    """Whether a notification recorded earlier (at etcd revision ``delivery_revision``) must be dropped now.

    Not when it is this very request's retry. Otherwise yes while its subject is held or replied, and when
    the claim it led to was ended by a call (released, aborted, taken over, resolved) since it was recorded.
    When that claim lapsed instead (its holder crashed mid-draft), the notification has had no effect: its
    redelivery may claim again, which is how a crash is recovered. A notification recorded for another
    subject, or by RecordDelivery alone, is always a duplicate.
    """
    if is_own_delivery(delivery, caller, command.request_id):
        return False
    if current is not None or delivery.subject != command.subject:
        return True
    # "Since it was recorded" by revisions, not by the two records' timestamps: those come from the clocks of
    # the replicas that wrote them. The claim an end mark ended was created at its token.
    return end is not None and end.settles_delivery and end.token >= delivery_revision


def claim_conflict(current: Stored, caller: Caller, command: ClaimReply) -> ClaimResult:
    """The answer to a ClaimReply whose create-if-absent found the subject taken. HELD may name the caller
    itself: its own claim, made by another request (use that request's token)."""
    record = current.record
    if record.state is State.CLAIMED:
        if record.holder == caller.principal and is_retry(record.request_id, record.fingerprint, command):
            return ClaimResult.GRANTED
        return ClaimResult.HELD
    return ClaimResult.ALREADY_REPLIED


# --- Calls that present a fencing token -----------------------------------------------------------------


def _check_token(current: Stored | None, caller: Caller, token: int) -> bool:
    """True when ``token`` is the subject's current claim; raises if the caller is not its holder. A claim a
    reply written outside ended keeps its key (and so its create revision) but no longer holds anything."""
    if current is None or current.token != token or current.record.replied_outside:
        return False
    if current.record.holder != caller.principal:
        raise PermissionDenied(
            f"fencing token {token} belongs to another principal; only the holder may use it", reason="NOT_HOLDER"
        )
    return True


def _wrong_state(call: str, token: int, state: State, needed: str) -> FailedPrecondition:
    return FailedPrecondition(f"{call}: the claim with token {token} is {state.name}; {call} needs {needed}")


def _repeats_last(record: SubjectRecord, command: Command) -> bool:
    return is_retry(record.last_request_id, record.last_fingerprint, command)


def _repeats_holders_last(current: Stored | None, caller: Caller, command: Command) -> bool:
    """Whether the holder's last call on the subject was this one; checked before the token, so that an id
    reused with another token is refused rather than answered STALE_TOKEN."""
    return current is not None and current.record.holder == caller.principal and _repeats_last(current.record, command)


def _stamped(record: SubjectRecord, command: Command) -> SubjectRecord:
    return replace(record, last_request_id=command.request_id, last_fingerprint=command.fingerprint)


def renew(rules: Rules, current: Stored | None, caller: Caller, command: RenewClaim, *, now_ms: int) -> Transition:
    token, ttl_seconds = command.token, command.ttl_seconds
    repeat = _repeats_holders_last(current, caller, command)
    if not _check_token(current, caller, token):
        return Transition(FenceResult.STALE_TOKEN)
    assert current is not None
    if current.record.state is not State.CLAIMED:
        raise _wrong_state("RenewClaim", token, current.record.state, "CLAIMED")
    if repeat:
        return Transition(FenceResult.OK)  # the same answer as the first attempt, not a second renewal
    renewed = replace(current.record, ttl_seconds=ttl_seconds, expires_ms=rules.claim_expiry(now_ms, ttl_seconds))
    return Transition(FenceResult.OK, write=_stamped(renewed, command))


def release(
    current: Stored | None, last_end: EndMark | None, caller: Caller, command: ReleaseClaim, *, now_ms: int
) -> Transition:
    token = command.token
    if _repeats(last_end, caller, token, command, EndReason.RELEASED):
        return Transition(FenceResult.OK)
    if not _check_token(current, caller, token):
        return Transition(FenceResult.STALE_TOKEN)
    assert current is not None
    if current.record.state is not State.CLAIMED:
        raise _wrong_state("ReleaseClaim", token, current.record.state, "CLAIMED (after BeginSend use AbortSend)")
    stopped = current.record.agents_stopped
    return Transition(
        FenceResult.OK,
        end=EndMark(
            EndReason.RELEASED,
            caller.principal,
            token,
            current.record.holder,
            command.request_id,
            now_ms,
            # Watchers (the board) learn why agents let it go: a person should look (docs/design.md#reply-storms).
            stopped.reason if stopped is not None else "",
            settles_delivery=not command.redeliverable,
            fingerprint=command.fingerprint,
        ),
    )


def guarded(record: SubjectRecord) -> bool:
    """Whether a subject's sends are an agent's and have guard records (docs/design.md#reply-storms)."""
    return record.holder_kind is HolderKind.AGENT and bool(record.thread_id or record.correspondent)


def begin_send(
    rules: Rules,
    current: Stored | None,
    caller: Caller,
    command: BeginSend,
    *,
    now_ms: int,
    guard: GuardView | None = None,
) -> Transition:
    token = command.token
    _repeats_holders_last(current, caller, command)
    if not _check_token(current, caller, token):
        return Transition(FenceResult.STALE_TOKEN)
    assert current is not None
    record = current.record
    if record.state is State.SENDING:
        return Transition(FenceResult.OK)  # a retry: the commit point was already passed with this token
    if record.state is State.IN_DOUBT:
        # A retry whose first attempt committed, answered too late: the send deadline passed meanwhile, so
        # sending now would race a person resolving it. Do not send; the caller may abort (nothing went out).
        return Transition(FenceResult.STALE_TOKEN)
    if record.state is not State.CLAIMED:
        raise _wrong_state("BeginSend", token, record.state, "CLAIMED")
    counting = None
    if guard is not None and guarded(record):
        subject = command.subject
        checked = check_send(
            guard,
            rules.reply_budgets(subject.mailbox),
            received_ms=record.received_ms,
            # A thread claim's message has no id, nor has the newest inbound a thread claim recorded: the thread's id
            # keeps a newer inbound from passing for the claim's own message (a message whose id is the thread's,
            # as Gmail's first one, is never newer than the claim's).
            message_id=subject.id,
            token=token,
            now_ms=now_ms,
            expiry=lambda window_ms: _round_up(now_ms + window_ms, rules.claim_bucket_ms),
        )
        if isinstance(checked, Refusal):
            if checked.kind is RefusalKind.REPLY_BUDGET_SPENT and record.agents_stopped != checked:
                # Kept on the claim while it is held, for the people watching: a person should look.
                return Transition(FenceResult.REFUSED, write=replace(record, agents_stopped=checked), refusal=checked)
            return Transition(FenceResult.REFUSED, refusal=checked)
        counting = checked
    sending = replace(
        record,
        state=State.SENDING,
        expires_ms=None,
        send_started_ms=now_ms,
        send_deadline_ms=now_ms + rules.send_timeout_ms,
        agents_stopped=None,
    )
    return Transition(FenceResult.OK, write=_stamped(sending, command), counting=counting)


def confirm_sent(
    rules: Rules, current: Stored | None, caller: Caller, command: ConfirmSent, *, now_ms: int
) -> Transition:
    token, sent_message_id = command.token, command.sent_message_id
    if not _check_token(current, caller, token):
        return Transition(FenceResult.STALE_TOKEN)
    assert current is not None
    record = current.record
    if record.state is State.REPLIED:
        # A retry. The reply record keeps no request id (it is the record etcd's quota is sized by), so a
        # ConfirmSent with other arguments is told apart by them, whatever its request id.
        # A send settled by its stamped copy first (plan_outgoing) holds the copy's id: the holder's confirmation
        # without an id is that same reply.
        if record.sent_message_id != sent_message_id and not (record.settled_by and not sent_message_id):
            raise InvalidArgument(
                "sent_message_id",
                f"the reply with token {token} was already confirmed with sent message id "
                f"{record.sent_message_id!r}; a retry of that ConfirmSent repeats its arguments",
                reason="REQUEST_ID_REUSED",
            )
        return Transition(FenceResult.OK)
    if record.state not in (State.SENDING, State.IN_DOUBT):
        raise _wrong_state("ConfirmSent", token, record.state, "SENDING (call BeginSend first)")
    return Transition(FenceResult.OK, write=_replied(rules, record, sent_message_id, now_ms))


def abort_send(
    rules: Rules,
    current: Stored | None,
    last_end: EndMark | None,
    caller: Caller,
    command: AbortSend,
    *,
    now_ms: int,
    guard: GuardView | None = None,
) -> Transition:
    token = command.token
    if _repeats(last_end, caller, token, command, EndReason.ABORTED):
        return Transition(FenceResult.OK)
    if (
        current is not None
        and current.token == token
        and current.record.outside_reply is not None
        and current.record.outside_reply.stopped_holder == caller.principal
        and _repeats_last(current.record, command)
    ):
        return Transition(FenceResult.OK)  # a retry of the abort that found someone had answered (below)
    if not _check_token(current, caller, token):
        return Transition(FenceResult.STALE_TOKEN)
    assert current is not None
    record = current.record
    if record.state not in (State.SENDING, State.IN_DOUBT):
        raise _wrong_state("AbortSend", token, record.state, "SENDING (before BeginSend use ReleaseClaim)")
    answered = _answered_by_its_copy(rules, record, now_ms)
    if answered is not None:
        return Transition(FenceResult.OK, write=_stamped(answered, command))
    return Transition(
        FenceResult.OK,
        end=EndMark(
            EndReason.ABORTED,
            caller.principal,
            token,
            current.record.holder,
            command.request_id,
            now_ms,
            command.reason,
            settles_delivery=not command.redeliverable,
            fingerprint=command.fingerprint,
        ),
        # Certainly not sent: the send's unit goes back to its budgets (docs/design.md#reply-storms).
        counting=give_back(guard, token) if guard is not None and guarded(record) else None,
    )


def mark_replied(
    rules: Rules, current: Stored | None, caller: Caller, command: MarkReplied, *, now_ms: int
) -> Transition:
    """The holder answered without the coordinator (in a mail client, by phone): CLAIMED becomes REPLIED.

    Fenced like BeginSend, since it stands for a send: a holder whose claim lapsed or was taken over must not
    record a reply over the new holder's claim."""
    token = command.token
    retried = _repeats_holders_last(current, caller, command)
    if not _check_token(current, caller, token):
        return Transition(FenceResult.STALE_TOKEN)
    assert current is not None
    record = current.record
    if record.state is State.REPLIED and retried:
        return Transition(FenceResult.OK)  # a retry: the first attempt recorded it
    if record.state is not State.CLAIMED:
        raise _wrong_state("MarkReplied", token, record.state, "CLAIMED (after BeginSend use ConfirmSent)")
    replied = replace(
        _replied(rules, record, command.sent_message_id, now_ms), note=command.note or record.note, replied_by_hand=True
    )
    return Transition(FenceResult.OK, write=_stamped(replied, command))


def _answered_by_its_copy(rules: Rules, record: SubjectRecord, now_ms: int) -> SubjectRecord | None:
    """A send that certainly did not go out (aborted, resolved as not sent) whose ``echo`` was taken for its copy:
    that message was someone answering from the mailbox, so the subject is answered, not free to be answered
    again. None when there is no such copy (or it predates the message)."""
    echo = record.echo
    if echo is None or (record.received_ms is not None and record.received_ms > echo.sent_ms):
        return None
    return answered_outside(rules, replace(record, state=State.CLAIMED), echo, now_ms)


def mark_in_doubt(current: Stored | None, *, swept_revision: int) -> Transition:
    """The sweeper's transition: a send whose send marker etcd expired is reported, never freed. The sweep saw
    the marker gone at ``swept_revision``; a subject written since then is not judged on that sight. No clock
    is read: the marker's lease is the deadline (docs/design.md#leases-and-expiry)."""
    if current is None or current.record.state is not State.SENDING or current.revision > swept_revision:
        return Transition(FenceResult.STALE_TOKEN)
    return Transition(FenceResult.OK, write=replace(current.record, state=State.IN_DOUBT))


def _replied(rules: Rules, record: SubjectRecord, sent_message_id: str, now_ms: int) -> SubjectRecord:
    # Without the claim's bookkeeping, which a reply record does not keep (coordinator/store/etcd/codec.py): the answer
    # of the call that writes it is then the same as a later read's, and as its retry's.
    outside = record.outside_reply
    if outside is None and record.echo is not None and sent_message_id and record.echo.message_id != sent_message_id:
        # The message taken for this send's copy was another: someone answered beside it, and both went out.
        outside = record.echo
    return replace(
        record,
        outside_reply=outside,
        echo=None,
        received_ms=None,
        thread_id="",
        correspondent="",
        agents_stopped=None,
        state=State.REPLIED,
        acquired_ms=0,
        ttl_seconds=0,
        request_id="",
        fingerprint="",
        last_request_id="",
        last_fingerprint="",
        expires_ms=rules.reply_expiry(now_ms),
        send_deadline_ms=None,
        sent_ms=now_ms,
        sent_message_id=sent_message_id,
    )


def _repeats(last_end: EndMark | None, caller: Caller, token: int, command: Command, reason: EndReason) -> bool:
    """Whether ``last_end`` is this very call's: its retry answers OK and changes nothing."""
    return (
        last_end is not None
        and last_end.by == caller.principal
        and (token == 0 or last_end.token == token)
        and is_retry(last_end.request_id, last_end.fingerprint, command)
        and last_end.reason is reason
    )


# --- Humans' calls --------------------------------------------------------------------------------------


def require_human(caller: Caller, call: str = "Takeover") -> None:
    if caller.kind is not HolderKind.HUMAN:
        instead = "an agent must wait or use ClaimReply" if call == "Takeover" else "a person must judge it"
        raise PermissionDenied(f"{call} is for principals of kind human; {instead}", reason="NOT_HUMAN")


def takeover_refusal(current: Stored | None, caller: Caller, from_person: str = "") -> TakeoverResult | None:
    """Why a takeover cannot proceed, or None when the subject is FREE, claimed by an agent, or claimed by
    ``from_person``: the colleague the caller confirmed taking it from (docs/security.md#roles). Never from
    the caller itself, and never from a person the caller did not name: one who claimed in between, say."""
    if current is None:
        return None
    record = current.record
    if record.state is not State.CLAIMED:
        return TakeoverResult.ALREADY_REPLIED
    if record.holder_kind is HolderKind.HUMAN and (record.holder != from_person or record.holder == caller.principal):
        return TakeoverResult.HELD
    return None


def own_takeover(
    current: Stored | None, last_end: EndMark | None, caller: Caller, command: Takeover
) -> tuple[bool, EndMark | None]:
    """What a Takeover with this request id already did: (whether the claim it made stands, the end mark it left
    on the agent's claim). A retry answers from these instead of taking over again (or answering HELD)."""
    holds = (
        current is not None
        and current.record.state is State.CLAIMED
        and current.record.holder == caller.principal
        and is_retry(current.record.request_id, current.record.fingerprint, command)
    )
    ended = _repeats(last_end, caller, 0, command, EndReason.TAKEN_OVER)
    return holds, last_end if ended else None


def takeover_release(current: Stored | None, caller: Caller, command: Takeover, *, now_ms: int) -> Transition:
    """First step of a takeover: end the holder's claim (an agent's, or the named colleague's), which makes
    its token stale at once."""
    require_human(caller)
    if current is None or takeover_refusal(current, caller, command.from_person) is not None:
        return Transition(FenceResult.STALE_TOKEN)
    return Transition(
        FenceResult.OK,
        end=EndMark(
            EndReason.TAKEN_OVER,
            caller.principal,
            current.token,
            current.record.holder,
            command.request_id,
            now_ms,
            f"taken over by {caller.principal}",
            fingerprint=command.fingerprint,
        ),
    )


def resolve_in_doubt(
    rules: Rules,
    current: Stored | None,
    caller: Caller,
    command: ResolveInDoubt,
    *,
    now_ms: int,
    last_end: EndMark | None = None,
) -> Transition:
    note = command.note
    state = state_of(current)
    # A retry finds the subject as its first attempt left it: REPLIED with its stamp, or FREE with its end mark.
    if state is State.REPLIED:
        assert current is not None
        if _repeats_last(current.record, command):
            return Transition(FenceResult.OK)
    elif state is State.FREE and _repeats(last_end, caller, 0, command, EndReason.RESOLVED_NOT_SENT):
        return Transition(FenceResult.OK)
    if state is not State.IN_DOUBT:
        raise FailedPrecondition(
            f"ResolveInDoubt: the subject is {state.name}; only an IN_DOUBT subject can be resolved"
        )
    assert current is not None
    if command.outcome is ResolveOutcome.SENT:
        resolved = _stamped(_replied(rules, current.record, command.sent_message_id, now_ms), command)
        return Transition(
            FenceResult.OK, write=replace(resolved, note=note or resolved.note, settled_by=caller.principal)
        )
    answered = _answered_by_its_copy(rules, current.record, now_ms)
    if answered is not None:  # not sent, so the message taken for its copy was someone's answer (as abort_send)
        return Transition(FenceResult.OK, write=_stamped(replace(answered, note=note), command))
    return Transition(
        FenceResult.OK,
        end=EndMark(
            EndReason.RESOLVED_NOT_SENT,
            caller.principal,
            current.token,
            current.record.holder,
            command.request_id,
            now_ms,
            note,
            fingerprint=command.fingerprint,
        ),
    )


def undo_outside_reply(
    current: Stored | None, last_end: EndMark | None, caller: Caller, command: UndoOutsideReply, *, now_ms: int
) -> Transition:
    """A person (the ``resolve`` role) finds that a reply recorded as written outside did not answer this message
    (recorded by mistake, or by a reporter that should not have): the subject becomes FREE, answerable again, and
    the thread's record of that reply is withdrawn (if it is still the thread's latest), so that the message's
    next ClaimReply is not answered by it again. The end mark says who undid what, when; the notification that
    led to the message may claim again (the undo is no decision about the message)."""
    require_human(caller, "UndoOutsideReply")
    if _repeats(last_end, caller, 0, command, EndReason.OUTSIDE_REPLY_UNDONE):
        return Transition(FenceResult.OK)
    if current is None or not current.record.replied_outside:
        state = state_of(current)
        raise FailedPrecondition(
            f"UndoOutsideReply: the subject is {state.name}"
            + (" by its own send" if state is State.REPLIED else "")
            + "; only a message recorded as answered outside the coordinator can be undone"
        )
    record = current.record
    undone = record.outside_reply
    return Transition(
        FenceResult.OK,
        end=EndMark(
            EndReason.OUTSIDE_REPLY_UNDONE,
            caller.principal,
            current.token,
            record.holder,
            command.request_id,
            now_ms,
            command.note,
            settles_delivery=False,
            fingerprint=command.fingerprint,
            undone=undone,
        ),
        withdraw=undone if undone is not None and undone.thread_id else None,
    )


# --- Replies written outside the coordinator ------------------------------------------------------------
# docs/design.md#replies-written-outside: a reply in thread T dated d answers every message of T received at or
# before d. The store keeps, per thread, the subjects claimed for its messages (with their received times) and
# the latest reply written outside; these rules decide what a reported outgoing message means.

# Who a subject answered outside shows as holder when its message carried no sender.
UNKNOWN_SENDER = "the mailbox"


@dataclass(frozen=True)
class ThreadEntry:
    """A subject claimed for a message of a thread, when that message was received, and the subject now; who
    entered it in the thread, and whether that principal reports the mailbox's mail (``ThreadLink``). Entries
    written before this was kept have neither: vouched, as every entry was then."""

    subject: Subject
    received_ms: int
    stored: Stored | None
    entered_by: str = ""
    vouched: bool = True


def _counts_for(entry: ThreadEntry, record: SubjectRecord | None) -> bool:
    """Whether a reply written outside in the entry's thread may end or mark the entry's subject: the thread was
    named by a principal that reports the mailbox's mail (its word is the provider's), or by the subject's own
    holder about its own claim (naming a wrong thread can then cost only itself). A thread named by anyone
    else (an agent without ``report``, a person) for a message is that principal's word alone, and never makes
    the message answered for others (docs/design.md#replies-written-outside, "What a reporter vouches for")."""
    if entry.vouched:
        return True
    return record is not None and not record.replied_outside and record.holder == entry.entered_by


@dataclass(frozen=True)
class ThreadView:
    """What the store holds about one thread, all read at ``revision``: its claimed subjects, the latest reply
    written outside (``mark``, written at ``mark_revision``; 0 when there is none) and, when asked for, the
    delivery record of the reporting notification."""

    entries: tuple[ThreadEntry, ...]
    mark: OutsideReply | None
    revision: int
    mark_revision: int = 0
    delivery: DeliveryRecord | None = None


@dataclass(frozen=True)
class OutgoingPlan:
    """What RecordOutgoing decided: its answer, the subjects to rewrite (each from the entry it was read as), the
    thread's new latest outside reply (None: unchanged) and the subjects the answer names."""

    result: OutgoingResult
    writes: tuple[tuple[ThreadEntry, SubjectRecord], ...] = ()
    mark: OutsideReply | None = None
    subjects: tuple[Subject, ...] = ()


def answered_before(mark: OutsideReply | None, link: ThreadLink | None) -> bool:
    """Whether a reply written outside (``mark``) answered the message ``link`` describes: same thread, the
    message received at or before the reply's date (the provider's times on both sides)."""
    return mark is not None and link is not None and link.received_ms <= mark.sent_ms


def answered_outside(
    rules: Rules, current: SubjectRecord | None, reply: OutsideReply, now_ms: int, summary: Summary | None = None
) -> SubjectRecord | None:
    """What a reply written outside makes of a subject it answered; None: the subject stays as it is.

    FREE or CLAIMED: REPLIED, answered outside (a CLAIMED holder's token stops holding: ``_check_token``).
    SENDING, IN_DOUBT or REPLIED by its own send: past the commit point, so the state stays and the record says
    both replies went out (the first outside reply it learns of). Answered outside already: as it is."""
    if current is None or current.state is State.CLAIMED:
        kept = current.summary if current is not None else summary if rules.store_summaries else None
        return SubjectRecord(
            state=State.REPLIED,
            holder=reply.sender or UNKNOWN_SENDER,
            holder_kind=HolderKind.HUMAN,
            acquired_ms=0,
            ttl_seconds=0,
            expires_ms=rules.reply_expiry(now_ms),
            sent_ms=reply.sent_ms,
            sent_message_id=reply.message_id,
            replied_outside=True,
            outside_reply=replace(reply, stopped_holder=current.holder if current is not None else ""),
            summary=kept,
        )
    if current.outside_reply is None and not current.replied_outside:
        return replace(current, outside_reply=reply)
    return None


def _is_own_send(record: SubjectRecord, message_id: str) -> bool:
    return (record.state is State.REPLIED and not record.replied_outside and record.sent_message_id == message_id) or (
        record.echo is not None and record.echo.message_id == message_id
    )


def _knows_outside(record: SubjectRecord, message_id: str) -> bool:
    return record.outside_reply is not None and record.outside_reply.message_id == message_id


def _in_flight(record: SubjectRecord) -> bool:
    return record.state in (State.SENDING, State.IN_DOUBT) and not record.replied_outside


def plan_outgoing(
    rules: Rules, view: ThreadView, reply: OutsideReply, now_ms: int, claim_token: int = 0
) -> OutgoingPlan:
    """What an outgoing message of the thread means, in this order:

    0. a message carrying the stamp of a send of the thread that is SENDING or IN_DOUBT (``claim_token``): that
       send's copy, proven (docs/design.md#providers): the subject is REPLIED with the copy's id, settled by the
       principal that reported it: OWN_REPLY;

    1. the reply a subject of the thread sent (its ConfirmSent's or MarkReplied's sent message id), or the copy
       already taken for one: OWN_REPLY;
    2. a reply already recorded as written outside (a retry, another notification of it): recorded again,
       which changes nothing more;
    3. while a subject of the thread is past BeginSend and unconfirmed (SENDING or IN_DOUBT) with no copy yet,
       for a message received at or before this one's date, the copy of that send, arriving before its
       ConfirmSent: OWN_REPLY, and the subject keeps it as its ``echo`` until its confirmation settles it (a
       person's reply recorded in this moment is taken for it);
    4. otherwise a reply written outside: it answers every subject of the thread whose message was received at
       or before its date (``answered_outside``), and becomes the thread's latest outside reply if it is."""
    present = [(entry, entry.stored.record) for entry in view.entries if entry.stored is not None]
    stamped = [
        (entry, record)
        for entry, record in present
        if claim_token and entry.stored is not None and entry.stored.token == claim_token and _in_flight(record)
    ]
    if stamped:
        entry, record = stamped[0]
        settled = replace(
            _replied(rules, record, reply.message_id, now_ms),
            settled_by=reply.recorded_by,
            note=f"settled by its copy in the mailbox's sent mail: message {reply.message_id} carries this claim's "
            f"stamp (reported by {reply.recorded_by})",
        )
        return OutgoingPlan(OutgoingResult.OWN_REPLY, writes=((entry, settled),), subjects=(entry.subject,))
    own = tuple(entry.subject for entry, record in present if _is_own_send(record, reply.message_id))
    if own:
        return OutgoingPlan(OutgoingResult.OWN_REPLY, subjects=own)
    known = any(_knows_outside(record, reply.message_id) for _, record in present) or (
        view.mark is not None and view.mark.message_id == reply.message_id
    )
    # A send answering a message received after this one's date cannot be what sent it.
    waiting = [
        (entry, record)
        for entry, record in present
        if _in_flight(record)
        and record.echo is None
        and (record.received_ms is None or record.received_ms <= reply.sent_ms)
    ]
    if not known and waiting:
        entry, record = waiting[0]
        return OutgoingPlan(
            OutgoingResult.OWN_REPLY, writes=((entry, replace(record, echo=reply)),), subjects=(entry.subject,)
        )
    writes: list[tuple[ThreadEntry, SubjectRecord]] = []
    answered: list[Subject] = []
    for entry in view.entries:
        if entry.received_ms > reply.sent_ms:
            continue  # a question asked after this reply: still to be answered
        current = entry.stored.record if entry.stored is not None else None
        if current is not None and _knows_outside(current, reply.message_id):
            answered.append(entry.subject)  # recorded before (a retry, another notification of it)
            continue
        if not _counts_for(entry, current):
            continue  # in this thread only by the word of a principal that does not report the mailbox's mail
        after = answered_outside(rules, current, reply, now_ms)
        if after is not None:
            writes.append((entry, after))
            answered.append(entry.subject)
    latest = view.mark is None or view.mark.sent_ms < reply.sent_ms
    return OutgoingPlan(OutgoingResult.ANSWERED_OUTSIDE, tuple(writes), reply if latest else None, tuple(answered))


def recorded_answer(view: ThreadView, result: OutgoingResult, message_id: str) -> tuple[Subject, ...]:
    """The subjects a RecordOutgoing's retry names, from what its first attempt (``result``) left."""
    present = [(entry.subject, entry.stored.record) for entry in view.entries if entry.stored is not None]
    mine = _knows_outside if result is OutgoingResult.ANSWERED_OUTSIDE else _is_own_send
    return tuple(subject for subject, record in present if mine(record, message_id))


# --- Watch ----------------------------------------------------------------------------------------------

_END_EVENTS = {
    EndReason.RELEASED: EventType.RELEASED,
    EndReason.ABORTED: EventType.ABORTED,
    EndReason.TAKEN_OVER: EventType.TAKEN_OVER,
    EndReason.RESOLVED_NOT_SENT: EventType.RESOLVED_NOT_SENT,
    EndReason.OUTSIDE_REPLY_UNDONE: EventType.OUTSIDE_REPLY_UNDONE,
}

_STATE_EVENTS = {
    State.SENDING: EventType.SENDING,
    State.REPLIED: EventType.REPLIED,
    State.IN_DOUBT: EventType.IN_DOUBT,
}


def classify_change(previous: Stored | None, now: Stored | None, end: EndMark | None) -> EventType | None:
    """Names a change of one subject key; ``end`` is the EndMark written in the same revision, if any."""
    if now is not None:
        if now.record.outside_reply is not None and (previous is None or previous.record.outside_reply is None):
            return EventType.ANSWERED_OUTSIDE
        if previous is None or previous.token != now.token:
            return EventType.CLAIMED
        if now.record.state is State.CLAIMED:
            return EventType.RENEWED
        if now.record.replied_by_hand and previous.record.state is State.CLAIMED:
            return EventType.MARKED_REPLIED
        return _STATE_EVENTS.get(now.record.state)
    if previous is None:
        return None
    if end is not None and end.token == previous.token:
        return _END_EVENTS[end.reason]
    if previous.record.state is State.REPLIED:
        return EventType.RETENTION_ENDED
    return EventType.EXPIRED


# --- Cursors (docs/design.md#cursors) -------------------------------------------------------------------


@dataclass(frozen=True)
class CursorRecord:
    """A mailbox's named cursor: a value the coordinator does not read, a position that never decreases, and the
    last advance's request id and fingerprint (its retry's evidence)."""

    value: str
    position: int
    last_request_id: str = ""
    last_fingerprint: str = ""


@dataclass(frozen=True)
class CursorRange:
    """The range in progress, on a lease of its TTL: who took it, by which request, and when it ends (for people)."""

    holder: str
    request_id: str
    fingerprint: str
    expires_ms: int


@dataclass(frozen=True)
class CursorView:
    """A cursor and its range as read together: ``cursor_revision`` the cursor's last write (0: never written),
    ``range_token`` the range's create revision (0: no range)."""

    cursor: CursorRecord | None
    cursor_revision: int
    range: CursorRange | None
    range_token: int

    @property
    def value(self) -> str:
        return self.cursor.value if self.cursor is not None else ""

    @property
    def position(self) -> int:
        return self.cursor.position if self.cursor is not None else 0


class TakeResult(enum.Enum):
    TAKEN = "taken"
    COVERED = "covered"
    BUSY = "busy"


class AdvanceResult(enum.Enum):
    OK = "ok"
    STALE_RANGE = "stale_range"


def take_cursor_range(
    view: CursorView, caller: Caller, command: TakeCursorRange, *, expires_ms: int
) -> tuple[TakeResult, CursorRange | None]:
    """TAKEN with the range to write (None: this request's range stands already, a retry), COVERED or BUSY."""
    current = view.range
    if (
        current is not None
        and current.holder == caller.principal
        and is_retry(current.request_id, current.fingerprint, command)
    ):
        return TakeResult.TAKEN, None
    if command.through_position > 0 and view.position >= command.through_position:
        return TakeResult.COVERED, None
    if current is not None:
        return TakeResult.BUSY, None
    return TakeResult.TAKEN, CursorRange(caller.principal, command.request_id, command.fingerprint, expires_ms)


def advance_cursor(
    view: CursorView, caller: Caller, command: AdvanceCursor
) -> tuple[AdvanceResult, CursorRecord | None]:
    """OK with the cursor to write (None: a retry, already written), or STALE_RANGE: another range was taken, or the
    cursor moved, since this range's token."""
    cursor = view.cursor
    if cursor is not None and is_retry(cursor.last_request_id, cursor.last_fingerprint, command):
        return AdvanceResult.OK, None
    if command.position < view.position:
        raise InvalidArgument(
            "position", f"{command.position} is before the cursor's {view.position}; a cursor never goes back"
        )
    if view.range is not None:
        if view.range_token != command.range_token:
            return AdvanceResult.STALE_RANGE, None
        if view.range.holder != caller.principal:
            raise PermissionDenied(
                f"cursor range {command.range_token} belongs to another principal; only its holder may advance it",
                reason="NOT_HOLDER",
            )
    elif view.cursor_revision >= command.range_token:
        return AdvanceResult.STALE_RANGE, None  # lapsed, and the cursor was written since
    return AdvanceResult.OK, CursorRecord(command.value, command.position, command.request_id, command.fingerprint)
