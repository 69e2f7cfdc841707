"""AgentMail behind the provider seam: its Svix-signed events in, ``reply`` with an ``Idempotency-Key`` out
(docs/providers.md, "AgentMail"; the vectors: conformance/providers/agentmail). Needs ``httpx`` (the ``agentmail``
extra).

* Authenticity: the Svix signature (``svix-id``, ``svix-timestamp``, ``svix-signature``) on the raw body.
* The dedup key is the event's ``event_id``: AgentMail documents it as the same on every retry and on every webhook
  that receives the event, where ``svix-id`` differs between an organisation's, a pod's and an inbox's webhook.
* ``message.received`` carries the whole message (labels, headers): no request is made. ``message.sent`` carries
  only ids: the message is read, for its labels and the claim stamp in its headers. A message labelled ``sent``
  is in the mailbox's sent mail (``SENT``), so the outgoing rules report it; its stamp settles an IN_DOUBT send.
* Send: ``POST /v0/inboxes/{inbox}/messages/{message}/reply`` with the claim's ``Idempotency-Key`` (a retry with
  the key answers the first send; AgentMail keeps keys 24 hours), the stamp ``X-Inbox-Claim`` and
  ``Auto-Submitted: auto-replied`` (RFC 3834) as headers.
"""

from __future__ import annotations

import os
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

__all__ = ["DEFAULT_API_BASE", "AgentMailProvider", "AgentMailSendOutcomeUnknown", "AgentMailSendRejected"]

DEFAULT_API_BASE = "https://api.agentmail.to"
SENT_LABEL = "sent"
_RECEIVED = "message.received"


class AgentMailSendRejected(SvixSendRejected):
    """AgentMail refused the reply (400, 403, 404...): nothing went out (``claim.send`` aborts: FREE)."""


class AgentMailSendOutcomeUnknown(SvixSendOutcomeUnknown):
    """The reply may have gone out (5xx, timeout, 409): SENDING, then IN_DOUBT, until its copy settles it."""


def _time(text: Any) -> datetime | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


class AgentMailProvider:
    """AgentMail events for a webhook (``secret``: its ``whsec_...`` secret) and replies through its API."""

    name = "agentmail"

    def __init__(
        self,
        secret: str,
        *,
        api_key: str | Callable[[], str],
        api_base: str = DEFAULT_API_BASE,
        inbox_ids: Sequence[str] = (),
        tolerance: float = 300.0,
        mailbox_addresses: Sequence[str] = (),
        transport: HttpTransport | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        check_secret(secret, "AgentMail")
        if not api_key:
            raise ValueError("api_key is empty: the AgentMail API key that reads messages and sends replies")
        self.secret = secret
        self.api_key = api_key
        self.api_base = api_base.rstrip("/")
        self.inbox_ids = frozenset(inbox_ids)
        """The inboxes this endpoint answers for (empty: every inbox its webhook hears of)."""
        self.tolerance = tolerance
        self.mailbox_addresses = tuple(mailbox_addresses)
        self.transport = transport or AsyncHttp()
        self.clock = clock

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> AgentMailProvider:
        """From ``AGENTMAIL_WEBHOOK_SECRET``, ``AGENTMAIL_API_KEY``, ``AGENTMAIL_API_BASE`` (default
        ``https://api.agentmail.to``), ``AGENTMAIL_INBOX_IDS`` (comma-separated) and ``INBOX_MAILBOX_ADDRESSES``."""
        env = os.environ if environ is None else environ
        for name in ("AGENTMAIL_WEBHOOK_SECRET", "AGENTMAIL_API_KEY"):
            if not env.get(name):
                raise ValueError(f"set {name} (docs/providers.md, AgentMail)")
        arguments: dict[str, Any] = {
            "api_key": env["AGENTMAIL_API_KEY"],
            "api_base": env.get("AGENTMAIL_API_BASE") or DEFAULT_API_BASE,
            "inbox_ids": _listed(env.get("AGENTMAIL_INBOX_IDS", "")),
            "mailbox_addresses": _listed(env.get("INBOX_MAILBOX_ADDRESSES", "")),
        }
        arguments.update(overrides)
        return cls(env["AGENTMAIL_WEBHOOK_SECRET"], **arguments)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any], **overrides: Any) -> AgentMailProvider:
        """From a vector file's settings (conformance/providers/agentmail)."""
        return cls(
            settings["webhook_secret"],
            api_key=settings["api_key"],
            api_base=settings["api_base"],
            inbox_ids=settings.get("inbox_ids") or (),
            mailbox_addresses=settings.get("mailbox_addresses") or (),
            **overrides,
        )

    def _request(self, method: str, url: str, body: Any = None, *extra: tuple[str, str]) -> HttpRequest:
        key = self.api_key() if callable(self.api_key) else self.api_key
        return HttpRequest(method, url, (), (("Authorization", f"Bearer {key}"), *extra), body)

    def _message_url(self, inbox_id: str, message_id: str) -> str:
        return f"{self.api_base}/v0/inboxes/{quote(inbox_id, safe='@')}/messages/{quote(message_id, safe='')}"

    # -- check ---------------------------------------------------------------------------------------------------

    def check(self, request: WebhookRequest) -> Flow[Answer | Accepted]:
        return self.verify(request)
        yield  # no effect

    def verify(self, request: WebhookRequest) -> Answer | Accepted:
        document = verify_svix(request, self.secret, self.tolerance, self.clock, "AgentMail")
        if isinstance(document, Answer):
            return document
        if not isinstance(document.get("event_id"), str) or not document["event_id"]:
            return Answer(400, "the event has no event_id: not an AgentMail event")
        if not isinstance(document.get("event_type"), str):
            return Answer(400, "the event has no event_type: not an AgentMail event")
        return Accepted(document)

    def acknowledge(self) -> Answer:
        return Answer(200, "ok")

    # -- open ------------------------------------------------------------------------------------------------------

    def open(self, accepted: Accepted, cursors: Cursors) -> Flow[Batch]:
        event: dict[str, Any] = accepted.delivery
        kind = event["event_type"]
        # The spam, blocked and unauthenticated variants of message.received are never answered: no facts.
        if kind == _RECEIVED and isinstance(event.get("message"), dict):
            message = event["message"]
        elif kind == "message.sent" and isinstance(event.get("send"), dict):
            send = event["send"]
            inbox, message_id = send.get("inbox_id"), send.get("message_id")
            if not isinstance(inbox, str) or not isinstance(message_id, str) or not self._ours(inbox):
                return Batch()
            found = yield from self._read(inbox, message_id)
            if found is None:
                return Batch()
            message = found
        else:
            return Batch()
        if not self._ours(str(message.get("inbox_id") or "")) or not isinstance(message.get("message_id"), str):
            return Batch()
        return Batch((self.facts(message, event["event_id"], sent=kind == "message.sent"),))

    def _ours(self, inbox: str) -> bool:
        return not self.inbox_ids or inbox in self.inbox_ids

    def _read(self, inbox: str, message_id: str) -> Flow[dict[str, Any] | None]:
        response = yield from http(self.transport, self._request("GET", self._message_url(inbox, message_id)))
        if response.status == 404:
            return None  # deleted before it was read: nothing to report
        document = response.json()
        if response.status != 200 or not isinstance(document, dict):
            raise ProviderError(f"reading AgentMail message {message_id!r} answered HTTP {response.status}")
        return document

    def facts(self, message: Mapping[str, Any], event_id: str, *, sent: bool = False) -> MessageFacts:
        """The facts of an AgentMail message (as its API and its ``message.received`` event give it)."""
        name, address = split_address(str(message.get("from") or ""))
        labels = tuple(label for label in message.get("labels") or () if isinstance(label, str))
        folders = (*labels, "SENT") if sent or SENT_LABEL in labels else labels
        raw_headers = message.get("headers")
        headers = [(k, v) for k, v in raw_headers.items()] if isinstance(raw_headers, dict) else []
        reply_to = [a for a in message.get("reply_to") or () if isinstance(a, str) and a]
        subject = str(message.get("subject") or "")
        references = [r for r in message.get("references") or () if isinstance(r, str)]
        return MessageFacts(
            provider=self.name,
            event="message.created",
            mailbox=str(message["inbox_id"]),
            dedup_key=event_id,
            message_id=str(message["message_id"]),
            thread_id=message.get("thread_id") or None,
            received_at=_time(message.get("timestamp")),
            sender=f"{name} <{address}>" if name and address else name or address,
            subject_line=subject,
            from_addresses=(address,) if address else (),
            folders=folders,
            stamp=parse_stamp(header(headers, STAMP_HEADER)),
            reply=ReplyContext(
                to=tuple(split_address(a)[1] for a in reply_to) or ((address,) if address else ()),
                subject=reply_subject(subject),
                internet_message_id=header(headers, "Message-ID") or None,
                references=tuple(references) or message_ids(header(headers, "References")),
            ),
            source=dict(message),
        )

    # -- send ------------------------------------------------------------------------------------------------

    def reply(self, message: MessageFacts, body: str, *, html: str | None = None) -> Any:
        """``claim.send(provider.reply, message, body=...)``: replies in the message's thread with the claim's
        idempotency key and stamp; the sent message's id: a ``str`` on a blocking transport (``Claim.send``), a
        coroutine of it on an asyncio one (``AsyncClaim.send``)."""
        return drive(self._reply(message, body, current_stamp(), html=html), self.transport)

    def _reply(
        self, message: MessageFacts, body: str, stamp: ClaimStamp, *, html: str | None = None
    ) -> Flow[str | None]:
        headers = {STAMP_HEADER: str(stamp), **dict(agent_headers())}  # a person's reply is never marked
        document: dict[str, Any] = {"text": body, "headers": headers}
        if html is not None:
            document["html"] = html
        url = self._message_url(message.mailbox, message.message_id) + "/reply"
        request = self._request("POST", url, document, ("Idempotency-Key", stamp.key))
        try:
            response = yield from http(self.transport, request)
        except ProviderError as error:
            raise AgentMailSendOutcomeUnknown(f"the reply may have gone out: {error}") from error
        try:
            sent = send_outcome("AgentMail", response, _sent_id)
        except SvixSendRejected as error:
            raise AgentMailSendRejected(str(error), status_code=error.status_code) from None
        except SvixSendOutcomeUnknown as error:
            raise AgentMailSendOutcomeUnknown(str(error), status_code=error.status_code) from None
        return sent


def _sent_id(document: Any) -> str | None:
    value = document.get("message_id") if isinstance(document, dict) else None
    return value if isinstance(value, str) and value else None


def _listed(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]
