"""Nylas behind the provider seam: its webhooks (``x-nylas-signature``, ``?challenge=``, the v3 envelope) as
:class:`~inbox_claims.providers.MessageFacts`, and its send API, with error semantics that fit ``claim.send``.
Needs ``httpx`` for the send adapters (the ``nylas`` extra).

A Nylas notification is one message: its top-level ``id`` is the delivery's dedup key, ``data.object.id`` the
message id (conformance/notifications.json pins the envelope; conformance/providers/nylas the facts). The send
carries the claim's ``Idempotency-Key``; ``inbox_claims.nylas.send`` passes the commit point with your httpx client.

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
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Self
from urllib.parse import parse_qs, quote

import httpx

from .._current import agent_headers
from .._envelope import Notification, NotificationError, parse_notification
from .._errors import InboxClaimsError, SendRejected
from .._webhooks import (
    NYLAS_SIGNATURE_HEADER,
    WebhookVerificationError,
    nylas_challenge_response,
    sign_nylas,
    sign_standard_webhook,
    verify_nylas_signature,
    verify_standard_webhook,
)
from ._httpx import AsyncHttp, HttpTransport, current_stamp, drive
from ._seam import (
    Accepted,
    Answer,
    Automated,
    Batch,
    Cursors,
    Flow,
    HttpRequest,
    MessageFacts,
    ProviderError,
    ReplyContext,
    WebhookRequest,
    http,
    newer_than,
    reply_subject,
)

__all__ = [
    "DEFAULT_API_BASE",
    "MAX_IDEMPOTENCY_KEY_LENGTH",
    "AsyncNylas",
    "Nylas",
    "NylasDuplicateSend",
    "NylasProvider",
    "NylasReply",
    "NylasSendOutcomeUnknown",
    "NylasSendRejected",
    "SendRequest",
    "build_send_request",
    "facts_of",
    "interpret_send_response",
]

DEFAULT_API_BASE = "https://api.us.nylas.com"
# Unix seconds of the year 10000: a later "date" is not a time the coordinator can store.
_YEAR_10000 = 253402300800
_MESSAGE_EVENTS = ("message.created", "message.updated")


def facts_of(notification: Notification) -> MessageFacts | None:
    """The facts of a Nylas message notification (any action, any variant); None for a notification about no
    message (``grant.expired``...). Fields of another shape than Nylas documents are left out, never an error."""
    if not notification.is_message_event or notification.message_id is None:
        return None
    return message_facts(
        notification.object,
        event=notification.base_type,
        mailbox=notification.grant_id or "",
        dedup_key=notification.notification_id,
        message_id=notification.message_id,
        thread_id=notification.thread_id,
        source=notification,
    )


def message_facts(
    message: Mapping[str, Any],
    *,
    event: str,
    mailbox: str,
    dedup_key: str,
    message_id: str,
    thread_id: str | None,
    source: Any,
) -> MessageFacts:
    """The facts of a Nylas message object (a notification's ``data.object``, or one the API answered)."""
    senders = message.get("from")
    first = senders[0] if isinstance(senders, list) and senders and isinstance(senders[0], dict) else {}
    name, email = first.get("name"), first.get("email")
    name = name if isinstance(name, str) else ""
    email = email if isinstance(email, str) else ""
    subject = message.get("subject")
    subject = subject if isinstance(subject, str) else ""
    folders = message.get("folders")
    addresses: list[str] = [
        sender["email"]
        for sender in (senders if isinstance(senders, list) else [])
        if isinstance(sender, dict) and isinstance(sender.get("email"), str)
    ]
    answer_to = message.get("reply_to") or senders or []
    to: list[str] = [
        p["email"] for p in answer_to if isinstance(p, dict) and isinstance(p.get("email"), str) and p["email"]
    ]
    headers = message.get("headers")
    return MessageFacts(
        provider="nylas",
        event=event,
        mailbox=mailbox,
        dedup_key=dedup_key,
        message_id=message_id,
        thread_id=thread_id,
        received_at=_date_of(message),
        sender=f"{name} <{email}>" if name and email else name or email,
        subject_line=subject,
        from_addresses=tuple(addresses),
        folders=tuple(f for f in folders if isinstance(f, str)) if isinstance(folders, list) else (),
        # A webhook's message carries no headers; one read with fields=include_headers does (NylasProvider.open).
        automated=Automated.of(_header_pairs(headers), email) if isinstance(headers, list) else None,
        reply=ReplyContext(to=tuple(to), subject=reply_subject(subject)),
        source=source,
    )


def _header_pairs(headers: list[Any]) -> list[tuple[Any, Any]]:
    return [(h.get("name"), h.get("value")) for h in headers if isinstance(h, dict)]


def _date_of(message: Mapping[str, Any]) -> datetime | None:
    """The message's date (``date``, unix seconds), as Nylas gives it. Not the notification's ``time``: that is when
    Nylas noticed the message, later, and the thread rule compares messages' own dates."""
    seconds = message.get("date")
    if isinstance(seconds, int) and not isinstance(seconds, bool) and 0 <= seconds < _YEAR_10000:
        return datetime.fromtimestamp(seconds, tz=UTC)
    return None


class NylasProvider:
    """Nylas webhooks behind the seam. ``secret``: the webhook secret (``scheme="standard"``: a Standard Webhooks
    ``whsec_...`` secret, its headers checked within ``tolerance`` seconds).

    ``api_key``: with it, each message notification's message is read again with its headers
    (``GET /v3/grants/{grant_id}/messages/{id}?fields=include_headers``, one call per message) so that the
    automated-mail rules see ``Auto-Submitted``, ``Precedence``, the list headers...; without it only the sender's
    rules apply (a notification carries no headers; docs/providers.md)."""

    name = "nylas"

    def __init__(
        self,
        secret: str | bytes,
        *,
        scheme: str = "nylas",
        tolerance: float = 300.0,
        mailbox_addresses: Sequence[str] = (),
        api_key: str | None = None,
        api_base: str = DEFAULT_API_BASE,
        transport: HttpTransport | None = None,
    ) -> None:
        if scheme == "nylas":
            sign_nylas(b"", secret)  # raises on an empty or mistyped secret: at start, not on the first request
        elif scheme == "standard":
            if not isinstance(secret, str):
                raise TypeError("a Standard Webhooks secret is a str ('whsec_<base64>')")
            sign_standard_webhook(b"", msg_id="config-check", timestamp=0, secret=secret)
        else:
            raise ValueError(f"scheme must be 'nylas' or 'standard', not {scheme!r}")
        self.secret = secret
        self.scheme = scheme
        self.tolerance = tolerance
        self.mailbox_addresses = tuple(mailbox_addresses)
        self.api_key = api_key
        self.api_base = api_base.rstrip("/")
        # Made only when headers are read: a provider without an API key makes no HTTP client.
        self.transport: HttpTransport | None = transport or (AsyncHttp() if api_key else None)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any], **io: Any) -> NylasProvider:
        return cls(
            settings["webhook_secret"],
            mailbox_addresses=settings.get("mailbox_addresses") or (),
            api_key=settings.get("api_key"),
            api_base=settings.get("api_base") or DEFAULT_API_BASE,
            transport=io.get("transport"),
        )

    def verify(self, request: WebhookRequest) -> Answer | Notification:
        """The challenge's answer, a refusal (401 signature, 400 envelope), or the notification (no I/O)."""
        if request.method in ("GET", "HEAD"):
            return _challenge(request.query)
        if request.method != "POST":
            return Answer(405, "use GET ?challenge= or POST", (("allow", "GET, HEAD, POST"),))
        try:
            if self.scheme == "nylas":
                verify_nylas_signature(request.body, request.headers.get(NYLAS_SIGNATURE_HEADER), self.secret)
            else:
                assert isinstance(self.secret, str)
                verify_standard_webhook(request.body, request.headers, self.secret, tolerance=self.tolerance)
        except WebhookVerificationError as error:
            return Answer(401, f"signature refused: {error}")
        try:
            return parse_notification(request.body)
        except NotificationError as error:
            return Answer(400, f"not a notification envelope: {error}")

    def check(self, request: WebhookRequest) -> Flow[Answer | Accepted]:
        verdict = self.verify(request)
        return verdict if isinstance(verdict, Answer) else Accepted(verdict)
        yield  # a flow with no effect

    def open(self, accepted: Accepted, cursors: Cursors) -> Flow[Batch]:
        facts = facts_of(accepted.delivery)
        if facts is None:
            return Batch()
        if self.api_key and self.transport is not None and facts.automated is None and facts.mailbox:
            message = yield from self._with_headers(facts.mailbox, facts.message_id)
            if message is not None:
                headers = message.get("headers")
                if isinstance(headers, list):
                    automated = Automated.of(_header_pairs(headers), (facts.from_addresses or (None,))[0])
                    facts = dataclasses.replace(facts, automated=automated)
        return Batch(facts=(facts,))

    def _api(self, method: str, path: str, params: tuple[tuple[str, str], ...] = (), **more: Any) -> HttpRequest:
        headers = (("Authorization", f"Bearer {self.api_key}"), ("Accept", "application/json"))
        extra = tuple(more.pop("headers", ()))
        return HttpRequest(method, f"{self.api_base}/v3/grants/{path}", params, headers + extra, **more)

    def look(self, message: MessageFacts) -> Flow[tuple[MessageFacts, ...]]:
        """The thread's messages received after ``message`` (``GET /v3/grants/{grant}/messages`` with ``thread_id``
        and ``received_after``, their headers included: one call), for the guard's look right before the commit
        point. Without ``api_key``, nothing (the notifications alone tell)."""
        if not self.api_key or self.transport is None or not message.thread_id or message.received_at is None:
            return ()
        params = (
            ("thread_id", message.thread_id),
            ("received_after", str(int(message.received_at.timestamp()))),
            ("fields", "include_headers"),
        )
        response = yield from http(
            self.transport, self._api("GET", f"{quote(message.mailbox, safe='')}/messages", params)
        )
        document = response.json()
        listed = document.get("data") if isinstance(document, dict) else None
        if response.status != 200 or not isinstance(listed, list):
            raise ProviderError(f"listing thread {message.thread_id!r} answered HTTP {response.status}")
        found = (
            message_facts(
                item,
                event="message.created",
                mailbox=message.mailbox,
                dedup_key="",
                message_id=item["id"],
                thread_id=item.get("thread_id") if isinstance(item.get("thread_id"), str) else message.thread_id,
                source=item,
            )
            for item in listed
            if isinstance(item, dict) and isinstance(item.get("id"), str)
        )
        return tuple(newer_than(message, found))

    def reply(self, message: MessageFacts, body: str) -> Any:
        """``claim.send(provider.reply, message, body=...)``: the reply through Nylas's send API, with the claim's
        ``Idempotency-Key`` and an agent's ``Auto-Submitted`` (so that the guard looks at the thread first); the
        sent message's id: a ``str`` on a blocking transport, a coroutine of it on an asyncio one. Needs
        ``api_key``."""
        if not self.api_key or self.transport is None:
            raise ValueError("NylasProvider.reply needs api_key= (the Nylas API key)")
        draft = NylasReply(message.message_id, list(message.reply.to), message.reply.subject, body)
        return drive(self._reply(message.mailbox, draft, current_stamp().key), self.transport)

    def _reply(self, grant_id: str, draft: NylasReply, idempotency_key: str) -> Flow[str | None]:
        headers = (("Idempotency-Key", idempotency_key), ("Content-Type", "application/json"))
        path = f"{quote(grant_id, safe='')}/messages/send"
        request = self._api("POST", path, headers=headers, content=_payload(draft))
        assert self.transport is not None
        try:
            response = yield from http(self.transport, request)
        except ProviderError as error:
            raise NylasSendOutcomeUnknown(f"the send may have gone out: {error}") from error
        return interpret_send_response(response.status, response.content)

    def _with_headers(self, grant_id: str, message_id: str) -> Flow[dict[str, Any] | None]:
        """The message read with its headers; None when it is gone (404: deleted since). Any other failure is the
        delivery's (503, delivered again): answering automated mail is what this read prevents."""
        assert self.transport is not None
        path = f"{quote(grant_id, safe='')}/messages/{quote(message_id, safe='')}"
        request = self._api("GET", path, (("fields", "include_headers"),))
        response = yield from http(self.transport, request)
        if response.status == 404:
            return None
        document = response.json()
        data = document.get("data") if isinstance(document, dict) else None
        if response.status != 200 or not isinstance(data, dict):
            raise ProviderError(f"reading message {message_id!r} with its headers answered HTTP {response.status}")
        return data

    def acknowledge(self) -> Answer:
        return Answer(200, "ok")


def _challenge(query: str) -> Answer:
    parsed = parse_qs(query, keep_blank_values=True)
    single: dict[str, Any] = {name: values[0] if len(values) == 1 else values for name, values in parsed.items()}
    try:
        value = nylas_challenge_response(single)
    except WebhookVerificationError as error:
        return Answer(400, str(error))
    if value is None:
        return Answer(400, "expected GET ?challenge=<value> (endpoint verification) or a signed POST")
    return Answer(200, value)


MAX_IDEMPOTENCY_KEY_LENGTH = 256
DEFAULT_TIMEOUT = 60.0

Recipient = str | Mapping[str, str]


class NylasSendOutcomeUnknown(InboxClaimsError):
    """The send may or may not have gone out (5xx, timeout, connection error, unreadable answer).

    Raised from a send function, ``claim.send`` leaves the subject SENDING (reported IN_DOUBT) and raises
    :class:`~inbox_claims.SendOutcomeUnknown` from this. ``status_code`` is ``None`` when no answer came.
    """

    def __init__(self, message: str, *, status_code: int | None = None, request_id: str = "") -> None:
        super().__init__(message)
        self.status_code = status_code
        self.request_id = request_id


class NylasDuplicateSend(NylasSendOutcomeUnknown):
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
    return SendRequest(
        api_base.rstrip("/") + _send_path(grant_id), _send_headers(idempotency_key, api_key), _payload(reply)
    )


def _send_path(grant_id: str) -> str:
    if not grant_id:
        raise ValueError("grant_id is empty: pass the notification's grant_id")
    return f"/v3/grants/{quote(grant_id, safe='')}/messages/send"


def _send_headers(idempotency_key: str, api_key: str | None) -> dict[str, str]:
    """The send's headers; ``Authorization`` only with an ``api_key`` (else the HTTP client's own is used)."""
    if not idempotency_key or len(idempotency_key) > MAX_IDEMPOTENCY_KEY_LENGTH or not idempotency_key.isascii():
        raise ValueError(
            f"idempotency_key must be 1 to {MAX_IDEMPOTENCY_KEY_LENGTH} ASCII characters (pass claim.idempotency_key)"
        )
    headers = {"Idempotency-Key": idempotency_key, "Content-Type": "application/json", "Accept": "application/json"}
    if api_key is not None:
        if not api_key:
            raise ValueError("the Nylas API key is empty")
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


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
    raise NylasSendOutcomeUnknown(
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


def transport_failure(error: httpx.HTTPError) -> NylasSendOutcomeUnknown:
    """What a request that got no answer (timeout, connection error) means: the outcome is unknown."""
    kind = "timed out" if isinstance(error, httpx.TimeoutException) else f"failed ({type(error).__name__})"
    return NylasSendOutcomeUnknown(f"the Nylas send request {kind}; the message may have been sent: {error}")


SENT_ATTRIBUTE = "\\Sent"
"""The attribute Nylas gives a sent folder, on every provider."""


def sent_folders_in(document: Mapping[str, Any]) -> tuple[list[str], str]:
    """From one page of ``GET /v3/grants/{grant_id}/folders``: the ids of the folders whose ``attributes`` hold
    ``\\Sent``, and the cursor of the next page (empty on the last)."""
    data = document.get("data")
    folders = data if isinstance(data, list) else []
    ids = [
        folder["id"]
        for folder in folders
        if isinstance(folder, Mapping)
        and isinstance(folder.get("id"), str)
        and isinstance(folder.get("attributes"), list)
        and SENT_ATTRIBUTE in folder["attributes"]
    ]
    cursor = document.get("next_cursor")
    return ids, cursor if isinstance(cursor, str) else ""


def _folders_path(grant_id: str) -> str:
    if not grant_id:
        raise ValueError("grant_id is empty")
    return f"/v3/grants/{quote(grant_id, safe='')}/folders"


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

    def _folders_request(self, grant_id: str, cursor: str) -> tuple[str, dict[str, str], dict[str, str]]:
        params = {"page_token": cursor} if cursor else {}
        headers = {"Authorization": f"Bearer {self.api_key}", "Accept": "application/json"}
        return self.api_base.rstrip("/") + _folders_path(grant_id), headers, params

    def __repr__(self) -> str:
        return f"{type(self).__name__}(api_base={self.api_base!r})"


class Nylas(_NylasBase):
    """The blocking Nylas send adapter (one ``httpx.Client``; thread-safe). Close it, or use ``with``."""

    def __init__(self, api_key: str, *, api_base: str = DEFAULT_API_BASE, timeout: float = DEFAULT_TIMEOUT) -> None:
        super().__init__(api_key, api_base=api_base, timeout=timeout)
        self._http = httpx.Client(timeout=timeout)

    def send(self, grant_id: str, reply: NylasReply, *, idempotency_key: str) -> str | None:
        """Sends ``reply`` from ``grant_id``; returns the sent message id. Raises as the module's table says."""
        return _post_sync(self._http, self._request(grant_id, reply, idempotency_key))

    def sent_folder_ids(self, grant_id: str) -> list[str]:
        """The ids of the grant's sent folders (``attributes`` holding ``\\Sent``), every page; for the guard's
        ``sent_folders``. Raises ``httpx.HTTPStatusError`` when Nylas refuses."""
        ids: list[str] = []
        cursor = ""
        while True:
            url, headers, params = self._folders_request(grant_id, cursor)
            response = self._http.get(url, headers=headers, params=params)
            response.raise_for_status()
            found, cursor = sent_folders_in(_json(response.content))
            ids += found
            if not cursor:
                return ids

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
        return await _post_async(self._http, self._request(grant_id, reply, idempotency_key))

    async def sent_folder_ids(self, grant_id: str) -> list[str]:
        """See :meth:`Nylas.sent_folder_ids`."""
        ids: list[str] = []
        cursor = ""
        while True:
            url, headers, params = self._folders_request(grant_id, cursor)
            response = await self._http.get(url, headers=headers, params=params)
            response.raise_for_status()
            found, cursor = sent_folders_in(_json(response.content))
            ids += found
            if not cursor:
                return ids

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


# ------------------------------------------------------------------------------------- send(http, ...)

Draft = NylasReply | Mapping[str, Any]
"""What to send: a :class:`NylasReply`, or the JSON body of Nylas's send request as a dict."""


def _payload(draft: Draft) -> bytes:
    if isinstance(draft, NylasReply):
        document = draft.payload()
    elif isinstance(draft, Mapping):
        document = dict(draft)
    else:
        raise TypeError(
            f"draft must be a NylasReply or the send request's JSON body (a dict), not {type(draft).__name__}"
        )
    return json.dumps(marked(document)).encode("utf-8")


def marked(document: dict[str, Any]) -> dict[str, Any]:
    """The send body with an agent's ``Auto-Submitted: auto-replied`` among its ``custom_headers`` (Nylas's field
    for the message's own headers), unless the draft set ``Auto-Submitted`` itself or a person sends it. Nylas
    threads the reply from ``reply_to_message_id`` (``In-Reply-To`` and ``References``), which stays as given."""
    extra = agent_headers()
    given = document.get("custom_headers")
    headers = list(given) if isinstance(given, list) else []
    names = {str(h.get("name", "")).lower() for h in headers if isinstance(h, Mapping)}
    added = [{"name": name, "value": value} for name, value in extra if name.lower() not in names]
    return {**document, "custom_headers": headers + added} if added else document


def _post_sync(client: httpx.Client, request: SendRequest) -> str | None:
    try:
        response = client.post(request.url, headers=dict(request.headers), content=request.content)
    except httpx.HTTPError as error:
        raise transport_failure(error) from error
    return interpret_send_response(response.status_code, response.content)


async def _post_async(client: httpx.AsyncClient, request: SendRequest) -> str | None:
    try:
        response = await client.post(request.url, headers=dict(request.headers), content=request.content)
    except httpx.HTTPError as error:
        raise transport_failure(error) from error
    return interpret_send_response(response.status_code, response.content)
