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

from inbox_wire import VERSION

# Imported here so that ``inbox_claims.types`` is there after ``import inbox_claims`` alone, as it always was.
from . import types as types
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
    ReplyRefused,
    SendOutcomeUnknown,
    SendRejected,
    SentButUnconfirmed,
)
from ._guard import ANSWERED_EVENTS
from ._sync import Claim, Coordinator
from ._types import RetryPolicy, Subject, SubjectState, SubjectStatus

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
    "ReplyRefused",
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
