"""Client for the Inbox Coordinator: claims on email replies, so that an agent never replies twice.

::

    from inbox_claims import AsyncCoordinator, ClaimNotGranted, parse_notification

    coord = AsyncCoordinator(principal="support-agent-1")

    async def on_webhook(raw_body: bytes) -> None:
        notification = parse_notification(raw_body)
        try:
            async with coord.reply_to(notification, ttl=60) as claim:  # dedup + claim, renewed in the background
                draft = await write_reply(notification)
                await claim.send(send_with_nylas, draft, idempotency_key=claim.idempotency_key)
        except ClaimNotGranted:
            pass  # a redelivery, or someone else has it, or it was answered already

See ``docs/client.md``. :class:`Coordinator` is the blocking twin of :class:`AsyncCoordinator`;
:mod:`inbox_claims.testing` starts a real coordinator for your tests.
"""

from ._async import AsyncClaim, AsyncCoordinator
from ._core import DEFAULT_TARGET
from ._envelope import EnvelopeError, Notification, NotificationVariant, parse_notification
from ._errors import (
    AlreadyReplied,
    ClaimLost,
    ClaimNotGranted,
    CoordinatorError,
    CoordinatorUnavailable,
    DuplicateDelivery,
    FailedPrecondition,
    InboxClaimsError,
    InvalidRequest,
    PermissionDenied,
    QuotaExceeded,
    ReplyHeld,
    SendOutcomeUnknown,
    SendRejected,
    SentButUnconfirmed,
    Unauthenticated,
)
from ._sync import Claim, Coordinator
from ._types import (
    ClaimOutcome,
    ClaimResult,
    ClaimsPage,
    DeliveryRecord,
    DeliveryResult,
    EventType,
    FenceResult,
    HolderKind,
    LossReason,
    MessageSummary,
    RetryPolicy,
    Subject,
    SubjectKind,
    SubjectState,
    SubjectStatus,
    TakeoverOutcome,
    TakeoverResult,
    WatchEvent,
    WatchItem,
    WatchSnapshot,
    idempotency_key,
)
from ._webhooks import (
    NYLAS_SIGNATURE_HEADER,
    WebhookVerificationError,
    nylas_challenge_response,
    sign_nylas,
    sign_standard_webhook,
    verify_nylas_signature,
    verify_standard_webhook,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_TARGET",
    "NYLAS_SIGNATURE_HEADER",
    "AlreadyReplied",
    "AsyncClaim",
    "AsyncCoordinator",
    "Claim",
    "ClaimLost",
    "ClaimNotGranted",
    "ClaimOutcome",
    "ClaimResult",
    "ClaimsPage",
    "Coordinator",
    "CoordinatorError",
    "CoordinatorUnavailable",
    "DeliveryRecord",
    "DeliveryResult",
    "DuplicateDelivery",
    "EnvelopeError",
    "EventType",
    "FailedPrecondition",
    "FenceResult",
    "HolderKind",
    "InboxClaimsError",
    "InvalidRequest",
    "LossReason",
    "MessageSummary",
    "Notification",
    "NotificationVariant",
    "PermissionDenied",
    "QuotaExceeded",
    "ReplyHeld",
    "RetryPolicy",
    "SendOutcomeUnknown",
    "SendRejected",
    "SentButUnconfirmed",
    "Subject",
    "SubjectKind",
    "SubjectState",
    "SubjectStatus",
    "TakeoverOutcome",
    "TakeoverResult",
    "Unauthenticated",
    "WatchEvent",
    "WatchItem",
    "WatchSnapshot",
    "WebhookVerificationError",
    "idempotency_key",
    "nylas_challenge_response",
    "parse_notification",
    "sign_nylas",
    "sign_standard_webhook",
    "verify_nylas_signature",
    "verify_standard_webhook",
]
