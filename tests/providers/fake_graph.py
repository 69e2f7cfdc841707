"""A Microsoft Graph mail API double that follows Graph's documented behaviour (docs/providers.md cites the pages):
messages by immutable id, ``createReply`` (201, a draft keeping the ``internetMessageHeaders`` given) then ``send``
(202, no body: the draft, same immutable id, moves to Sent Items), the Sent Items folder, delta queries with
``@odata.deltaLink``, and change notifications (``value`` array, ``clientState``, ``resource``, ``resourceData``).
It is an in-process transport for the providers (``HttpRequest`` -> ``HttpResponse``), counting sends."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from inbox_claims.providers._seam import HttpRequest, HttpResponse

BASE = "https://graph.test/v1.0"
INBOX, SENT, DRAFTS = "AAMk-inbox=", "AAMk-sentitems=", "AAMk-drafts="


@dataclass
class FakeGraph:
    user: str = "u-1"
    address: str = "support@shop.example"
    client_state: str = "graph-client-state"
    messages: dict[str, dict[str, Any]] = field(default_factory=dict)
    sends: list[dict[str, Any]] = field(default_factory=list)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    fail_send: int | None = None  # answer this status to the next send (and still send on 5xx? no: not sent)

    is_async = True

    def receive(self, sender: str, subject: str, conversation: str, at: str = "2026-12-02T14:03:00Z") -> dict[str, Any]:
        """A customer's mail arriving in the Inbox."""
        message_id = f"AAMk-msg-{next(self._ids)}="
        self.messages[message_id] = {
            "id": message_id,
            "changeKey": f"CQ-{message_id}-1",
            "conversationId": conversation,
            "receivedDateTime": at,
            "subject": subject,
            "from": {"emailAddress": {"name": "", "address": sender}},
            "replyTo": [],
            "parentFolderId": INBOX,
            "internetMessageId": f"<{message_id}@mail.example>",
            "internetMessageHeaders": [{"name": "Message-ID", "value": f"<{message_id}@mail.example>"}],
        }
        return self.messages[message_id]

    def person_replies(self, to: dict[str, Any], at: str = "2026-12-02T14:04:00Z") -> dict[str, Any]:
        """A person answering from Outlook: the copy lands in Sent Items."""
        message_id = f"AAMk-msg-{next(self._ids)}="
        self.messages[message_id] = {
            "id": message_id,
            "changeKey": f"CQ-{message_id}-1",
            "conversationId": to["conversationId"],
            "receivedDateTime": at,
            "subject": "RE: " + to["subject"],
            "from": {"emailAddress": {"name": "Ana", "address": self.address}},
            "replyTo": [],
            "parentFolderId": SENT,
            "internetMessageId": f"<{message_id}@mail.example>",
            "internetMessageHeaders": [],
        }
        self.sends.append({"by": "person", "in_reply_to": to["id"]})
        return self.messages[message_id]

    def notification(self, message: dict[str, Any], change: str = "created", state: str | None = None) -> bytes:
        note = {
            "subscriptionId": "sub-1",
            "subscriptionExpirationDateTime": "2026-12-05T11:00:00Z",
            "clientState": self.client_state if state is None else state,
            "changeType": change,
            "resource": f"Users/{self.user}/Messages/{message['id']}",
            "tenantId": "t-1",
            "resourceData": {
                "@odata.type": "#Microsoft.Graph.Message",
                "@odata.id": f"Users/{self.user}/Messages/{message['id']}",
                "@odata.etag": f'W/"{message["changeKey"]}"',
                "id": message["id"],
            },
        }
        return json.dumps({"value": [note]}).encode()

    def replies_to(self, message_id: str) -> int:
        return sum(1 for send in self.sends if send["in_reply_to"] == message_id)

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.answer(request)

    def answer(self, request: HttpRequest) -> HttpResponse:
        prefix = f"{BASE}/users/{self.user}/"
        if not request.url.startswith(prefix):
            return _json(404, {"error": {"code": "ResourceNotFound"}})
        path = unquote(request.url[len(prefix) :])
        if request.method == "GET" and path == "mailFolders/sentitems":
            return _json(200, {"id": SENT, "displayName": "Sent Items"})
        if request.method == "GET" and path.startswith("messages/"):
            message = self.messages.get(path[len("messages/") :])
            return _json(200, message) if message else _json(404, {"error": {"code": "ErrorItemNotFound"}})
        if request.method == "POST" and path.endswith("/createReply"):
            original = self.messages.get(path[len("messages/") : -len("/createReply")])
            if original is None:
                return _json(404, {"error": {"code": "ErrorItemNotFound"}})
            draft_id = f"AAMk-msg-{next(self._ids)}="
            given = (request.json_body or {}).get("message", {}).get("internetMessageHeaders", [])
            self.messages[draft_id] = {
                "id": draft_id,
                "changeKey": f"CQ-{draft_id}-1",
                "conversationId": original["conversationId"],
                "receivedDateTime": "2026-12-02T14:05:00Z",
                "subject": "RE: " + original["subject"],
                "from": {"emailAddress": {"name": "Shop", "address": self.address}},
                "replyTo": [],
                "parentFolderId": DRAFTS,
                "internetMessageId": f"<{draft_id}@mail.example>",
                "internetMessageHeaders": list(given),
                "_reply_to": original["id"],
            }
            return _json(201, self.messages[draft_id])
        if request.method == "POST" and path.endswith("/send"):
            draft = self.messages.get(path[len("messages/") : -len("/send")])
            if draft is None or draft["parentFolderId"] != DRAFTS:
                return _json(404, {"error": {"code": "ErrorItemNotFound"}})
            if self.fail_send is not None:
                status, self.fail_send = self.fail_send, None
                return _json(status, {"error": {"code": "ServiceUnavailable"}})
            draft["parentFolderId"] = SENT  # the same immutable id, now in Sent Items
            self.sends.append({"by": "agent", "in_reply_to": draft["_reply_to"], "id": draft["id"]})
            return HttpResponse(202, b"")
        return _json(400, {"error": {"code": "BadRequest", "message": f"{request.method} {path}"}})


def _json(status: int, body: Any) -> HttpResponse:
    return HttpResponse(status, json.dumps(body).encode(), {"content-type": "application/json"})
