"""The client's public value types: subjects, statuses and the results of every call.

Every type here is a frozen dataclass or an enum; none of them is a protobuf message, so callers never
depend on the generated wire code.
"""

from __future__ import annotations

import enum
import hashlib
import json
import random
from dataclasses import dataclass
from datetime import datetime

from ._message_ids import canonical_message_id

__all__ = [
    "CallerIdentity",
    "ClaimOutcome",
    "ClaimResult",
    "ClaimsPage",
    "DeliveryRecord",
    "DeliveryResult",
    "EventType",
    "FenceResult",
    "HolderKind",
    "IncomingOutcome",
    "IncomingResult",
    "LossReason",
    "MessageSummary",
    "OutgoingOutcome",
    "OutgoingResult",
    "OutsideReply",
    "OutsideReplyUndone",
    "RecentMessage",
    "RefusalKind",
    "RetryPolicy",
    "SendRefusal",
    "Subject",
    "SubjectKind",
    "SubjectState",
    "SubjectStatus",
    "TakeoverOutcome",
    "TakeoverResult",
    "WatchEvent",
    "WatchItem",
    "WatchSnapshot",
    "canonical_message_id",
    "idempotency_key",
]

IDEMPOTENCY_KEY_PREFIX = "ic1-"


class SubjectKind(enum.Enum):
    """What a claim is on: one message, or a whole thread (one reply per conversation)."""

    MESSAGE = "message"
    THREAD = "thread"


class HolderKind(enum.Enum):
    """Who holds a claim: an agent, or a human (only humans may take a subject over)."""

    AGENT = "agent"
    HUMAN = "human"


class SubjectState(enum.Enum):
    """The states of a subject (docs/design.md#states-of-a-subject)."""

    FREE = "free"
    CLAIMED = "claimed"
    SENDING = "sending"
    REPLIED = "replied"
    IN_DOUBT = "in_doubt"


class ClaimOutcome(enum.Enum):
    """The answer to :meth:`~inbox_claims.AsyncCoordinator.claim`."""

    GRANTED = "granted"
    HELD = "held"
    ALREADY_REPLIED = "already_replied"
    DUPLICATE_DELIVERY = "duplicate_delivery"


class TakeoverOutcome(enum.Enum):
    """The answer to :meth:`~inbox_claims.AsyncCoordinator.takeover`."""

    TAKEN_OVER = "taken_over"
    GRANTED = "granted"
    HELD = "held"
    ALREADY_REPLIED = "already_replied"


class OutgoingOutcome(enum.Enum):
    """The answer to :meth:`~inbox_claims.AsyncCoordinator.record_outgoing`."""

    OWN_REPLY = "own_reply"
    """The mailbox's own reply, sent through the coordinator (or being sent): nothing changed."""
    ANSWERED_OUTSIDE = "answered_outside"
    """A reply written outside the coordinator: it ended the claims on the messages of its thread it answered."""
    DUPLICATE_DELIVERY = "duplicate_delivery"
    """The notification was seen before: nothing changed."""


class IncomingOutcome(enum.Enum):
    """The answer to ``record_incoming``."""

    RECORDED = "recorded"
    """The message is recorded (also when it was before): people see it, agents' older claims of its thread are
    refused at BeginSend (the conversation moved on)."""
    DUPLICATE_DELIVERY = "duplicate_delivery"
    """The notification was seen before: nothing changed."""


class RefusalKind(enum.Enum):
    """Why BeginSend refused an agent's send (docs/design.md#reply-storms)."""

    REPLY_BUDGET_SPENT = "reply_budget_spent"
    CONVERSATION_MOVED_ON = "conversation_moved_on"


class EventType(enum.Enum):
    """What happened to a subject, in a :class:`WatchEvent`."""

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
    """The holder recorded a reply made by hand (``mark_replied``)."""
    ANSWERED_OUTSIDE = "answered_outside"
    """Someone answered in the subject's thread outside the coordinator (``status.outside_reply``): a CLAIMED
    subject became REPLIED (``previous_holder`` stopped), a SENDING or IN_DOUBT one kept its state (both went out)."""
    OUTSIDE_REPLY_UNDONE = "outside_reply_undone"
    """A person undid a reply recorded as written outside (``undone``, by ``by`` at ``at``): the subject is FREE,
    answerable again."""


class LossReason(enum.Enum):
    """Why a guarded claim was lost (:attr:`inbox_claims.ClaimLost.reason`)."""

    TAKEN_OVER = "taken_over"
    """A human took the subject over; they hold it now."""
    EXPIRED = "expired"
    """The claim's TTL ran out (the holder paused longer than its TTL); it may be held by someone else now."""
    STALE_TOKEN = "stale_token"
    """The coordinator refused the fencing token for another reason (the claim was released or superseded)."""
    RENEWAL_FAILED = "renewal_failed"
    """The coordinator could not be reached to renew the claim before its TTL ran out: it may be gone."""
    ANSWERED_OUTSIDE = "answered_outside"
    """Someone answered the message from the mailbox (a person in Gmail, a helpdesk): ``status.outside_reply``."""


def idempotency_key(mailbox: str, kind: SubjectKind, subject_id: str) -> str:
    """The deterministic send idempotency key of one subject: ``"ic1-"`` and 64 hex digits (68 characters).

    Derived only from (mailbox, kind, id), so every agent that ever tries to reply to the subject computes the
    same key. Pass it as the ``Idempotency-Key`` header of the mail API's send call (Nylas caches it for an
    hour per grant and answers a second request with the same key and another payload with 409): a last-resort
    backstop that stops a second reply even if everything else failed.
    """
    canonical = json.dumps([mailbox, kind.value, subject_id], ensure_ascii=False, separators=(",", ":"))
    return IDEMPOTENCY_KEY_PREFIX + hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True, slots=True)
class Subject:
    """What is claimed: a message or a thread inside one mailbox.

    ``mailbox`` is the scope of coordination (a Nylas grant id, or the mailbox address when several grants see
    one inbox); ``id`` is the provider's message id or thread id. ``Subject.message`` writes a message id the
    one way every client does (``canonical_message_id``: `` <m1@x> `` is ``m1@x``), so that a spelling of an
    answered message is that message; the constructor takes an id as it is (as the coordinator answered it).
    """

    mailbox: str
    kind: SubjectKind
    id: str

    @classmethod
    def message(cls, mailbox: str, message_id: str) -> Subject:
        return cls(mailbox, SubjectKind.MESSAGE, canonical_message_id(message_id))

    @classmethod
    def thread(cls, mailbox: str, thread_id: str) -> Subject:
        return cls(mailbox, SubjectKind.THREAD, thread_id)

    @property
    def idempotency_key(self) -> str:
        """See :func:`idempotency_key`."""
        return idempotency_key(self.mailbox, self.kind, self.id)


@dataclass(frozen=True, slots=True)
class MessageSummary:
    """Which email a claim is about, shown to the people watching the mailbox (``inboxctl``, the claims board).

    Personal data: the coordinator keeps it with the claim and its reply record only, and not at all when its
    ``store_summaries`` setting is off. ``reply_to(notification)`` fills it from the notification's message.
    """

    subject_line: str = ""
    sender: str = ""
    """As people read it: ``Bea Costa <bea@example.org>``."""
    received_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class OutsideReply:
    """A reply written outside the coordinator in a subject's thread (a person in Gmail, Outlook, a helpdesk)."""

    sender: str
    """Who sent it, as the message's ``from`` says: ``Ana Lima <ana@shop.example>``."""
    sent_at: datetime | None
    """The message's date, as the provider gives it."""
    message_id: str
    recorded_by: str
    """The principal whose client reported it (it has the role ``report``): the one who vouches for it. ``sender``
    is what the message says, which the coordinator cannot check: show both."""
    stopped_holder: str = ""
    """The principal whose claim it ended; empty when none was held."""


@dataclass(frozen=True, slots=True)
class SendRefusal:
    """Why the mailbox's reply rules stopped an agent's send (BeginSend REFUSED). ``reason`` is for a person."""

    kind: RefusalKind
    reason: str
    scope: str = ""
    """REPLY_BUDGET_SPENT: ``"thread"`` or ``"correspondent"``."""
    limit: int = 0
    window_seconds: int = 0
    counted: int = 0
    frees_at: datetime | None = None
    """REPLY_BUDGET_SPENT: when the oldest counted reply leaves the window."""
    newer_message_id: str = ""
    """CONVERSATION_MOVED_ON: the customer's newer message."""
    newer_received_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class SubjectStatus:
    """Everything recorded about one subject. Times are timezone-aware UTC datetimes, ``None`` when unset."""

    subject: Subject
    state: SubjectState
    holder: str = ""
    """The principal holding the claim or who sent the reply; empty when FREE."""
    holder_kind: HolderKind | None = None
    fencing_token: int = 0
    acquired_at: datetime | None = None
    expires_at: datetime | None = None
    """CLAIMED: when the claim frees unless renewed. REPLIED: when the reply record's retention ends."""
    note: str = ""
    send_started_at: datetime | None = None
    send_deadline: datetime | None = None
    """SENDING: when the subject becomes IN_DOUBT unless confirmed or aborted."""
    sent_at: datetime | None = None
    sent_message_id: str = ""
    revision: int = 0
    ttl_seconds: int = 0
    replied_by_hand: bool = False
    """REPLIED by ``mark_replied`` (a person answered outside the coordinator), not by a confirmed send."""
    summary: MessageSummary | None = None
    """Which email this is (subject line, sender), when the claim gave one and the coordinator keeps them."""
    replied_outside: bool = False
    """REPLIED because someone answered in its thread outside the coordinator (``outside_reply`` says who):
    ``holder`` is then that sender."""
    outside_reply: OutsideReply | None = None
    """A reply written outside in its thread: with ``replied_outside``, the one that answered it; on a SENDING,
    IN_DOUBT or REPLIED subject that sent its own, both replies went out."""
    settled_by: str = ""
    """REPLIED by ``resolve_in_doubt(SENT)``: the person who settled it (``holder`` is whose send it was)."""
    automated: str = ""
    """Automated mail agents leave (``"Auto-Submitted: auto-replied"``): why; a person can still answer it."""
    agents_stopped: SendRefusal | None = None
    """While agents are stopped on this conversation (its reply budget spent): the refusal they were given."""


@dataclass(frozen=True, slots=True)
class RecentMessage:
    """A message the coordinator saw delivered (``recent_messages``): for a person to find one to answer."""

    subject: Subject
    summary: MessageSummary | None
    """As the delivery's claim described it; ``None`` when it gave none or summaries are not stored."""
    first_seen_at: datetime | None
    seen_by: str
    """The agent whose claim recorded the delivery."""
    automated: str = ""
    """Automated mail agents leave (``"Auto-Submitted: auto-replied"``): why; a person can still answer it."""
    agents_stopped: SendRefusal | None = None
    """``waiting_for_a_person`` only: agents are stopped on its conversation (the refusal, ``frees_at`` when the
    budget frees); ``first_seen_at`` / ``seen_by``: when and which agent was stopped."""


@dataclass(frozen=True, slots=True)
class DeliveryRecord:
    """The first sighting of a webhook notification id."""

    mailbox: str
    notification_id: str
    recorded_by: str
    recorded_at: datetime | None
    subject: Subject | None
    """The subject it led to, when it was recorded by a claim."""


@dataclass(frozen=True, slots=True)
class DeliveryResult:
    """The answer to ``record_delivery``: ``is_new`` on the first sighting; ``first`` says who saw it first."""

    is_new: bool
    first: DeliveryRecord


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """The answer to ``claim``: a business outcome, never an error.

    ``status`` is your claim when GRANTED, the current holder's when HELD, the reply record when
    ALREADY_REPLIED; ``delivery`` is the first sighting when DUPLICATE_DELIVERY (then ``status`` is ``None``).
    """

    outcome: ClaimOutcome
    status: SubjectStatus | None
    delivery: DeliveryRecord | None = None

    @property
    def granted(self) -> bool:
        return self.outcome is ClaimOutcome.GRANTED

    @property
    def token(self) -> int:
        """The fencing token when GRANTED, else 0."""
        return self.status.fencing_token if self.granted and self.status is not None else 0


@dataclass(frozen=True, slots=True)
class IncomingResult:
    """The answer to ``record_incoming``: ``status`` the message's subject as it is now; ``delivery`` the first
    sighting when DUPLICATE_DELIVERY."""

    outcome: IncomingOutcome
    status: SubjectStatus | None = None
    delivery: DeliveryRecord | None = None


@dataclass(frozen=True, slots=True)
class OutgoingResult:
    """The answer to ``record_outgoing``: what the coordinator took the message for, and the subjects of its
    thread it concerns (the subject whose reply it is, or those it answered, as they are now); ``delivery`` is
    the first sighting when DUPLICATE_DELIVERY."""

    outcome: OutgoingOutcome
    subjects: tuple[SubjectStatus, ...] = ()
    delivery: DeliveryRecord | None = None


@dataclass(frozen=True, slots=True)
class FenceResult:
    """The answer to every call that presents a fencing token.

    ``ok``: the change was made. Otherwise the token is stale (the claim expired, was released or taken over)
    and nothing changed: stop, you no longer hold the subject. ``status`` is the subject's state after the call.
    """

    ok: bool
    status: SubjectStatus
    refusal: SendRefusal | None = None
    """BeginSend only: the mailbox's reply rules refused the send (the claim is still held); not stale."""

    @property
    def stale(self) -> bool:
        return not self.ok and self.refusal is None


@dataclass(frozen=True, slots=True)
class ClaimsPage:
    """One page of ``list_claims``; ``next_page_token`` is empty on the last page."""

    subjects: tuple[SubjectStatus, ...]
    next_page_token: str
    revision: int


@dataclass(frozen=True, slots=True)
class CallerIdentity:
    """Who the coordinator takes the caller to be (``caller()``, ``inboxctl whoami``): what to offer a person."""

    principal: str
    kind: HolderKind
    roles: tuple[str, ...] = ()
    """Sorted: ``admin``, ``report``, ``resolve``, ``takeover`` (``admin`` implies the others, which are listed too)."""
    mailboxes: tuple[str, ...] = ()
    """The granted mailboxes: exact names or globs; ``("*",)`` for every mailbox."""
    development_mode: bool = False
    """The coordinator has no token file: anyone may name themselves, with every right."""


@dataclass(frozen=True, slots=True)
class TakeoverResult:
    """The answer to ``takeover``; ``previous_holder``/``previous_token`` name the agent's ended claim."""

    outcome: TakeoverOutcome
    status: SubjectStatus
    previous_holder: str = ""
    previous_token: int = 0

    @property
    def holds(self) -> bool:
        """True when the caller holds the subject now (TAKEN_OVER or GRANTED)."""
        return self.outcome in (TakeoverOutcome.TAKEN_OVER, TakeoverOutcome.GRANTED)


@dataclass(frozen=True, slots=True)
class WatchSnapshot:
    """The first item of every watch stream (and of every reconnection): each subject that is not FREE."""

    subjects: tuple[SubjectStatus, ...]
    revision: int


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One transition of one subject, in commit order; ``status`` is the state after it."""

    type: EventType
    status: SubjectStatus
    previous_holder: str
    previous_token: int
    revision: int
    reason: str
    by: str = ""
    """For a subject a call ended: the principal whose call ended it (the person who took it over, settled it or
    undid an outside reply, or the holder)."""
    at: datetime | None = None
    """When that call was made (its coordinator's clock)."""
    undone: OutsideReply | None = None
    """``OUTSIDE_REPLY_UNDONE``: the reply that had been recorded as written outside."""


@dataclass(frozen=True, slots=True)
class OutsideReplyUndone:
    """The answer to ``undo_outside_reply``: the subject now (FREE, answerable again), the reply that had been
    recorded as written outside, and who undid it, when."""

    status: SubjectStatus
    undone: OutsideReply | None
    undone_by: str
    undone_at: datetime | None


WatchItem = WatchSnapshot | WatchEvent


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How calls are retried on UNAVAILABLE, DEADLINE_EXCEEDED and ABORTED (all safe to retry: every
    mutation carries one request id, reused by every attempt of one logical call).

    ``attempts`` counts the first try; the wait before retry *n* (from 0) is drawn uniformly from
    ``[cap / 2, cap]`` with ``cap = min(max_backoff, initial_backoff * multiplier ** n)`` (exponential backoff
    with jitter, so that many clients do not retry in step).
    """

    attempts: int = 6
    initial_backoff: float = 0.1
    max_backoff: float = 2.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("RetryPolicy.attempts must be at least 1 (1 means no retry)")
        if self.initial_backoff < 0 or self.max_backoff < self.initial_backoff or self.multiplier < 1:
            raise ValueError("RetryPolicy needs 0 <= initial_backoff <= max_backoff and multiplier >= 1")

    @classmethod
    def none(cls) -> RetryPolicy:
        """One attempt, no retry."""
        return cls(attempts=1)

    def backoff(self, retry: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (0 for the first retry)."""
        cap = min(self.max_backoff, self.initial_backoff * self.multiplier ** min(retry, 64))
        return (rng or random).uniform(cap / 2, cap)
