"""The mail providers behind one seam (docs/providers.md): each turns its webhooks into :class:`MessageFacts`, the one
value the guard, the webhook adapters, the outgoing rules and the MCP tools read.

One module per provider: :mod:`~inbox_claims.providers.nylas`, :mod:`~inbox_claims.providers.graph` (the ``graph``
extra), :mod:`~inbox_claims.providers.gmail` (the ``gmail`` extra), :mod:`~inbox_claims.providers.agentmail` and
:mod:`~inbox_claims.providers.resend` (Svix-signed; httpx for their APIs), :mod:`~inbox_claims.providers.imap` (the
``imap`` extra). The webhook adapters take any of them:
``inbox_claims.asgi.webhook_app(provider, handle, coordinator=...)`` and ``inbox_claims.wsgi.webhook_wsgi``; an IMAP
mailbox has no webhook: its ``ImapWatcher`` watches it, through the same admission.
"""

from ._seam import (
    STAMP_HEADER,
    Accepted,
    Answer,
    Automated,
    Batch,
    ClaimStamp,
    CursorRange,
    Cursors,
    HttpRequest,
    HttpResponse,
    MessageFacts,
    Provider,
    ProviderError,
    ReplyContext,
    WebhookRequest,
    parse_stamp,
)

PROVIDERS = {
    "nylas": "inbox_claims.providers.nylas:NylasProvider",
    "graph": "inbox_claims.providers.graph:GraphProvider",
    "gmail": "inbox_claims.providers.gmail:GmailProvider",
    "agentmail": "inbox_claims.providers.agentmail:AgentMailProvider",
    "resend": "inbox_claims.providers.resend:ResendProvider",
}
"""Each webhook provider's class by name, imported when asked for (Graph and Gmail need their extras); each has its
vectors in conformance/providers/<name>/. IMAP has no webhook to replay: inbox_claims.providers.imap, tested against a
real Dovecot (tests/providers/test_imap.py)."""

__all__ = [
    "PROVIDERS",
    "STAMP_HEADER",
    "Accepted",
    "Answer",
    "Automated",
    "Batch",
    "ClaimStamp",
    "CursorRange",
    "Cursors",
    "HttpRequest",
    "HttpResponse",
    "MessageFacts",
    "Provider",
    "ProviderError",
    "ReplyContext",
    "WebhookRequest",
    "parse_stamp",
]
