"""An AgentMail API double that follows AgentMail's documented behaviour (docs/providers.md cites the pages), never
our code:

* events as AgentMail's webhooks post them, signed as Svix signs (``svix-id``, ``svix-timestamp``,
  ``svix-signature``: ``v1,`` + base64 HMAC-SHA256 of ``<id>.<timestamp>.<body>`` with the secret's bytes); the
  same event to two webhooks (an inbox's and its pod's) carries one ``event_id`` and two ``svix-id``;
  ``message.received`` carries the message and its thread, ``message.sent`` only ids (``send``);
* ``GET /v0/inboxes/{inbox}/messages/{message}``: the message (``labels``, ``headers``, ``from`` as a string);
* ``POST /v0/inboxes/{inbox}/messages/{message}/reply`` (``text``, ``html``, ``headers``; ``Idempotency-Key``):
  200 ``{message_id, thread_id}``, the reply labelled ``sent`` with the headers given; a retry with a key already
  used answers the first send's result and sends nothing, the same key with another request answers 409 (keys are
  kept 24 hours); an unknown message answers 404.

An in-process transport for the providers (``HttpRequest`` -> ``HttpResponse``), and through
tests/providers/serving.py a real HTTP server (the SDK tests, the example). It counts every reply sent."""

from __future__ import annotations

import base64
import hashlib
import hmac
import itertools
import json
import threading
import time
from collections import Counter
from datetime import UTC, datetime
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

from inbox_claims.providers._seam import HttpRequest, HttpResponse
from tests.providers.outbox import Blocking, Outbox, Sent

BASE = "https://agentmail.test"
SECRET = "whsec_" + base64.b64encode(b"agentmail-double-secret-32-bytes").decode()
SendFailure = Literal["reject", "unavailable", "lost_answer"]


def svix_headers(body: bytes, secret: str, msg_id: str, at: int | None = None) -> dict[str, str]:
    """The headers Svix signs a delivery with."""
    stamp = int(time.time()) if at is None else at
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, f"{msg_id}.{stamp}.".encode() + body, hashlib.sha256).digest()
    return {
        "content-type": "application/json",
        "svix-id": msg_id,
        "svix-timestamp": str(stamp),
        "svix-signature": "v1," + base64.b64encode(mac).decode(),
    }


class FakeAgentMail(Outbox):
    """One AgentMail inbox (``inbox``, its address) and the API's messages and replies."""

    is_async = True

    def __init__(self, inbox: str = "support@shop.agentmail.to", *, api_key: str = "am_test", secret: str = SECRET):
        self.inbox = inbox
        self.api_key = api_key
        self.secret = secret
        self.messages: dict[str, dict[str, Any]] = {}
        self.sends: list[Sent] = []
        self.calls: Counter[str] = Counter()
        self.keys: dict[str, tuple[str, dict[str, Any]]] = {}
        self.send_failure: SendFailure | None = None
        """How the next reply goes: ``reject`` (400, nothing sent), ``unavailable`` (503, nothing sent),
        ``lost_answer`` (sent, and answered 503: the sender cannot know); once."""
        self._lock = threading.RLock()
        self._ids = itertools.count(1)

    # -- the inbox's life -----------------------------------------------------------------------------------

    def _message(self, thread: str, subject: str, sender: str, labels: list[str], **more: Any) -> dict[str, Any]:
        with self._lock:
            number = next(self._ids)
            message_id = f"<am-{number}.{thread}@mail.agentmail.test>"
            now = _now()
            message: dict[str, Any] = {
                "inbox_id": self.inbox,
                "thread_id": thread,
                "message_id": message_id,
                "labels": labels,
                "timestamp": now,
                "from": sender,
                "to": [self.inbox],
                "subject": subject,
                "preview": "",
                "text": more.pop("text", ""),
                "references": [],
                "headers": {"Message-ID": message_id},
                "size": 1024,
                "updated_at": now,
                "created_at": now,
                **more,
            }
            self.messages[message_id] = message
            return message

    def receive(self, sender: str, subject: str, thread: str) -> dict[str, Any]:
        """A customer's mail arriving in the inbox."""
        return self._message(thread, subject, sender, ["received", "unread"], text="Where is my order 1042?")

    def person_replies(self, to: dict[str, Any]) -> dict[str, Any]:
        """A person answering from AgentMail's console: a sent message in the thread, no stamp."""
        message = self._message(to["thread_id"], "Re: " + to["subject"], f"Ana <{self.inbox}>", ["sent"])
        with self._lock:
            self.sends.append(Sent("person", message["message_id"], to["message_id"]))
        return message

    # -- events -------------------------------------------------------------------------------------------------

    def received(self, message: dict[str, Any], *, webhook: str = "inbox") -> tuple[bytes, dict[str, str]]:
        """The ``message.received`` event of ``message``, as the ``webhook`` named receives it."""
        thread = {"inbox_id": self.inbox, "thread_id": message["thread_id"], "message_count": 1}
        event = {
            "type": "event",
            "event_type": "message.received",
            "event_id": _event_id("received", message),
            "message": {k: v for k, v in message.items() if not k.startswith("_")},
            "thread": thread,
        }
        return self._signed(event, webhook)

    def sent(self, message: dict[str, Any], *, webhook: str = "inbox") -> tuple[bytes, dict[str, str]]:
        """The ``message.sent`` event of a message the inbox sent (ids only)."""
        send = {
            "inbox_id": self.inbox,
            "thread_id": message["thread_id"],
            "message_id": message["message_id"],
            "timestamp": message["timestamp"],
            "recipients": list(message["to"]),
        }
        event = {"type": "event", "event_type": "message.sent", "event_id": _event_id("sent", message), "send": send}
        return self._signed(event, webhook)

    def _signed(self, event: dict[str, Any], webhook: str) -> tuple[bytes, dict[str, str]]:
        body = json.dumps(event).encode()
        # Svix's message id is per webhook endpoint: the same event to two webhooks has two.
        msg_id = "msg_" + hashlib.sha256(f"{webhook}/{event['event_id']}".encode()).hexdigest()[:24]
        return body, svix_headers(body, self.secret, msg_id)

    # -- the API ----------------------------------------------------------------------------------------------

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.answer(request)

    def blocking(self) -> Blocking:
        return Blocking(self)

    def answer(self, request: HttpRequest) -> HttpResponse:
        headers = {k.lower(): v for k, v in request.headers}
        if headers.get("authorization") != f"Bearer {self.api_key}":
            return _error(401, "UnauthorizedError", "Invalid API key")
        parts = unquote(urlsplit(request.url).path).strip("/").split("/")
        # v0 / inboxes / {inbox} / messages / {message} [/ reply]
        if len(parts) < 5 or parts[:2] != ["v0", "inboxes"] or parts[3] != "messages":
            return _error(404, "NotFoundError", "Route not found")
        with self._lock:
            message = self.messages.get(parts[4]) if parts[2] == self.inbox else None
            if request.method == "GET" and len(parts) == 5:
                self.calls["messages.get"] += 1
                if message is None:
                    return _error(404, "NotFoundError", "Message not found")
                return _json(200, {k: v for k, v in message.items() if not k.startswith("_")})
            if request.method == "POST" and parts[5:] == ["reply"]:
                self.calls["messages.reply"] += 1
                if message is None:
                    return _error(404, "NotFoundError", "Message not found")
                return self._reply(message, request.json_body or {}, headers.get("idempotency-key"))
        return _error(404, "NotFoundError", "Route not found")

    def _reply(self, original: dict[str, Any], body: dict[str, Any], key: str | None) -> HttpResponse:
        fingerprint = json.dumps([original["message_id"], body], sort_keys=True)
        if key is not None and key in self.keys:
            used, result = self.keys[key]
            if used != fingerprint:
                return _error(409, "IdempotencyConflictError", "Idempotency key reused with a different request")
            return _json(200, result)
        if not body.get("text") and not body.get("html"):
            return _error(400, "ValidationError", "text or html is required")
        failure, self.send_failure = self.send_failure, None
        if failure == "reject":
            return _error(400, "ValidationError", "Invalid recipient address")
        if failure == "unavailable":
            return _error(503, "ServiceUnavailableError", "Service unavailable")
        sent = self._message(
            original["thread_id"],
            "Re: " + original["subject"],
            f"Support <{self.inbox}>",
            ["sent"],
            text=body.get("text") or "",
            in_reply_to=original["message_id"],
            references=[original["message_id"]],
        )
        sent["headers"] = {**dict(body.get("headers") or {}), "Message-ID": sent["message_id"]}
        self.sends.append(Sent("agent", sent["message_id"], original["message_id"]))
        result = {"message_id": sent["message_id"], "thread_id": sent["thread_id"]}
        if key is not None:
            self.keys[key] = (fingerprint, result)
        if failure == "lost_answer":
            return _error(503, "ServiceUnavailableError", "Service unavailable")
        return _json(200, result)


def _event_id(kind: str, message: dict[str, Any]) -> str:
    return "evt_" + hashlib.sha256(f"{kind}/{message['message_id']}".encode()).hexdigest()[:20]


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _json(status: int, body: Any) -> HttpResponse:
    return HttpResponse(status, json.dumps(body).encode(), {"content-type": "application/json"})


def _error(status: int, name: str, message: str) -> HttpResponse:
    return _json(status, {"name": name, "message": message})
