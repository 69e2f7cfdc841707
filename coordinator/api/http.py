"""The HTTP/JSON face: the same API over the Connect protocol, for browsers, helpdesk sidebars and ``curl``.

``POST /inbox.coordinator.v1.Coordinator/ClaimReply`` with ``Content-Type: application/json`` and the request
message in protobuf's JSON mapping answers the response message as JSON; ``Watch`` is a Connect server stream
(``application/connect+json``). The routes and messages are generated from the same .proto as the gRPC API
(``coordinator_connect.py``, by scripts/gen_proto.py), and no call is implemented twice: each Connect method
runs the gRPC servicer's own method, wrapped by the same RpcObserver, with an ``HttpCall`` standing in for the
gRPC call context. So authentication (``Authorization: Bearer``, or the development-mode principal headers),
authorization, limits, the rate limit, the deadline, metrics and the log line are the gRPC call's.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import contextvars
import errno
import json
import logging
import re
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, cast

import grpc
import uvicorn
from connectrpc import _codec as connect_codecs
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from google.protobuf import descriptor_pool, json_format, message_factory
from google.protobuf import message as message_module
from google.protobuf.any_pb2 import Any as AnyMessage
from google.rpc import error_details_pb2, status_pb2

from coordinator.api._connect import CoordinatorASGIApplication
from coordinator.api.encoded import Encoded
from coordinator.api.interceptor import RpcObserver
from coordinator.api.protojson import ProtoJson
from coordinator.api.service import SERVICE_NAME, CoordinatorServicer
from coordinator.api.status import DOMAIN
from inbox_wire import PRINCIPAL_KIND_METADATA, PRINCIPAL_METADATA
from inbox_wire.http_guard import (
    CERTIFICATE_NAMES,
    GuardedServer,
    HostPolicy,
    HttpGuardSettings,
    Reporter,
    connection_cap,
)
from inbox_wire.v1 import coordinator_pb2 as pb

log = logging.getLogger(__name__)

# The claims board: plain HTML, CSS and JavaScript, served as they are (no build step, nothing from a CDN).
BOARD_DIR = Path(__file__).resolve().parent / "board"

ASGIApp = Callable[[dict[str, Any], Callable[..., Awaitable[Any]], Callable[..., Awaitable[Any]]], Awaitable[None]]


# Where json_format says a refused value was: "... at ClaimReplyRequest.summary.receivedAt." (JSON names).
_JSON_PATH = re.compile(r" at [A-Za-z0-9_]+\.([A-Za-z0-9_.\[\]]+?)\.*\Z")
_CAMEL_HUMP = re.compile(r"(?<=[a-z0-9])([A-Z])")


def _refused_body(name: str, problem: str) -> ConnectError:
    """INVALID_ARGUMENT for a JSON body json_format refused; when it says which field, the field is named first
    (by its proto name: ``summary.received_at``) and in an ErrorInfo, as the service names the fields it refuses
    (a time outside a Timestamp's range, year 10000, can only be refused here: RFC 3339 has no such year)."""
    located = _JSON_PATH.search(problem)
    if located is None:
        return ConnectError(Code.INVALID_ARGUMENT, f"the body is not a {name}: {problem}")
    field = _CAMEL_HUMP.sub(r"_\1", located.group(1)).lower()
    info = AnyMessage()
    info.Pack(error_details_pb2.ErrorInfo(reason="INVALID_FIELD", domain=DOMAIN, metadata={"field": field}))
    return ConnectError(Code.INVALID_ARGUMENT, f"{field}: the body is not a {name}: {problem}", (info,))


class _StrictJsonCodec(connect_codecs.ProtoJSONCodec):  # type: ignore[type-arg]
    """protobuf's JSON mapping (``ProtoJson``: json_format's results, from tables built once), whose failures
    (not JSON, not an object, an unknown field, a value of the wrong type) are the caller's: INVALID_ARGUMENT
    naming the problem, where connect-python 0.9.0 answers UNKNOWN (HTTP 500) for them."""

    def decode(self, data: bytes | bytearray, message: Any) -> Any:
        name = message.DESCRIPTOR.name
        try:
            document = json.loads(data)
        except (ValueError, RecursionError) as error:
            raise ConnectError(Code.INVALID_ARGUMENT, f"the body is not JSON: {error}") from None
        if not isinstance(document, dict):
            raise ConnectError(Code.INVALID_ARGUMENT, f"the body must be a JSON object (a {name})") from None
        try:
            _PROTO_JSON.parse(document, message)
        except (json_format.ParseError, ValueError, TypeError, RecursionError) as error:
            raise _refused_body(name, str(error)) from None
        return message

    def encode(self, message: Any) -> bytes:
        # Compact: the library's indented JSON is a third larger and slower to write.
        return _COMPACT.encode(_PROTO_JSON.to_dict(message)).encode()


class _StrictProtoCodec(connect_codecs.ProtoBinaryCodec):  # type: ignore[type-arg]
    """The binary protobuf codec, whose failure to parse a body (not a protobuf, a truncated one) is the caller's:
    INVALID_ARGUMENT, where connect-python 0.9.0 answers UNKNOWN (HTTP 500)."""

    def decode(self, data: bytes | bytearray, message: Any) -> Any:
        try:
            message.ParseFromString(bytes(data))
        except (message_module.DecodeError, ValueError, RecursionError) as error:
            raise ConnectError(
                Code.INVALID_ARGUMENT, f"the body is not a {message.DESCRIPTOR.name} in protobuf's binary form: {error}"
            ) from None
        return message


_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
_PROTO_JSON = ProtoJson()


# connect-python keeps one codec per name in a module registry (customizing per handler is not offered yet).
for _name, _codec in list(connect_codecs._codecs.items()):
    if isinstance(_codec, connect_codecs.ProtoJSONCodec):
        connect_codecs._codecs[_name] = _StrictJsonCodec()
    elif isinstance(_codec, connect_codecs.ProtoBinaryCodec):
        connect_codecs._codecs[_name] = _StrictProtoCodec()

_CONNECT_CODES = {
    code: Code[code.name.replace("CANCELLED", "CANCELED")] for code in grpc.StatusCode if code.name != "OK"
}


class HttpCall:
    """What the servicer and the observer read of a gRPC call, taken from an HTTP request: its headers as
    metadata (lower-case names, as gRPC gives them), its peer, and the status it was aborted with."""

    def __init__(
        self,
        metadata: tuple[tuple[str, str], ...],
        peer: str,
        request: Any,
        *,
        stream: bool = False,
        certificate_names: tuple[str, ...] = (),
    ) -> None:
        self._metadata = metadata  # names in lower case
        self._peer = peer
        self._certificate_names = certificate_names
        self._request = request
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._status_details: tuple[Any, ...] = ()
        # A server stream's messages, handed to the HTTP response one at a time: write() waits until the
        # response took the previous one, so a client that stops reading holds the writer back as HTTP/2 flow
        # control does for gRPC (and the Watch drain timeout sees the same stuck write). A unary call has none.
        self._outbox: asyncio.Queue[Any] | None = asyncio.Queue(maxsize=1) if stream else None
        self._done_callbacks: list[Callable[[Any], object]] = []
        self.trailers: tuple[tuple[str, str], ...] = ()

    @property
    def outbox(self) -> asyncio.Queue[Any]:
        if self._outbox is None:
            raise TypeError("a unary call has no stream to write to")
        return self._outbox

    async def read(self) -> Any:
        """The request message: already decoded by the Connect codec (a body it cannot decode never gets here)."""
        return self._request

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def auth_context(self) -> Mapping[str, Iterable[bytes]]:
        """The verified client certificate's names (mTLS), as gRPC's auth context has them."""
        if not self._certificate_names:
            return {}
        return {"x509_subject_alternative_name": [name.encode() for name in self._certificate_names]}

    def peer(self) -> str:
        return self._peer

    async def write(self, message: Any) -> None:
        await self.outbox.put(message.message if type(message) is Encoded else message)

    def add_done_callback(self, callback: Callable[[Any], object]) -> None:
        self._done_callbacks.append(callback)

    def done(self) -> None:
        """The call is over for the HTTP side (its response ended, or its client went away)."""
        callbacks, self._done_callbacks = self._done_callbacks, []
        for callback in callbacks:
            callback(self)

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    @property
    def failed(self) -> bool:
        return self._code not in (None, grpc.StatusCode.OK)

    def details(self) -> str:
        return self._details

    def set_trailing_metadata(self, metadata: Iterable[tuple[str, str | bytes]]) -> None:
        # Text trailers become response headers (retry-after-ms); the binary status details travel in the
        # Connect error body instead (see abort).
        self.trailers = tuple((name, value) for name, value in metadata if isinstance(value, str))

    async def abort(
        self, code: grpc.StatusCode, details: str, trailing_metadata: Iterable[tuple[str, str | bytes]] = ()
    ) -> None:
        trailing_metadata = tuple(trailing_metadata)
        self.set_trailing_metadata(trailing_metadata)
        self._code, self._details = code, details
        self._status_details = tuple(
            detail
            for name, value in trailing_metadata
            if name == _STATUS_DETAILS_METADATA and isinstance(value, bytes)
            for detail in status_pb2.Status.FromString(value).details
        )
        raise grpc.aio.AbortError()

    def error(self) -> ConnectError:
        """The Connect error for the status the call was aborted with, with its google.rpc details (ErrorInfo,
        RetryInfo) as the Connect error's details."""
        code = _CONNECT_CODES.get(self._code or grpc.StatusCode.UNKNOWN, Code.UNKNOWN)
        return ConnectError(code, self._details, self._status_details)


# Where gRPC carries a google.rpc.Status (coordinator.api.status puts ErrorInfo and RetryInfo in it).
_STATUS_DETAILS_METADATA = "grpc-status-details-bin"


# The headers that name a development-mode caller. gRPC refuses metadata values outside printable ASCII before
# a call starts; over HTTP they arrive as any bytes, which read as Latin-1 would make another name of them.
_PRINCIPAL_HEADERS = (PRINCIPAL_METADATA, PRINCIPAL_KIND_METADATA)


def _checked(metadata: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    for name, value in metadata:
        if name in _PRINCIPAL_HEADERS and not (value.isascii() and value.isprintable()):
            raise ConnectError(
                Code.INVALID_ARGUMENT,
                f"the {name} header holds bytes outside printable ASCII, which gRPC metadata (and so this header) "
                "cannot carry: name the principal in ASCII",
            )
    return metadata


# The client certificate's names of the request being served, for the calls connect-python runs (its request
# context has no scope); set by the application for each request, in the request's own task.
_REQUEST_CERTIFICATE_NAMES: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "inbox_coordinator_http_certificate_names", default=()
)


def _certificate_names(scope: dict[str, Any]) -> tuple[str, ...]:
    names: tuple[str, ...] = scope.get("extensions", {}).get("tls", {}).get(CERTIFICATE_NAMES, ())
    return names


def _call_of(ctx: RequestContext[Any, Any], request: Any, *, stream: bool = False) -> HttpCall:
    metadata = _checked(tuple((name.lower(), value) for name, value in ctx.request_headers().allitems()))
    return HttpCall(
        metadata,
        f"http:{ctx.client_address() or '?'}",
        request,
        stream=stream,
        certificate_names=_REQUEST_CERTIFICATE_NAMES.get(),
    )


class ConnectFace:
    """The generated Connect service protocol, every method delegating to the gRPC servicer's method of the
    same RPC through the observer (built from the .proto's service descriptor, so no RPC can be left out)."""

    def __init__(self, servicer: CoordinatorServicer, observer: RpcObserver) -> None:
        # The unary methods by URL path, with their request type, for the JSON fast path (``_UnaryJson``).
        self.unary: dict[str, tuple[type[Any], Callable[[Any, Any], Awaitable[Any]]]] = {}
        for method in pb.DESCRIPTOR.services_by_name["Coordinator"].methods:
            path = f"/{SERVICE_NAME}/{method.name}"
            inner = observer.observe(path, getattr(servicer, method.name), streaming=method.server_streaming)
            if method.server_streaming:
                setattr(self, _snake(method.name), _stream(inner))
            else:
                setattr(self, _snake(method.name), _unary(inner))
                self.unary[path] = (getattr(pb, method.input_type.name), inner)


def _snake(name: str) -> str:
    return "".join(f"_{ch.lower()}" if ch.isupper() else ch for ch in name).lstrip("_")


def _unary(inner: Callable[[Any, Any], Awaitable[Any]]) -> Callable[[Any, RequestContext[Any, Any]], Awaitable[Any]]:
    async def call(request: Any, ctx: RequestContext[Any, Any]) -> Any:
        http_call = _call_of(ctx, request)
        try:
            return await inner(request, http_call)
        except grpc.aio.AbortError:
            for name, value in http_call.trailers:
                ctx.response_headers()[name] = value  # retry-after-ms on RESOURCE_EXHAUSTED, as gRPC's trailer
            raise http_call.error() from None

    return call


def _stream(inner: Callable[[Any, Any], Awaitable[None]]) -> Callable[[Any, RequestContext[Any, Any]], Any]:
    """A server stream: the servicer's handler writes its messages to the call (as to a gRPC context), and they
    are yielded to the HTTP response as it takes them."""

    async def call(request: Any, ctx: RequestContext[Any, Any]) -> AsyncIterator[Any]:
        http_call = _call_of(ctx, request, stream=True)
        handler = asyncio.ensure_future(inner(request, http_call))
        try:
            while True:
                taken = asyncio.ensure_future(http_call.outbox.get())
                await asyncio.wait((taken, handler), return_when=asyncio.FIRST_COMPLETED)
                if taken.done():
                    yield taken.result()
                    continue
                taken.cancel()
                break
            try:
                handler.result()
            except grpc.aio.AbortError:
                raise http_call.error() from None
            if http_call.failed:  # a status set without aborting (a Watch ended for being slow)
                raise http_call.error()
        finally:
            handler.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AbortError):
                await handler
            http_call.done()

    return call


def build_app(
    servicer: CoordinatorServicer,
    observer: RpcObserver,
    *,
    max_message_bytes: int,
    board_dir: Path | None = None,
    hosts: HostPolicy | None = None,
    reporter: Reporter | None = None,
) -> ASGIApp:
    """The ASGI application: the Connect routes, and the claims board's files (``/``) when ``board_dir``; only
    for the Host names ``hosts`` allows, and for a browser only from the same origin."""
    face = ConnectFace(servicer, observer)
    fast = _UnaryJson(face.unary)
    connect = CoordinatorASGIApplication(
        cast(Any, face),
        read_max_bytes=max_message_bytes,
        # Answers are a few hundred bytes: compressing them costs more CPU than it saves on the wire.
        compressions=(),
    )
    streams = frozenset(
        f"/{SERVICE_NAME}/{method.name}"
        for method in pb.DESCRIPTOR.services_by_name["Coordinator"].methods
        if method.server_streaming
    )
    prefix = f"/{SERVICE_NAME}/"
    board = _load_board(board_dir) if board_dir is not None else {}
    hosts = hosts or HostPolicy.for_listen("127.0.0.1")
    reporter = reporter or Reporter()

    async def app(
        scope: dict[str, Any], receive: Callable[..., Awaitable[Any]], send: Callable[..., Awaitable[Any]]
    ) -> None:
        if scope["type"] != "http":
            return
        api = scope["path"].startswith(prefix)
        refusal = _misdirected(scope, hosts, api=api)
        if refusal is not None:
            status, reason, message = refusal
            reporter.refusal(reason, message)
            await _send_refusal(send, status, message, json_body=api)
            return
        if not api:
            await _static(board, scope, send)
            return
        size = _content_length(scope)
        if size is not None and size > max_message_bytes:
            # Said before the body is read, and as what it is: too large, not "retry later" (Connect's 429).
            reporter.refusal("body_too_large", _too_large(size, max_message_bytes))
            await _send_refusal(send, 413, _too_large(size, max_message_bytes), json_body=True)
            return
        bounded = _BoundedBody(receive, send, max_message_bytes, reporter)
        if await fast(scope, bounded.receive, bounded.send):
            return
        if scope["path"] in streams:
            replay = await _one_envelope(scope, bounded, send)
            if replay is None:
                return
            receive = replay
        else:
            receive = bounded.receive
        _REQUEST_CERTIFICATE_NAMES.set(_certificate_names(scope))
        await connect(cast(Any, _utf8_headers(scope)), cast(Any, receive), cast(Any, bounded.send))

    return app


def _too_large(size: int | None, limit: int) -> str:
    said = f"is {size} bytes" if size is not None else f"is over {limit} bytes"
    return f"the request body {said}; the limit is {limit} (--max-message-bytes)"


async def _send_refusal(send: Callable[..., Awaitable[Any]], status: int, message: str, *, json_body: bool) -> None:
    """A refusal made before the API saw the request. The connection stays open: closing it with the rest of a
    body unread would be a reset, which can throw the answer away before the client reads it; what is left of
    the body is read and dropped, within the body's deadline (--request-timeout)."""
    code = {413: "resource_exhausted", 421: "permission_denied", 403: "permission_denied", 400: "invalid_argument"}
    body = (json.dumps({"code": code.get(status, "unknown"), "message": message}) if json_body else message).encode()
    content_type = b"application/json" if json_body else b"text/plain; charset=utf-8"
    headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _misdirected(scope: dict[str, Any], hosts: HostPolicy, *, api: bool) -> tuple[int, str, str] | None:
    """Why a request is not for this face (a Host it does not answer to, a page of another origin), or None."""
    host: str | None = None
    origin: str | None = None
    host_count = 0
    for name, value in scope["headers"]:
        if name == b"host":
            host_count += 1
            host = value.decode("latin-1")
        elif name == b"origin":
            origin = value.decode("latin-1")
    if host_count > 1:
        return 400, "host_not_allowed", "the request has more than one Host header"
    if not hosts.allows_host(host):
        return (
            421,
            "host_not_allowed",
            f"this coordinator does not answer to the name {host!r} (it answers to {hosts.describe()}); behind a "
            "proxy, add the name the proxy forwards with --http-allowed-hosts",
        )
    if api and not hosts.allows_origin(origin, host):
        return (
            403,
            "cross_origin",
            f"a page of another origin ({origin}) may not call this coordinator: only the board it serves may",
        )
    return None


class _BoundedBody:
    """The request body as the application reads it, cut at ``limit`` bytes whether or not a length was declared
    (a chunked body has none): past it the client is answered 413 and the application reads a disconnect; what
    the application sends after that is dropped."""

    def __init__(
        self,
        receive: Callable[..., Awaitable[Any]],
        send: Callable[..., Awaitable[Any]],
        limit: int,
        reporter: Reporter,
    ) -> None:
        self._receive = receive
        self._send = send
        self._limit = limit
        self._reporter = reporter
        self._size = 0
        self._refused = False
        self._started = False

    async def receive(self) -> Any:
        if self._refused:
            return _DISCONNECT
        message = await self._receive()
        if message["type"] == "http.request":
            self._size += len(message.get("body", b""))
            if self._size > self._limit:
                self._refused = True
                self._reporter.refusal("body_too_large", _too_large(None, self._limit))
                if not self._started:
                    await _send_refusal(self._send, 413, _too_large(None, self._limit), json_body=True)
                return _DISCONNECT
        return message

    async def send(self, message: Any) -> None:
        if self._refused:
            return
        if message["type"] == "http.response.start":
            self._started = True
        await self._send(message)


_DISCONNECT = {"type": "http.disconnect"}
_ENVELOPE_HEADER = 5  # Connect's stream framing: a flags byte and a 4-byte big-endian length
# The stream protocols connect-python speaks, each framing its messages that way (gRPC-Web too).
_ENVELOPED_TYPES = (b"application/connect+", b"application/grpc-web", b"application/grpc")


async def _one_envelope(
    scope: dict[str, Any], body: _BoundedBody, send: Callable[..., Awaitable[Any]]
) -> Callable[..., Awaitable[Any]] | None:
    """A server stream's request, read whole before the stream starts: it must be one Connect envelope. One that
    is not is answered 400 naming the framing (connect-python would answer 200 and an 'unimplemented' end of
    stream: no message a person could act on). The receive to hand on, or None when answered here."""
    chunks: list[bytes] = []
    while True:
        message = await body.receive()
        if message["type"] != "http.request":
            return None  # gone, or answered 413 by the body's limit
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    data = b"".join(chunks)
    content_type = next((value for name, value in scope["headers"] if name == b"content-type"), b"")
    problem = None
    if not content_type.startswith(_ENVELOPED_TYPES):
        problem = (
            f"a stream's request has Content-Type application/connect+json (or +proto), not "
            f"{content_type.decode('latin-1') or 'none'}"
        )
    elif len(data) < _ENVELOPE_HEADER or _ENVELOPE_HEADER + int.from_bytes(data[1:5], "big") != len(data):
        problem = (
            f"the request body ({len(data)} bytes) is not one Connect envelope: a flags byte (0), the message's "
            "length in 4 bytes (big-endian), then the message; a chunked body is fine, its bytes must be one envelope"
        )
    if problem is not None:
        await _send_refusal(body.send, 400, problem, json_body=True)
        return None
    delivered = False

    async def replay() -> Any:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": data, "more_body": False}
        return await body.receive()  # connect-python waits on it for the client's disconnect

    return replay


def _utf8_headers(scope: dict[str, Any]) -> dict[str, Any]:
    """connect-python decodes every header as UTF-8 and answers 500 when one is not; a client's Latin-1
    User-Agent is no server error. Such values are handed on as their Latin-1 reading, in UTF-8."""
    headers = scope["headers"]
    try:
        for _name, value in headers:
            value.decode()
    except UnicodeDecodeError:
        fixed = [(name, value.decode("latin-1").encode()) for name, value in headers]
        return {**scope, "headers": fixed}
    return scope


class _UnaryJson:
    """A unary call as ``curl`` and the board make it (``POST``, ``Content-Type: application/json``, no
    compression), answered without connect-python's per-request machinery (its request context, header
    multi-dict, compression negotiation, codec look-up), which cost more coordinator CPU per call than the call's
    own work (docs/performance.md#the-httpjson-face-python--m-bench-http). Same answers, same errors (Connect's
    JSON error body, HTTP status by code); anything else (GET, application/proto, a compressed body, streams)
    is the Connect application's."""

    def __init__(self, methods: dict[str, tuple[type[Any], Callable[[Any, Any], Awaitable[Any]]]]) -> None:
        self._methods = methods

    async def __call__(
        self, scope: dict[str, Any], receive: Callable[..., Awaitable[Any]], send: Callable[..., Awaitable[Any]]
    ) -> bool:
        """Answers the call and says True, or says False (having read nothing) when it is not one for here."""
        method = self._methods.get(scope["path"])
        if method is None or scope["method"] != "POST":
            return False
        # ASGI gives header names in lower case, as gRPC gives metadata.
        headers = tuple((name.decode("latin-1"), value.decode("latin-1")) for name, value in scope["headers"])
        fields = dict(headers)
        if fields.get("content-type") not in _JSON_TYPES or fields.get("content-encoding", "identity") != "identity":
            return False
        request_type, inner = method
        client = scope.get("client")
        try:
            request = _JSON.decode(await self._body(receive), request_type())
            call = HttpCall(
                _checked(headers),
                f"http:{client[0]}:{client[1]}" if client else "http:?",
                request,
                certificate_names=_certificate_names(scope),
            )
            try:
                answer = _JSON.encode(await inner(request, call))
            except grpc.aio.AbortError:
                await _send_error(send, call.error(), call.trailers)
                return True
        except Exception as error:  # as connect-python: ConnectError as it says, anything else UNKNOWN (500)
            await _send_error(send, error, ())
            return True
        # With its length, the answer goes out in one piece rather than as a chunked body (two more chunk lines).
        length = (b"content-length", b"%d" % len(answer))
        await send({"type": "http.response.start", "status": 200, "headers": [*_JSON_RESPONSE_HEADERS, length]})
        await send({"type": "http.response.body", "body": answer})
        return True

    async def _body(self, receive: Callable[..., Awaitable[Any]]) -> bytes:
        """The whole body (``receive`` cuts one over the limit, answering 413, and then reads as a disconnect)."""
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise ConnectError(Code.CANCELED, "the client went away before sending the whole request")
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks)


_JSON = _StrictJsonCodec()
_JSON_TYPES = frozenset(("application/json", "application/json; charset=utf-8", "application/json;charset=utf-8"))
_JSON_RESPONSE_HEADERS = [(b"content-type", b"application/json")]


async def _send_error(
    send: Callable[..., Awaitable[Any]], error: Exception, headers: Iterable[tuple[str, str]]
) -> None:
    status, body = _connect_error(error)
    length = (b"content-length", b"%d" % len(body))
    extra = ((name.encode(), value.encode()) for name, value in headers)
    await send({"type": "http.response.start", "status": status, "headers": [*_JSON_RESPONSE_HEADERS, length, *extra]})
    await send({"type": "http.response.body", "body": body})


# The Connect protocol's HTTP status for each error code of a unary call (connectrpc.com/docs/protocol).
_HTTP_STATUS = {
    Code.CANCELED: 499,
    Code.UNKNOWN: 500,
    Code.INVALID_ARGUMENT: 400,
    Code.DEADLINE_EXCEEDED: 504,
    Code.NOT_FOUND: 404,
    Code.ALREADY_EXISTS: 409,
    Code.PERMISSION_DENIED: 403,
    Code.RESOURCE_EXHAUSTED: 429,
    Code.FAILED_PRECONDITION: 400,
    Code.ABORTED: 409,
    Code.OUT_OF_RANGE: 400,
    Code.UNIMPLEMENTED: 501,
    Code.INTERNAL: 500,
    Code.UNAVAILABLE: 503,
    Code.DATA_LOSS: 500,
    Code.UNAUTHENTICATED: 401,
}
_TYPE_URL_PREFIX = "type.googleapis.com/"


def _connect_error(error: Exception) -> tuple[int, bytes]:
    """A unary call's Connect error: its HTTP status and JSON body (``code``, ``message``, and ``details`` with
    each google.rpc detail as its type, unpadded base64 of its bytes, and its JSON as ``debug``). Anything
    but a ConnectError is UNKNOWN, as connect-python answers it."""
    if isinstance(error, ConnectError):
        code, message, details = error.code, error.message, error.details
    else:
        code, message, details = Code.UNKNOWN, str(error), ()
    document: dict[str, Any] = {"code": code.value, "message": message}
    if details:
        document["details"] = [_error_detail(detail) for detail in details]
    # ASCII escapes: a message may quote a client's text, lone surrogates included, which UTF-8 cannot carry.
    return _HTTP_STATUS.get(code, 500), json.dumps(document).encode()


def _error_detail(detail: AnyMessage) -> dict[str, Any]:
    name = detail.type_url.removeprefix(_TYPE_URL_PREFIX)
    document: dict[str, Any] = {"type": name, "value": base64.b64encode(detail.value).decode().rstrip("=")}
    with contextlib.suppress(KeyError):  # a type this process does not know goes without its JSON
        message = message_factory.GetMessageClass(descriptor_pool.Default().FindMessageTypeByName(name))()
        if detail.Unpack(message):
            document["debug"] = json_format.MessageToDict(message)
    return document


_TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8", ".js": "text/javascript"}
_STATIC_HEADERS = [
    (b"cache-control", b"no-cache"),
    (b"content-security-policy", b"default-src 'self'; connect-src 'self'; frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
]


def _load_board(root: Path) -> dict[str, tuple[bytes, bytes]]:
    """The board's files by URL path, read once: a handful of small files, served from memory."""
    files = {
        f"/{path.name}": (path.read_bytes(), _TYPES.get(path.suffix, "application/octet-stream").encode())
        for path in root.iterdir()
        if path.is_file()
    }
    if "/index.html" in files:
        files["/"] = files["/index.html"]
    return files


async def _static(
    files: dict[str, tuple[bytes, bytes]], scope: dict[str, Any], send: Callable[..., Awaitable[Any]]
) -> None:
    found = files.get(scope["path"])
    if scope["method"] not in ("GET", "HEAD") or found is None:
        await _plain(send, 404, "not found")
        return
    body, content_type = found
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", content_type), *_STATIC_HEADERS]}
    )
    await send({"type": "http.response.body", "body": body if scope["method"] == "GET" else b""})


def _content_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit():
            return int(value)
    return None


async def _plain(send: Callable[..., Awaitable[Any]], status: int, text: str) -> None:
    await _send(send, status, b"text/plain; charset=utf-8", text)


async def _send(send: Callable[..., Awaitable[Any]], status: int, content_type: bytes, text: str) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]})
    await send({"type": "http.response.body", "body": text.encode()})


# A development coordinator whose default HTTP port is taken (another coordinator, or any program, on this
# machine) serves on the next free one of these, said plainly in its banner, rather than without a board.
FALLBACK_PORTS = 9


class HttpFace:
    """Serves ``build_app`` on ``host:port`` with uvicorn's HTTP/1.1 protocol, on the running event loop, behind
    the guard of inbox_wire/http_guard.py (which the MCP server's HTTP transport serves behind too)."""

    def __init__(
        self,
        app: ASGIApp,
        listen: str,
        *,
        ssl_certfile: str | None = None,
        ssl_keyfile: str | None = None,
        ssl_client_ca: str | None = None,
        guard: HttpGuardSettings | None = None,
        reporter: Reporter | None = None,
    ) -> None:
        host, _, port = listen.rpartition(":")
        self._host, self._port = host.strip("[]"), int(port)
        self._guard = guard or HttpGuardSettings()
        self._reporter = reporter or Reporter()
        self._config = uvicorn.Config(
            app,
            lifespan="off",
            http="httptools",  # C parser: h11 (pure Python) doubled the CPU of a call (docs/performance.md)
            ws="none",  # no WebSocket: an upgrade request is answered as any other request
            log_config=None,
            access_log=False,  # the RpcObserver logs every call, as for gRPC
            server_header=False,  # "server: uvicorn" tells a stranger what to attack, and nobody else anything
            proxy_headers=False,  # the peer logged is the connection's; X-Forwarded-For is anyone's to write
            ssl_certfile=ssl_certfile,
            ssl_keyfile=ssl_keyfile,
            # mTLS as on the gRPC port: with a client CA every client presents a certificate it signed.
            ssl_ca_certs=ssl_client_ca,
            ssl_cert_reqs=ssl.CERT_REQUIRED if ssl_client_ca else ssl.CERT_NONE,
            timeout_graceful_shutdown=1,
        )
        self._socket: socket.socket | None = None
        # The port asked for, when it was taken and start(fall_back=True) served on another one.
        self.taken_port: int | None = None
        self._server: GuardedServer | None = None

    @property
    def connection_cap(self) -> int:
        assert self._server is not None
        return self._server.cap

    async def start(self, *, fall_back: bool = False) -> None:
        """Binds and serves. ``fall_back``: when the port is taken, the next :data:`FALLBACK_PORTS` ports are
        tried, then any free one (:attr:`taken_port` says which was asked for)."""
        cap = connection_cap(self._guard.max_connections)
        # Bound here, not by uvicorn, whose bind failure is a SystemExit that would end the whole process.
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        candidates = [self._port]
        if fall_back and self._port:
            candidates += [*range(self._port + 1, min(self._port + 1 + FALLBACK_PORTS, 65536)), 0]
        self._socket = self._bind(family, candidates)
        self.taken_port = self._port if self._socket.getsockname()[1] != self._port and self._port else None
        # No Nagle delay on the connections it accepts (Linux copies the option to them): asyncio sets it only on
        # sockets made with proto IPPROTO_TCP, which create_server's are not, and uvicorn writes an answer's
        # head and body apart, so the body waited for the client's delayed ACK: 40 ms per call on a kept-alive
        # connection (docs/performance.md#the-httpjson-face-python--m-bench-http).
        self._socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._server = GuardedServer(self._config, self._socket, guard=self._guard, reporter=self._reporter, cap=cap)
        await self._server.start()

    def _bind(self, family: socket.AddressFamily, ports: list[int]) -> socket.socket:
        """A listening socket on the first of ``ports`` that is free; only a taken port moves on to the next."""
        for port in ports[:-1]:
            try:
                return socket.create_server((self._host, port), family=family, backlog=1024)
            except OSError as error:
                if error.errno != errno.EADDRINUSE:
                    raise
        return socket.create_server((self._host, ports[-1]), family=family, backlog=1024)

    @property
    def address(self) -> str:
        assert self._socket is not None
        host, port = self._socket.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    async def stop(self) -> None:
        if self._server is None:
            return
        await self._server.stop()
        if self._socket is not None:
            self._socket.close()
