"""Resend behind the provider seam: its Svix-signed ``email.received`` (inbound) and ``email.sent`` events in,
``POST /emails`` with an ``Idempotency-Key`` out (docs/providers.md, "Resend"; the vectors:
conformance/providers/resend). Needs ``httpx`` (the ``resend`` extra).

* Authenticity: the Svix signature (``svix-id``, ``svix-timestamp``, ``svix-signature``) on the raw body.
* The dedup key is the ``svix-id``: Resend's events carry no id of their own, and Resend names an event by its Svix
  message id (``msg_...``, the id its replay takes), the same on every retry to the endpoint.
* ``email.received`` carries metadata only: the email (its headers) is read from the received-emails API
  (``GET /emails/receiving/{email_id}``). Resend has no threads: the thread is the first id of ``References`` (else
  ``In-Reply-To``, else the email's own ``Message-ID``), hashed into a tag-safe id (``rt-<hex>``).
* ``email.sent`` is outgoing (``SENT``). It carries no headers, so a reply sent here carries its thread and its claim
  stamp as Resend tags too (``inbox_thread``, ``inbox_claim`` = ``<key>_<token>``), which the event gives back.
* Send: ``POST /emails`` with the claim's ``Idempotency-Key`` (Resend answers a retry with the key, within 24 hours,
  with the first send's id), ``In-Reply-To``/``References``, the stamp ``X-Inbox-Claim`` and
  ``Auto-Submitted: auto-replied`` (RFC 3834).
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any
from urllib.parse import quote

from .._current import agent_headers
from ._httpx import AsyncHttp, HttpTransport, current_stamp, drive
from ._seam import (
    STAMP_HEADER,
    Accepted,
    Answer,
    Batch,
    ClaimStamp,
    Cursors,
    Flow,
    HttpRequest,
    MessageFacts,
    ProviderError,
    ReplyContext,
    WebhookRequest,
    header,
    http,
    message_ids,
    parse_stamp,
    reply_subject,
    split_address,
)
from ._svix import SvixSendOutcomeUnknown, SvixSendRejected, check_secret, send_outcome, verify_svix

__all__ = ["DEFAULT_API_BASE", "ResendProvider", "ResendSendOutcomeUnknown", "ResendSendRejected", "thread_of"]

DEFAULT_API_BASE = "https://api.resend.com"
CLAIM_TAG = "inbox_claim"
THREAD_TAG = "inbox_thread"
_TAG_STAMP = re.compile(r"(ic1-[0-9a-f]{64})_([1-9][0-9]{0,18})")


class ResendSendRejected(SvixSendRejected):
    """Resend refused the email (400, 403, 422, 429...): nothing went out (``claim.send`` aborts: FREE)."""


class ResendSendOutcomeUnknown(SvixSendOutcomeUnknown):
    """The email may have gone out (5xx, timeout, 409): SENDING, then IN_DOUBT, until its email.sent settles it."""


def thread_of(root: str) -> str:
    """The thread id of the conversation whose first message has the ``Message-ID`` ``root``: tag-safe (Resend
    tags take ASCII letters, digits, ``_`` and ``-``)."""
    return "rt-" + hashlib.sha256(root.strip().encode()).hexdigest()[:40]


def _time(text: Any) -> datetime | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def _tags(data: Mapping[str, Any]) -> dict[str, str]:
    """An event's tags, given as an object or as ``[{name, value}]``."""
    tags = data.get("tags")
    if isinstance(tags, dict):
        return {k: v for k, v in tags.items() if isinstance(k, str) and isinstance(v, str)}
    if isinstance(tags, list):
        return {
            t["name"]: t["value"]
            for t in tags
            if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("value"), str)
        }
    return {}


def _addresses(value: Any) -> list[str]:
    items = value if isinstance(value, list) else [value] if isinstance(value, str) else []
    return [split_address(item)[1] for item in items if isinstance(item, str) and item]


class ResendProvider:
    """Resend inbound for one receiving address (``mailbox``), answered from ``sender``."""

    name = "resend"

    def __init__(
        self,
        secret: str,
        mailbox: str,
        *,
        api_key: str | Callable[[], str],
        sender: str = "",
        api_base: str = DEFAULT_API_BASE,
        tolerance: float = 300.0,
        mailbox_addresses: Sequence[str] = (),
        transport: HttpTransport | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        check_secret(secret, "Resend")
        if not mailbox:
            raise ValueError("mailbox is empty: the receiving address whose mail this endpoint answers")
        if not api_key:
            raise ValueError("api_key is empty: the Resend API key that reads received emails and sends replies")
        self.secret = secret
        self.mailbox = mailbox
        self.api_key = api_key
        self.sender = sender or mailbox
        self.api_base = api_base.rstrip("/")
        self.tolerance = tolerance
        self.mailbox_addresses = tuple(mailbox_addresses) or (split_address(self.sender)[1],)
        self.transport = transport or AsyncHttp()
        self.clock = clock

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> ResendProvider:
        """From ``RESEND_WEBHOOK_SECRET``, ``RESEND_MAILBOX``, ``RESEND_API_KEY``, ``RESEND_FROM`` (default: the
        mailbox), ``RESEND_API_BASE`` (default ``https://api.resend.com``) and ``INBOX_MAILBOX_ADDRESSES``."""
        env = os.environ if environ is None else environ
        for name in ("RESEND_WEBHOOK_SECRET", "RESEND_MAILBOX", "RESEND_API_KEY"):
            if not env.get(name):
                raise ValueError(f"set {name} (docs/providers.md, Resend)")
        arguments: dict[str, Any] = {
            "api_key": env["RESEND_API_KEY"],
            "sender": env.get("RESEND_FROM", ""),
            "api_base": env.get("RESEND_API_BASE") or DEFAULT_API_BASE,
            "mailbox_addresses": [a.strip() for a in env.get("INBOX_MAILBOX_ADDRESSES", "").split(",") if a.strip()],
        }
        arguments.update(overrides)
        return cls(env["RESEND_WEBHOOK_SECRET"], env["RESEND_MAILBOX"], **arguments)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any], **overrides: Any) -> ResendProvider:
        """From a vector file's settings (conformance/providers/resend)."""
        return cls(
            settings["webhook_secret"],
            settings["mailbox"],
            api_key=settings["api_key"],
            sender=settings.get("sender", ""),
            api_base=settings["api_base"],
            mailbox_addresses=settings.get("mailbox_addresses") or (),
            **overrides,
        )

    def _request(self, method: str, url: str, body: Any = None, *extra: tuple[str, str]) -> HttpRequest:
        key = self.api_key() if callable(self.api_key) else self.api_key
        return HttpRequest(method, url, (), (("Authorization", f"Bearer {key}"), *extra), body)

    # -- check ---------------------------------------------------------------------------------------------------

    def check(self, request: WebhookRequest) -> Flow[Answer | Accepted]:
        return self.verify(request)
        yield  # no effect

    def verify(self, request: WebhookRequest) -> Answer | Accepted:
        document = verify_svix(request, self.secret, self.tolerance, self.clock, "Resend")
        if isinstance(document, Answer):
            return document
        if not isinstance(document.get("type"), str) or not isinstance(document.get("data"), dict):
            return Answer(400, "the event has no type and data: not a Resend event")
        svix_id = {k.lower(): v for k, v in request.headers.items()}["svix-id"].strip()
        return Accepted((svix_id, document))

    def acknowledge(self) -> Answer:
        return Answer(200, "ok")

    # -- open ------------------------------------------------------------------------------------------------------

    def open(self, accepted: Accepted, cursors: Cursors) -> Flow[Batch]:
        svix_id, event = accepted.delivery
        data: dict[str, Any] = event["data"]
        email_id = data.get("email_id")
        if not isinstance(email_id, str) or not email_id:
            return Batch()
        if event["type"] == "email.received":
            email = yield from self._read(email_id)
            return Batch(() if email is None else (self.received(email, svix_id),))
        if event["type"] == "email.sent":
            return Batch((self.sent(data, svix_id),))
        return Batch()  # delivered, bounced, opened...: nothing to answer or report

    def _read(self, email_id: str) -> Flow[dict[str, Any] | None]:
        url = f"{self.api_base}/emails/receiving/{quote(email_id, safe='')}"
        response = yield from http(self.transport, self._request("GET", url))
        if response.status == 404:
            return None  # gone before it was read: nothing to answer
        document = response.json()
        if response.status != 200 or not isinstance(document, dict):
            raise ProviderError(f"reading received email {email_id!r} answered HTTP {response.status}")
        return document

    def received(self, email: Mapping[str, Any], dedup_key: str) -> MessageFacts:
        """The facts of a received email (as the received-emails API gives it)."""
        raw = email.get("headers")
        headers = [(k, v) for k, v in raw.items()] if isinstance(raw, dict) else []
        own = str(email.get("message_id") or header(headers, "Message-ID") or "")
        references = message_ids(header(headers, "References"))
        root = (references or message_ids(header(headers, "In-Reply-To")) or (own,))[0]
        name, address = split_address(str(email.get("from") or ""))
        subject = str(email.get("subject") or "")
        reply_to = _addresses(email.get("reply_to"))
        return MessageFacts(
            provider=self.name,
            event="message.created",
            mailbox=self.mailbox,
            dedup_key=dedup_key,
            message_id=str(email["id"]),
            thread_id=thread_of(root) if root else None,
            received_at=_time(email.get("created_at")),
            sender=f"{name} <{address}>" if name and address else name or address,
            subject_line=subject,
            from_addresses=(address,) if address else (),
            folders=(),
            stamp=parse_stamp(header(headers, STAMP_HEADER)),
            reply=ReplyContext(
                to=tuple(reply_to) or ((address,) if address else ()),
                subject=reply_subject(subject),
                internet_message_id=own or None,
                references=references,
            ),
            source=dict(email),
        )

    def sent(self, data: Mapping[str, Any], dedup_key: str) -> MessageFacts:
        """The facts of an ``email.sent`` event: outgoing; its thread and stamp from our tags when it has them."""
        tags = _tags(data)
        stamp_tag = _TAG_STAMP.fullmatch(tags.get(CLAIM_TAG, ""))
        name, address = split_address(str(data.get("from") or ""))
        subject = str(data.get("subject") or "")
        return MessageFacts(
            provider=self.name,
            event="message.created",
            mailbox=self.mailbox,
            dedup_key=dedup_key,
            message_id=str(data["email_id"]),
            thread_id=tags.get(THREAD_TAG) or None,
            received_at=_time(data.get("created_at")),
            sender=f"{name} <{address}>" if name and address else name or address,
            subject_line=subject,
            from_addresses=(address,) if address else (),
            folders=("SENT",),
            stamp=ClaimStamp(stamp_tag.group(1), int(stamp_tag.group(2))) if stamp_tag else None,
            reply=ReplyContext(to=tuple(_addresses(data.get("to"))), subject=reply_subject(subject)),
            source=dict(data),
        )

    # -- send ------------------------------------------------------------------------------------------------

    def reply(self, message: MessageFacts, body: str, *, html: str | None = None) -> Any:
        """``claim.send(provider.reply, message, body=...)``: the reply from ``sender`` with the claim's idempotency
        key and stamp; the sent email's id: a ``str`` on a blocking transport (``Claim.send``), a coroutine of it on
        an asyncio one (``AsyncClaim.send``)."""
        return drive(self._reply(message, body, current_stamp(), html=html), self.transport)

    def payload(self, message: MessageFacts, body: str, stamp: ClaimStamp, html: str | None = None) -> dict[str, Any]:
        """The ``POST /emails`` body of a reply to ``message``."""
        if not message.reply.to:
            raise ValueError(f"email {message.message_id!r} has no sender address to reply to")
        headers = {STAMP_HEADER: str(stamp), **dict(agent_headers())}  # a person's reply is never marked
        if message.reply.internet_message_id:
            headers["In-Reply-To"] = message.reply.internet_message_id
            headers["References"] = " ".join((*message.reply.references, message.reply.internet_message_id))
        tags = [{"name": CLAIM_TAG, "value": f"{stamp.key}_{stamp.token}"}]
        if message.thread_id:
            tags.append({"name": THREAD_TAG, "value": message.thread_id})
        document: dict[str, Any] = {
            "from": self.sender,
            "to": list(message.reply.to),
            "subject": message.reply.subject,
            "text": body,
            "headers": headers,
            "tags": tags,
        }
        if html is not None:
            document["html"] = html
        return document

    def _reply(
        self, message: MessageFacts, body: str, stamp: ClaimStamp, *, html: str | None = None
    ) -> Flow[str | None]:
        document = self.payload(message, body, stamp, html)
        request = self._request("POST", f"{self.api_base}/emails", document, ("Idempotency-Key", stamp.key))
        try:
            response = yield from http(self.transport, request)
        except ProviderError as error:
            raise ResendSendOutcomeUnknown(f"the email may have gone out: {error}") from error
        try:
            return send_outcome("Resend", response, _sent_id)
        except SvixSendRejected as error:
            raise ResendSendRejected(str(error), status_code=error.status_code) from None
        except SvixSendOutcomeUnknown as error:
            raise ResendSendOutcomeUnknown(str(error), status_code=error.status_code) from None


def _sent_id(document: Any) -> str | None:
    value = document.get("id") if isinstance(document, dict) else None
    return value if isinstance(value, str) and value else None
