"""Which agent session a tool call belongs to: the one of a stdio process, or, over HTTP, an MCP session or a
claim handle.

Over stdio a process is one session. Over HTTP a client of the 2025 protocol has an MCP session
(``Mcp-Session-Id``, checked by the SDK: an id it did not issue is refused before any tool runs), and that is its
agent session. A client of the 2026-07-28 protocol has no session: each of its calls is a session of its own,
made for the call, unless it passes a claim handle (``claim_handle``) that an earlier answer gave; a session that
holds a claim when its call ends is kept under its handle, one that holds nothing is closed. So two clients
never share a claim unless they pass the same handle, and a session id on such a request is not read at all
(a stale or made-up one can touch nobody's claims). Sessions and handles are capped (``--max-sessions``,
``--max-handles``; one server process acts for one principal, so these are that principal's caps): past a cap,
a call that would keep a claim is refused, saying so. A session idle for the session timeout ends and its
claims are released; so does an MCP session its client closes (its DELETE).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from mcp.server import ServerRequestContext
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from starlette import types as asgi

from .._async import AsyncCoordinator
from ._session import AgentSession, SentReplies

SessionFor = Callable[[ServerRequestContext[Any, Any], str | None, bool], AbstractAsyncContextManager[AgentSession]]
"""``session_for(ctx, claim_handle, keeps_claims)``: the agent session a tool call acts in, for the length of the
call (``keeps_claims``: the call may end holding a claim, as claim_message does)."""

DEFAULT_SESSION_TIMEOUT = 600.0
DEFAULT_MAX_SESSIONS = 100
DEFAULT_MAX_HANDLES = 1000


class SessionCapReached(Exception):
    """Too many sessions or handles hold claims for this principal: said to the model, nothing done."""


class OneSession:
    """Every call in one session: a stdio process's (or a test's). A handle passed is that session's, or
    nothing: there is no other session to act in."""

    def __init__(self, session: AgentSession) -> None:
        self.session = session

    @contextlib.asynccontextmanager
    async def __call__(
        self, ctx: ServerRequestContext[Any, Any], handle: str | None, keeps_claims: bool
    ) -> AsyncIterator[AgentSession]:
        yield self.session


class HttpSessions:
    """The agent sessions of an HTTP server (see the module): by MCP session id, and by claim handle."""

    def __init__(
        self,
        coordinator: AsyncCoordinator,
        *,
        ttl: int,
        timeout: float = DEFAULT_SESSION_TIMEOUT,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        max_handles: int = DEFAULT_MAX_HANDLES,
    ) -> None:
        self._coordinator = coordinator
        self._ttl = ttl
        self._timeout = timeout
        self._max_sessions = max_sessions
        self._max_handles = max_handles
        self._sent = SentReplies()
        self._sessions: dict[str, AgentSession] = {}  # by Mcp-Session-Id
        self._handles: dict[str, AgentSession] = {}  # by claim handle, those that hold (or held) a claim

    @property
    def counts(self) -> tuple[int, int]:
        """(MCP sessions, sessions kept by handle alone), for the tests and the figures."""
        return len(self._sessions), sum(1 for session in self._handles.values() if session.sessionless)

    @contextlib.asynccontextmanager
    async def __call__(
        self, ctx: ServerRequestContext[Any, Any], handle: str | None, keeps_claims: bool
    ) -> AsyncIterator[AgentSession]:
        session = self._find(ctx, handle, keeps_claims)
        try:
            yield session
        finally:
            await self._settle(session)

    def _find(self, ctx: ServerRequestContext[Any, Any], handle: str | None, keeps_claims: bool) -> AgentSession:
        if handle:
            found = self._handles.get(handle)
            if found is not None and not found.ended:
                return found
            # An unknown handle (ended, or never issued) is no handle: the call acts in a session of its own.
        if ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS:
            headers = getattr(ctx.request, "headers", None) or {}
            key = headers.get("mcp-session-id", "")
            if key:
                session = self._sessions.get(key)
                if session is None or session.ended:  # one that is ending (releasing its claims) takes no calls
                    if len(self._sessions) >= self._max_sessions:
                        raise SessionCapReached(
                            f"Nothing was done: {len(self._sessions)} sessions of this agent are open on this server, "
                            f"its most (--max-sessions {self._max_sessions}). Close one, or wait for one unused for "
                            f"{self._timeout:g} s to end (--session-timeout)."
                        )
                    session = self._sessions[key] = self._new(sessionless=False)
                return session
        if keeps_claims and self.counts[1] >= self._max_handles:
            raise SessionCapReached(
                f"Nothing was done: {self.counts[1]} claims of this agent are held by handle on this server, its "
                f"most (--max-handles {self._max_handles}). Release one (release_message with its claim_handle), or "
                f"wait for one unused for {self._timeout:g} s to end (--session-timeout)."
            )
        return self._new(sessionless=True)

    def _new(self, *, sessionless: bool) -> AgentSession:
        return AgentSession(self._coordinator, ttl=self._ttl, sent=self._sent, sessionless=sessionless)

    async def _settle(self, session: AgentSession) -> None:
        """After a call: a session holding a claim (or still at work on one) is kept under its handle; a
        sessionless one holding nothing is closed."""
        if session.held or session.busy:
            self._handles.setdefault(session.handle, session)
            return
        if session.sessionless:
            if self._handles.get(session.handle) is session:
                del self._handles[session.handle]
            await session.close()

    async def sweep(self) -> None:
        while True:
            await asyncio.sleep(min(self._timeout / 4, 30.0))
            now = time.monotonic()
            for key, session in list(self._sessions.items()):
                if now - session.last_used >= self._timeout and not session.busy:
                    await self.end(key)
            for handle, session in list(self._handles.items()):
                if session.sessionless and now - session.last_used >= self._timeout and not session.busy:
                    await self._end_handle(handle, session)

    async def _end_handle(self, handle: str, session: AgentSession) -> None:
        await session.close()
        if self._handles.get(handle) is session:
            del self._handles[handle]

    async def end(self, key: str) -> None:
        """The MCP session ``key`` ended (the client closed it, or it was idle too long): its claims are released."""
        session = self._sessions.get(key)
        if session is not None:
            await session.close()  # still listed meanwhile: a shutdown that interrupts this releases the rest
            if self._sessions.get(key) is session:
                del self._sessions[key]
            if self._handles.get(session.handle) is session:
                del self._handles[session.handle]

    def ending_sessions(self, app: asgi.ASGIApp) -> asgi.ASGIApp:
        """``app``, and when it ends an MCP session at the client's request (a DELETE it accepts), that session's
        claims released before the client hears it is closed, as a stdio session's are when its client leaves.
        A DELETE of the 2026-07-28 protocol, which has no sessions, ends none. The SDK's refusal of a session past
        the cap (``max_sessions``, the same number) is said in the words of ``--max-sessions``."""

        async def serve(scope: asgi.Scope, receive: asgi.Receive, send: asgi.Send) -> None:
            headers = dict(scope.get("headers") or ())
            key = headers.get(b"mcp-session-id", b"").decode("latin-1")
            version = headers.get(b"mcp-protocol-version", b"").decode("latin-1")
            if scope["type"] == "http" and scope["method"] == "POST" and not key:
                await app(scope, receive, self._saying_the_cap(send))
                return
            if scope["type"] != "http" or scope["method"] != "DELETE" or not key or version in MODERN_PROTOCOL_VERSIONS:
                await app(scope, receive, send)
                return

            async def releasing_first(message: asgi.Message) -> None:
                if message["type"] == "http.response.start" and message["status"] < 300:
                    await self.end(key)
                await send(message)

            await app(scope, receive, releasing_first)

        return serve

    def _saying_the_cap(self, send: asgi.Send) -> asgi.Send:
        """``send``, but a 503 (the SDK refusing a new MCP session at its cap) answered in our words."""
        refused = False

        async def answer(message: asgi.Message) -> None:
            nonlocal refused
            if message["type"] == "http.response.start" and message["status"] == 503:
                refused = True
                body = json.dumps(
                    {
                        "jsonrpc": "2.0",
                        "id": None,
                        "error": {
                            "code": -32603,
                            "message": f"No new session: {self._max_sessions} sessions of this agent are open on "
                            f"this server, its most (--max-sessions {self._max_sessions}). Close one, or wait for "
                            f"one unused for {self._timeout:g} s to end (--session-timeout).",
                        },
                    }
                ).encode()
                headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
                await send({"type": "http.response.start", "status": 503, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
            if not refused:
                await send(message)

        return answer

    async def close(self) -> None:
        for session in [*self._sessions.values(), *self._handles.values()]:
            await session.close()
        self._sessions.clear()
        self._handles.clear()
