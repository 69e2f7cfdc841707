"""Every exception the client raises on purpose (the tree is in ``_errors``'s docstring and docs/client.md).

The refusals a guarded agent meets and the send outcomes are at the top level too; the gRPC status classes
below ``CoordinatorError`` (``InvalidRequest``, ``FailedPrecondition``, ``PermissionDenied``,
``Unauthenticated``, ``QuotaExceeded``) live here.
"""

from ._envelope import NotificationError
from ._errors import *  # noqa: F403  (every client error; _errors.__all__ lists them)
from ._errors import __all__ as _client_errors
from ._webhooks import WebhookVerificationError

__all__ = [*_client_errors, "NotificationError", "WebhookVerificationError"]
