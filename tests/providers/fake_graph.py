"""A Microsoft Graph mail API double that follows Graph's documented behaviour (docs/providers.md cites the pages),
never our code:

* messages by immutable id (a message moved to another folder keeps its id), read with ``$select`` (only the
  properties asked for, with ``id`` and ``@odata.etag``; ``internetMessageHeaders`` only when selected);
* ``createReply`` (201, a draft in Drafts) in JSON (keeping the ``internetMessageHeaders`` given, each of which must
  be an ``X-`` header) or in MIME (``Content-Type: text/plain``, the MIME in base64: the draft keeps its headers,
  any name; not base64: 400 ``ErrorMimeContentInvalidBase64String``), then ``send`` (202, no body: the draft, same
  immutable id, moves to Sent Items);
* ``GET /messages`` (every folder's messages) with ``$filter=conversationId eq '<id>'``, optionally ``and
  receivedDateTime gt|ge <time>`` (the filters Graph documents for messages), ``$select`` as for one message;
* the well-known folders (``inbox``, ``sentitems``, ``drafts``), by name or ``('name')``;
* delta queries per folder: the first round lists the folder's messages (``$filter=receivedDateTime ge <t>``
  supported, as documented for messages), ``odata.maxpagesize`` per page with an ``@odata.nextLink``, then an
  ``@odata.deltaLink``; a delta link answers what was created, updated or moved in since it was made (a message
  moved out as ``@removed``); a delta token the double no longer knows answers 410;
* subscriptions: ``POST /subscriptions`` (201) and ``PATCH /subscriptions/{id}`` (200);
* change notifications (a ``value`` array; ``clientState``, ``subscriptionId``, ``changeType``, ``resource``,
  ``resourceData`` with ``@odata.etag`` and ``id``) and lifecycle notifications (``lifecycleEvent``).

It is an in-process transport for the providers (``HttpRequest`` -> ``HttpResponse``) and, through
tests/providers/serving.py, a real HTTP server. It counts every API call and every reply sent."""

from __future__ import annotations

import base64
import binascii
import email
import itertools
import json
import re
import threading
from collections import Counter
from datetime import UTC, datetime
from typing import Any, Literal
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from inbox_claims.providers._seam import HttpRequest, HttpResponse
from tests.providers.outbox import Blocking, Outbox, Sent

BASE = "https://graph.test/v1.0"
INBOX, SENT, DRAFTS = "AAMk-inbox=", "AAMk-sentitems=", "AAMk-drafts="
_FOLDERS = {"inbox": INBOX, "sentitems": SENT, "drafts": DRAFTS}
_USER_PATH = re.compile(r"^(?P<version>/[^/]+)?/users/(?P<user>[^/]+)/(?P<rest>.+)$")
_FOLDER_DELTA = re.compile(r"^mailFolders(?:\('(?P<quoted>[^']+)'\)|/(?P<plain>[^/]+))/messages/delta$")
_FILTER = re.compile(r"^receivedDateTime (ge|gt) (\S+)$")
_CONVERSATION = re.compile(r"^conversationId eq '((?:[^']|'')*)'(?: and receivedDateTime (ge|gt) (\S+))?$")
SendFailure = Literal["reject", "unavailable", "lost_answer"]


class FakeGraph(Outbox):
    """One user's mailbox (``user``, at ``address``) of the Graph API, with its change notifications."""

    is_async = True

    def __init__(
        self,
        user: str = "u-1",
        address: str = "support@shop.example",
        *,
        client_state: str = "graph-client-state",
        token: str = "t",
        page_size: int = 10,
    ) -> None:
        self.user = user
        self.address = address
        self.client_state = client_state
        self.token = token
        self.page_size = page_size
        self.messages: dict[str, dict[str, Any]] = {}
        self.sends: list[Sent] = []
        self.calls: Counter[str] = Counter()
        self.subscriptions: dict[str, dict[str, Any]] = {}
        self.send_failure: SendFailure | None = None
        """How the next ``send`` goes: ``reject`` (400, nothing sent), ``unavailable`` (503, nothing sent),
        ``lost_answer`` (sent, and answered 503: the sender cannot know); once."""
        self.oldest_delta = 0
        """Delta tokens before this change number are forgotten (410): Graph's delta tokens expire."""
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._changes = itertools.count(1)
        self._change = 0

    # -- the mailbox's life -------------------------------------------------------------------------------

    def _changed(self, message: dict[str, Any]) -> None:
        self._change = next(self._changes)
        message["_change"] = self._change
        message["changeKey"] = f"CQ-{message['id']}-{self._change}"

    def _message(
        self, conversation: str, subject: str, sender: tuple[str, str], folder: str, at: str
    ) -> dict[str, Any]:
        with self._lock:
            message_id = f"AAMk-msg-{next(self._ids)}="
            message: dict[str, Any] = {
                "id": message_id,
                "conversationId": conversation,
                "receivedDateTime": at,
                "subject": subject,
                "from": {"emailAddress": {"name": sender[0], "address": sender[1]}},
                "replyTo": [],
                "parentFolderId": folder,
                "internetMessageId": f"<{message_id}@mail.example>",
                "internetMessageHeaders": [{"name": "Message-ID", "value": f"<{message_id}@mail.example>"}],
                "_folders": {folder},  # every folder it has been in, for delta's @removed
            }
            self._changed(message)
            self.messages[message_id] = message
            return message

    def receive(self, sender: str, subject: str, conversation: str, at: str | None = None) -> dict[str, Any]:
        """A customer's mail arriving in the Inbox (now, unless ``at`` says when)."""
        return self._message(conversation, subject, ("", sender), INBOX, at or _now())

    def person_replies(self, to: dict[str, Any]) -> dict[str, Any]:
        """A person answering from Outlook: the copy lands in Sent Items."""
        message = self._message(to["conversationId"], "RE: " + to["subject"], ("Ana", self.address), SENT, _now())
        message["internetMessageHeaders"] = []
        with self._lock:
            self.sends.append(Sent("person", message["id"], to["id"]))
        return message

    def update(self, message: dict[str, Any]) -> None:
        """Something changed the message (read, flagged): a new change key."""
        with self._lock:
            self._changed(message)

    def forget_delta_tokens(self) -> None:
        with self._lock:
            self.oldest_delta = self._change + 1

    # -- notifications --------------------------------------------------------------------------------------

    def notification(self, message: dict[str, Any], change: str = "created", state: str | None = None) -> bytes:
        """A change notification of ``message`` (as its subscription to the message's folder sends it)."""
        return self.notifications([message], change, state)

    def notifications(self, messages: list[dict[str, Any]], change: str = "created", state: str | None = None) -> bytes:
        value = [
            {
                "subscriptionId": "sub-sent" if message["parentFolderId"] == SENT else "sub-inbox",
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
            for message in messages
        ]
        return json.dumps({"value": value}).encode()

    def lifecycle(self, event: str, subscription: str = "sub-inbox", state: str | None = None) -> bytes:
        """A lifecycle notification (``missed``, ``reauthorizationRequired``, ``subscriptionRemoved``)."""
        note = {
            "lifecycleEvent": event,
            "subscriptionId": subscription,
            "subscriptionExpirationDateTime": "2026-12-05T11:00:00Z",
            "clientState": self.client_state if state is None else state,
            "tenantId": "t-1",
            "resource": f"users/{self.user}/mailFolders('inbox')/messages",
        }
        return json.dumps({"value": [note]}).encode()

    # -- the API ----------------------------------------------------------------------------------------------

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.answer(request)

    def blocking(self) -> Blocking:
        return Blocking(self)

    def answer(self, request: HttpRequest) -> HttpResponse:
        split = urlsplit(request.url)
        path = unquote(split.path)
        params = dict(parse_qsl(split.query, keep_blank_values=True)) | dict(request.params)
        headers = {k.lower(): v for k, v in request.headers}
        if headers.get("authorization") != f"Bearer {self.token}":
            return _error(401, "InvalidAuthenticationToken", "Access token is empty or invalid.")
        with self._lock:
            if path.rstrip("/").endswith("/subscriptions") or "/subscriptions/" in path:
                return self._subscription(request, path)
            match = _USER_PATH.match(path)
            if match is None or match["user"] not in (self.user, self.address):
                return _error(404, "ResourceNotFound", f"no such user or path: {path}")
            rest = match["rest"]
            delta = _FOLDER_DELTA.match(rest)
            if request.method == "GET" and delta is not None:
                self.calls["delta"] += 1
                return self._delta(delta["quoted"] or delta["plain"], params, request.url, headers)
            folder = re.fullmatch(r"mailFolders(?:\('([^']+)'\)|/([^/]+))", rest)
            if request.method == "GET" and folder is not None:
                self.calls["mailFolders.get"] += 1
                name = folder.group(1) or folder.group(2)
                if name not in _FOLDERS:
                    return _error(404, "ErrorInvalidIdMalformed", f"no folder {name}")
                return _json(200, _selected({"id": _FOLDERS[name], "displayName": name}, params))
            parts = rest.split("/")
            if request.method == "GET" and parts == ["messages"]:
                self.calls["messages.list"] += 1
                return self._list(params)
            if parts[0] != "messages" or len(parts) < 2:
                return _error(400, "BadRequest", f"{request.method} {rest}")
            message = self.messages.get(parts[1])
            if message is None:
                self.calls[f"messages.{parts[2] if len(parts) > 2 else 'get'}"] += 1
                return _error(404, "ErrorItemNotFound", "The specified object was not found in the store.")
            if request.method == "GET" and len(parts) == 2:
                self.calls["messages.get"] += 1
                return _json(200, _selected(message, params))
            if request.method == "POST" and parts[2:] == ["createReply"]:
                self.calls["messages.createReply"] += 1
                if headers.get("content-type", "").startswith("text/plain"):
                    return self._create_reply_mime(message, request.content or b"")
                return self._create_reply(message, request.json_body)
            if request.method == "POST" and parts[2:] == ["send"]:
                self.calls["messages.send"] += 1
                return self._send(message)
        return _error(400, "BadRequest", f"{request.method} {path}")

    def _subscription(self, request: HttpRequest, path: str) -> HttpResponse:
        body = request.json_body if isinstance(request.json_body, dict) else {}
        if request.method == "POST":
            self.calls["subscriptions.create"] += 1
            missing = [
                k for k in ("changeType", "notificationUrl", "resource", "expirationDateTime") if not body.get(k)
            ]
            if missing:
                return _error(400, "InvalidRequest", f"missing {', '.join(missing)}")
            subscription_id = f"sub-{next(self._ids)}"
            self.subscriptions[subscription_id] = {**body, "id": subscription_id}
            return _json(201, self.subscriptions[subscription_id])
        subscription_id = path.rsplit("/", 1)[1]
        if request.method == "PATCH":
            self.calls["subscriptions.update"] += 1
            if not body.get("expirationDateTime"):
                return _error(400, "InvalidRequest", "expirationDateTime is required")
            known = self.subscriptions.setdefault(subscription_id, {"id": subscription_id})
            known["expirationDateTime"] = body["expirationDateTime"]
            return _json(200, known)
        return _error(405, "MethodNotAllowed", request.method)

    def _create_reply(self, original: dict[str, Any], body: Any) -> HttpResponse:
        given = ((body or {}).get("message") or {}).get("internetMessageHeaders") or []
        for entry in given:
            if not str(entry.get("name", "")).lower().startswith("x-"):
                return _error(400, "InvalidInternetMessageHeader", "custom headers must start with 'x-' or 'X-'")
        draft = self._message(
            original["conversationId"],
            "RE: " + original["subject"],
            ("Shop", self.address),
            DRAFTS,
            _now(),
        )
        draft["internetMessageHeaders"] = list(given)
        draft["_reply_to"] = original["id"]
        return _json(201, _selected(draft, {}))

    def _create_reply_mime(self, original: dict[str, Any], content: bytes) -> HttpResponse:
        try:
            mime = email.message_from_bytes(base64.b64decode(content, validate=True))
        except (binascii.Error, ValueError):
            return _error(400, "ErrorMimeContentInvalidBase64String", "Invalid base64 string for MIME content.")
        # Graph lists each header unfolded (RFC 5322 section 2.2.3), its value without the space after the colon.
        headers = [{"name": name, "value": re.sub(r"\r?\n", "", str(value)).strip()} for name, value in mime.items()]
        answer = self._create_reply(original, {})
        draft = self.messages[json.loads(answer.content)["id"]]
        draft["internetMessageHeaders"] = headers
        return answer

    def _list(self, params: dict[str, str]) -> HttpResponse:
        bound = _CONVERSATION.match(params.get("$filter", ""))
        if bound is None:
            return _error(400, "ErrorInvalidUrlQueryFilter", "only conversationId eq [and receivedDateTime] here")
        conversation = bound.group(1).replace("''", "'")
        found = [m for m in self.messages.values() if m["conversationId"] == conversation]
        if bound.group(2):
            at = _time(bound.group(3))
            found = [
                m
                for m in found
                if _time(m["receivedDateTime"]) > at or (bound.group(2) == "ge" and _time(m["receivedDateTime"]) == at)
            ]
        return _json(200, {"value": [_selected(m, params) for m in found]})

    def _send(self, draft: dict[str, Any]) -> HttpResponse:
        if draft["parentFolderId"] != DRAFTS:
            return _error(400, "ErrorInvalidRequest", "only a draft can be sent")
        failure, self.send_failure = self.send_failure, None
        if failure == "reject":
            return _error(400, "ErrorInvalidRecipients", "At least one recipient is not valid.")
        if failure == "unavailable":
            return _error(503, "ServiceUnavailable", "The service is unavailable.")
        draft["parentFolderId"] = SENT  # the same immutable id, now in Sent Items
        draft["_folders"].add(SENT)
        self._changed(draft)
        self.sends.append(Sent("agent", draft["id"], draft["_reply_to"]))
        if failure == "lost_answer":
            return _error(503, "ServiceUnavailable", "The service is unavailable.")
        return HttpResponse(202, b"")

    def _delta(self, name: str, params: dict[str, str], url: str, headers: dict[str, str]) -> HttpResponse:
        folder = _FOLDERS.get(name)
        if folder is None:
            return _error(404, "ErrorInvalidIdMalformed", f"no folder {name}")
        if "$deltatoken" in params or "$skiptoken" in params:  # opaque to the caller: the round's state
            state = json.loads(params.get("$deltatoken") or params["$skiptoken"])
            if "$deltatoken" in params and state["since"] < self.oldest_delta:
                return _error(410, "SyncStateNotFound", "The sync state is no longer available; sync again.")
        else:  # a first round: the query options given are kept in the links
            given = params.get("$filter", "")
            if given and _FILTER.match(given) is None:
                return _error(400, "ErrorInvalidUrlQueryFilter", "only receivedDateTime ge/gt is supported here")
            state = {"since": None, "filter": given, "select": params.get("$select", ""), "offset": 0}
        if state["offset"] == 0:
            state["until"] = self._change  # the round lists what was there up to now; later changes: next round
        changed = self._round(folder, state)
        size = _page_size(headers.get("prefer", ""), self.page_size)
        page = changed[state["offset"] : state["offset"] + size]
        select = {"$select": state["select"]} if state["select"] else {}
        value = [
            _selected(m, select)
            if m["parentFolderId"] == folder
            else {"id": m["id"], "@removed": {"reason": "deleted"}}
            for m in page
        ]
        document: dict[str, Any] = {"value": value}
        base = url.split("?", 1)[0]
        if state["offset"] + size < len(changed):
            token = json.dumps({**state, "offset": state["offset"] + size})
            document["@odata.nextLink"] = f"{base}?{urlencode({'$skiptoken': token})}"
        else:
            token = json.dumps({"since": state["until"], "filter": "", "select": state["select"], "offset": 0})
            document["@odata.deltaLink"] = f"{base}?{urlencode({'$deltatoken': token})}"
        return _json(200, document)

    def _round(self, folder: str, state: dict[str, Any]) -> list[dict[str, Any]]:
        """A first round: the folder's messages (``$filter`` on the received time); a later one: what changed in
        the folder, or left it, since the delta link was made. Either up to the round's start."""
        if state["since"] is None:
            found = [
                m for m in self.messages.values() if m["parentFolderId"] == folder and m["_change"] <= state["until"]
            ]
            bound = _FILTER.match(state["filter"]) if state["filter"] else None
            if bound is not None:
                at = _time(bound.group(2))
                found = [
                    m
                    for m in found
                    if _time(m["receivedDateTime"]) > at
                    or (bound.group(1) == "ge" and _time(m["receivedDateTime"]) == at)
                ]
        else:
            found = [
                m
                for m in self.messages.values()
                if state["since"] < m["_change"] <= state["until"] and folder in m["_folders"]
            ]
        return sorted(found, key=lambda m: m["_change"])


def _page_size(prefer: str, default: int) -> int:
    found = re.search(r"odata\.maxpagesize=(\d+)", prefer)
    return int(found.group(1)) if found else default


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)


def _selected(message: dict[str, Any], params: dict[str, str]) -> dict[str, Any]:
    """What Graph answers for ``$select``: those properties, with ``id`` and ``@odata.etag``; without ``$select``
    every property but ``internetMessageHeaders`` (returned only when selected)."""
    public = {k: v for k, v in message.items() if not k.startswith("_")}
    if "changeKey" in public:
        public["@odata.etag"] = f'W/"{public["changeKey"]}"'
    chosen = [name.strip() for name in params.get("$select", "").split(",") if name.strip()]
    if not chosen:
        return {k: v for k, v in public.items() if k != "internetMessageHeaders"}
    return {k: v for k, v in public.items() if k in chosen or k in ("id", "@odata.etag")}


def _json(status: int, body: Any) -> HttpResponse:
    return HttpResponse(status, json.dumps(body).encode(), {"content-type": "application/json"})


def _error(status: int, code: str, message: str) -> HttpResponse:
    return _json(status, {"error": {"code": code, "message": message}})
