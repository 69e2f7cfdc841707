"""The send-path guard's logic, shared by ``Claim`` (threads) and ``AsyncClaim`` (asyncio), without I/O.

A guarded claim goes through these phases (:class:`Phase`)::

    CLAIMING --the message is outgoing, RecordOutgoing--> OUTGOING (refused: the user's code never runs)
    CLAIMING --the message is automated mail, RecordIncoming--> AUTOMATED (refused: the user's code never runs)
    CLAIMING --ClaimReply GRANTED--> CLAIMED --renewal finds it gone--> LOST
    CLAIMED --send()--> BEGINNING --BeginSend OK--> SENDING --fn returned, ConfirmSent--> REPLIED
                                  --BeginSend STALE--> LOST         --fn raised SendRejected, AbortSend--> ABORTED
                                  --BeginSend REFUSED--> REFUSED (released, not redeliverable, on leaving)
                                                                    --fn raised anything else--> UNKNOWN (left SENDING)
    CLAIMED (or LOST after failed renewals, or BEGINNING with an unknown answer) --leaving the block--> RELEASED

Renewal only ever runs in CLAIMED: a renewal answer that arrives after ``send()`` started is ignored, so the
renewal can never declare a loss the commit point has already settled.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import logging
import sys
import threading
import time
import unicodedata
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, TypeAlias, TypedDict, TypeVar

from ._automated import automated_reason
from ._core import Core
from ._current import current as _current
from ._effects import Flow, Invoke, Op, Sleep
from ._envelope import Notification, parse_notification
from ._errors import (
    AlreadyReplied,
    AutomatedMessage,
    ClaimLost,
    ClaimNotGranted,
    DuplicateDelivery,
    FailedPrecondition,
    InboxClaimsError,
    OutgoingMessage,
    ReplyHeld,
    ReplyRefused,
    SendOutcomeUnknown,
    SendRejected,
    SentButUnconfirmed,
)
from ._outgoing import OutgoingMatch, OutgoingRules
from ._types import (
    ClaimOutcome,
    ClaimResult,
    FenceResult,
    HolderKind,
    IncomingResult,
    LossReason,
    MessageSummary,
    OutgoingResult,
    Subject,
    SubjectState,
    SubjectStatus,
)
from .providers._seam import MessageFacts, ProviderError, split_address
from .providers.nylas import facts_of as nylas_facts

log = logging.getLogger("inbox_claims")


class _Stderr(logging.Handler):
    """Writes to whatever ``sys.stderr`` is when a record comes (a server or a test may have replaced it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:
            self.handleError(record)


# Under uvicorn or gunicorn, which configure only their own loggers, an app that set up no logging would never see
# a refusal: they are INFO, and Python's last resort shows WARNING and up. So while nothing would take a record of
# the inbox_claims logger (no handler on it or above, its level not set), a refusal line goes to stderr anyway;
# once the app configures logging, or sets this logger's level, that decides.
_UNCONFIGURED = _Stderr()
_UNCONFIGURED.setFormatter(logging.Formatter("%(levelname)s:%(name)s: %(message)s"))


def log_refusal(message: str, *args: object) -> None:
    """An absorbed refusal's one INFO line, shown even where the app configured no logging."""
    if log.level == logging.NOTSET and not log.hasHandlers():
        _UNCONFIGURED.handle(log.makeRecord(log.name, logging.INFO, __file__, 0, message, args, None))
    else:
        log.info(message, *args)


Scope = Literal["message", "thread"]

Event: TypeAlias = MessageFacts | Notification | Mapping[str, Any] | bytes | bytearray | str
"""What a webhook handler has: a provider's :class:`MessageFacts`, or from Nylas the parsed :class:`Notification`, the
decoded JSON event, or the raw body."""
EventT = TypeVar("EventT", bound=Event)

ANSWERED_EVENTS = frozenset({"message.created", "message.updated"})
"""The notification types an agent answers (any variant, e.g. ``message.created.truncated``).

``message.updated`` too: it may be the first notification that reaches you about a message (a lost or
reordered ``message.created``), and the claim decides whether the message still needs an answer (a message
already answered is refused as :class:`AlreadyReplied`; a notification seen before as
:class:`DuplicateDelivery`)."""

EXPECTED_REFUSALS: tuple[type[Exception], ...] = (ClaimNotGranted, ClaimLost, ReplyRefused)
"""What ``guard`` absorbs: the message is not this agent's to answer (a redelivery, held by someone else,
answered already, automated mail), or stopped being so (lost, taken over), or the mailbox's reply rules stopped the
send (the reply budget spent, the conversation moved on). Each is one log line, not an error."""

AUTOMATED_REASON_MAX_BYTES = 256
CORRESPONDENT_MAX_BYTES = 320

REASON_MAX_BYTES = 1024
# After a failed renewal, try again after a third of the time left, but not more often than this.
RENEWAL_RETRY_FLOOR_S = 0.2


class Phase(enum.Enum):
    CLAIMING = "claiming"
    OUTGOING = "outgoing"
    AUTOMATED = "automated"
    CLAIMED = "claimed"
    LOST = "lost"
    BEGINNING = "beginning"
    REFUSED = "refused"
    SENDING = "sending"
    REPLIED = "replied"
    ABORTED = "aborted"
    UNKNOWN = "unknown"
    RELEASED = "released"


def as_notification(event: Notification | Mapping[str, Any] | bytes | bytearray | str) -> Notification:
    """The :class:`Notification` of what a handler has (raises :class:`NotificationError` if it is none)."""
    if isinstance(event, Notification):
        return event
    if not isinstance(event, Mapping | bytes | bytearray | str):
        raise TypeError(
            "pass the webhook event as received: the raw body (bytes), its decoded JSON (dict), a Notification, "
            f"or a provider's MessageFacts, not {type(event).__name__}"
        )
    return parse_notification(bytes(event) if isinstance(event, bytearray) else event)


def facts_of(event: Event) -> MessageFacts | None:
    """The neutral facts of what a handler has: a provider's :class:`MessageFacts` as they are, a Nylas event read
    by the Nylas provider; None for a notification about no message. Everything past this reads only the facts."""
    if isinstance(event, MessageFacts):
        return event
    return nylas_facts(as_notification(event))


def automated_of(facts: MessageFacts) -> str | None:
    """Why the message of ``facts`` is automated mail agents leave, or None. The provider's verdict when it read the
    headers; without them (a Nylas event the guard reads alone, docs/providers.md) the sender's rules still hold."""
    if facts.automated is not None:
        return facts.automated.why or "automated" if facts.automated.automated else None
    return automated_reason({}, facts.from_addresses[0] if facts.from_addresses else None)


def correspondent_of(facts: MessageFacts) -> str:
    """The sender's address, for the reply budget per correspondent; empty when there is none the coordinator
    takes (over its byte limit)."""
    address = facts.from_addresses[0].strip() if facts.from_addresses else ""
    return address if len(address.encode("utf-8")) <= CORRESPONDENT_MAX_BYTES else ""


def correspondent_in(summary: MessageSummary | None) -> str:
    """A claim made without its notification (the MCP tools) knows its sender from the summary, if at all."""
    address = split_address(summary.sender)[1] if summary is not None else ""
    return address if "@" in address and len(address.encode("utf-8")) <= CORRESPONDENT_MAX_BYTES else ""


def outgoing_of(
    rules: OutgoingRules, facts: MessageFacts, more_addresses: Collection[str] = ()
) -> OutgoingMatch | None:
    """Why the mailbox sent the message of ``facts``, by the client's outgoing rules (docs/client.md)."""
    return rules.judge(facts.folders, facts.from_addresses, more_addresses)


class GuardOptions(TypedDict, total=False):
    """The options of ``guard`` (all optional)."""

    ttl: int
    """The claim's TTL in seconds (default 60); it is renewed every third of it while the function runs."""
    scope: Scope
    """``"message"`` (default): one reply per message; ``"thread"``: one reply per thread."""
    note: str
    """A free text shown to humans next to the claim (``inboxctl ls``)."""
    events: Collection[str]
    """The notification types answered (default :data:`ANSWERED_EVENTS`); others are skipped."""
    raise_refusals: bool
    """Raise the expected refusals (:data:`EXPECTED_REFUSALS`) instead of logging them (default False)."""


@dataclass(frozen=True, slots=True)
class ReplyPolicy:
    """Which notifications a guard answers, how it claims them, and what it does with a refusal."""

    events: frozenset[str] = ANSWERED_EVENTS
    ttl: int = 60
    scope: Scope = "message"
    note: str = ""
    raise_refusals: bool = False

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> ReplyPolicy:
        known = {name: options[name] for name in GuardOptions.__annotations__ if name in options}
        if "events" in known:
            known["events"] = frozenset(known["events"])
        return cls(**known)

    def wants(self, facts: MessageFacts) -> bool:
        if facts.event in self.events:
            return True
        log.debug(
            "not answering message %s (notification %s): a %s event", facts.message_id, facts.dedup_key, facts.event
        )
        return False

    def answered(self, event: Event) -> MessageFacts | None:
        """The facts of the message to claim for, or ``None`` when it is not one to answer."""
        facts = facts_of(event)
        if facts is None:
            log.debug("not answering %s: it is about no message", type(event).__name__)
            return None
        return facts if self.wants(facts) else None

    def claim_options(self) -> dict[str, Any]:
        """The keyword arguments of ``reply_to``."""
        return {"ttl": self.ttl, "scope": self.scope, "note": self.note}

    @staticmethod
    def refused(facts: MessageFacts, refusal: Exception) -> None:
        """The one log line of an absorbed refusal (an outgoing message's was written when it was found)."""
        if isinstance(refusal, OutgoingMessage | AutomatedMessage):
            return
        log_refusal("not replying to message %s (notification %s): %s", facts.message_id, facts.dedup_key, refusal)

    @contextlib.contextmanager
    def absorbing(self, facts: MessageFacts) -> Iterator[None]:
        """Logs and swallows the expected refusals in its block (unless ``raise_refusals``)."""
        try:
            yield
        except EXPECTED_REFUSALS as refusal:
            if self.raise_refusals:
                raise
            self.refused(facts, refusal)


def current_claim_base() -> ClaimBase | None:
    """The guarded claim whose block (or ``guard``-ed function) is running in this task or thread, if any."""
    claim = _current.get()
    return claim if isinstance(claim, ClaimBase) else None


# The coordinator's limits on a summary's texts (coordinator/core/limits.py): longer ones are cut, not refused.
SUMMARY_SUBJECT_LINE_MAX_BYTES = 512
SUMMARY_SENDER_MAX_BYTES = 512


def summary_of(event: Event | None) -> MessageSummary | None:
    """Which email a message is, from its facts (subject line, sender, received time), when it has them; what is
    missing is left out, and the texts are cut to the coordinator's limits."""
    facts = facts_of(event) if event is not None else None
    if facts is None:
        return None
    summary = MessageSummary(
        clean_text(facts.subject_line, SUMMARY_SUBJECT_LINE_MAX_BYTES),
        clean_text(facts.sender, SUMMARY_SENDER_MAX_BYTES),
        facts.received_at,
    )
    return summary if summary.subject_line or summary.sender or summary.received_at else None


def granted_status(result: ClaimResult, subject: Subject, notification_id: str) -> SubjectStatus:
    """The granted claim's status, or the refusal as an exception."""
    if result.outcome is ClaimOutcome.DUPLICATE_DELIVERY:
        raise DuplicateDelivery(subject, notification_id, result.delivery)
    assert result.status is not None
    if result.outcome is ClaimOutcome.HELD:
        raise ReplyHeld(result.status)
    if result.outcome is ClaimOutcome.ALREADY_REPLIED:
        raise AlreadyReplied(result.status)
    return result.status


def clean_text(text: str, max_bytes: int = REASON_MAX_BYTES) -> str:
    """A free-form text the coordinator accepts: control characters become spaces, cut to ``max_bytes``."""
    flat = "".join(" " if unicodedata.category(ch) == "Cc" else ch for ch in text)
    return flat.encode("utf-8", "replace")[:max_bytes].decode("utf-8", "ignore")


class GuardState:
    """One guarded claim: its phase, token and renewal schedule, and the flows of its steps.

    Thread-safe: in the sync client the renewal runs in its own thread while the caller drafts and sends.
    """

    outgoing: OutgoingMatch | None
    """Why the notification's message is one the mailbox sent (then it is never answered), if it is."""
    _outgoing_op: Op[OutgoingResult] | None
    automated: str | None
    """Why the notification's message is automated mail (then agents never answer it), if it is."""
    _incoming_op: Op[IncomingResult] | None

    @classmethod
    def for_reply(
        cls,
        core: Core,
        notification: Event | None,
        *,
        mailbox: str | None,
        message_id: str | None,
        thread_id: str | None,
        notification_id: str | None,
        scope: Scope,
        ttl: int,
        note: str,
        summary: MessageSummary | None = None,
        received_at: datetime | None = None,
    ) -> GuardState:
        """The state of ``reply_to``'s claim (both clients): the subject to claim, the notification id to dedup on
        and the summary, from one decoding of the notification and/or explicit ids.

        Explicit arguments win over the notification's fields (``mailbox=`` lets several grants that see one inbox
        coordinate on the mailbox address instead of the grant id).
        """
        facts = None
        if notification is not None:
            facts = facts_of(notification)
            if facts is None:
                kind = as_notification(notification).type if not isinstance(notification, MessageFacts) else ""
                raise ValueError(f"a {kind} notification is not about a message: there is nothing to reply to")
            mailbox = mailbox or facts.mailbox
            message_id = message_id or facts.message_id
            thread_id = thread_id or facts.thread_id
            if notification_id is None:
                notification_id = facts.dedup_key
        # The thread and the message's date come from the facts (or, without them, from the caller): with them a
        # reply written outside the coordinator in the thread ends the claim; without a date, neither is sent (the
        # coordinator needs both).
        date = facts.received_at if facts is not None else received_at
        thread = thread_id if date is not None else None
        if not mailbox:
            raise ValueError("reply_to needs a mailbox: pass mailbox= (the notification carries no grant_id)")
        if scope == "message":
            if not message_id:
                raise ValueError("reply_to(scope='message') needs a message id: pass message_id=")
            subject = Subject.message(mailbox, message_id)
        elif scope == "thread":
            if not thread_id:
                raise ValueError(
                    "reply_to(scope='thread') needs a thread id: pass thread_id= (none in the notification)"
                )
            subject = Subject.thread(mailbox, thread_id)
        else:
            raise ValueError(f"scope must be 'message' or 'thread', not {scope!r}")
        summary = summary or summary_of(facts)
        state = cls(
            core,
            subject,
            notification_id=notification_id or "",
            ttl=ttl,
            note=note,
            summary=summary,
            thread_id=thread or "",
            received_at=date,
            correspondent=correspondent_of(facts) if facts is not None else correspondent_in(summary),
        )
        if facts is not None:
            state.outgoing_check(facts, mailbox, thread, date)
            if state.outgoing is None and core.options.kind is HolderKind.AGENT:
                state.automated_check(facts, mailbox, thread, date, summary)
        return state

    def automated_check(
        self,
        facts: MessageFacts,
        mailbox: str,
        thread_id: str | None,
        date: datetime | None,
        summary: MessageSummary | None,
    ) -> None:
        """Finds whether the message is automated mail (docs/client.md, "Automated mail"); entering then records it
        for people (RecordIncoming) instead of claiming it. Only an agent's claim: a person may answer anything."""
        why = automated_of(facts)
        if why is None:
            return
        self.automated = clean_text(why, AUTOMATED_REASON_MAX_BYTES)
        if facts.message_id and thread_id and date is not None:
            self._incoming_op = self.core.record_incoming_op(
                mailbox,
                facts.message_id,
                thread_id,
                date,
                automated=self.automated,
                summary=summary,
                notification_id=self.notification_id,
            )

    def outgoing_check(self, facts: MessageFacts, mailbox: str, thread_id: str | None, date: datetime | None) -> None:
        """Finds whether the message is one the mailbox sent (the provider's adapter may have decided it already,
        with the addresses it knows); entering then reports it, with the claim stamp it carries."""
        why = facts.outgoing if isinstance(facts.outgoing, OutgoingMatch) else None
        why = why or outgoing_of(self.core.options.outgoing, facts)
        if why is None:
            return
        self.outgoing = why
        if facts.message_id and thread_id and date is not None:
            self._outgoing_op = self.core.record_outgoing_op(
                mailbox,
                facts.message_id,
                thread_id,
                date,
                sender=clean_text(facts.sender, SUMMARY_SENDER_MAX_BYTES),
                notification_id=self.notification_id,
                # The stamp is evidence of our send only on a message in the mailbox's sent mail: a From can be
                # forged, and so can a header (docs/design.md#providers).
                claim_token=facts.stamp.token if facts.stamp is not None and why.rule == "sent_folder" else 0,
            )

    def __init__(
        self,
        core: Core,
        subject: Subject,
        *,
        notification_id: str,
        ttl: int,
        note: str,
        summary: MessageSummary | None = None,
        thread_id: str = "",
        received_at: datetime | None = None,
        correspondent: str = "",
    ) -> None:
        self.core = core
        self.subject = subject
        self.notification_id = notification_id
        self.ttl = ttl
        self.phase = Phase.CLAIMING
        self.status: SubjectStatus | None = None
        self.loss: ClaimLost | None = None
        self.sent_message_id: str | None = None
        self._lock = threading.Lock()
        # Until this time.monotonic() value the claim certainly holds: the coordinator counts the TTL from
        # when it handled the last claim or renewal, which is after we sent it.
        self._valid_until = 0.0
        self._token = 0
        self._claim_op = core.claim_op(
            subject,
            ttl=ttl,
            notification_id=notification_id,
            note=clean_text(note),
            summary=summary,
            thread_id=thread_id,
            received_at=received_at if thread_id else None,
            correspondent=correspondent,
        )
        self.outgoing = None
        self._outgoing_op = None
        self.automated = None
        self._incoming_op = None

    @property
    def token(self) -> int:
        """The fencing token granted on entry (0 before); kept when later answers show the subject FREE."""
        return self._token

    @property
    def expires_at(self) -> datetime | None:
        return self.status.expires_at if self.status is not None else None

    def lost_error(self) -> ClaimLost:
        """A fresh exception for the recorded loss (each raise gets its own traceback)."""
        assert self.loss is not None
        return ClaimLost(self.loss.subject, self.loss.token, self.loss.reason, self.loss.status)

    def raise_if_lost(self) -> None:
        if self.loss is not None:
            raise self.lost_error()

    # -- claim ------------------------------------------------------------------------------------------

    def enter(self, deadline: float | None = None) -> Flow[None]:
        """ClaimReply with the notification id: dedup and claim in one call; a refusal is raised. A message the
        mailbox sent is never claimed: RecordOutgoing reports it, and :class:`OutgoingMessage` is raised.
        ``deadline`` (a ``time.monotonic()`` value) bounds the call with its retries."""
        if self.phase is not Phase.CLAIMING:
            raise RuntimeError("a claim can be entered only once; call reply_to() again for a new one")
        if self.outgoing is not None:
            self.phase = Phase.OUTGOING
            recorded = None
            if self._outgoing_op is not None:
                recorded = yield from self.core.call(self._outgoing_op, deadline=deadline)
            refusal = OutgoingMessage(self.subject, self.notification_id, self.outgoing, recorded)
            log_refusal("%s", refusal)
            raise refusal
        if self.automated is not None:
            self.phase = Phase.AUTOMATED
            incoming = None
            if self._incoming_op is not None:
                incoming = yield from self.core.call(self._incoming_op, deadline=deadline)
            automated = AutomatedMessage(self.subject, self.notification_id, self.automated, incoming)
            log_refusal("%s", automated)
            raise automated
        started = time.monotonic()
        result = yield from self.core.call(self._claim_op, deadline=deadline)
        status = granted_status(result, self.subject, self.notification_id)
        self.status = status
        self._token = status.fencing_token
        self.ttl = status.ttl_seconds or self.ttl
        self._valid_until = started + self.ttl
        self.phase = Phase.CLAIMED

    # -- renewal -----------------------------------------------------------------------------------------

    def renewal(self) -> Flow[ClaimLost | None]:
        """Renews at a third of the TTL until the phase leaves CLAIMED. Returns the loss when it finds one.

        A ``Sleep`` that answers True means "stop" (the sync client's wake-up); the async client cancels.
        """
        interval = self.ttl / 3
        next_at = self._valid_until - self.ttl + interval
        while True:
            stopped = yield Sleep(max(next_at - time.monotonic(), 0.0))
            if stopped or self.phase is not Phase.CLAIMED:
                return None
            started = time.monotonic()
            op = self.core.renew_op(self.subject, self.token, ttl=self.ttl)
            # Normally a renewal must land before the claim's expiry as counted from the first ClaimReply attempt.
            # A grant that arrived after retries longer than the TTL is past that already: ask once anyway, with
            # a normal deadline. The renewal is fenced, so an OK proves the claim still holds.
            deadline = self._valid_until if self._valid_until > started else started + interval
            try:
                result: FenceResult = yield from self.core.call(op, deadline=deadline)
            except Exception as error:  # the coordinator is unreachable, or the client was closed
                now = time.monotonic()
                if self.phase is not Phase.CLAIMED:
                    return None  # the block was left (or the send began) meanwhile
                if now >= self._valid_until:
                    return self._lose(LossReason.RENEWAL_FAILED, None, Phase.CLAIMED)
                log.warning("renewing claim %d on %s failed: %s; trying again", self.token, self.subject, error)
                next_at = now + max(RENEWAL_RETRY_FLOOR_S, min(interval, (self._valid_until - now) / 3))
                continue
            if result.stale:
                return self._lose(self._stale_reason(result.status), result.status, Phase.CLAIMED)
            with self._lock:
                if self.phase is Phase.CLAIMED:
                    self.status = result.status
                    self._valid_until = started + self.ttl
            next_at = started + interval

    def _stale_reason(self, status: SubjectStatus) -> LossReason:
        if status.replied_outside:
            return LossReason.ANSWERED_OUTSIDE
        if status.state is SubjectState.CLAIMED and status.holder_kind is HolderKind.HUMAN:
            return LossReason.TAKEN_OVER
        if time.monotonic() >= self._valid_until:
            return LossReason.EXPIRED  # we were paused past the TTL
        return LossReason.STALE_TOKEN  # renewed in time, yet gone: released or taken over meanwhile

    def _lose(self, reason: LossReason, status: SubjectStatus | None, expected: Phase) -> ClaimLost | None:
        with self._lock:
            if self.phase is not expected:
                return None  # the send (or the exit) got there first: this answer no longer matters
            self.phase = Phase.LOST
            self.loss = ClaimLost(self.subject, self.token, reason, status)
            return self.loss

    # -- send --------------------------------------------------------------------------------------------

    def send(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Flow[Any]:
        """BeginSend (fenced), then ``fn``, then ConfirmSent with the id it returned (or AbortSend)."""
        with self._lock:
            if self.phase is Phase.LOST:
                raise self.lost_error()
            if self.phase is not Phase.CLAIMED:
                raise RuntimeError(
                    f"claim.send() runs once, inside the claim's block (this claim is {self.phase.value})"
                )
            self.phase = Phase.BEGINNING  # renewal stops; until BeginSend answers, the exit aborts
        yield from self._look(fn, args)
        begin = yield from self.core.call(self.core.begin_send_op(self.subject, self.token))
        if begin.refusal is not None:
            # Still held: leaving the block releases it, not redeliverable (the refusal is the decision).
            self.status = begin.status
            self.phase = Phase.REFUSED
            raise ReplyRefused.of(self.subject, self.token, begin.refusal)
        if begin.stale:
            loss = self._lose(self._stale_reason(begin.status), begin.status, Phase.BEGINNING)
            assert loss is not None
            raise self.lost_error()
        self.status = begin.status
        self.phase = Phase.SENDING
        try:
            sent = yield Invoke(fn, args, kwargs)
        except SendRejected as rejected:
            yield from self._abort(rejected)
            raise
        except Exception as error:
            self.phase = Phase.UNKNOWN
            raise SendOutcomeUnknown(self.subject, self.token) from error
        except BaseException:  # cancelled or interrupted while sending: the outcome is unknown too
            self.phase = Phase.UNKNOWN
            raise
        yield from self._confirm(sent)
        return sent

    def _look(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Flow[None]:
        """Look before you send (docs/design.md#reply-storms): when the send is a provider's reply to a message's
        facts (``claim.send(provider.reply, message, ...)``), ask the provider for the thread's messages received
        since, right before the commit point, and record each as its notification would have been: a reply from the
        mailbox with RecordOutgoing (BeginSend then finds the message answered), a customer's newer message with
        RecordIncoming (BeginSend then refuses: the conversation moved on); automated mail is left to its own
        notification. A provider that cannot answer does not stop the send: the notifications still come."""
        provider = getattr(fn, "__self__", None)
        look = getattr(provider, "look", None)
        message = args[0] if args and isinstance(args[0], MessageFacts) else None
        if message is None or not callable(look):
            return
        try:
            found: tuple[MessageFacts, ...] = yield from look(message)
        except ProviderError as error:
            log.warning("could not look at the thread of %s before sending (%s); sending anyway", self.subject, error)
            return
        addresses = getattr(provider, "mailbox_addresses", ())
        for facts in found:
            # newer_than keeps only messages with both
            assert facts.thread_id is not None
            assert facts.received_at is not None
            why = facts.outgoing if isinstance(facts.outgoing, OutgoingMatch) else None
            why = why or outgoing_of(self.core.options.outgoing, facts, addresses)
            if why is not None:
                stamp = facts.stamp.token if facts.stamp is not None and why.rule == "sent_folder" else 0
                op: Op[Any] = self.core.record_outgoing_op(
                    facts.mailbox,
                    facts.message_id,
                    facts.thread_id,
                    facts.received_at,
                    sender=clean_text(facts.sender, SUMMARY_SENDER_MAX_BYTES),
                    claim_token=stamp,
                )
            elif automated_of(facts) is not None:
                # An auto-reply in the thread (an out-of-office answering an earlier reply) is no new question from
                # the customer: it must not stop the answer to theirs. Its own notification records it.
                log.info(
                    "looked before sending %s: %s is automated mail, left to its notification",
                    self.subject,
                    facts.message_id,
                )
                continue
            else:
                op = self.core.record_incoming_op(
                    facts.mailbox,
                    facts.message_id,
                    facts.thread_id,
                    facts.received_at,
                    summary=summary_of(facts),
                )
            yield from self.core.call(op)
            log.info("looked before sending %s: found %s, recorded (%s)", self.subject, facts.message_id, why or "new")

    def mark_replied(self, sent_message_id: str, note: str) -> Flow[None]:
        """MarkReplied (fenced): the reply was made outside ``send``; a refusal is the claim's loss."""
        with self._lock:
            if self.phase is Phase.LOST:
                raise self.lost_error()
            if self.phase is not Phase.CLAIMED:
                raise RuntimeError(f"claim.mark_replied() needs a held claim (this claim is {self.phase.value})")
            self.phase = Phase.BEGINNING  # renewal stops; the exit releases if the answer never comes
        op = self.core.mark_replied_op(self.subject, self.token, sent_message_id, clean_text(note))
        try:
            result = yield from self.core.call(op)
        except BaseException:
            self.phase = Phase.CLAIMED
            raise
        if result.stale:
            self._lose(self._stale_reason(result.status), result.status, Phase.BEGINNING)
            raise self.lost_error()
        self.status = result.status
        self.sent_message_id = sent_message_id
        self.phase = Phase.REPLIED

    def _abort(self, rejected: SendRejected) -> Flow[None]:
        op = self.core.abort_send_op(self.subject, self.token, clean_text(rejected.reason))
        try:
            result = yield from self.core.call(op)
        except InboxClaimsError as error:
            self.phase = Phase.UNKNOWN
            log.warning(
                "AbortSend for %s failed (%s): it stays SENDING and will be reported IN_DOUBT", self.subject, error
            )
            return
        self.status = result.status
        self.phase = Phase.ABORTED if result.ok else Phase.UNKNOWN

    def _confirm(self, sent: Any) -> Flow[None]:
        wrong_type = sent is not None and not isinstance(sent, str)
        op = self.core.confirm_sent_op(self.subject, self.token, "" if wrong_type else (sent or ""))
        try:
            result = yield from self.core.call(op)
        except InboxClaimsError as error:
            self.phase = Phase.UNKNOWN
            raise SentButUnconfirmed(self.subject, self.token, sent, f"ConfirmSent failed: {error}") from error
        if result.stale:
            self.phase = Phase.UNKNOWN
            raise SentButUnconfirmed(
                self.subject,
                self.token,
                sent,
                f"the coordinator no longer knows this send ({result.status.state.name})",
            )
        self.status = result.status
        self.sent_message_id = sent
        self.phase = Phase.REPLIED
        if wrong_type:
            raise TypeError(
                f"the send function returned {type(sent).__name__}; return the sent message id (str) or None. "
                "The reply was sent and is recorded as REPLIED without an id."
            )

    # -- leaving the block -------------------------------------------------------------------------------

    def exit(self, failed: bool = False) -> Flow[None]:
        """Best effort, never raises a coordinator error: release an unsent claim; abort a BeginSend whose
        answer was lost (the send function was never called, so nothing went out).

        ``failed``: the block ended with an exception. Then, as after a lost renewal or a lost BeginSend
        answer, giving the claim up is no decision about the message: it is released as redeliverable, so
        that a redelivery of its notification may claim again (as after a crash)."""
        with self._lock:
            phase = self.phase
            unsure = phase is Phase.LOST and self.loss is not None and self.loss.reason is LossReason.RENEWAL_FAILED
            if phase in (Phase.CLAIMED, Phase.BEGINNING, Phase.REFUSED) or unsure:
                self.phase = Phase.RELEASED
        try:
            if phase is Phase.REFUSED:
                yield from self._release(redeliverable=False)
            elif phase is Phase.CLAIMED or unsure:
                yield from self._release(redeliverable=failed or unsure)
            elif phase is Phase.BEGINNING:
                reason = "BeginSend's answer was lost; the send function was never called"
                try:
                    yield from self.core.call(
                        self.core.abort_send_op(self.subject, self.token, reason, redeliverable=True)
                    )
                except FailedPrecondition:  # BeginSend never committed: the subject is still CLAIMED
                    yield from self._release(redeliverable=True)
        except InboxClaimsError as error:
            log.warning("could not release %s (%s); it frees when its TTL runs out", self.subject, error)

    def _release(self, *, redeliverable: bool) -> Flow[None]:
        op: Op[FenceResult] = self.core.release_op(self.subject, self.token, redeliverable=redeliverable)
        result = yield from self.core.call(op)
        self.status = result.status


class ClaimBase:
    """What ``Claim`` and ``AsyncClaim`` share: the read-only view of one guarded claim."""

    def __init__(self, state: GuardState) -> None:
        self._state = state
        self._context: contextvars.Token[Any] | None = None

    def _make_current(self) -> None:
        """Entered: ``current_claim()`` (and so ``inbox_claims.nylas.send``) finds this claim from now on."""
        self._context = _current.set(self)

    def _stop_being_current(self) -> None:
        context, self._context = self._context, None
        if context is None:
            return
        try:
            _current.reset(context)
        except ValueError:  # left in another context than entered (a task that entered, another that exits)
            _current.set(None)

    @property
    def sending(self) -> bool:
        """True while ``send`` runs its send function (between BeginSend and ConfirmSent)."""
        return self._state.phase is Phase.SENDING

    @property
    def by_person(self) -> bool:
        """True when the claim is a person's (the client's kind is ``human``): its reply is never marked automatic."""
        return self._state.core.options.kind is HolderKind.HUMAN

    @property
    def subject(self) -> Subject:
        """The message (or thread, with ``scope="thread"``) this claim is on."""
        return self._state.subject

    @property
    def notification_id(self) -> str:
        """The notification this claim recorded as delivered (empty when none was given)."""
        return self._state.notification_id

    @property
    def token(self) -> int:
        """The fencing token (0 until the claim is granted)."""
        return self._state.token

    @property
    def ttl(self) -> int:
        """The claim's TTL in seconds; it is renewed every third of it."""
        return self._state.ttl

    @property
    def expires_at(self) -> datetime | None:
        """When the claim frees unless renewed, as of the last grant or renewal (the coordinator's clock)."""
        return self._state.expires_at

    @property
    def status(self) -> SubjectStatus | None:
        """The subject's status as last answered by the coordinator."""
        return self._state.status

    @property
    def idempotency_key(self) -> str:
        """``"ic1-"`` + 64 hex digits, derived only from (mailbox, subject kind, subject id).

        Send it as the mail API's ``Idempotency-Key`` header (Nylas: at most 256 characters, cached one hour per
        grant, a second request with the same key and another payload gets 409): every agent computes the same
        key for the same subject, so even if everything else failed, the provider refuses a second reply.
        """
        return self._state.subject.idempotency_key

    @property
    def loss(self) -> ClaimLost | None:
        """Why the claim was lost, once it was (see ``lost``)."""
        return self._state.loss

    @property
    def sent_message_id(self) -> str | None:
        """What the send function returned, once the reply is recorded."""
        return self._state.sent_message_id

    @property
    def replied(self) -> bool:
        """True once ``send`` went through and the coordinator recorded the reply (REPLIED)."""
        return self._state.phase is Phase.REPLIED

    def raise_if_lost(self) -> None:
        """Raises :class:`ClaimLost` if the claim was lost: call it between long steps of drafting."""
        self._state.raise_if_lost()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.subject} token={self.token} {self._state.phase.value}>"
