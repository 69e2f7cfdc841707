"""Agent sessions of our MCP server, connected in memory with the SDK's own client, for the tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from mcp import Client, StdioServerParameters
from mcp.server import MCPServer, Server
from mcp.types import CallToolRequest, CallToolRequestParams, ListToolsRequest, Request, TextContent
from pydantic import BaseModel, ConfigDict

from inbox_claims import AsyncCoordinator, Subject, SubjectState
from inbox_claims.mcp import AgentSession, NylasReplies, SendTool, Upstream, build_guard, build_server
from inbox_claims.mcp._sessions import OneSession

API_KEY = "nyk_v0_mcp_test_key"
REPO = Path(__file__).resolve().parents[2]
TTL = 3
"""The claim TTL of the command's processes in the tests (``--ttl``)."""
FREE_BOUND_S = 2.0
"""A claim frees within its TTL plus this (docs/design.md#leases-and-expiry: < 1 s bucket, ~0.5 s expiry check)."""
SERVER_INFO = "io.modelcontextprotocol/serverInfo"


@contextlib.asynccontextmanager
async def agent_session(
    address: str, principal: str, *, api_base: str | None = None, ttl: int = 30, kind: str = "agent"
) -> AsyncIterator[tuple[Client, AgentSession]]:
    """One agent session: its own server object, as one stdio process would be, and an SDK client on it."""
    coordinator = AsyncCoordinator(address, principal=principal, kind=kind)  # type: ignore[arg-type]
    session = AgentSession(coordinator, ttl=ttl)
    replies = NylasReplies(API_KEY, api_base=api_base) if api_base else None

    try:
        async with Client(build_server(OneSession(session), replies=replies)) as client:
            yield client, session
    finally:
        await session.close()
        if replies is not None:
            await replies.close()
        await coordinator.close()


@contextlib.asynccontextmanager
async def guarded(
    address: str,
    principal: str,
    upstream: Server[Any] | MCPServer,
    send_tools: Sequence[SendTool],
    *,
    ttl: int = 30,
    upstream_mode: str = "auto",
    mode: str = "auto",
    **options: Any,
) -> AsyncIterator[Client]:
    """One agent session behind the guard, in front of ``upstream`` (in memory): its own upstream connection and
    coordinator client, as one guard process has. ``upstream_mode`` is the era the guard speaks upstream
    (``legacy``: the initialize handshake, as the email MCP servers of 2025 do), ``mode`` the era its client
    speaks to it; ``options`` are ``build_guard``'s."""
    async with (
        AsyncCoordinator(address, principal=principal) as coordinator,
        Upstream(lambda: Client(upstream, mode=upstream_mode)) as connection,
    ):
        session = AgentSession(coordinator, ttl=ttl)
        try:
            async with Client(build_guard(connection, send_tools, OneSession(session), **options), mode=mode) as client:
                yield client
        finally:
            await session.close()


class Raw(BaseModel):
    """A result as the server sent it, every field kept."""

    model_config = ConfigDict(extra="allow")


async def raw(client: Client, request: Request[Any, Any]) -> dict[str, Any]:
    """The server's result of ``request``, as it came, but for the stamp that names the server answering (the
    2026-07-28 protocol's ``serverInfo``): the guard's is its own, not its upstream's."""
    result = (await client.session.send_request(request, Raw)).model_dump()
    meta = {key: value for key, value in (result.pop("_meta", None) or {}).items() if key != SERVER_INFO}
    return {**result, **({"_meta": meta} if meta else {})}


async def raw_list(client: Client) -> dict[str, Any]:
    return await raw(client, ListToolsRequest())


async def raw_call(client: Client, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return await raw(client, CallToolRequest(params=CallToolRequestParams(name=name, arguments=arguments)))


def reply_arguments(mailbox: str, message_id: str, body: str = "It ships today.") -> dict[str, Any]:
    return {
        "mailbox": mailbox,
        "message_id": message_id,
        "to": [{"email": "customer@example.com", "name": "A Customer"}],
        "subject": "Re: Where is my order?",
        "body": body,
    }


def text(result: Any) -> str:
    """The text a tool result says (its first content block)."""
    block = result.content[0]
    assert isinstance(block, TextContent), result
    return block.text


def config_file(tmp_path: Path, name: str, address: str) -> Path:
    """``inbox-claims-mcp``'s config file for principal ``name`` (its path also tells its process apart)."""
    config = tmp_path / f"{name}.toml"
    config.write_text(f'target = "{address}"\nprincipal = "{name}"\n')
    return config


async def state_of(address: str, subject: Subject) -> SubjectState:
    """The subject's state, as an observer sees it."""
    async with AsyncCoordinator(address, principal="observer") as coord:
        return (await coord.status(subject)).state


async def renewed_while_alive_then_freed_when_killed(address: str, subject: Subject, pid: int) -> None:
    """The claim on ``subject``, held by process ``pid``, outlives its TTL while the process lives (renewed), and
    frees within the TTL (plus the stated bound) once the process is killed with SIGKILL."""
    await asyncio.sleep(TTL * 1.2)
    assert await state_of(address, subject) is SubjectState.CLAIMED
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    while await state_of(address, subject) is SubjectState.CLAIMED:
        assert time.monotonic() - killed < TTL + FREE_BOUND_S, "the killed process's claim outlived its TTL"
        await asyncio.sleep(0.1)


def command(tmp_path: Path, name: str, address: str, *args: str) -> StdioServerParameters:
    """``inbox-claims-mcp`` configured by its own config file (its path also tells its process apart)."""
    config = config_file(tmp_path, name, address)
    return StdioServerParameters(
        command=sys.executable,
        args=["-m", "inbox_claims.mcp", args[0], "--config", str(config), "--ttl", str(TTL), *args[1:]],
        cwd=REPO,
        env={"PATH": os.environ.get("PATH", "")},
    )


def pid_of(marker: str, *, program: str) -> int:
    """The process of ``program`` (a module run with -m) whose command line holds ``marker`` (a path only it
    was given; the guard's command line names its upstream's too)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                words = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if words[1:3] == ["-m", program] and marker in words:
                return int(entry.name)
    raise AssertionError(f"no process with {marker!r}")
