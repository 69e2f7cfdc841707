"""The email MCP server behind the guard: one connection, made again when it breaks, and what became of a request.

A stdio upstream is a process the guard starts; a URL upstream, a streamable HTTP endpoint. Either can die, hang
or answer more than anyone should read. So:

- the connection lives in a task of its own; when it ends (the process exited, its output ended, the HTTP
  transport failed) or a request finds it broken, it is closed (the process stopped) and the next request
  connects again (the command started anew, the URL reached again);
- every request has a total deadline (``call_timeout``): a clock around the whole request, which no keep-alive
  ping or trickle of bytes can extend;
- an answer over ``max_answer_bytes`` is not read: counted as it arrives, dropped past the limit (a stdio
  connection is then ended, since its stream cannot be resynchronised; an HTTP answer fails alone);
- each request knows whether it was **handed over**: written whole to the process's stdin, or sent to the HTTP
  server (a connection that could not be made sent nothing). A request that failed before it was handed over
  certainly did nothing upstream; one that failed after may have.

``reachable()`` proves the upstream answers now (a ``ping``, or ``server/discover`` in the 2026-07-28 protocol,
within ``probe_timeout``, after connecting again once if it must): the guard asks before a send's commit point,
so that a send never passes BeginSend towards an upstream it cannot reach.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import anyio.abc
import httpx2
import mcp_types as types
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp import Client, StdioServerParameters
from mcp.client.stdio import get_default_environment
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import BaseModel, ConfigDict

log = logging.getLogger("inbox_claims.mcp")

DEFAULT_CALL_TIMEOUT = 60.0
"""Seconds an upstream request may take in all (``--upstream-timeout``): well inside the coordinator's send
timeout (120 s), so that the guard, not the sweeper, says what became of a send."""
DEFAULT_MAX_ANSWER_BYTES = 16 << 20
"""The largest upstream answer read (``--upstream-max-bytes``): an email with its attachments, base64."""
PROBE_TIMEOUT = 5.0
"""Seconds the upstream has to answer the probe before a send."""
CONNECT_TIMEOUT = 60.0
"""Seconds a new connection may take (a process started, its handshake answered: ``npx -y`` may fetch a package
first)."""
_STOP_GRACE_S = 2.0
_SERVER_INFO = "io.modelcontextprotocol/serverInfo"


class UpstreamFailed(Exception):
    """A request the upstream did not answer. ``handed_over``: it reached the upstream (which may have acted on
    it); when False, it certainly did nothing there."""

    def __init__(self, reason: str, *, handed_over: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.handed_over = handed_over


class UpstreamMismatch(UpstreamFailed):
    """The upstream is there, but does not list a tool the guard was told fences its replies."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason, handed_over=False)


@dataclasses.dataclass
class _Attempt:
    handed_over: bool = False


# The request being made in this task, so that the transport (called in the same task, or a copy of its context)
# can say that it handed the request over.
_ATTEMPT: contextvars.ContextVar[_Attempt | None] = contextvars.ContextVar(
    "inbox_claims_upstream_attempt", default=None
)


def _handed_over() -> None:
    attempt = _ATTEMPT.get()
    if attempt is not None:
        attempt.handed_over = True


def _size(limit: int) -> str:
    return f"{limit / (1 << 20):g} MiB" if limit >= 1 << 20 else f"{limit} bytes"


class _Raw(BaseModel):
    """A result exactly as the upstream sent it: every field kept as it came (no field of ours to fill)."""

    model_config = ConfigDict(extra="allow")

    def document(self) -> dict[str, Any]:
        return dict(self.__pydantic_extra__ or {})


# --- stdio: a process, with handed-over writes and counted reads ----------------------------------------------


class _Ended:
    """Why a connection ended, said once by whoever saw it first, and an event for whoever waits for it."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.why: str | None = None

    def end(self, why: str) -> None:
        if self.why is None:
            self.why = why
        self.event.set()


class _Writes:
    """The write side of a stdio connection: each message written whole to the process's stdin before ``send``
    returns, so that a request is handed over exactly when its bytes are in the pipe."""

    def __init__(self, process: anyio.abc.Process, ended: _Ended) -> None:
        assert process.stdin is not None
        self._stdin = process.stdin
        self._ended = ended
        self._lock = anyio.Lock()

    async def send(self, item: SessionMessage, /) -> None:
        data = (item.message.model_dump_json(by_alias=True, exclude_unset=True) + "\n").encode()
        async with self._lock:
            if self._ended.why is not None:
                raise anyio.BrokenResourceError(self._ended.why)
            try:
                await self._stdin.send(data)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as error:
                self._ended.end(f"it stopped reading its input ({error or type(error).__name__})")
                raise anyio.BrokenResourceError(self._ended.why) from error
        if isinstance(item.message, types.JSONRPCRequest):
            _handed_over()

    async def aclose(self) -> None:
        with contextlib.suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            await self._stdin.aclose()

    async def __aenter__(self) -> _Writes:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class StdioTransport:
    """An MCP ``Transport`` to a command over stdio, for the SDK's ``Client``: the process in a session of its
    own (so that stopping it stops what it started), its stderr the guard's, its answers counted as they arrive
    and refused past ``max_answer_bytes``, its requests handed over when written."""

    def __init__(self, params: StdioServerParameters, *, max_answer_bytes: int) -> None:
        self._params = params
        self._max = max_answer_bytes
        self.ended = _Ended()
        self._process: anyio.abc.Process | None = None
        self._tasks: anyio.abc.TaskGroup | None = None

    async def __aenter__(self) -> tuple[MemoryObjectReceiveStream[SessionMessage | Exception], _Writes]:
        params = self._params
        environment = get_default_environment() | (params.env or {})
        try:
            self._process = await anyio.open_process(
                [params.command, *params.args],
                env=environment,
                cwd=params.cwd,
                stderr=None,  # the guard's own stderr: what the server says there reaches the person running it
                start_new_session=True,
            )
        except OSError as error:
            self.ended.end(f"{params.command} could not be started: {error.strerror or error}")
            raise
        sender, receiver = anyio.create_memory_object_stream[SessionMessage | Exception](0)
        self._tasks = await anyio.create_task_group().__aenter__()
        self._tasks.start_soon(self._read, sender)
        self._tasks.start_soon(self._watch_exit)
        return receiver, _Writes(self._process, self.ended)

    async def _watch_exit(self) -> None:
        assert self._process is not None
        code = await self._process.wait()
        self.ended.end(f"it exited (status {code})")

    async def _read(self, sender: MemoryObjectSendStream[SessionMessage | Exception]) -> None:
        """Each line of stdout, parsed; a line over the limit ends the connection, unread."""
        assert self._process is not None
        assert self._process.stdout is not None
        line = bytearray()
        async with sender:
            try:
                async for chunk in self._process.stdout:
                    start = 0
                    while start <= len(chunk):
                        newline = chunk.find(b"\n", start)
                        end = len(chunk) if newline < 0 else newline
                        if len(line) + end - start > self._max:
                            self.ended.end(f"it answered more than {_size(self._max)} (--upstream-max-bytes), unread")
                            return
                        line += chunk[start:end]
                        if newline < 0:
                            break
                        start = newline + 1
                        if line.strip():
                            await sender.send(_parsed(bytes(line)))
                        line.clear()
            except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
                pass
            with anyio.move_on_after(1.0):  # its output ends as it exits: say how it exited, when it did
                await self._process.wait()
            code = self._process.returncode
            self.ended.end(f"it exited (status {code})" if code is not None else "its output ended")

    async def __aexit__(self, *exc: object) -> None:
        process = self._process
        if process is not None:
            with anyio.CancelScope(shield=True):
                if process.stdin is not None:
                    with contextlib.suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                        await process.stdin.aclose()
                # The MCP shutdown: stdin closed, a grace period, then the process group is stopped.
                with anyio.move_on_after(_STOP_GRACE_S):
                    await process.wait()
                for stop in (signal.SIGTERM, signal.SIGKILL):
                    if process.returncode is not None:
                        break
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(process.pid, stop)
                    with anyio.move_on_after(_STOP_GRACE_S):
                        await process.wait()
                with contextlib.suppress(OSError):
                    await process.aclose()
        if self._tasks is not None:
            self._tasks.cancel_scope.cancel()
            with contextlib.suppress(BaseException):
                await self._tasks.__aexit__(None, None, None)
        self.ended.end("closed")


def _parsed(line: bytes) -> SessionMessage | Exception:
    try:
        return SessionMessage(types.jsonrpc_message_adapter.validate_json(line, by_name=False))
    except ValueError as error:
        return error


# --- HTTP: handed over once the server was reached, answers counted ------------------------------------------


class AnswerTooLarge(httpx2.StreamError):
    """An HTTP answer over the limit (the SDK answers the request with a parse error naming this)."""


class _Counted(httpx2.AsyncByteStream):
    def __init__(self, stream: httpx2.AsyncByteStream, limit: int) -> None:
        self._stream = stream
        self._limit = limit

    async def __aiter__(self) -> AsyncIterator[bytes]:
        total = 0
        async for chunk in self._stream:
            total += len(chunk)
            if total > self._limit:
                raise AnswerTooLarge(
                    f"the email MCP server answered more than {_size(self._limit)} (--upstream-max-bytes)"
                )
            yield chunk

    async def aclose(self) -> None:
        await self._stream.aclose()


class _TrackedTransport(httpx2.AsyncBaseTransport):
    """The HTTP client's transport: a POST that reached the server hands its request over; a JSON answer is
    counted (an event stream is bounded per event by the SDK's ``max_sse_event_size``)."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, limit: int) -> None:
        self._inner = inner
        self._limit = limit

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        try:
            response = await self._inner.handle_async_request(request)
        except (httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.PoolTimeout):
            raise  # no connection: nothing was sent
        except BaseException:
            if request.method == "POST":
                _handed_over()  # the request may have reached the server before this failed
            raise
        if request.method == "POST":
            _handed_over()
        if not response.headers.get("content-type", "").lower().startswith("text/event-stream"):
            response.stream = _Counted(response.stream, self._limit)  # type: ignore[arg-type]
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


@contextlib.asynccontextmanager
async def _http(url: str, limit: int) -> AsyncIterator[Any]:
    http = httpx2.AsyncClient(
        transport=_TrackedTransport(httpx2.AsyncHTTPTransport(), limit),
        # A read timeout per chunk would let keep-alive pings extend a call forever: the call's own deadline
        # bounds it instead; connecting and writing are bounded here.
        timeout=httpx2.Timeout(30.0, read=None),
    )
    async with http, streamable_http_client(url, http_client=http, max_sse_event_size=limit) as streams:
        yield streams


# --- the upstream --------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Connection:
    ended: _Ended = dataclasses.field(default_factory=_Ended)
    client: Client | None = None
    owner: asyncio.Task[None] | None = None
    stdio: StdioTransport | None = None
    mismatch: str | None = None
    checked: bool = False

    def why(self, otherwise: str = "its connection ended") -> str:
        """Why it ended, as whoever saw it first said (the process's transport knows best)."""
        said = self.stdio.ended.why if self.stdio is not None else None
        if said not in (None, "closed"):
            return str(said)
        return self.ended.why if self.ended.why not in (None, "closed") else otherwise


Check = Callable[[list[dict[str, Any]]], str | None]
"""Reads the upstream's whole tool list; answers why the guard cannot work with it, or None."""


class Upstream:
    """The email MCP server behind the guard, through the SDK's client: raw requests and raw results.

    ``async with Upstream.to(target) as upstream:`` (a command or a URL, over the transports above); in tests,
    ``Upstream(lambda: Client(server))`` (an in-memory server: what is handed over is not known there, so a
    failed request counts as handed over). ``check`` reads the tool list after every new connection.
    """

    def __init__(
        self,
        connect: Callable[[], Client],
        *,
        call_timeout: float = DEFAULT_CALL_TIMEOUT,
        probe_timeout: float = PROBE_TIMEOUT,
        connect_timeout: float | None = None,
        check: Check | None = None,
        tracks_handover: bool = False,
    ) -> None:
        self._connect = connect
        self.call_timeout = call_timeout
        self.probe_timeout = min(probe_timeout, call_timeout)
        self.connect_timeout = connect_timeout if connect_timeout is not None else CONNECT_TIMEOUT
        self.check = check
        self._tracks_handover = tracks_handover
        self._connection: _Connection | None = None
        self._said: tuple[types.Implementation | None, types.ServerCapabilities, str | None] = (
            None,
            types.ServerCapabilities(),
            None,
        )
        self._stop = asyncio.Event()
        self._opening = asyncio.Lock()
        self.connections = 0
        """How many connections were made (the first, then each one made again)."""

    @classmethod
    def to(
        cls,
        target: StdioServerParameters | str,
        *,
        call_timeout: float = DEFAULT_CALL_TIMEOUT,
        max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
        probe_timeout: float = PROBE_TIMEOUT,
        connect_timeout: float | None = None,
        check: Check | None = None,
    ) -> Upstream:
        """The upstream at ``target``: a command (stdio) or a streamable HTTP URL."""

        def connect() -> Client:
            if isinstance(target, str):
                return Client(_http(target, max_answer_bytes))
            return Client(StdioTransport(target, max_answer_bytes=max_answer_bytes))

        return cls(
            connect,
            call_timeout=call_timeout,
            probe_timeout=probe_timeout,
            connect_timeout=connect_timeout,
            check=check,
            tracks_handover=True,
        )

    @property
    def instructions(self) -> str | None:
        """What the upstream said, when it was last connected."""
        return self._said[2]

    @property
    def capabilities(self) -> types.ServerCapabilities:
        """What the upstream offered when it was last connected."""
        return self._said[1]

    @property
    def server_info(self) -> types.Implementation | None:
        """Who the upstream said it is (name, version), when it was last connected."""
        return self._said[0]

    async def __aenter__(self) -> Upstream:
        await self._live()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        connection = self._connection
        if connection is not None and connection.owner is not None:
            await asyncio.wait([connection.owner])

    # -- the connection --------------------------------------------------------------------------------------

    async def _live(self) -> _Connection:
        """The connection, made (again) when there is none or it ended, and checked (``check``)."""
        async with self._opening:
            connection = self._connection
            if connection is None or connection.ended.event.is_set():
                connection = self._connection = _Connection()
                ready = asyncio.Event()
                connection.owner = asyncio.create_task(self._own(connection, ready), name="inbox-claims upstream")
                await ready.wait()
                if connection.client is None:
                    why = connection.why("no reason given")
                    raise UpstreamFailed(f"it cannot be reached: {why}", handed_over=False)
                self.connections += 1
            if not connection.checked or connection.mismatch is not None:
                await self._check(connection)
            if connection.mismatch is not None:
                raise UpstreamMismatch(connection.mismatch)
            return connection

    async def _own(self, connection: _Connection, ready: asyncio.Event) -> None:
        unopened = self._connect()
        transport = unopened.server
        stdio = connection.stdio = transport if isinstance(transport, StdioTransport) else None
        try:
            async with contextlib.AsyncExitStack() as stack:
                async with asyncio.timeout(self.connect_timeout):
                    client = await stack.enter_async_context(unopened)
                connection.client = client
                self._said = (client.server_info, client.server_capabilities, client.instructions)
                ready.set()
                waits = [asyncio.ensure_future(self._stop.wait()), asyncio.ensure_future(connection.ended.event.wait())]
                if stdio is not None:
                    waits.append(asyncio.ensure_future(stdio.ended.event.wait()))
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for wait in waits:
                        wait.cancel()
                if stdio is not None and stdio.ended.why is not None:
                    connection.ended.end(stdio.ended.why)
        except TimeoutError:
            connection.ended.end(f"it did not answer within {self.connect_timeout:g} s of being started")
        except Exception as error:  # the upstream went away; the next request connects again
            said = stdio.ended.why if stdio is not None else None
            connection.ended.end(said if said not in (None, "closed") else _first_leaf(error))
        finally:
            connection.client = None
            if not self._stop.is_set() and connection.ended.why not in (None, "closed"):
                log.warning("the connection to the email MCP server ended: %s", connection.ended.why)
            connection.ended.end("closed")
            ready.set()

    def _broken(self, connection: _Connection, why: str) -> None:
        """The connection cannot be used: it is closed (the process stopped), and the next request connects again."""
        connection.ended.end(why)

    def lost_a_tool(self, why: str) -> None:
        """A tool list the guard forwarded lacks a tool it fences: nothing passes until a check finds it again."""
        if self._connection is not None:
            self._connection.mismatch = why

    async def _check(self, connection: _Connection) -> None:
        connection.checked = True
        if self.check is None:
            return
        tools = await self._all_tools(connection)
        connection.mismatch = self.check(tools)

    async def _all_tools(self, connection: _Connection) -> list[dict[str, Any]]:
        tools: list[dict[str, Any]] = []
        cursor: str | None = None
        for _page in range(100):  # a paginator that never ends cannot hang the guard
            params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
            page = await self._send(connection, types.ListToolsRequest(params=params))
            tools += [tool for tool in page.get("tools") or () if isinstance(tool, dict)]
            cursor = page.get("nextCursor")
            if not cursor:
                break
        return tools

    # -- requests --------------------------------------------------------------------------------------------

    async def reachable(self) -> None:
        """Returns once the upstream answered a probe; raises ``UpstreamFailed`` (never handed over) when it
        cannot be reached, even after connecting again once."""
        for last in (False, True):
            connection = await self._live()
            client = connection.client
            if client is None:
                continue
            modern = client.protocol_version in MODERN_PROTOCOL_VERSIONS
            probe: types.Request[Any, Any] = types.DiscoverRequest() if modern else types.PingRequest()
            try:
                async with asyncio.timeout(self.probe_timeout):
                    await client.session.send_request(probe, _Raw)
                return
            except MCPError as error:
                if error.code != types.CONNECTION_CLOSED:
                    return  # it answered, if only to refuse the probe: it is there
                why = connection.why()
            except TimeoutError:
                why = f"it did not answer within {self.probe_timeout:g} s"
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                why = connection.why()
            self._broken(connection, why)
            if last:
                raise UpstreamFailed(why, handed_over=False)
        raise UpstreamFailed("it cannot be reached", handed_over=False)

    async def request(self, request: types.Request[Any, Any]) -> dict[str, Any]:
        """Sends ``request`` and answers the upstream's result as it came; a request that failed before it was
        handed over is sent once more on a new connection. Raises ``UpstreamFailed``, or ``MCPError`` with the
        upstream's own JSON-RPC error.

        A result of a server of the handshake era has no ``resultType``, which means "complete" (the 2026-07-28
        protocol's own bridge): said, so that it reaches a downstream client of either era (for one of the
        handshake era, the field is dropped again). The ``serverInfo`` stamp a 2026-era server puts on each
        result names the upstream: it is left out."""
        try:
            document = await self._send(await self._live(), request)
        except UpstreamFailed as failure:
            if failure.handed_over or isinstance(failure, UpstreamMismatch):
                raise
            document = await self._send(await self._live(), request)  # it never got there: once more, anew
        document.setdefault("resultType", "complete")
        meta = document.get("_meta")
        if isinstance(meta, dict) and _SERVER_INFO in meta:
            # The upstream connection's stamp, not the result's: the guard's own goes on what it answers.
            document["_meta"] = {key: value for key, value in meta.items() if key != _SERVER_INFO}
            if not document["_meta"]:
                del document["_meta"]
        return document

    async def _send(self, connection: _Connection, request: types.Request[Any, Any]) -> dict[str, Any]:
        client = connection.client
        if client is None:
            raise UpstreamFailed(connection.why(), handed_over=False)
        attempt = _Attempt(handed_over=not self._tracks_handover)
        token = _ATTEMPT.set(attempt)
        try:
            async with asyncio.timeout(self.call_timeout):
                return (await client.session.send_request(request, _Raw)).document()
        except TimeoutError:
            raise UpstreamFailed(
                f"it did not answer within {self.call_timeout:g} s (--upstream-timeout)",
                handed_over=attempt.handed_over,
            ) from None
        except MCPError as error:
            if error.code != types.CONNECTION_CLOSED:
                raise
            why = connection.why()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            why = connection.why()
        finally:
            _ATTEMPT.reset(token)
        self._broken(connection, why)
        raise UpstreamFailed(why, handed_over=attempt.handed_over)

    async def list_tools(self, params: types.PaginatedRequestParams | None) -> dict[str, Any]:
        return await self.request(types.ListToolsRequest(params=params))

    async def call_tool(self, params: types.CallToolRequestParams) -> dict[str, Any]:
        return await self.request(types.CallToolRequest(params=params))


def _first_leaf(error: BaseException) -> str:
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return str(error) or type(error).__name__
