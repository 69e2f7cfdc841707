"""What a connection to an HTTP face may cost before the application sees it, below uvicorn's ASGI machinery: the
coordinator's HTTP/JSON face and the MCP server's streamable HTTP both serve behind it (``GuardedServer``), which is
why it lives in this package, imported by both and importing neither (docs/design.md#architecture).

gRPC bounds a call's headers (HTTP/2 frames), cuts a request that does not arrive within --request-timeout and
holds each client to its own HTTP/2 connection; uvicorn on httptools does none of that: it buffers a request
head of any size (one 200 MiB header line took the coordinator from 88 to 438 MiB) and keeps any connection
open for as long as the client likes (2,000 idle ones were all open after a minute, and with 1,024 descriptors
1,100 of them starved gRPC's accept: health DEADLINE_EXCEEDED). So:

- every byte of a request head is counted as it arrives, before the parser buffers it: the request line, each
  header line, the number of headers and their total are capped (``HeadLimits``), and a head over a cap is
  answered 414 or 431 and the connection closed;
- a connection has a deadline for whatever it owes: its request head (--http-header-timeout, from the
  connection's first byte or its first byte after an answer), its body (--request-timeout, as for gRPC), and an
  idle keep-alive connection is closed after --http-idle-timeout;
- ``Listener`` accepts connections itself, counts them from accept to close (TLS handshake included) and
  refuses those over the cap at once, with a 503 on plaintext, so that HTTP never holds more descriptors than
  the cap, which is below the process's limit by a stated reserve for gRPC, etcd and files
  (``connection_cap``), and the soft limit is raised to the hard one at start (``raise_descriptor_limit``);
- ``HostPolicy`` says which Host names the face answers to and which Origins may call it (DNS rebinding: a
  page on evil.example resolving to 127.0.0.1 is same-origin to the browser, so only the Host header tells).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import resource
import socket
import ssl
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from inbox_wire.addresses import is_ip, is_loopback

log = logging.getLogger(__name__)

# Kept free for everything but HTTP connections: gRPC's listener and its clients' connections, the etcd
# channels, the embedded etcd's pipes, log and token files, grpc's own wake-up descriptors. The HTTP face takes
# at most the process's descriptor limit less this many.
DESCRIPTOR_RESERVE = 256
# Beyond this the descriptor limit is not worth raising to (an unlimited hard limit means any number).
_DESCRIPTOR_CEILING = 1 << 20


@dataclass(frozen=True)
class HeadLimits:
    """The request head a client may send: what nginx and Node allow by default, 10 to 100 times what any call
    of this API needs (a bearer token is under 100 bytes)."""

    request_line_max_bytes: int = 8 << 10
    header_line_max_bytes: int = 8 << 10
    header_count_max: int = 100
    head_max_bytes: int = 32 << 10  # request line and every header line together


@dataclass(frozen=True)
class HttpGuardSettings:
    head: HeadLimits = HeadLimits()
    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    idle_timeout_s: float = 30.0
    max_connections: int = 1000
    server: str = "this coordinator"
    """Who refuses, in a refusal's words."""
    elsewhere: str = ", or use gRPC"
    """What else a client refused for capacity may do."""
    reserved_for: str = "gRPC and etcd"
    """What the descriptors kept from HTTP are for, in the refusal to start without any for it."""


class Reporter:
    """Where the guard says what it did: the open-connection gauge and a count of refusals by reason, and at
    most one log line per reason every ``interval_s`` (an attack would otherwise write a line per connection)."""

    def __init__(
        self,
        open_connections: Callable[[int], None] = lambda _count: None,
        refused: Callable[[str], None] = lambda _reason: None,
        interval_s: float = 60.0,
    ) -> None:
        self._open_connections = open_connections
        self._refused = refused
        self._interval_s = interval_s
        self._said: dict[str, tuple[float, int]] = {}

    def connections(self, count: int) -> None:
        self._open_connections(count)

    def refusal(self, reason: str, message: str, *, level: int = logging.INFO) -> None:
        self._refused(reason)
        now = time.monotonic()
        last, unsaid = self._said.get(reason, (-self._interval_s, 0))
        if now - last < self._interval_s:
            self._said[reason] = (last, unsaid + 1)
            return
        self._said[reason] = (now, 0)
        more = f" ({unsaid} more since the last line like this)" if unsaid else ""
        log.log(level, "HTTP: %s%s", message, more, extra={"fields": {"event": "http_refused", "reason": reason}})


# How long a refused connection is read (and what comes dropped) after its answer, so that the client reads the
# answer rather than a reset.
LINGER_S = 2.0

# --- the request head, counted before it is parsed -----------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    status: int
    reason: str
    message: str


class HeadScanner:
    """Counts one request head's bytes as they arrive (lines end at LF; an empty line ends the head), and says
    which limit a head goes over the moment it does, so that no more of it is buffered."""

    def __init__(self, limits: HeadLimits) -> None:
        self._limits = limits
        self.reset()

    def reset(self) -> None:
        self.done = False
        self.total = 0
        self._line = 0  # bytes of the line being read, its LF included once it came
        self._lines = 0  # complete lines of the head so far, the request line first

    @property
    def started(self) -> bool:
        return self.total > 0

    def feed(self, data: bytes) -> Refusal | None:
        limits = self._limits
        position, size = 0, len(data)
        while position < size and not self.done:
            end = data.find(b"\n", position)
            stop = size if end < 0 else end + 1
            self._line += stop - position
            self.total += stop - position
            position = stop
            if self._lines == 0 and self._line > limits.request_line_max_bytes + 2:
                return Refusal(
                    414, "request_line_too_long", f"the request line is over {limits.request_line_max_bytes} bytes"
                )
            if self._lines > 0 and self._line > limits.header_line_max_bytes + 2:
                return Refusal(431, "header_too_long", f"a header line is over {limits.header_line_max_bytes} bytes")
            if self.total > limits.head_max_bytes:
                return Refusal(
                    431, "headers_too_large", f"the request's headers are over {limits.head_max_bytes} bytes"
                )
            if end < 0:
                break
            if self._line <= 2:  # an empty line: the end of the head (or, before the request line, ignored)
                self.done = self._lines > 0
            else:
                self._lines += 1
                if self._lines - 1 > limits.header_count_max:
                    return Refusal(431, "too_many_headers", f"the request has over {limits.header_count_max} headers")
            self._line = 0
        return None


def plain_response(status: int, phrase: str, body: bytes, content_type: bytes) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection, for refusals made below the application."""
    head = f"HTTP/1.1 {status} {phrase}\r\ncontent-length: {len(body)}\r\nconnection: close\r\n".encode()
    return head + b"content-type: " + content_type + b"\r\n\r\n" + body


def error_response(status: int, phrase: str, code: str, message: str) -> bytes:
    """A refusal as a Connect error body, the shape every other error of the face has."""
    return plain_response(status, phrase, json.dumps({"code": code, "message": message}).encode(), b"application/json")


_PHRASES = {408: "Request Timeout", 414: "URI Too Long", 431: "Request Header Fields Too Large"}


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the head counted before it is parsed, and a deadline on what the client
    owes: its head (from the connection's start, or from its first byte after an answer), then its body, and
    on a kept-alive connection between requests its next request (in place of uvicorn's keep-alive timer)."""

    def __init__(self, *, guard: HttpGuardSettings, reporter: Reporter, release: Callable[[], None], **uvicorn: Any):
        super().__init__(**uvicorn)
        self._guard = guard
        self._reporter = reporter
        self._release = release
        self._head = HeadScanner(guard.head)
        self._deadline: asyncio.TimerHandle | None = None
        self._refused = False
        self._answering = False  # the request is in; its answer is being written
        self._idle = False  # answered, and nothing of the next request came yet
        self._certificate_names: tuple[str, ...] = ()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._certificate_names = certificate_names(transport.get_extra_info("peercert"))
        self._await_head()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._certificate_names:
            cast(dict[str, Any], self.scope)["extensions"] = {"tls": {CERTIFICATE_NAMES: self._certificate_names}}

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        try:
            super().connection_lost(exc)
        finally:
            self._release()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._idle:
            self._idle = False
            self._await_head()  # the first byte of the next request on a kept-alive connection
        if not self._head.done:
            refusal = self._head.feed(data)
            if refusal is not None:
                self._refuse(refusal)
                return
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._set_deadline(self._guard.body_timeout_s, "body")
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._cancel_deadline()
        self._answering = True
        # What comes next on this connection is another request's head: counted from here (a pipelined head
        # in the same read as this body is parsed uncounted, one read's worth at most).
        self._head.reset()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._answering = False
        super().on_response_complete()
        self._unset_keepalive_if_required()  # the idle deadline below instead, of its own length
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return  # closing, or a pipelined request started: it has the deadline it had
        if self._head.started:
            self._await_head()  # a pipelined request's head is on its way: it owes the rest of it
        else:
            self._idle = True
            self._set_deadline(self._guard.idle_timeout_s, "idle")

    def _await_head(self) -> None:
        self._set_deadline(self._guard.header_timeout_s, "header")

    def _set_deadline(self, seconds: float, what: str) -> None:
        self._cancel_deadline()
        self._deadline = self.loop.call_later(seconds, self._expired, what, seconds)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self, what: str, seconds: float) -> None:
        self._deadline = None
        if what == "idle":
            self._close()  # as any keep-alive timeout: nothing to say, the client opens a new connection
            return
        if what == "header" and not self._head.started:
            # A connection that never said anything gets no answer: there is no request to answer.
            self._reporter.refusal("header_timeout", f"a connection sent nothing for {seconds:g} s; closed")
            self._close()
            return
        setting = "--http-header-timeout" if what == "header" else "--request-timeout"
        message = (
            f"the request's {'headers' if what == 'header' else 'body'} did not arrive within {seconds:g} s ({setting})"
        )
        self._reporter.refusal(f"{what}_timeout", message)
        if self.cycle is None or not self.cycle.response_started:
            self._answer_and_close(error_response(408, _PHRASES[408], "deadline_exceeded", message))
        else:
            self._close()

    def _refuse(self, refusal: Refusal) -> None:
        self._reporter.refusal(refusal.reason, f"{refusal.message}; refused with {refusal.status}")
        self._answer_and_close(
            error_response(refusal.status, _PHRASES[refusal.status], "resource_exhausted", refusal.message)
        )

    def _answer_and_close(self, answer: bytes) -> None:
        """Writes ``answer`` and ends the connection so that the client can read it: a close with the client's
        bytes unread would be a reset, which throws away what the client had not read yet. So the answer goes
        with a FIN, what still comes is read and dropped, and the connection closes when the client closes its
        side or after LINGER_S, whichever is first."""
        self._close(linger=True)
        self.transport.write(answer)
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self._deadline = self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()  # TLS: no half close; its close_notify goes first

    def _close(self, *, linger: bool = False) -> None:
        self._refused = True
        self._cancel_deadline()
        if self.cycle is not None:
            self.cycle.keep_alive = False
        if not linger:
            self.transport.close()


# Where a request's scope carries the verified client certificate's names (mTLS), for authentication.
CERTIFICATE_NAMES = "certificate_names"


def certificate_names(peercert: Any) -> tuple[str, ...]:
    """A verified client certificate's common names and DNS names (what gRPC's auth context gives)."""
    if not peercert:
        return ()
    names = [value for rdn in peercert.get("subject", ()) for key, value in rdn if key == "commonName"]
    names += [value for kind, value in peercert.get("subjectAltName", ()) if kind == "DNS"]
    return tuple(dict.fromkeys(names))


# --- connections: accepted here, counted, capped -------------------------------------------------------------


def raise_descriptor_limit() -> tuple[int, int]:
    """Raises the soft RLIMIT_NOFILE to the hard one (systemd and many shells start services at 1,024 with a
    hard limit far above); returns (soft, hard) as they are after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(hard if hard != resource.RLIM_INFINITY else _DESCRIPTOR_CEILING, _DESCRIPTOR_CEILING)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def connection_cap(requested: int, *, reserved_for: str = "gRPC and etcd") -> int:
    """The HTTP connections this process may hold: ``requested``, or fewer when the descriptor limit less
    DESCRIPTOR_RESERVE is lower. OSError when the limit leaves nothing for HTTP."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = requested if soft == resource.RLIM_INFINITY else min(requested, soft - DESCRIPTOR_RESERVE)
    if room < 1:
        raise OSError(
            f"the open-file limit ({soft}) leaves no descriptors for HTTP connections after the {DESCRIPTOR_RESERVE} "
            f"kept for {reserved_for}: raise it (ulimit -n, LimitNOFILE= in systemd) or serve no HTTP face"
        )
    return room


# Accept errors that mean "not now" (out of descriptors or memory, a connection reset before it was taken).
_TRANSIENT_ACCEPT = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED, errno.EPROTO, errno.EPERM}
)


def _over_capacity_answer(settings: HttpGuardSettings) -> bytes:
    message = (
        f"{settings.server} has as many HTTP connections open as it allows (--http-max-connections); retry shortly"
        f"{settings.elsewhere}"
    )
    return plain_response(
        503,
        "Service Unavailable",
        json.dumps({"code": "unavailable", "message": message}).encode(),
        b"application/json",
    )


class Listener:
    """Accepts on ``sock`` and hands each connection to a protocol from ``protocol_factory(release)`` (with TLS
    when ``ssl_context``); a connection counts from accept until the protocol calls ``release`` (or its TLS
    handshake fails), and one over ``cap`` is refused at once."""

    def __init__(
        self,
        sock: socket.socket,
        protocol_factory: Callable[[Callable[[], None]], asyncio.Protocol],
        *,
        cap: int,
        ssl_context: ssl.SSLContext | None,
        handshake_timeout_s: float,
        reporter: Reporter,
        over_capacity: bytes = _over_capacity_answer(HttpGuardSettings()),
    ) -> None:
        self._socket = sock
        self._over_capacity_answer = over_capacity
        self._factory = protocol_factory
        self.cap = cap
        self._ssl = ssl_context
        self._handshake_timeout_s = handshake_timeout_s
        self._reporter = reporter
        self.open = 0
        self._task: asyncio.Task[None] | None = None
        self._handshakes: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self._socket.setblocking(False)
        self._task = asyncio.get_running_loop().create_task(self._accept(), name="http accept")

    async def close(self) -> None:
        """Stops accepting (connections already taken go on until the server closes them)."""
        tasks = [task for task in (self._task, *self._handshakes) if task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                connection, _address = await loop.sock_accept(self._socket)
            except OSError as error:
                if error.errno not in _TRANSIENT_ACCEPT:
                    raise
                if error.errno in (errno.EMFILE, errno.ENFILE):
                    self._reporter.refusal(
                        "out_of_descriptors",
                        f"cannot accept a connection: {error.strerror}; the process is out of descriptors",
                        level=logging.WARNING,
                    )
                await asyncio.sleep(0.1)
                continue
            if self.open >= self.cap:
                self._over_capacity(connection)
                continue
            self.open += 1
            self._reporter.connections(self.open)
            handshake = loop.create_task(self._connect(connection))
            self._handshakes.add(handshake)
            handshake.add_done_callback(self._handshakes.discard)

    def _over_capacity(self, connection: socket.socket) -> None:
        self._reporter.refusal(
            "over_capacity",
            f"{self.open} connections open, the cap (--http-max-connections, within the descriptor limit); "
            "refusing new ones",
            level=logging.WARNING,
        )
        with contextlib.suppress(OSError):
            connection.setblocking(False)
            if self._ssl is None:
                with contextlib.suppress(BlockingIOError):
                    connection.recv(65536)  # what the client sent already: unread, the close would be a reset
                connection.send(self._over_capacity_answer)
        connection.close()

    async def _connect(self, connection: socket.socket) -> None:
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.open -= 1
                self._reporter.connections(self.open)

        loop = asyncio.get_running_loop()
        try:
            await loop.connect_accepted_socket(
                lambda: self._factory(release),
                sock=connection,
                ssl=self._ssl,
                ssl_handshake_timeout=self._handshake_timeout_s if self._ssl is not None else None,
            )
        except (OSError, TimeoutError) as error:  # ssl.SSLError and ConnectionError are OSErrors too
            # The handshake failed or timed out (the transport closed the socket): no protocol ever saw it.
            connection.close()
            release()
            if self._ssl is not None:
                why = getattr(error, "reason", None) or str(error) or type(error).__name__
                self._reporter.refusal("tls_handshake_failed", f"TLS handshake refused: {why}")
        except asyncio.CancelledError:
            connection.close()
            release()
            raise


# --- the server: uvicorn's protocol behind all of the above -------------------------------------------------


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside the caller's loop: the caller owns the signals and the shutdown, and the connections are
    accepted by ``Listener``, so uvicorn opens no listener of its own."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await self.lifespan.startup()
        self.servers = []
        self.started = True


class GuardedServer:
    """``config``'s app served with uvicorn's HTTP/1.1 protocol (httptools) on the running event loop, every
    connection accepted on ``sock`` (listening already) by ``Listener`` and read by ``GuardedHttpProtocol``."""

    def __init__(
        self, config: uvicorn.Config, sock: socket.socket, *, guard: HttpGuardSettings, reporter: Reporter, cap: int
    ) -> None:
        self._config = config
        self._socket = sock
        self._guard = guard
        self._reporter = reporter
        self.cap = cap
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task[None] | None = None
        self._listener: Listener | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(), name="http face")
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise OSError("the HTTP face stopped before it started")
            await asyncio.sleep(0.01)
        server = self._server

        def protocol(release: Callable[[], None]) -> asyncio.Protocol:
            return GuardedHttpProtocol(
                guard=self._guard,
                reporter=self._reporter,
                release=release,
                config=self._config,
                server_state=server.server_state,
                app_state=server.lifespan.state,
            )

        self._listener = Listener(
            self._socket,
            protocol,
            cap=self.cap,
            ssl_context=self._config.ssl,
            handshake_timeout_s=self._guard.header_timeout_s,
            reporter=self._reporter,
            over_capacity=_over_capacity_answer(self._guard),
        )
        self._listener.start()

    @property
    def open_connections(self) -> int:
        return self._listener.open if self._listener is not None else 0

    async def stop(self) -> None:
        if self._task is None:
            return
        if self._listener is not None:
            await self._listener.close()
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


# --- Host and Origin -----------------------------------------------------------------------------------------

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def _host_of(authority: str) -> str:
    """``name:port``, ``[v6]:port``, ``name`` to the lower-case host, without brackets or a trailing dot."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        host = authority[1 : authority.find("]")] if "]" in authority else authority
    else:
        host = authority.rsplit(":", 1)[0] if authority.count(":") == 1 else authority
    return host.rstrip(".")


def _port_of(authority: str, default: int | None) -> int | None:
    authority = authority.strip()
    tail = authority.rsplit("]", 1)[-1] if authority.startswith("[") else authority
    if tail.count(":") == 1:
        port = tail.rsplit(":", 1)[1]
        return int(port) if port.isdigit() else -1
    return default


@dataclass(frozen=True)
class HostPolicy:
    """The Host names the face answers to: those it listens on (the loopback names for a loopback address; any
    IP address and this machine's names for 0.0.0.0 or [::]), and ``extra`` (a deployment behind a proxy). A
    request naming another host is refused: a page on a name that resolves to this address (DNS rebinding) is
    same-origin to the browser, so only the Host header tells it from the board."""

    names: frozenset[str]
    any_ip: bool = False

    @classmethod
    def for_listen(cls, host: str, extra: Iterable[str] = ()) -> HostPolicy:
        host = host.strip("[]").lower()
        names = {_host_of(name) for name in extra if name.strip()}
        wildcard = host in ("", "0.0.0.0", "::", "*")
        if wildcard:
            names |= LOOPBACK_NAMES | {socket.gethostname().lower(), socket.getfqdn().lower()}
        elif is_loopback(host):
            names |= LOOPBACK_NAMES | {host}
        else:
            names.add(host)
        return cls(frozenset(names), any_ip=wildcard)

    def allows_host(self, host_header: str | None) -> bool:
        if host_header is None:
            return True  # HTTP/1.0 without Host: no browser sends that, so no rebinding page can
        host = _host_of(host_header)
        return host in self.names or (self.any_ip and is_ip(host))

    def allows_origin(self, origin: str | None, host_header: str | None) -> bool:
        """Same-origin or not a browser: an Origin (which browsers send with every POST) must name the host and
        port the request was sent to."""
        if origin is None:
            return True
        parts = urlsplit(origin.strip())
        if parts.scheme not in ("http", "https") or not parts.netloc or host_header is None:
            return False  # "null" (a sandboxed frame, a file), or something no browser sends
        default = 443 if parts.scheme == "https" else 80
        return _host_of(parts.netloc) == _host_of(host_header) and _port_of(parts.netloc, default) == _port_of(
            host_header, default
        )

    def describe(self) -> str:
        shown = sorted(self.names) + (["any IP address"] if self.any_ip else [])
        return ", ".join(shown)
