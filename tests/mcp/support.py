"""Agent sessions of our MCP server, connected in memory with the SDK's own client, for the tests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from mcp import Client
from mcp.server import ServerRequestContext
from mcp.types import TextContent

from inbox_claims import AsyncCoordinator
from inbox_claims.mcp import AgentSession, NylasReplies, build_server

API_KEY = "nyk_v0_mcp_test_key"


@contextlib.asynccontextmanager
async def agent_session(
    address: str, principal: str, *, api_base: str | None = None, ttl: int = 30, kind: str = "agent"
) -> AsyncIterator[tuple[Client, AgentSession]]:
    """One agent session: its own server object, as one stdio process would be, and an SDK client on it."""
    coordinator = AsyncCoordinator(address, principal=principal, kind=kind)  # type: ignore[arg-type]
    session = AgentSession(coordinator, ttl=ttl)
    replies = NylasReplies(API_KEY, api_base=api_base) if api_base else None

    async def session_for(ctx: ServerRequestContext[Any, Any]) -> AgentSession:
        return session

    try:
        async with Client(build_server(session_for, replies=replies)) as client:
            yield client, session
    finally:
        await session.close()
        if replies is not None:
            await replies.close()
        await coordinator.close()


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
