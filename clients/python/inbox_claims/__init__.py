"""Client for the Inbox Coordinator: claims on email replies, so that an agent never replies twice.

::

    from inbox_claims import guard, nylas as guarded_nylas

    @guard                                       # dedup + claim on the message, renewed; refusals logged
    async def answer(event: dict[str, Any]) -> None:
        draft = await write_reply(event)
        await guarded_nylas.send(http, event["data"]["object"]["grant_id"], draft)   # fenced: at most one reply

See ``docs/client.md``. :class:`AsyncCoordinator` and its blocking twin :class:`Coordinator` are the clients
(``from_env()`` reads the variables ``inboxctl`` reads); :mod:`inbox_claims.webhooks` verifies and parses
webhooks; :mod:`inbox_claims.types` and :mod:`inbox_claims.errors` hold every result type and exception;
:mod:`inbox_claims.testing` starts a real coordinator for your tests.
"""

import importlib
import warnings
from typing import Any

from inbox_wire import VERSION

from . import _errors as _client_errors
from . import types as _value_types
from ._async import AsyncClaim, AsyncCoordinator
from ._default import current_claim, guard
from ._envelope import Notification
from ._errors import (
    AlreadyReplied,
    ClaimLost,
    ClaimNotGranted,
    CoordinatorError,
    CoordinatorUnavailable,
    DuplicateDelivery,
    InboxClaimsError,
    OutgoingMessage,
    ReplyHeld,
    SendOutcomeUnknown,
    SendRejected,
    SentButUnconfirmed,
)
from ._guard import ANSWERED_EVENTS
from ._sync import Claim, Coordinator
from ._types import RetryPolicy, Subject, SubjectState, SubjectStatus
from ._webhooks import __all__ as _webhook_names

__version__ = VERSION

__all__ = [
    "ANSWERED_EVENTS",
    "AlreadyReplied",
    "AsyncClaim",
    "AsyncCoordinator",
    "Claim",
    "ClaimLost",
    "ClaimNotGranted",
    "Coordinator",
    "CoordinatorError",
    "CoordinatorUnavailable",
    "DuplicateDelivery",
    "InboxClaimsError",
    "Notification",
    "OutgoingMessage",
    "ReplyHeld",
    "RetryPolicy",
    "SendOutcomeUnknown",
    "SendRejected",
    "SentButUnconfirmed",
    "Subject",
    "SubjectState",
    "SubjectStatus",
    "current_claim",
    "guard",
]

# Value types added after 0.1 live in inbox_claims.types only: they were never at the top level.
_NEWER_VALUE_TYPES = frozenset(
    {"CallerIdentity", "MessageSummary", "OutgoingOutcome", "OutgoingResult", "OutsideReply", "RecentMessage"}
)

# The names that were at the top level in 0.1 and moved: they keep working until 0.2, with a DeprecationWarning
# that names the new place. old name -> (module, name there).
MOVED: dict[str, tuple[str, str]] = {
    **{
        name: ("inbox_claims.types", name)
        for name in _value_types.__all__
        if name not in __all__ and name not in _NEWER_VALUE_TYPES
    },
    **{name: ("inbox_claims.errors", name) for name in _client_errors.__all__ if name not in __all__},
    **{name: ("inbox_claims.webhooks", name) for name in _webhook_names if name not in __all__},
    "NotificationVariant": ("inbox_claims.webhooks", "NotificationVariant"),
    "parse_notification": ("inbox_claims.webhooks", "parse_notification"),
    "EnvelopeError": ("inbox_claims.webhooks", "NotificationError"),
    "sign_nylas": ("inbox_claims.testing", "sign_nylas"),
    "sign_standard_webhook": ("inbox_claims.testing", "sign_standard_webhook"),
}


def __getattr__(name: str) -> Any:
    try:
        module, new_name = MOVED[name]
    except KeyError:
        raise AttributeError(f"module 'inbox_claims' has no attribute {name!r}") from None
    warnings.warn(
        f"inbox_claims.{name} moved to {module}.{new_name}; the old name goes away in inbox-claims 0.2",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(module), new_name)
