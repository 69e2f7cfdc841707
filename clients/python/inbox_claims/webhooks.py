"""Receiving Nylas webhooks: signature verification (Nylas's ``X-Nylas-Signature`` and Standard Webhooks),
the challenge answer, and the typed parser of the notification envelope.

Verify the signature on the raw body before parsing it. The ready-made receivers are ``inbox_claims.asgi``
and ``inbox_claims.wsgi``; the signers for tests are in ``inbox_claims.testing``.
"""

from ._envelope import Notification, NotificationError, NotificationVariant, parse_notification
from ._guard import ANSWERED_EVENTS
from ._webhooks import (
    NYLAS_SIGNATURE_HEADER,
    WebhookVerificationError,
    nylas_challenge_response,
    verify_nylas_signature,
    verify_standard_webhook,
)

__all__ = [
    "ANSWERED_EVENTS",
    "NYLAS_SIGNATURE_HEADER",
    "Notification",
    "NotificationError",
    "NotificationVariant",
    "WebhookVerificationError",
    "nylas_challenge_response",
    "parse_notification",
    "verify_nylas_signature",
    "verify_standard_webhook",
]
