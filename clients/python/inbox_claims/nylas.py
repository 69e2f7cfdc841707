"""Replies through the Nylas v3 send API, with error semantics that fit ``claim.send``. Needs ``httpx``
(the ``nylas`` extra).

::

    from inbox_claims.nylas import AsyncNylas, NylasReply

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
5xx, a timeout, a connection error, an     raises :class:`NylasSendUnknown`: it may have gone out: SENDING, then
unreadable answer                          IN_DOUBT for a human to resolve
=========================================  ====================================================================

``send`` never retries by itself: a second attempt is a decision for whoever resolves the subject.
:class:`Nylas` is the blocking twin of :class:`AsyncNylas`; both build the request and read the answer in the
same code (:func:`build_send_request`, :func:`interpret_send_response`) and only do the I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self
from urllib.parse import quote

import httpx

from . import InboxClaimsError, Notification, SendRejected

__all__ = [
    "DEFAULT_API_BASE",
    "MAX_IDEMPOTENCY_KEY_LENGTH",
    "AsyncNylas",
    "Nylas",
    "NylasDuplicateSend",
    "NylasReply",
    "NylasSendRejected",
    "NylasSendUnknown",
    "SendRequest",
    "build_send_request",
    "interpret_send_response",
]

DEFAULT_API_BASE = "https://api.us.nylas.com"
MAX_IDEMPOTENCY_KEY_LENGTH = 256
DEFAULT_TIMEOUT = 60.0

Recipient = str | Mapping[str, str]


class NylasSendUnknown(InboxClaimsError):
    """The send may or may not have gone out (5xx, timeout, connection error, unreadable answer).

    Raised from a send function, ``claim.send`` leaves the subject SENDING (reported IN_DOUBT) and raises
    :class:`~inbox_claims.SendOutcomeUnknown` from this. ``status_code`` is ``None`` when no answer came.
    """

    def __init__(self, message: str, *, status_code: int | None = None, request_id: str = "") -> None:
        super().__init__(message)
        self.status_code = status_code
        self.request_id = request_id


class NylasDuplicateSend(NylasSendUnknown):
    """409: Nylas already took a request with this idempotency key (and another payload), in the last hour.

    A reply for this subject went out or is in flight: never treat it as "not sent".
    """


class NylasSendRejected(SendRejected):
    """A 4xx other than 409: Nylas refused the request, nothing was sent (``claim.send`` aborts: FREE)."""

    def __init__(self, reason: str, *, status_code: int, request_id: str = "", error_type: str = "") -> None:
        super().__init__(reason)
        self.status_code = status_code
        self.request_id = request_id
        self.error_type = error_type


@dataclass(frozen=True, slots=True)
class NylasReply:
    """What to send: ``to`` holds addresses (``"a@b.c"``) or Nylas participants (``{"email": ..., "name": ...}``);
    ``fields`` are more fields of the Nylas send body (``reply_to``, ``tracking_options``...), sent as given."""

    reply_to_message_id: str
    to: Sequence[Recipient]
    subject: str
    body: str
    cc: Sequence[Recipient] = ()
    bcc: Sequence[Recipient] = ()
    fields: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def answering(cls, notification: Notification, *, body: str, subject: str | None = None) -> NylasReply:
        """A reply to the message a notification is about: to its sender (its ``reply_to`` when set), with
        ``"Re: "`` and its subject unless ``subject`` is given."""
        message = notification.object
        if notification.message_id is None:
            raise ValueError(f"a {notification.type} notification is not about a message")
        senders = message.get("reply_to") or message.get("from") or []
        to = [dict(p) for p in senders if isinstance(p, Mapping) and p.get("email")]
        if not to:
            raise ValueError(f"message {notification.message_id!r} has no sender address to reply to")
        if subject is None:
            original = str(message.get("subject") or "")
            subject = original if original.lower().startswith("re:") else f"Re: {original}".rstrip()
        return cls(reply_to_message_id=notification.message_id, to=to, subject=subject, body=body)

    def payload(self) -> dict[str, Any]:
        """The JSON body of the send request."""
        document: dict[str, Any] = dict(self.fields)
        document.update(
            reply_to_message_id=self.reply_to_message_id,
            to=_participants(self.to, "to"),
            subject=self.subject,
            body=self.body,
        )
        for name, recipients in (("cc", self.cc), ("bcc", self.bcc)):
            if recipients:
                document[name] = _participants(recipients, name)
        return document


def _participants(recipients: Sequence[Recipient], name: str) -> list[dict[str, str]]:
    if isinstance(recipients, str | Mapping):
        raise TypeError(f"{name} must be a sequence of recipients, not one {type(recipients).__name__}")
    participants = [{"email": r} if isinstance(r, str) else dict(r) for r in recipients]
    if name == "to" and not participants:
        raise ValueError("a reply needs at least one recipient in to")
    for participant in participants:
        if not participant.get("email"):
            raise ValueError(f"every recipient in {name} needs an email address, not {participant!r}")
    return participants


@dataclass(frozen=True, slots=True)
class SendRequest:
    """One send request, ready for any HTTP client."""

    url: str
    headers: Mapping[str, str]
    content: bytes


def build_send_request(
    api_base: str, api_key: str, grant_id: str, reply: NylasReply, *, idempotency_key: str
) -> SendRequest:
    """The ``POST .../v3/grants/{grant_id}/messages/send`` request for ``reply``."""
    if not api_key:
        raise ValueError("the Nylas API key is empty")
    if not grant_id:
        raise ValueError("grant_id is empty: pass the notification's grant_id")
    if not idempotency_key or len(idempotency_key) > MAX_IDEMPOTENCY_KEY_LENGTH or not idempotency_key.isascii():
        raise ValueError(
            f"idempotency_key must be 1 to {MAX_IDEMPOTENCY_KEY_LENGTH} ASCII characters (pass claim.idempotency_key)"
        )
    url = f"{api_base.rstrip('/')}/v3/grants/{quote(grant_id, safe='')}/messages/send"
    headers = {
        "Authorization": f"Bearer {api_key}",
        "Idempotency-Key": idempotency_key,
        "Content-Type": "application/json",
        "Accept": "application/json",
    }
    return SendRequest(url, headers, json.dumps(reply.payload()).encode("utf-8"))


def interpret_send_response(status_code: int, content: bytes) -> str | None:
    """The sent message's id from a 2xx answer, or the exception for any other (see the module's table).

    A 2xx answer without a readable ``data.id`` still means the message went out: ``None`` (recorded as
    REPLIED without an id).
    """
    document = _json(content)
    data = document.get("data")
    request_id = str(document.get("request_id") or "")
    error = document.get("error")
    if not isinstance(error, Mapping):
        error = {}
    detail = str(error.get("message") or content[:200].decode("utf-8", "replace")).strip()
    if 200 <= status_code < 300:
        sent_id = data.get("id") if isinstance(data, Mapping) else None
        return sent_id if isinstance(sent_id, str) and sent_id else None
    if status_code == 409:
        raise NylasDuplicateSend(
            f"Nylas answered 409: a send with this idempotency key went out or is in flight ({detail})",
            status_code=409,
            request_id=request_id,
        )
    if 400 <= status_code < 500:
        raise NylasSendRejected(
            f"Nylas refused the send (HTTP {status_code}): {detail}",
            status_code=status_code,
            request_id=request_id,
            error_type=str(error.get("type") or ""),
        )
    raise NylasSendUnknown(
        f"Nylas answered HTTP {status_code}; the message may have been sent: {detail}",
        status_code=status_code,
        request_id=request_id,
    )


def _json(content: bytes) -> Mapping[str, Any]:
    try:
        document = json.loads(content) if content else {}
    except ValueError:
        return {}
    return document if isinstance(document, Mapping) else {}


def transport_failure(error: httpx.HTTPError) -> NylasSendUnknown:
    """What a request that got no answer (timeout, connection error) means: the outcome is unknown."""
    kind = "timed out" if isinstance(error, httpx.TimeoutException) else f"failed ({type(error).__name__})"
    return NylasSendUnknown(f"the Nylas send request {kind}; the message may have been sent: {error}")


class _NylasBase:
    def __init__(self, api_key: str, *, api_base: str = DEFAULT_API_BASE, timeout: float = DEFAULT_TIMEOUT) -> None:
        """``api_key``: the Nylas application's API key. ``api_base``: ``https://api.us.nylas.com`` (default) or
        ``https://api.eu.nylas.com``. ``timeout``: seconds for the whole send; past it the outcome is unknown."""
        if not api_key:
            raise ValueError("the Nylas API key is empty")
        if not api_base.startswith(("https://", "http://")):
            raise ValueError(f"api_base must be an http(s) URL such as {DEFAULT_API_BASE!r}, not {api_base!r}")
        self.api_key = api_key
        self.api_base = api_base
        self.timeout = timeout

    def _request(self, grant_id: str, reply: NylasReply, idempotency_key: str) -> SendRequest:
        return build_send_request(self.api_base, self.api_key, grant_id, reply, idempotency_key=idempotency_key)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(api_base={self.api_base!r})"


class Nylas(_NylasBase):
    """The blocking Nylas send adapter (one ``httpx.Client``; thread-safe). Close it, or use ``with``."""

    def __init__(self, api_key: str, *, api_base: str = DEFAULT_API_BASE, timeout: float = DEFAULT_TIMEOUT) -> None:
        super().__init__(api_key, api_base=api_base, timeout=timeout)
        self._http = httpx.Client(timeout=timeout)

    def send(self, grant_id: str, reply: NylasReply, *, idempotency_key: str) -> str | None:
        """Sends ``reply`` from ``grant_id``; returns the sent message id. Raises as the module's table says."""
        request = self._request(grant_id, reply, idempotency_key)
        try:
            response = self._http.post(request.url, headers=dict(request.headers), content=request.content)
        except httpx.HTTPError as error:
            raise transport_failure(error) from error
        return interpret_send_response(response.status_code, response.content)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncNylas(_NylasBase):
    """The asyncio Nylas send adapter (one ``httpx.AsyncClient``). ``await close()`` it, or ``async with``."""

    def __init__(self, api_key: str, *, api_base: str = DEFAULT_API_BASE, timeout: float = DEFAULT_TIMEOUT) -> None:
        super().__init__(api_key, api_base=api_base, timeout=timeout)
        self._http = httpx.AsyncClient(timeout=timeout)

    async def send(self, grant_id: str, reply: NylasReply, *, idempotency_key: str) -> str | None:
        """Sends ``reply`` from ``grant_id``; returns the sent message id. Raises as the module's table says."""
        request = self._request(grant_id, reply, idempotency_key)
        try:
            response = await self._http.post(request.url, headers=dict(request.headers), content=request.content)
        except httpx.HTTPError as error:
            raise transport_failure(error) from error
        return interpret_send_response(response.status_code, response.content)

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
