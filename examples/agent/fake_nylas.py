"""A stand-in for the Nylas v3 send endpoint, on a loopback port: checks every request, records every send.

``POST /v3/grants/{grant_id}/messages/send`` is checked the way an agent's request must look: the bearer API
key, an ``Idempotency-Key`` of 1 to 256 characters, a JSON body with ``reply_to_message_id``, ``to`` (a
non-empty list of ``{"email": ...}``), ``subject`` and ``body``. A request that breaks a rule is answered 400
and listed in ``problems``. Idempotency works as Nylas documents it: a key seen before (per grant, kept for
the fake's lifetime) with the same payload gets the first answer again, with another payload 409.

``behaviour`` says how a good request is answered: ``"send"`` (200, ``data.id``), ``"conflict"`` (409),
``"reject"`` (422), ``"unavailable"`` (503), ``"hang"`` (no answer until the fake stops or ``release()``) or
``"lost_answer"`` (sent, and answered 503: the sender cannot know).
``on_send``, if set, is called with each new send before it is answered (as Nylas's own notification of the sent
message can come before the send's answer). ``GET /v3/grants/{grant_id}/folders`` lists ``folders[grant_id]``,
``folder_page_size`` a page, with Nylas's ``next_cursor``. ``GET /v3/grants/{grant_id}/messages/{id}`` answers a sent
message (in ``SENT``), its ``headers`` (the send's ``custom_headers`` among them) only with
``fields=include_headers``, as Nylas documents.

Run it on its own: ``python -m examples.agent.fake_nylas --port 8999 --api-key demo-key``.
"""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal, Self
from urllib.parse import parse_qs, urlsplit

Behaviour = Literal["send", "conflict", "reject", "unavailable", "hang", "lost_answer"]

_SEND_PATH = re.compile(r"^/v3/grants/(?P<grant>[^/]+)/messages/send$")
_FOLDERS_PATH = re.compile(r"^/v3/grants/(?P<grant>[^/]+)/folders$")
_MESSAGE_PATH = re.compile(r"^/v3/grants/(?P<grant>[^/]+)/messages/(?P<message>[^/]+)$")
_ANSWERS: dict[str, tuple[int, str, str]] = {
    "conflict": (409, "idempotency_key_conflict", "a request with this Idempotency-Key is already being handled"),
    "reject": (422, "invalid_request_error", "the message could not be sent: unprocessable recipient"),
    "unavailable": (503, "service_unavailable", "the provider is not answering"),
}


@dataclass(frozen=True)
class ReceivedRequest:
    """One request as the fake saw it (header names lower-case)."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(frozen=True)
class Sent:
    """One message the fake "sent"."""

    id: str
    grant_id: str
    idempotency_key: str
    payload: dict[str, Any]
    at: float = field(default_factory=time.time)

    @property
    def reply_to_message_id(self) -> str:
        return str(self.payload.get("reply_to_message_id", ""))


class FakeNylas:
    """The fake endpoint; ``start()``/``stop()`` or ``with FakeNylas(...) as nylas:``. ``api_base`` is its URL."""

    def __init__(
        self,
        api_key: str = "test-api-key",
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        require_idempotency_key: bool = True,
    ) -> None:
        """``require_idempotency_key=False``: accept sends without the header, as Nylas does (the unguarded
        handlers in tests/data/handlers send none); sends without one are never deduplicated."""
        self.api_key = api_key
        self.require_idempotency_key = require_idempotency_key
        self.behaviour: Behaviour = "send"
        self.requests: list[ReceivedRequest] = []
        self.problems: list[str] = []
        self.sends: list[Sent] = []
        self.replays = 0
        self.on_send: Callable[[Sent], None] | None = None
        self.folders: dict[str, list[dict[str, Any]]] = {}
        self.folder_page_size = 50
        self._keys: dict[tuple[str, str], tuple[bytes, int, bytes]] = {}
        self._lock = threading.Lock()
        self._released = threading.Event()
        self._server = ThreadingHTTPServer((host, port), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-nylas", daemon=True
        )

    @property
    def api_base(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._released.set()
        self._server.shutdown()
        self._server.server_close()

    def release(self) -> None:
        """Lets hanging requests go (they are then dropped without an answer)."""
        self._released.set()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def sends_for(self, message_id: str) -> list[Sent]:
        with self._lock:
            return [sent for sent in self.sends if sent.reply_to_message_id == message_id]

    # -- the request handling, called from the server's threads ----------------------------------------------

    def answer(self, request: ReceivedRequest) -> tuple[int, dict[str, Any]] | None:
        """The status and JSON document to answer with, or ``None`` to hang up without answering."""
        with self._lock:
            self.requests.append(request)
        url = urlsplit(request.path)
        folders = _FOLDERS_PATH.match(url.path)
        if request.method == "GET" and folders is not None:
            return self._folders(folders["grant"], request, parse_qs(url.query).get("page_token", ["0"])[0])
        read = _MESSAGE_PATH.match(url.path)
        if request.method == "GET" and read is not None and read["message"] != "send":
            return self._message(read["grant"], read["message"], request, parse_qs(url.query))
        match = _SEND_PATH.match(request.path)
        if request.method != "POST" or match is None:
            return 404, _error("not_found", f"no route {request.method} {request.path}")
        grant_id = match["grant"]
        problem = self._check(request)
        if problem:
            with self._lock:
                self.problems.append(problem)
            status = 401 if problem.startswith("authorization") else 400
            return status, _error("invalid_request_error", problem)
        if self.behaviour == "hang":
            self._released.wait(60)
            return None
        if self.behaviour in _ANSWERS:
            status, kind, message = _ANSWERS[self.behaviour]
            return status, _error(kind, message)
        return self._send(grant_id, request)

    def _folders(self, grant_id: str, request: ReceivedRequest, cursor: str) -> tuple[int, dict[str, Any]]:
        if request.headers.get("authorization") != f"Bearer {self.api_key}":
            return 401, _error("unauthorized", "authorization: expected 'Bearer <the API key>'")
        start = int(cursor) if cursor.isdigit() else 0
        page = self.folders.get(grant_id, [])[start : start + self.folder_page_size]
        document: dict[str, Any] = {"request_id": "req-folders", "data": page}
        if start + self.folder_page_size < len(self.folders.get(grant_id, [])):
            document["next_cursor"] = str(start + self.folder_page_size)
        return 200, document

    def _message(
        self, grant_id: str, message_id: str, request: ReceivedRequest, query: dict[str, list[str]]
    ) -> tuple[int, dict[str, Any]]:
        if request.headers.get("authorization") != f"Bearer {self.api_key}":
            return 401, _error("unauthorized", "authorization: expected 'Bearer <the API key>'")
        with self._lock:
            sent = next((s for s in self.sends if s.id == message_id and s.grant_id == grant_id), None)
        if sent is None:
            return 404, _error("not_found", f"no message {message_id}")
        data: dict[str, Any] = {**sent.payload, "id": sent.id, "grant_id": grant_id, "object": "message"}
        data["folders"] = ["SENT"]
        custom = data.pop("custom_headers", None) or []
        if "include_headers" in query.get("fields", []):
            data["headers"] = [{"name": "Message-ID", "value": f"<{sent.id}@mail.nylas.test>"}, *custom]
        return 200, {"request_id": f"req-{len(self.requests)}", "data": data}

    def _send(self, grant_id: str, request: ReceivedRequest) -> tuple[int, dict[str, Any]]:
        key = request.headers.get("idempotency-key", "")
        with self._lock:
            seen = self._keys.get((grant_id, key)) if key else None
            if seen is not None:
                body, status, answer = seen
                if body != request.body:
                    return 409, _error("idempotency_key_conflict", "this Idempotency-Key was used with another payload")
                self.replays += 1
                return status, json.loads(answer)
            sent = Sent(f"sent-{len(self.sends) + 1}", grant_id, key, request.json())
            self.sends.append(sent)
            # As Nylas answers a send: the message, with its id, its grant and its object type.
            data = {**sent.payload, "id": sent.id, "grant_id": grant_id, "object": "message"}
            document = {"request_id": f"req-{len(self.requests)}", "data": data}
            if key:
                self._keys[(grant_id, key)] = (request.body, 200, json.dumps(document).encode())
        if self.on_send is not None:
            self.on_send(sent)
        if self.behaviour == "lost_answer":
            return 503, _error("service_unavailable", "the provider is not answering")
        return 200, document

    def _check(self, request: ReceivedRequest) -> str:
        headers = request.headers
        if headers.get("authorization") != f"Bearer {self.api_key}":
            return "authorization: expected 'Bearer <the API key>'"
        key = headers.get("idempotency-key", "")
        if (key or self.require_idempotency_key) and not 1 <= len(key) <= 256:
            return f"Idempotency-Key must be 1 to 256 characters, got {len(key)}"
        if not headers.get("content-type", "").startswith("application/json"):
            return "Content-Type must be application/json"
        try:
            document = request.json()
        except ValueError:
            return "the body is not JSON"
        if not isinstance(document, dict):
            return "the body is not a JSON object"
        for name in ("reply_to_message_id", "subject", "body"):
            if not isinstance(document.get(name), str) or not document[name]:
                return f"{name} must be a non-empty string"
        to = document.get("to")
        if not isinstance(to, list) or not to or not all(isinstance(p, dict) and p.get("email") for p in to):
            return "to must be a non-empty list of {'email': ...}"
        return ""


def _error(kind: str, message: str) -> dict[str, Any]:
    return {"request_id": "req-error", "error": {"type": kind, "message": message}}


def _handler_for(fake: FakeNylas) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            headers = {name.lower(): value for name, value in self.headers.items()}
            answer = fake.answer(ReceivedRequest(self.command, self.path, headers, body))
            if answer is None:
                self.close_connection = True
                return
            status, document = answer
            payload = json.dumps(document).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = do_PUT = do_DELETE = _serve

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description="A fake Nylas v3 send endpoint that prints every send.")
    parser.add_argument("--port", type=int, default=8999)
    parser.add_argument("--api-key", default="demo-key")
    options = parser.parse_args()
    with FakeNylas(options.api_key, port=options.port) as fake:
        print(f"fake Nylas at {fake.api_base} (API key {options.api_key!r}); Ctrl-C to stop", flush=True)
        shown = 0
        try:
            while True:
                time.sleep(0.2)
                for sent in fake.sends[shown:]:
                    print(f"sent {sent.id}: reply to {sent.reply_to_message_id} key {sent.idempotency_key}", flush=True)
                shown = len(fake.sends)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
