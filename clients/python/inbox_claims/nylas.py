"""Replies through the Nylas v3 send API, with error semantics that fit ``claim.send``. Needs ``httpx``
(the ``nylas`` extra).

With the httpx client you already have (its ``base_url`` and ``Authorization`` header set, or pass
``api_base=``/``api_key=``)::

    from inbox_claims import guard, nylas as guarded_nylas

    @guard
    async def answer(event: dict[str, Any]) -> None:
        draft = await write_reply(event)                          # the Nylas send body (a dict), or a NylasReply
        await guarded_nylas.send(http, event["data"]["object"]["grant_id"], draft)

:func:`send` adds the claim's ``Idempotency-Key``, applies the status rules below, and, awaited inside a
guarded claim, passes the fenced commit point itself (it is ``await claim.send(nylas.send(...))``, which
works too). With an ``httpx.Client`` it is blocking and does the same inside ``Coordinator.guard`` /
``with coord.reply_to(...)``. Outside any claim it sends only with an explicit ``idempotency_key=``.

The adapter classes hold a client of their own::

    nylas = AsyncNylas(api_key=NYLAS_API_KEY)            # api_base="https://api.eu.nylas.com" in the EU

    async with coord.reply_to(notification) as claim:
        reply = NylasReply.answering(notification, body=await write_reply(notification))
        sent_id = await claim.send(nylas.send, notification.grant_id, reply, idempotency_key=claim.idempotency_key)

``send`` is ``POST {api_base}/v3/grants/{grant_id}/messages/send`` with ``Authorization: Bearer <api key>``
and ``Idempotency-Key: <key>``, and returns the sent message's id (``data.id``). What its outcomes mean:

=========================================  ====================================================================
Nylas answers                              ``send`` does, and so ``claim.send`` leaves the subject
=========================================  ====================================================================
2xx                                        returns ``data.id``: REPLIED
409 (the idempotency key was used)         raises :class:`NylasDuplicateSend`: a reply with this key went out
                                           or is in flight, so it is never "not sent": SENDING, then IN_DOUBT
any other 4xx (400, 401, 403, 404, 422,    raises :class:`NylasSendRejected`, a :class:`~inbox_claims.SendRejected`:
429...)                                    nothing went out; the send is aborted and the subject is FREE
5xx, a timeout, a connection error, an     raises :class:`NylasSendOutcomeUnknown`: it may have gone out: SENDING, then
unreadable answer                          IN_DOUBT for a human to resolve
=========================================  ====================================================================

``send`` never retries by itself: a second attempt is a decision for whoever resolves the subject.

``sent_folder_ids(grant_id)`` lists the grant's sent folders (``GET /v3/grants/{grant_id}/folders``, the
folders whose ``attributes`` hold ``\\Sent``): the ids the guard's ``sent_folders`` setting
(``INBOX_SENT_FOLDERS``) takes for Microsoft and IMAP grants, whose folder ids are opaque or the server's own
names (Google's is always ``SENT``, which the guard knows).
:class:`Nylas` is the blocking twin of :class:`AsyncNylas`; both build the request and read the answer in the
same code (:func:`build_send_request`, :func:`interpret_send_response`) and only do the I/O.
"""

from __future__ import annotations

from collections.abc import Coroutine, Generator
from typing import Any, overload

import httpx

from ._async import AsyncClaim
from ._current import current_claim_base as current_claim
from ._sync import Claim
from .providers.nylas import (
    DEFAULT_API_BASE,
    DEFAULT_TIMEOUT,
    MAX_IDEMPOTENCY_KEY_LENGTH,
    SENT_ATTRIBUTE,
    AsyncNylas,
    Draft,
    Nylas,
    NylasDuplicateSend,
    NylasReply,
    NylasSendOutcomeUnknown,
    NylasSendRejected,
    SendRequest,
    _payload,
    _post_async,
    _post_sync,
    _send_headers,
    _send_path,
    build_send_request,
    interpret_send_response,
    sent_folders_in,
    transport_failure,
)

__all__ = [
    "DEFAULT_API_BASE",
    "DEFAULT_TIMEOUT",
    "MAX_IDEMPOTENCY_KEY_LENGTH",
    "SENT_ATTRIBUTE",
    "AsyncNylas",
    "Nylas",
    "NylasDuplicateSend",
    "NylasReply",
    "NylasSendOutcomeUnknown",
    "NylasSendRejected",
    "SendRequest",
    "build_send_request",
    "interpret_send_response",
    "send",
    "sent_folders_in",
    "transport_failure",
]


def _client_request(
    client: httpx.Client | httpx.AsyncClient,
    grant_id: str,
    draft: Draft,
    idempotency_key: str | None,
    api_key: str | None,
    api_base: str | None,
) -> SendRequest:
    """The send request for ``client``: relative to its ``base_url`` unless ``api_base`` is given, with its
    own ``Authorization`` unless ``api_key`` is given, and the claim's idempotency key unless one is given."""
    if idempotency_key is None:
        claim = current_claim()
        if claim is None:
            raise RuntimeError(
                "nylas.send outside a guarded claim: call it inside @guard / reply_to(...), or pass "
                "idempotency_key= (for example Subject.message(grant_id, message_id).idempotency_key)"
            )
        idempotency_key = claim.idempotency_key
    if api_key is None and "authorization" not in client.headers:
        raise ValueError("the httpx client has no Authorization header: pass api_key= (the Nylas API key)")
    if api_base is None and not str(client.base_url):
        api_base = DEFAULT_API_BASE
    path = _send_path(grant_id)
    url = api_base.rstrip("/") + path if api_base else path  # a path alone is sent to the client's base_url
    return SendRequest(url, _send_headers(idempotency_key, api_key), _payload(draft))


class NylasSend:
    """``nylas.send(async_client, ...)``: await it. Inside a guarded claim that is not sending yet, awaiting
    it goes through ``claim.send`` (the fenced commit point); inside ``claim.send`` (or outside any claim)
    it is the HTTP request alone."""

    def __init__(self, client: httpx.AsyncClient, request: SendRequest) -> None:
        self.client = client
        self.request = request

    def post(self) -> Coroutine[Any, Any, str | None]:
        """The HTTP request alone, without the commit point."""
        return _post_async(self.client, self.request)

    def __await__(self) -> Generator[Any, None, str | None]:
        claim = current_claim()
        if claim is None or claim.sending:
            return (yield from self.post().__await__())
        if not isinstance(claim, AsyncClaim):
            raise TypeError("an httpx.AsyncClient send inside a blocking claim: use an httpx.Client there")
        return (yield from claim.send(self.post).__await__())

    def __repr__(self) -> str:
        return f"<nylas.send POST {self.request.url}>"


@overload
def send(
    client: httpx.AsyncClient,
    grant_id: str,
    draft: Draft,
    *,
    idempotency_key: str | None = None,
    api_key: str | None = None,
    api_base: str | None = None,
) -> NylasSend: ...
@overload
def send(
    client: httpx.Client,
    grant_id: str,
    draft: Draft,
    *,
    idempotency_key: str | None = None,
    api_key: str | None = None,
    api_base: str | None = None,
) -> str | None: ...
def send(
    client: httpx.Client | httpx.AsyncClient,
    grant_id: str,
    draft: Draft,
    *,
    idempotency_key: str | None = None,
    api_key: str | None = None,
    api_base: str | None = None,
) -> NylasSend | str | None:
    """Sends ``draft`` from ``grant_id`` with ``client``; the sent message's id, or an exception by the table
    of this module (409: unknown outcome, never "not sent"; other 4xx: rejected; 5xx, timeouts: unknown).

    ``idempotency_key``: default, the current claim's. ``api_key``: default, the client's ``Authorization``
    header. ``api_base``: default, the client's ``base_url`` (or ``https://api.us.nylas.com`` without one).
    With an ``httpx.AsyncClient`` it returns an awaitable; with an ``httpx.Client`` it sends now. Inside a
    guarded claim it passes the commit point itself (BeginSend, the request, ConfirmSent or AbortSend).
    """
    request = _client_request(client, grant_id, draft, idempotency_key, api_key, api_base)
    if isinstance(client, httpx.AsyncClient):
        return NylasSend(client, request)
    if not isinstance(client, httpx.Client):
        raise TypeError(f"client must be an httpx.Client or httpx.AsyncClient, not {type(client).__name__}")
    claim = current_claim()
    if claim is None or claim.sending:
        return _post_sync(client, request)
    if not isinstance(claim, Claim):
        raise TypeError("an httpx.Client send inside an asyncio claim: use an httpx.AsyncClient there")
    return claim.send(_post_sync, client, request)
