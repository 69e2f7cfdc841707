"""The client's exceptions.

::

    InboxClaimsError
    ├── ClaimNotGranted            the claim was refused: do not reply (answer the webhook 200 and move on)
    │   ├── DuplicateDelivery      this notification id was seen before
    │   ├── ReplyHeld              someone else holds the subject now
    │   ├── AlreadyReplied         a reply was sent, is being sent, or is in doubt
    │   ├── OutgoingMessage        the message is one the mailbox sent: never answered (recorded instead)
    │   └── AutomatedMessage       automated mail (an auto-reply, a list, a bounce): agents leave it (recorded)
    ├── ClaimLost                  you held the claim and no longer do (fenced): never send
    ├── ReplyRefused               BeginSend REFUSED: the mailbox's reply rules stop this send (nothing sent)
    │   ├── ReplyBudgetSpent       the agents' reply budget of the thread or correspondent is spent
    │   └── ConversationMovedOn    the customer wrote again: draft again with the new message
    ├── SendRejected               raised BY YOU from a send function: "the mail API refused, nothing went out"
    ├── SendOutcomeUnknown         the send function raised something else: it may have gone out (IN_DOUBT)
    ├── SentButUnconfirmed         the reply went out but the coordinator could not record it
    └── CoordinatorError           a gRPC status from the coordinator (``.code``, ``.details``)
        ├── InvalidRequest         INVALID_ARGUMENT / OUT_OF_RANGE: the message names the field and limit
        ├── FailedPrecondition     the call does not fit the subject's state (a client bug)
        ├── PermissionDenied       e.g. a fencing token presented by a principal that is not its holder
        ├── Unauthenticated        no usable identity (set ``principal=`` or ``token=``)
        ├── QuotaExceeded          RESOURCE_EXHAUSTED: over the call rate (after retries) or the watch limit
        └── CoordinatorUnavailable UNAVAILABLE / DEADLINE_EXCEEDED / ABORTED after every retry
"""

from __future__ import annotations

from datetime import datetime

import grpc

from ._outgoing import OutgoingMatch
from ._types import (
    DeliveryRecord,
    HolderKind,
    IncomingResult,
    LossReason,
    OutgoingOutcome,
    OutgoingResult,
    RefusalKind,
    SendRefusal,
    Subject,
    SubjectState,
    SubjectStatus,
)

__all__ = [
    "AlreadyReplied",
    "AutomatedMessage",
    "ClaimLost",
    "ClaimNotGranted",
    "ConversationMovedOn",
    "CoordinatorError",
    "CoordinatorUnavailable",
    "DuplicateDelivery",
    "FailedPrecondition",
    "InboxClaimsError",
    "InvalidRequest",
    "OutgoingMessage",
    "PermissionDenied",
    "QuotaExceeded",
    "ReplyBudgetSpent",
    "ReplyHeld",
    "ReplyRefused",
    "SendOutcomeUnknown",
    "SendRejected",
    "SentButUnconfirmed",
    "Unauthenticated",
]


class InboxClaimsError(Exception):
    """Base of every exception this package raises on purpose."""


# --------------------------------------------------------------------------------------------- refusals


class ClaimNotGranted(InboxClaimsError):
    """The claim was refused: this agent must not reply. Nothing is held, nothing needs cleaning up."""

    subject: Subject


class DuplicateDelivery(ClaimNotGranted):
    """The notification id was seen before (a webhook redelivery): drop it. ``first`` is its first sighting."""

    def __init__(self, subject: Subject, notification_id: str, first: DeliveryRecord | None) -> None:
        by = (
            f" by {first.recorded_by!r} at {first.recorded_at:%Y-%m-%d %H:%M:%S}Z"
            if first and first.recorded_at
            else ""
        )
        super().__init__(f"notification {notification_id!r} was already delivered{by}; nothing was claimed")
        self.subject = subject
        self.notification_id = notification_id
        self.first = first

    @property
    def recorded_by(self) -> str:
        return self.first.recorded_by if self.first else ""

    @property
    def recorded_at(self) -> datetime | None:
        return self.first.recorded_at if self.first else None


class ReplyHeld(ClaimNotGranted):
    """Someone else holds the subject (``holder``, of ``holder_kind``, until ``expires_at``): do not reply."""

    def __init__(self, status: SubjectStatus) -> None:
        kind = status.holder_kind.value if status.holder_kind else "unknown"
        until = f" until {status.expires_at:%H:%M:%S}Z" if status.expires_at else ""
        super().__init__(f"{_describe(status.subject)} is held by {status.holder!r} ({kind}){until}")
        self.subject = status.subject
        self.status = status

    @property
    def holder(self) -> str:
        return self.status.holder

    @property
    def holder_kind(self) -> HolderKind | None:
        return self.status.holder_kind

    @property
    def expires_at(self) -> datetime | None:
        return self.status.expires_at


class AlreadyReplied(ClaimNotGranted):
    """A reply was sent (REPLIED), is being sent (SENDING) or may have been sent (IN_DOUBT): do not reply."""

    def __init__(self, status: SubjectStatus) -> None:
        super().__init__(
            f"{_describe(status.subject)} is {status.state.name}: replied by {status.holder!r}"
            + (f" (sent message {status.sent_message_id!r})" if status.sent_message_id else "")
        )
        self.subject = status.subject
        self.status = status

    @property
    def state(self) -> SubjectState:
        return self.status.state

    @property
    def holder(self) -> str:
        return self.status.holder

    @property
    def sent_at(self) -> datetime | None:
        return self.status.sent_at

    @property
    def sent_message_id(self) -> str:
        return self.status.sent_message_id


class OutgoingMessage(ClaimNotGranted):
    """The notification is about a message the mailbox sent (``why``: in a sent folder, or from one of its own
    addresses): an agent never answers it. The guard reported it to the coordinator (``result``: the mailbox's
    own reply, or one written outside that ended the claims on what it answered; ``None`` when it could not be
    reported, e.g. the notification carried no thread id)."""

    def __init__(
        self, subject: Subject, notification_id: str, why: OutgoingMatch, result: OutgoingResult | None
    ) -> None:
        if result is None:
            recorded = "it was not recorded (the notification has no thread id or date)"
        elif result.outcome is OutgoingOutcome.OWN_REPLY:
            recorded = "the coordinator knows it as the mailbox's own reply"
        elif result.outcome is OutgoingOutcome.ANSWERED_OUTSIDE:
            ended = ", ".join(f"{status.subject.kind.value} {status.subject.id!r}" for status in result.subjects)
            recorded = "recorded as a reply written outside the coordinator" + (
                f"; it answered {ended}" if ended else ""
            )
        else:
            recorded = "its notification was delivered before"
        super().__init__(
            f"not answering {_describe(subject)} (notification {notification_id!r}): it is outgoing, {why}; {recorded}"
        )
        self.subject = subject
        self.notification_id = notification_id
        self.why = why
        self.result = result


class AutomatedMessage(ClaimNotGranted):
    """The message is automated mail (``why``: "Auto-Submitted: auto-replied", "List-Id", ...): an agent never
    answers it, or two automatic responders answer each other forever (RFC 3834). The guard recorded it for people
    (``result``; ``None`` when it could not be: no thread id or date); a person can still claim and answer it."""

    def __init__(self, subject: Subject, notification_id: str, why: str, result: IncomingResult | None) -> None:
        recorded = (
            "recorded for people to see"
            if result is not None
            else "it was not recorded (the notification has no thread id or date)"
        )
        super().__init__(
            f"not answering {_describe(subject)} (notification {notification_id!r}): automated message ({why}): "
            f"agents leave it; {recorded}"
        )
        self.subject = subject
        self.notification_id = notification_id
        self.why = why
        self.result = result


# ------------------------------------------------------------------------------------------- the guard


class ClaimLost(InboxClaimsError):
    """You held the claim and no longer do: stop drafting and never send.

    ``reason`` says why (:class:`~inbox_claims.LossReason`); ``status`` is the subject's state as last seen
    (``None`` when the coordinator could not be reached). The fencing token is stale, so the coordinator
    refuses its commit point anyway: this exception only tells you early.
    """

    def __init__(self, subject: Subject, token: int, reason: LossReason, status: SubjectStatus | None) -> None:
        detail = {
            LossReason.TAKEN_OVER: f"taken over by {status.holder!r}" if status else "taken over",
            LossReason.EXPIRED: "its TTL ran out before it was renewed",
            LossReason.STALE_TOKEN: "the coordinator refused its fencing token",
            LossReason.RENEWAL_FAILED: "the coordinator could not be reached to renew it before its TTL ran out",
            LossReason.ANSWERED_OUTSIDE: _answered_outside(status),
        }[reason]
        super().__init__(f"claim {token} on {_describe(subject)} was lost: {detail}")
        self.subject = subject
        self.token = token
        self.reason = reason
        self.status = status


class ReplyRefused(InboxClaimsError):
    """BeginSend REFUSED: the mailbox's reply rules stop this send (docs/design.md#reply-storms). Nothing was sent or
    counted. The guard releases the claim (not redeliverable: the refusal is the decision) and logs ``reason``.
    Carries the refusal's fields (``refusal``, and each as an attribute)."""

    def __init__(self, subject: Subject, token: int, refusal: SendRefusal) -> None:
        super().__init__(f"not sending the reply to {_describe(subject)}: {refusal.reason}")
        self.subject = subject
        self.token = token
        self.refusal = refusal
        self.reason = refusal.reason
        self.kind = refusal.kind

    @staticmethod
    def of(subject: Subject, token: int, refusal: SendRefusal) -> ReplyRefused:
        """The exception of a refusal's kind."""
        if refusal.kind is RefusalKind.REPLY_BUDGET_SPENT:
            return ReplyBudgetSpent(subject, token, refusal)
        if refusal.kind is RefusalKind.CONVERSATION_MOVED_ON:
            return ConversationMovedOn(subject, token, refusal)
        return ReplyRefused(subject, token, refusal)


class ReplyBudgetSpent(ReplyRefused):
    """The agents' reply budget is spent: ``scope`` ("thread" or "correspondent") had ``counted`` agent replies of
    ``limit`` in the last ``window_seconds``; ``frees_at`` is when the oldest leaves the window. A person should
    look: agents stay stopped on this conversation until then."""

    def __init__(self, subject: Subject, token: int, refusal: SendRefusal) -> None:
        super().__init__(subject, token, refusal)
        self.scope = refusal.scope
        self.limit = refusal.limit
        self.window_seconds = refusal.window_seconds
        self.counted = refusal.counted
        self.frees_at = refusal.frees_at


class ConversationMovedOn(ReplyRefused):
    """The customer wrote again in the thread (``newer_message_id``, received ``newer_received_at``) after the
    claim's message: the draft answers a conversation that is no longer current. Nothing was sent; the newer
    message's own handler answers the whole conversation (docs/client.md, "Reply storms")."""

    def __init__(self, subject: Subject, token: int, refusal: SendRefusal) -> None:
        super().__init__(subject, token, refusal)
        self.newer_message_id = refusal.newer_message_id
        self.newer_received_at = refusal.newer_received_at


class SendRejected(InboxClaimsError):
    """Raise this (or a subclass) from your send function when the mail API certainly did NOT send.

    ``claim.send`` then calls AbortSend (the subject becomes FREE, so it can be answered again) and re-raises
    it. Raise it only when the API refused the request (a 4xx answer): a timeout or a dropped connection
    proves nothing, so let those propagate (they become :class:`SendOutcomeUnknown`).
    """

    def __init__(self, reason: str = "the mail API refused the send") -> None:
        super().__init__(reason)
        self.reason = reason


class SendOutcomeUnknown(InboxClaimsError):
    """The send function raised something other than :class:`SendRejected`: the reply may have gone out.

    The subject stays SENDING and the coordinator reports it IN_DOUBT after its send timeout; nobody else can
    reply until a human checks the sent folder and calls ``resolve_in_doubt``. Do not retry the send.
    The original exception is ``__cause__``.
    """

    def __init__(self, subject: Subject, token: int) -> None:
        super().__init__(
            f"the send for {_describe(subject)} raised an error that does not prove it failed; "
            "the subject stays SENDING and will be reported IN_DOUBT"
        )
        self.subject = subject
        self.token = token


class SentButUnconfirmed(InboxClaimsError):
    """The send function returned (the reply went out) but ConfirmSent could not be recorded.

    Do not send again: the subject stays SENDING, becomes IN_DOUBT, and a human resolves it as sent.
    """

    def __init__(self, subject: Subject, token: int, sent_message_id: str | None, detail: str) -> None:
        super().__init__(f"the reply for {_describe(subject)} was sent but not recorded: {detail}")
        self.subject = subject
        self.token = token
        self.sent_message_id = sent_message_id


# -------------------------------------------------------------------------------------- status codes


class CoordinatorError(InboxClaimsError):
    """The coordinator answered with an error status: ``code`` (a ``grpc.StatusCode``) and ``details``."""

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        *,
        method: str = "",
        attempts: int = 1,
        retry_after: float | None = None,
    ) -> None:
        where = f"{method}: " if method else ""
        tries = f" (after {attempts} attempts)" if attempts > 1 else ""
        super().__init__(f"{where}{code.name}: {details}{tries}")
        self.code = code
        self.details = details
        self.method = method
        self.attempts = attempts
        self.retry_after = retry_after
        """Seconds the coordinator asked to wait before trying again (its ``retry-after-ms`` hint), if any."""


class InvalidRequest(CoordinatorError):
    """A request field breaks a limit (INVALID_ARGUMENT); ``details`` names the field and the limit."""


class FailedPrecondition(CoordinatorError):
    """The call does not fit the subject's state, e.g. ConfirmSent before BeginSend."""


class PermissionDenied(CoordinatorError):
    """The caller may not do this (another principal's token; an agent calling Takeover)."""


class Unauthenticated(CoordinatorError):
    """The call carried no usable identity: pass ``principal=`` (development mode) or ``token=``."""


class CoordinatorUnavailable(CoordinatorError):
    """The coordinator (or its etcd) could not be reached, even after every retry. Safe to try again later."""


class QuotaExceeded(CoordinatorError):
    """RESOURCE_EXHAUSTED: over the principal's call rate (retried for you while the retry policy allows,
    after the coordinator's ``retry_after`` hint) or its number of concurrent watches."""


_BY_CODE: dict[grpc.StatusCode, type[CoordinatorError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequest,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.UNAVAILABLE: CoordinatorUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: CoordinatorUnavailable,
    grpc.StatusCode.ABORTED: CoordinatorUnavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: QuotaExceeded,
}


def error_for(
    code: grpc.StatusCode, details: str, *, method: str = "", attempts: int = 1, retry_after: float | None = None
) -> CoordinatorError:
    """The exception for a gRPC status; codes without a class of their own give :class:`CoordinatorError`."""
    return _BY_CODE.get(code, CoordinatorError)(
        code, details, method=method, attempts=attempts, retry_after=retry_after
    )


def _answered_outside(status: SubjectStatus | None) -> str:
    reply = status.outside_reply if status is not None else None
    if reply is None:
        return "someone answered it from the mailbox"
    when = f" at {reply.sent_at:%Y-%m-%d %H:%M}Z" if reply.sent_at else ""
    return f"someone answered it from the mailbox: {reply.sender or 'the mailbox'}{when}"


def _describe(subject: Subject) -> str:
    return f"{subject.kind.value} {subject.id!r} of mailbox {subject.mailbox!r}"
