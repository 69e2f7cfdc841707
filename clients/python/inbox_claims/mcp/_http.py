"""The MCP server's streamable HTTP transport, behind the coordinator's own HTTP guard (``inbox_wire.http_guard``).

uvicorn alone holds an idle connection, a request head that trickles in a byte at a time, or any number of
connections, for as long as a client likes, and a process out of descriptors logs every failed accept. So
``inbox-claims-mcp --transport http`` serves as the coordinator's HTTP face does: request heads counted and
capped before they are parsed (414, 431), a deadline for a request's head, for its body and for an idle
kept-alive connection (408, or closed), connections counted from accept to close and capped below the process's
descriptor limit (503 past the cap, descriptors kept in reserve for the coordinator's gRPC connection and the
upstream), refusals logged at most once a minute per reason, and a request only for the Host names the server
listens on (421) from no other web page's origin (403): a DNS-rebinding page gets nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
from typing import Any

import uvicorn
from starlette import types as asgi

from inbox_wire.http_guard import (
    GuardedServer,
    HeadLimits,
    HostPolicy,
    HttpGuardSettings,
    Reporter,
    connection_cap,
    raise_descriptor_limit,
)

RESERVED_FOR = "the coordinator's connection, the upstream and the process's files"


@dataclasses.dataclass(frozen=True)
class HttpOptions:
    """The HTTP guard's settings, as the command's flags give them (the coordinator's names and defaults)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    idle_timeout_s: float = 30.0
    max_connections: int = 1000
    allowed_hosts: tuple[str, ...] = ()

    def guard(self) -> HttpGuardSettings:
        return HttpGuardSettings(
            head=HeadLimits(),
            header_timeout_s=self.header_timeout_s,
            body_timeout_s=self.body_timeout_s,
            idle_timeout_s=self.idle_timeout_s,
            max_connections=self.max_connections,
            server="this MCP server",
            elsewhere="",
            reserved_for=RESERVED_FOR,
        )


def host_checked(app: asgi.ASGIApp, hosts: HostPolicy) -> asgi.ASGIApp:
    """``app``, for requests naming a Host it listens on (421 otherwise: a DNS-rebinding page's Host is its own
    name) and sent by no web page of another origin (403)."""

    async def serve(scope: asgi.Scope, receive: asgi.Receive, send: asgi.Send) -> None:
        if scope["type"] == "http":
            refusal = _misdirected(scope["headers"], hosts)
            if refusal is not None:
                status, message = refusal
                body = json.dumps({"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": message}})
                headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": body.encode()})
                return
        await app(scope, receive, send)

    return serve


def _misdirected(headers: Any, hosts: HostPolicy) -> tuple[int, str] | None:
    named = [value.decode("latin-1") for name, value in headers if name == b"host"]
    origins = [value.decode("latin-1") for name, value in headers if name == b"origin"]
    host = named[0] if named else None
    if len(named) > 1:
        return 400, "the request has more than one Host header"
    if not hosts.allows_host(host):
        return 421, (
            f"this MCP server does not answer to the name {host!r} (it answers to {hosts.describe()}); behind a "
            "proxy, add the name the proxy forwards with --http-allowed-hosts"
        )
    origin = origins[0] if origins else None
    if not hosts.allows_origin(origin, host):
        return 403, f"a page of another origin ({origin}) may not call this MCP server"
    return None


def listening_socket(host: str, port: int) -> socket.socket:
    """The listening socket (OSError when the address is wrong or taken: the caller says so plainly)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family, backlog=1024)
    # No Nagle delay on the accepted connections (Linux copies the option to them): uvicorn writes an answer's
    # head and body apart (docs/performance.md#the-httpjson-face-python--m-bench-http).
    listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return listener


async def serve_guarded(app: asgi.ASGIApp, listener: socket.socket, options: HttpOptions) -> None:
    """Serves ``app`` on ``listener`` behind the guard until cancelled, then stops (its lifespan shut down)."""
    raise_descriptor_limit()
    guard = options.guard()
    cap = connection_cap(guard.max_connections, reserved_for=RESERVED_FOR)
    host = listener.getsockname()[0]
    config = uvicorn.Config(
        host_checked(app, HostPolicy.for_listen(host, options.allowed_hosts)),
        lifespan="on",  # the MCP SDK's session manager runs in the app's lifespan
        http="httptools",
        ws="none",
        log_config=None,
        access_log=False,
        server_header=False,
        proxy_headers=False,
        timeout_graceful_shutdown=1,
    )
    server = GuardedServer(config, listener, guard=guard, reporter=Reporter(), cap=cap)
    await server.start()
    try:
        await asyncio.Event().wait()
    finally:
        await asyncio.shield(server.stop())
