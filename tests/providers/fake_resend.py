"""A Resend API double that follows Resend's documented behaviour (docs/providers.md cites the pages), never our code:

* events as Resend's webhooks post them, signed as Svix signs (``svix-id``, ``svix-timestamp``, ``svix-signature``),
  ``{type, created_at, data}``; a retry of an event carries its ``svix-id`` again; ``email.received`` carries
  metadata only (no body, no headers); ``email.sent`` the sent email's id, from, to, subject and tags;
* ``GET /emails/receiving/{id}``: the received email with its ``headers`` and body;
* ``POST /emails`` (``from``, ``to``, ``subject`` required; ``headers``; ``tags`` of ASCII letters, digits, ``_``
  and ``-``; ``Idempotency-Key``): 200 ``{id}``; the same key with the same body within 24 hours answers the first
  email's id and sends nothing, with another body 409 ``invalid_idempotent_request``; errors are
  ``{statusCode, name, message}``.

An in-process transport for the providers and, through tests/providers/serving.py, a real HTTP server (the SDK
tests, the example). It counts every reply sent, by the message it answers (its ``In-Reply-To``)."""

from __future__ import annotations

import itertools
import json
import re
import threading
import uuid
from collections import Counter
from datetime import UTC, datetime
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

from inbox_claims.providers._seam import HttpRequest, HttpResponse
from tests.providers.fake_agentmail import svix_headers
from tests.providers.outbox import Blocking, Outbox, Sent

BASE = "https://resend.test"
SECRET = "whsec_cmVzZW5kLWRvdWJsZS1zZWNyZXQtMzItYnl0ZXMh"
_TAG = re.compile(r"[A-Za-z0-9_-]{1,256}")
SendFailure = Literal["reject", "unavailable", "lost_answer"]


class FakeResend(Outbox):
    """A receiving address (``mailbox``) at Resend, and the emails it receives and sends."""

    is_async = True

    def __init__(self, mailbox: str = "support@shop.example", *, api_key: str = "re_test", secret: str = SECRET):
        self.mailbox = mailbox
        self.api_key = api_key
        self.secret = secret
        self.messages: dict[str, dict[str, Any]] = {}
        """Every email by id: received (``_kind`` received) and sent."""
        self.sends: list[Sent] = []
        self.calls: Counter[str] = Counter()
        self.keys: dict[str, tuple[str, str]] = {}
        self.send_failure: SendFailure | None = None
        """How the next send goes: ``reject`` (422), ``unavailable`` (503, nothing sent), ``lost_answer`` (sent,
        answered 503); once."""
        self._lock = threading.RLock()
        self._numbers = itertools.count(1)

    # -- mail ---------------------------------------------------------------------------------------------------

    def receive(
        self, sender: str, subject: str, *, in_reply_to: dict[str, Any] | None = None, kind: str = "received"
    ) -> dict[str, Any]:
        """An email arriving at the receiving address (a reply in a thread when ``in_reply_to`` is given)."""
        with self._lock:
            email_id = str(uuid.uuid4())
            rfc_id = f"<r{next(self._numbers)}.{email_id[:8]}@mail.example.org>"
            headers = {"Message-ID": rfc_id, "Subject": subject}
            if in_reply_to is not None:
                parent = in_reply_to["message_id"]
                headers["In-Reply-To"] = parent
                headers["References"] = " ".join([*in_reply_to["headers"].get("References", "").split(), parent])
            email = {
                "object": "email",
                "id": email_id,
                "to": [self.mailbox],
                "from": sender,
                "created_at": _now(),
                "subject": subject,
                "html": None,
                "text": "Where is my order 1042?",
                "bcc": [],
                "cc": [],
                "reply_to": [],
                "received_for": [self.mailbox],
                "message_id": rfc_id,
                "headers": headers,
                "attachments": [],
                "_kind": kind,
            }
            self.messages[email_id] = email
            return email

    def person_replies(self, to: dict[str, Any]) -> dict[str, Any]:
        """A person answering from their mail client as the mailbox, with the receiving address in Bcc (so that the
        inbound hears of it): it arrives as an email from the mailbox's own address, in the thread."""
        email = self.receive(f"Ana <{self.mailbox}>", "Re: " + to["subject"], in_reply_to=to, kind="person")
        with self._lock:
            self.sends.append(Sent("person", email["id"], to["id"]))
        return email

    # -- events -------------------------------------------------------------------------------------------------

    def received(self, email: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
        data = {k: email[k] for k in ("from", "to", "bcc", "cc", "message_id", "subject", "attachments", "created_at")}
        event = {"type": "email.received", "created_at": _now(), "data": {"email_id": email["id"], **data}}
        return self._signed(event, f"received/{email['id']}")

    def sent(self, email: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
        tags = {t["name"]: t["value"] for t in email.get("_tags", [])}
        data = {k: email[k] for k in ("from", "to", "subject", "created_at")}
        event = {"type": "email.sent", "created_at": _now(), "data": {"email_id": email["id"], **data, "tags": tags}}
        return self._signed(event, f"sent/{email['id']}")

    def _signed(self, event: dict[str, Any], what: str) -> tuple[bytes, dict[str, str]]:
        body = json.dumps(event).encode()
        msg_id = "msg_" + uuid.uuid5(uuid.NAMESPACE_URL, what).hex[:26]  # one per event, its retries included
        return body, svix_headers(body, self.secret, msg_id)

    # -- the API ----------------------------------------------------------------------------------------------

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.answer(request)

    def blocking(self) -> Blocking:
        return Blocking(self)

    def answer(self, request: HttpRequest) -> HttpResponse:
        headers = {k.lower(): v for k, v in request.headers}
        if headers.get("authorization") != f"Bearer {self.api_key}":
            return _error(401, "missing_api_key", "Missing API key in the authorization header")
        path = unquote(urlsplit(request.url).path).rstrip("/")
        with self._lock:
            if request.method == "GET" and path.startswith("/emails/receiving/"):
                self.calls["receiving.get"] += 1
                email = self.messages.get(path.rsplit("/", 1)[1])
                if email is None or email["_kind"] == "sent":
                    return _error(404, "not_found", "Email not found")
                return _json(200, {k: v for k, v in email.items() if not k.startswith("_")})
            if request.method == "POST" and path == "/emails":
                self.calls["emails.send"] += 1
                body = request.json_body if isinstance(request.json_body, dict) else {}
                return self._send(body, headers.get("idempotency-key"))
        return _error(404, "not_found", "The requested endpoint does not exist")

    def _send(self, body: dict[str, Any], key: str | None) -> HttpResponse:
        fingerprint = json.dumps(body, sort_keys=True)
        if key is not None and key in self.keys:
            used, email_id = self.keys[key]
            if used != fingerprint:
                return _error(409, "invalid_idempotent_request", "Same idempotency key used with a different payload")
            return _json(200, {"id": email_id})
        for field in ("from", "to", "subject"):
            if not body.get(field):
                return _error(422, "missing_required_field", f"Missing `{field}` field.")
        for tag in body.get("tags") or []:
            if not _TAG.fullmatch(str(tag.get("name", ""))) or not _TAG.fullmatch(str(tag.get("value", ""))):
                return _error(422, "validation_error", "Tags should only contain ASCII letters, numbers, _ or -.")
        failure, self.send_failure = self.send_failure, None
        if failure == "reject":
            return _error(422, "validation_error", "Invalid `to` field.")
        if failure == "unavailable":
            return _error(503, "application_error", "Service unavailable")
        email_id = str(uuid.uuid4())
        given = dict(body.get("headers") or {})
        email = {
            "object": "email",
            "id": email_id,
            "from": body["from"],
            "to": body["to"] if isinstance(body["to"], list) else [body["to"]],
            "subject": body["subject"],
            "created_at": _now(),
            "text": body.get("text"),
            "headers": given,
            "_tags": list(body.get("tags") or []),
            "_kind": "sent",
        }
        self.messages[email_id] = email
        parent = given.get("In-Reply-To")
        answered = next((m["id"] for m in self.messages.values() if m.get("message_id") == parent), "")
        self.sends.append(Sent("agent", email_id, answered))
        if key is not None:
            self.keys[key] = (fingerprint, email_id)
        if failure == "lost_answer":
            return _error(503, "application_error", "Service unavailable")
        return _json(200, {"id": email_id})


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _json(status: int, body: Any) -> HttpResponse:
    return HttpResponse(status, json.dumps(body).encode(), {"content-type": "application/json"})


def _error(status: int, name: str, message: str) -> HttpResponse:
    return _json(status, {"statusCode": status, "name": name, "message": message})
