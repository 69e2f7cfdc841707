"""A Gmail API and Cloud Pub/Sub push double that follows their documented behaviour (docs/providers.md cites the
pages), never our code:

* ``users.history.list``: the records after ``startHistoryId`` (exclusive), oldest first, filtered by
  ``historyTypes``, ``maxResults`` (default 100, at most 500) per page with an opaque ``nextPageToken``, and the
  mailbox's current ``historyId``; a ``startHistoryId`` older than the history kept answers 404. History ids grow
  with gaps, never one by one (the documentation says they are not contiguous).
* ``users.messages.get`` with ``format`` ``minimal``, ``metadata`` (only the ``metadataHeaders`` asked for),
  ``full`` (the default: headers and the body) or ``raw``; 404 for a message that is not there.
* ``users.messages.list`` (``q=newer_than:<n>d``, ``maxResults``), newest first; ``users.getProfile``.
* ``users.threads.get`` with ``format`` and ``metadataHeaders`` as ``messages.get``: the thread's messages, oldest
  first; 404 for a thread that is not there.
* ``users.messages.send``: a ``raw`` RFC 2822 message (base64url) and an optional ``threadId``; the message joins the
  thread only as documented (the ``threadId`` given, ``In-Reply-To`` or ``References`` naming a message of the
  thread, the same subject), Gmail writes its own ``Message-ID`` and keeps other headers; the sent copy is a new
  message labelled ``SENT`` with a new history record; the answer is ``{id, threadId, labelIds}``. No request
  without ``Authorization: Bearer <the token>`` is answered but 401.
* The push: Pub/Sub POSTs ``{"message": {"data": base64({"emailAddress", "historyId"}), "messageId", "publishTime"},
  "subscription"}`` with an OIDC token in ``Authorization: Bearer`` (RS256, issuer ``https://accounts.google.com``,
  the subscription's audience, the push service account's ``email``, ``email_verified``, ``iat``, ``exp``), signed
  with the double's own RSA key, whose public half it serves as a JWKS at ``/oauth2/v3/certs``.

It is an in-process transport for the providers (``HttpRequest`` -> ``HttpResponse``; ``blocking()`` for a blocking
client) and, through tests/providers/serving.py, a real HTTP server. It counts every API call and every reply sent.
"""

from __future__ import annotations

import base64
import bisect
import email
import email.policy
import itertools
import json
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from email.message import EmailMessage
from typing import Any, Literal
from urllib.parse import urlsplit

import jwt
from cryptography.hazmat.primitives.asymmetric import rsa

from inbox_claims.providers._seam import HttpRequest, HttpResponse
from tests.providers.outbox import Blocking, Outbox, Sent

BASE = "https://gmail.test"
JWKS_PATH = "/oauth2/v3/certs"
JWKS_URL = f"https://keys.test{JWKS_PATH}"
AUDIENCE = "https://agent.example/webhook"
SERVICE_ACCOUNT = "gmail-push@example-project.iam.gserviceaccount.com"
GOOGLE = "https://accounts.google.com"
SendFailure = Literal["reject", "unavailable", "lost_answer"]

_USER_PATH = re.compile(r"^/gmail/v1/users/(?P<user>[^/]+)/(?P<rest>.+)$")
_NEWER_THAN = re.compile(r"^newer_than:(\d+)d$")
_RECORD_KINDS = {
    "messageAdded": "messagesAdded",
    "messageDeleted": "messagesDeleted",
    "labelAdded": "labelsAdded",
    "labelRemoved": "labelsRemoved",
}
# History ids grow by these gaps, in turn (the documentation: increasing, not contiguous).
_GAPS = (3, 1, 7, 2, 11, 5)


_KEYS: dict[str, rsa.RSAPrivateKey] = {}
_KEYS_LOCK = threading.Lock()


def _key(name: str) -> rsa.RSAPrivateKey:
    """An RSA key per name, made once per test process (``own``: the double's; ``forger``: anyone else's), under a
    lock: two threads asking first must not sign with two keys."""
    with _KEYS_LOCK:
        if name not in _KEYS:
            _KEYS[name] = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        return _KEYS[name]


class FakeGmail(Outbox):
    """One mailbox (``address``) of the Gmail API, with its Pub/Sub push."""

    is_async = True

    def __init__(
        self,
        address: str = "support@shop.example",
        *,
        token: str = "gmail-token",
        audience: str = AUDIENCE,
        first_history_id: int = 1000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.address = address
        self.token = token
        self.audience = audience
        self.clock = clock
        self.key_id = "fake-gmail-1"
        self.published = {"fake-gmail-1": "own"}
        """The keys the JWKS serves, by key id (a key name for ``_key``); ``key_id`` signs the pushes."""
        self.messages: dict[str, dict[str, Any]] = {}
        self.history: list[dict[str, Any]] = []
        self.history_id = first_history_id
        self.oldest_history_id = first_history_id
        self.sends: list[Sent] = []
        self.calls: Counter[str] = Counter()
        self.failing: Counter[str] = Counter()
        """Calls of an operation (``messages.get``...) to answer 503 before answering again, as Google's API does
        now and then."""
        self.send_failure: SendFailure | None = None
        """How the next ``messages.send`` goes: ``reject`` (400, nothing sent), ``unavailable`` (503, nothing sent),
        ``lost_answer`` (sent, and answered 503: the sender cannot know); once."""
        self._lock = threading.RLock()
        self._history_ids: list[int] = []  # the records' ids, in order (they only grow)
        self._by_message_id: dict[str, str] = {}  # the Message-ID header's value -> the Gmail id
        self._gaps = itertools.cycle(_GAPS)
        self._ids = itertools.count(0x18C2F3A4B5D60000)
        self._pushes = itertools.count(2070443601311540)

    # -- the mailbox's life -------------------------------------------------------------------------------

    def _new_id(self) -> str:
        return f"{next(self._ids):x}"

    def _add(self, message: EmailMessage, labels: list[str], thread_id: str) -> dict[str, Any]:
        with self._lock:
            message_id = self._new_id()
            self.history_id += next(self._gaps)
            raw = bytes(message)
            text = message.get_body(("plain",))
            document = {
                "id": message_id,
                "threadId": thread_id or message_id,
                "labelIds": labels,
                "snippet": text.get_content()[:100] if text is not None else "",
                "historyId": str(self.history_id),
                "internalDate": str(int(self.clock() * 1000)),
                "sizeEstimate": len(raw),
                "_raw": raw,
            }
            self.messages[message_id] = document
            self._by_message_id[str(message["Message-ID"])] = message_id
            brief = {"id": message_id, "threadId": document["threadId"], "labelIds": list(labels)}
            self._history_ids.append(self.history_id)
            self.history.append(
                {
                    "id": str(self.history_id),
                    "messages": [{"id": message_id, "threadId": document["threadId"]}],
                    "messagesAdded": [{"message": brief}],
                }
            )
            return document

    def receive(self, sender: str, subject: str, body: str = "Hello", *, reply_to: str = "") -> dict[str, Any]:
        """A customer's mail arriving in the Inbox (a new thread); its message document."""
        message = EmailMessage()
        message["From"] = sender
        message["To"] = self.address
        message["Subject"] = subject
        message["Date"] = email.utils.formatdate(self.clock())
        message["Message-ID"] = f"<{uuid.uuid4().hex}@mail.example>"
        if reply_to:
            message["Reply-To"] = reply_to
        message.set_content(body)
        return self._add(message, ["UNREAD", "CATEGORY_PERSONAL", "INBOX"], "")

    def _in_thread(self, to: dict[str, Any], sender: str, recipient: str, message_id: str, body: str) -> EmailMessage:
        """A message answering ``to`` in its thread (In-Reply-To and References name it)."""
        original = self.parsed(to["id"])
        message = EmailMessage()
        message["From"] = sender or original["From"]
        message["To"] = recipient or original["From"]
        message["Subject"] = "Re: " + str(original["Subject"])
        message["Date"] = email.utils.formatdate(self.clock())
        message["Message-ID"] = message_id
        message["In-Reply-To"] = original["Message-ID"]
        message["References"] = original["Message-ID"]
        message.set_content(body)
        return message

    def customer_writes_again(
        self, to: dict[str, Any], body: str = "Also: can I change the address?"
    ) -> dict[str, Any]:
        """The customer of ``to`` writing again in its thread (a reply to their own message), in the Inbox."""
        message = self._in_thread(to, "", self.address, f"<{uuid.uuid4().hex}@mail.example>", body)
        return self._add(message, ["UNREAD", "INBOX"], to["threadId"])

    def person_replies(self, to: dict[str, Any], body: str = "I am on it. Ana") -> dict[str, Any]:
        """A person answering ``to`` from the Gmail UI: the reply, in the thread, labelled SENT."""
        message = self._in_thread(to, f"Ana <{self.address}>", "", f"<CA+{uuid.uuid4().hex}@mail.gmail.com>", body)
        document = self._add(message, ["SENT"], to["threadId"])
        with self._lock:
            self.sends.append(Sent("person", document["id"], to["id"]))
        return document

    def expire_history(self) -> None:
        """Gmail keeps history for a limited time: every history id before the current one answers 404 from now."""
        with self._lock:
            self.oldest_history_id = self.history_id

    def parsed(self, message_id: str) -> EmailMessage:
        with self._lock:
            raw = self.messages[message_id]["_raw"]
        parsed = email.message_from_bytes(raw, policy=email.policy.default)
        assert isinstance(parsed, EmailMessage)
        return parsed

    # -- the push -----------------------------------------------------------------------------------------

    def push(
        self,
        history_id: int | None = None,
        *,
        email_address: str | None = None,
        audience: str | None = None,
        issuer: str = GOOGLE,
        expires_in: float = 3600,
        signer: str = "",
        email_verified: bool = True,
    ) -> tuple[dict[str, str], bytes]:
        """One Pub/Sub push of ``history_id`` (default: the mailbox's current one), as its headers and raw body; the
        keyword arguments make a forged (``signer="forger"``), expired (``expires_in=-1``) or foreign-audience
        token."""
        now = int(self.clock())
        claims = {
            "iss": issuer,
            "aud": self.audience if audience is None else audience,
            "azp": "113774264463038321964",
            "email": SERVICE_ACCOUNT,
            "email_verified": email_verified,
            "sub": "113774264463038321964",
            "iat": now - 60,
            "exp": int(now + expires_in),
        }
        key = _key(signer or self.published[self.key_id])
        token = jwt.encode(claims, key, algorithm="RS256", headers={"kid": self.key_id})
        data = {"emailAddress": email_address or self.address, "historyId": history_id or self.history_id}
        number = str(next(self._pushes))
        body = {
            "message": {
                "data": base64.b64encode(json.dumps(data).encode()).decode(),
                "messageId": number,
                "message_id": number,
                "publishTime": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(now)),
            },
            "subscription": "projects/example-project/subscriptions/gmail-push",
        }
        headers = {"authorization": f"Bearer {token}", "content-type": "application/json"}
        return headers, json.dumps(body).encode()

    def rotate_key(self) -> None:
        """Google rotates its signing keys: a new one is published beside the old and signs from now on."""
        self.key_id = f"fake-gmail-{len(self.published) + 1}"
        self.published[self.key_id] = f"own-{len(self.published) + 1}"

    def jwks(self) -> dict[str, Any]:
        keys = []
        for key_id, name in self.published.items():
            key = jwt.algorithms.RSAAlgorithm.to_jwk(_key(name).public_key(), as_dict=True)
            keys.append({**key, "kid": key_id, "alg": "RS256", "use": "sig"})
        return {"keys": keys}

    # -- the API ------------------------------------------------------------------------------------------

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.answer(request)

    def blocking(self) -> Blocking:
        """This double as a blocking client's transport."""
        return Blocking(self)

    def answer(self, request: HttpRequest) -> HttpResponse:
        path = urlsplit(request.url).path
        if path == JWKS_PATH and request.method == "GET":
            self.calls["jwks"] += 1
            return _json(200, self.jwks())
        match = _USER_PATH.match(path)
        if match is None or match["user"] not in ("me", self.address):
            return _error(404, "Requested entity was not found.", "NOT_FOUND")
        if dict((k.lower(), v) for k, v in request.headers).get("authorization") != f"Bearer {self.token}":
            return _error(401, "Request had invalid authentication credentials.", "UNAUTHENTICATED")
        params: dict[str, list[str]] = {}
        for name, value in request.params:
            params.setdefault(name, []).append(value)
        rest = match["rest"]
        routes: dict[tuple[str, str], tuple[str, Callable[[], HttpResponse]]] = {
            ("GET", "history"): ("history.list", lambda: self._history(params)),
            ("GET", "profile"): ("getProfile", lambda: _json(200, self._profile())),
            ("GET", "messages"): ("messages.list", lambda: self._list(params)),
            ("POST", "messages/send"): ("messages.send", lambda: self._send(request.json_body)),
        }
        if request.method == "GET" and rest.startswith("threads/"):
            routes[("GET", rest)] = ("threads.get", lambda: self._thread(rest[len("threads/") :], params))
        if request.method == "GET" and rest.startswith("messages/"):
            routes[("GET", rest)] = ("messages.get", lambda: self._get(rest[len("messages/") :], params))
        route = routes.get((request.method, rest))
        if route is not None:
            operation, handle = route
            with self._lock:
                self.calls[operation] += 1
                if self.failing[operation] > 0:
                    self.failing[operation] -= 1
                    return _error(503, "The service is currently unavailable.", "UNAVAILABLE")
                return handle()
        return _error(404, f"Not found: {request.method} {path}", "NOT_FOUND")

    def _history(self, params: dict[str, list[str]]) -> HttpResponse:
        start = (params.get("startHistoryId") or [""])[0]
        if not start.isdigit():
            return _error(400, "Invalid startHistoryId", "INVALID_ARGUMENT")
        if int(start) < self.oldest_history_id:
            return _error(404, "Requested entity was not found.", "NOT_FOUND")
        size = min(int((params.get("maxResults") or ["100"])[0]), 500)
        offset = int((params.get("pageToken") or ["0"])[0])
        asked = params.get("historyTypes") or list(_RECORD_KINDS)
        kinds = {_RECORD_KINDS.get(kind, kind) for kind in asked}
        first = bisect.bisect_right(self._history_ids, int(start))
        records = [
            {key: value for key, value in record.items() if key in ("id", "messages") or key in kinds}
            for record in self.history[first:]
            if kinds.intersection(record)
        ]
        page = records[offset : offset + size]
        document: dict[str, Any] = {"historyId": str(self.history_id)}
        if page:
            document["history"] = page
        if offset + size < len(records):
            document["nextPageToken"] = str(offset + size)
        return _json(200, document)

    def _profile(self) -> dict[str, Any]:
        threads = {m["threadId"] for m in self.messages.values()}
        return {
            "emailAddress": self.address,
            "messagesTotal": len(self.messages),
            "threadsTotal": len(threads),
            "historyId": str(self.history_id),
        }

    def _list(self, params: dict[str, list[str]]) -> HttpResponse:
        query = (params.get("q") or [""])[0].strip()
        since = 0.0
        if query:
            newer = _NEWER_THAN.match(query)
            if newer is None:
                return _error(400, f"this double searches only newer_than:<days>d, not {query!r}", "INVALID_ARGUMENT")
            since = self.clock() - int(newer.group(1)) * 86400
        size = min(int((params.get("maxResults") or ["100"])[0]), 500)
        found = [m for m in self.messages.values() if int(m["internalDate"]) / 1000 >= since]
        found.sort(key=lambda m: int(m["internalDate"]), reverse=True)
        document: dict[str, Any] = {"resultSizeEstimate": len(found)}
        if found:
            document["messages"] = [{"id": m["id"], "threadId": m["threadId"]} for m in found[:size]]
        return _json(200, document)

    def _thread(self, thread_id: str, params: dict[str, list[str]]) -> HttpResponse:
        ids = [m["id"] for m in self.messages.values() if m["threadId"] == thread_id]
        if not ids:
            return _error(404, "Requested entity was not found.", "NOT_FOUND")
        messages = [json.loads(self._get(message_id, params).content) for message_id in ids]
        return _json(200, {"id": thread_id, "historyId": str(self.history_id), "messages": messages})

    def _get(self, message_id: str, params: dict[str, list[str]]) -> HttpResponse:
        message = self.messages.get(message_id)
        if message is None:
            return _error(404, "Requested entity was not found.", "NOT_FOUND")
        form = (params.get("format") or ["full"])[0]
        document = {k: v for k, v in message.items() if not k.startswith("_")}
        parsed = email.message_from_bytes(message["_raw"], policy=email.policy.default)
        headers = [{"name": name, "value": str(value)} for name, value in parsed.items()]
        if form == "minimal":
            return _json(200, document)
        if form == "raw":
            return _json(200, {**document, "raw": base64.urlsafe_b64encode(message["_raw"]).decode()})
        if form == "metadata":
            wanted = {name.lower() for name in params.get("metadataHeaders") or []}
            chosen = [h for h in headers if not wanted or h["name"].lower() in wanted]
            return _json(200, {**document, "payload": {"mimeType": parsed.get_content_type(), "headers": chosen}})
        if form != "full":
            return _error(400, f"Invalid value for format: {form}", "INVALID_ARGUMENT")
        text = parsed.get_body(("plain",))
        content = text.get_content().encode() if text is not None else b""
        body = {"size": len(content), "data": base64.urlsafe_b64encode(content).decode()}
        payload = {"mimeType": parsed.get_content_type(), "headers": headers, "body": body}
        return _json(200, {**document, "payload": payload})

    def _send(self, body: Any) -> HttpResponse:
        if not isinstance(body, dict) or not isinstance(body.get("raw"), str):
            return _error(400, "'raw' RFC822 payload message string or uploading message via /upload/ URL required")
        try:
            raw = base64.urlsafe_b64decode(body["raw"] + "=" * (-len(body["raw"]) % 4))
        except ValueError:
            return _error(400, "Invalid value for ByteString")
        parsed = email.message_from_bytes(raw, policy=email.policy.default)
        assert isinstance(parsed, EmailMessage)
        if not any(parsed.get(field) for field in ("To", "Cc", "Bcc")):
            return _error(400, "Invalid To header: Recipient address required")
        failure, self.send_failure = self.send_failure, None
        if failure == "reject":
            return _error(400, "Invalid To header")
        if failure == "unavailable":
            return _error(503, "The service is currently unavailable.", "UNAVAILABLE")
        thread, answered = self._thread_of(parsed, body.get("threadId"))
        del parsed["Message-ID"]
        parsed["Message-ID"] = f"<CA+{uuid.uuid4().hex}@mail.gmail.com>"  # Gmail writes its own
        document = self._add(parsed, ["SENT"], thread)
        self.sends.append(Sent("agent", document["id"], answered))
        if failure == "lost_answer":
            return _error(503, "The service is currently unavailable.", "UNAVAILABLE")
        return _json(200, {"id": document["id"], "threadId": document["threadId"], "labelIds": ["SENT"]})

    def _thread_of(self, message: EmailMessage, thread_id: Any) -> tuple[str, str]:
        """The thread a sent message joins (documented: the threadId given, In-Reply-To or References naming a message
        of it, the same subject; else a new one) and the message it answers."""
        named = set(re.findall(r"<[^<>\s]+>", f"{message.get('In-Reply-To', '')} {message.get('References', '')}"))
        found = [self._by_message_id[name] for name in named if name in self._by_message_id]
        answered = next((m for m in found if self.messages[m]["threadId"] == thread_id), "")
        if not answered:
            return "", ""
        subject = _bare_subject(str(message.get("Subject", "")))
        if subject != _bare_subject(str(self.parsed(answered).get("Subject", ""))):
            return "", answered
        return str(thread_id), answered


def _bare_subject(subject: str) -> str:
    return re.sub(r"^(\s*(re|fwd?):\s*)+", "", subject, flags=re.IGNORECASE).strip()


def _json(status: int, body: Any) -> HttpResponse:
    return HttpResponse(status, json.dumps(body).encode(), {"content-type": "application/json; charset=UTF-8"})


def _error(status: int, message: str, kind: str = "INVALID_ARGUMENT") -> HttpResponse:
    return _json(status, {"error": {"code": status, "message": message, "status": kind}})
