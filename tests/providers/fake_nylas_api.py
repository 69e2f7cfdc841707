"""A Nylas v3 Email API double that follows Nylas's documented behaviour (docs/providers.md cites the pages), never
our code, for the provider's own calls (the webhook side is examples/agent/fake_nylas.py and the vectors):

* ``GET /v3/grants/{grant_id}/messages``: the grant's messages, newest first, filtered by ``thread_id`` and
  ``received_after`` (Unix seconds, exclusive) when given; ``fields=include_headers`` adds each message's
  ``headers`` (``[{name, value}]``); answered ``{request_id, data, next_cursor}``;
* ``GET /v3/grants/{grant_id}/messages/{message_id}`` (``fields`` as above), 404 for a message that is not there;
* ``POST /v3/grants/{grant_id}/messages/send``: ``reply_to_message_id`` threads the reply into that message's thread;
  ``custom_headers`` become the sent message's headers; an ``Idempotency-Key`` used before with another body answers
  409, with the same body the first answer again; the sent copy lands in ``SENT``.

No request without ``Authorization: Bearer <the key>`` is answered but 401. It counts every call and every reply."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlsplit

from inbox_claims.providers._seam import HttpRequest, HttpResponse
from tests.providers.outbox import Outbox, Sent

BASE = "https://nylas.test"


class FakeNylasApi(Outbox):
    is_async = True

    def __init__(
        self,
        grant_id: str = "grant-1",
        address: str = "support@shop.example",
        *,
        api_key: str = "nylas-key",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.grant_id, self.address, self.api_key, self.clock = grant_id, address, api_key, clock
        self.messages: dict[str, dict[str, Any]] = {}
        self.sends: list[Sent] = []
        self.calls: Counter[str] = Counter()
        self.failing: Counter[str] = Counter()
        """Calls of an operation (``messages.get``...) to answer 503 before answering again."""
        self._keys: dict[str, tuple[bytes, HttpResponse]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.RLock()

    def _add(self, thread_id: str, sender: tuple[str, str], subject: str, folders: list[str], **more: Any) -> Any:
        with self._lock:
            message_id = f"nylas-msg-{next(self._ids)}"
            message = {
                "id": message_id,
                "grant_id": self.grant_id,
                "object": "message",
                "thread_id": thread_id or f"nylas-thread-{message_id}",
                "subject": subject,
                "from": [{"name": sender[0], "email": sender[1]}],
                "folders": folders,
                "date": int(self.clock()),
                "headers": more.pop("headers", []),
                **more,
            }
            self.messages[message_id] = message
            return message

    def receive(
        self, sender: str, subject: str, thread_id: str = "", *, headers: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """A mail arriving in the Inbox, with ``headers`` of its own (an auto-reply's ``Auto-Submitted``...)."""
        listed = [{"name": name, "value": value} for name, value in (headers or {}).items()]
        result: dict[str, Any] = self._add(
            thread_id, ("Bea Costa", sender), subject, ["INBOX", "UNREAD"], headers=listed
        )
        return result

    def customer_writes_again(self, to: dict[str, Any]) -> dict[str, Any]:
        return self.receive(to["from"][0]["email"], "Re: " + to["subject"], to["thread_id"])

    def person_replies(self, to: dict[str, Any]) -> dict[str, Any]:
        """A person answering from the mail client: the reply in the thread, in SENT."""
        message: dict[str, Any] = self._add(to["thread_id"], ("Ana", self.address), "Re: " + to["subject"], ["SENT"])
        with self._lock:
            self.sends.append(Sent("person", message["id"], to["id"]))
        return message

    def notification(self, message: dict[str, Any]) -> dict[str, Any]:
        """A message.created notification of ``message``, as the webhook delivers it (no headers)."""
        shown = {k: v for k, v in message.items() if k != "headers"}
        return {
            "specversion": "1.0",
            "type": "message.created",
            "id": f"notif-{message['id']}",
            "time": int(self.clock()),
            "data": {"application_id": "app-1", "object": shown},
        }

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.answer(request)

    def answer(self, request: HttpRequest) -> HttpResponse:
        headers = {k.lower(): v for k, v in request.headers}
        if headers.get("authorization") != f"Bearer {self.api_key}":
            return _json(401, {"request_id": "r", "error": {"type": "unauthorized", "message": "Unauthorized"}})
        params = dict(request.params)
        path = unquote(urlsplit(request.url).path)
        prefix = f"/v3/grants/{self.grant_id}/messages"
        with self._lock:
            operation = _operation(request.method, path, prefix)
            if self.failing[operation] > 0:
                self.failing[operation] -= 1
                self.calls[operation] += 1
                return _json(503, {"request_id": "r", "error": {"type": "api_error", "message": "unavailable"}})
            if request.method == "GET" and path == prefix:
                self.calls["messages.list"] += 1
                return self._list(params)
            if request.method == "POST" and path == prefix + "/send":
                self.calls["messages.send"] += 1
                return self._send(request, headers)
            if request.method == "GET" and path.startswith(prefix + "/"):
                self.calls["messages.get"] += 1
                found = self.messages.get(path[len(prefix) + 1 :])
                if found is None:
                    return _json(404, {"request_id": "r", "error": {"type": "not_found", "message": "not found"}})
                return _json(200, {"request_id": "r", "data": _shown(found, params)})
        return _json(404, {"request_id": "r", "error": {"type": "not_found", "message": path}})

    def _list(self, params: dict[str, str]) -> HttpResponse:
        found = list(self.messages.values())
        if "thread_id" in params:
            found = [m for m in found if m["thread_id"] == params["thread_id"]]
        if "received_after" in params:
            found = [m for m in found if m["date"] > int(params["received_after"])]
        found.sort(key=lambda m: m["date"], reverse=True)
        return _json(200, {"request_id": "r", "data": [_shown(m, params) for m in found], "next_cursor": None})

    def _send(self, request: HttpRequest, headers: dict[str, str]) -> HttpResponse:
        key, content = headers.get("idempotency-key", ""), request.content or b""
        if key in self._keys:
            earlier, answer = self._keys[key]
            if earlier != content:
                return _json(409, {"request_id": "r", "error": {"type": "conflict", "message": "key reused"}})
            return answer
        body = json.loads(content)
        original = self.messages.get(body.get("reply_to_message_id", ""))
        thread = original["thread_id"] if original is not None else ""
        custom = [{"name": h["name"], "value": h["value"]} for h in body.get("custom_headers") or []]
        sent = self._add(thread, ("Shop", self.address), body.get("subject", ""), ["SENT"], headers=custom)
        self.sends.append(Sent("agent", sent["id"], body.get("reply_to_message_id", "")))
        answer = _json(200, {"request_id": "r", "grant_id": self.grant_id, "data": _shown(sent, {})})
        if key:
            self._keys[key] = (content, answer)
        return answer


def _operation(method: str, path: str, prefix: str) -> str:
    if path == prefix:
        return "messages.list"
    return "messages.send" if method == "POST" else "messages.get"


def _shown(message: dict[str, Any], params: dict[str, str]) -> dict[str, Any]:
    if params.get("fields") == "include_headers":
        return dict(message)
    return {k: v for k, v in message.items() if k != "headers"}


def _json(status: int, body: Any) -> HttpResponse:
    return HttpResponse(status, json.dumps(body).encode(), {"content-type": "application/json"})
