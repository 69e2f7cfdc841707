"""The guard in front of a fake email MCP server (its send tool counts sends), against a real coordinator and
etcd, through the SDK's own clients in memory: every other tool passes through byte for byte, and a send tool's
calls send at most one reply per message."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from mcp import Client
from mcp.server import ServerRequestContext
from mcp.types import CallToolRequest, CallToolRequestParams, ListToolsRequest
from pydantic import BaseModel, ConfigDict

from coordinator.server import CoordinatorServer
from inbox_claims import AsyncCoordinator, Subject, SubjectState
from inbox_claims.mcp import AgentSession, SendTool, Upstream, build_guard
from tests.conftest import StartCoordinator
from tests.mcp.fake_email import SEND_TOOL, SEND_TOOL_SPEC, Outbox, fake_email_server
from tests.mcp.support import text


class Raw(BaseModel):
    """A result as the server sent it, every field kept."""

    model_config = ConfigDict(extra="allow")


async def raw_list(client: Client) -> dict[str, Any]:
    return (await client.session.send_request(ListToolsRequest(), Raw)).model_dump()


async def raw_call(client: Client, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    request = CallToolRequest(params=CallToolRequestParams(name=name, arguments=arguments))
    return (await client.session.send_request(request, Raw)).model_dump()


@contextlib.asynccontextmanager
async def guarded(address: str, principal: str, outbox: Outbox, *, ttl: int = 30) -> AsyncIterator[Client]:
    """One agent session behind the guard: its own upstream connection, as one guard process has."""
    async with (
        AsyncCoordinator(address, principal=principal) as coordinator,
        Upstream(lambda: Client(fake_email_server(outbox))) as upstream,
    ):
        session = AgentSession(coordinator, ttl=ttl)

        async def session_for(ctx: ServerRequestContext[Any, Any]) -> AgentSession:
            return session

        guard = build_guard(upstream, [SendTool.parse(SEND_TOOL_SPEC)], session_for)
        try:
            async with Client(guard) as client:
                yield client
        finally:
            await session.close()


def a_reply(mailbox: str, message_id: str, body: str = "It ships today.") -> dict[str, Any]:
    return {
        "grant_id": mailbox,
        "to": ["bea@example.org"],
        "subject": "Re: Where is my order?",
        "body": body,
        "reply_to_message_id": message_id,
    }


@pytest.fixture
async def server(start_coordinator: StartCoordinator) -> CoordinatorServer:
    return await start_coordinator()


async def test_every_tool_and_every_other_call_passes_through_byte_for_byte(
    server: CoordinatorServer, mailbox: str
) -> None:
    outbox = Outbox()
    calls = [
        ("list_messages", {"grant_id": mailbox}),
        ("get_message", {"grant_id": mailbox, "message_id": "msg-2"}),
        ("get_message", {"grant_id": mailbox, "message_id": "no-such"}),  # the upstream's own tool error
        ("get_message", {"grant_id": mailbox}),  # the upstream's own answer to bad arguments
    ]
    async with Client(fake_email_server(outbox)) as direct:
        expected_tools = await raw_list(direct)
        expected = [await raw_call(direct, name, arguments) for name, arguments in calls]
    async with guarded(server.address, "agent-a", outbox) as client:
        tools = await raw_list(client)
        through = [await raw_call(client, name, arguments) for name, arguments in calls]

    assert tools == expected_tools
    assert {tool["name"] for tool in tools["tools"]} == {"list_messages", "get_message", SEND_TOOL}
    assert through == expected
    assert expected[2]["isError"] is True
    assert outbox.sends == []


async def test_duplicate_and_concurrent_sends_from_two_sessions_send_one_reply_per_message(
    server: CoordinatorServer, mailbox: str
) -> None:
    outbox = Outbox()
    messages = [f"msg-{n}" for n in range(6)]
    async with (
        guarded(server.address, "agent-a", outbox) as first,
        guarded(server.address, "agent-b", outbox) as second,
    ):
        results = await asyncio.gather(
            *(
                client.call_tool(SEND_TOOL, a_reply(mailbox, message, body=f"from {who}"))
                for message in messages
                for client, who in ((first, "a"), (second, "b"), (first, "a"))  # one session twice, the same call
            )
        )
        once_more = await first.call_tool(SEND_TOOL, a_reply(mailbox, messages[0], body="from a"))

    for message in messages:
        assert len(outbox.sends_for(message)) == 1, message
    answered = [result for result in results if not result.is_error]
    refused = [result for result in results if result.is_error]
    assert len(answered) >= len(messages)
    assert all(result.structured_content is not None for result in answered)  # the upstream's own result
    assert all("do not reply" in text(result) for result in refused)
    sent_a = outbox.sends_for(messages[0])[0]
    if sent_a["body"] == "from a":  # the first session sent it: its repeat gets the upstream's first result again
        assert not once_more.is_error
        assert once_more.structured_content == {"id": sent_a["id"], "thread_id": f"thread-{sent_a['id']}"}
    else:  # the other session did: the repeat is refused, and sends nothing
        assert once_more.is_error
        assert "do not reply" in text(once_more)


async def test_a_repeated_send_answers_the_upstreams_first_result(server: CoordinatorServer, mailbox: str) -> None:
    outbox = Outbox()
    async with guarded(server.address, "agent-a", outbox) as client:
        first = await raw_call(client, SEND_TOOL, a_reply(mailbox, "msg-1"))
        again = await raw_call(client, SEND_TOOL, a_reply(mailbox, "msg-1"))
        other = await client.call_tool(SEND_TOOL, a_reply(mailbox, "msg-1", body="Second thoughts."))

    assert again == first
    assert first["structuredContent"]["id"] == "sent-1"
    assert other.is_error
    assert "this other reply was not sent" in text(other)
    assert len(outbox.sends) == 1
    async with AsyncCoordinator(server.address, principal="observer") as coord:
        status = await coord.status(Subject.message(mailbox, "msg-1"))
    assert (status.state, status.sent_message_id, status.holder) == (SubjectState.REPLIED, "sent-1", "agent-a")


async def test_bad_arguments_are_a_tool_error_naming_the_field_and_nothing_is_sent(
    server: CoordinatorServer, mailbox: str
) -> None:
    outbox = Outbox()
    good = a_reply(mailbox, "msg-1")
    async with guarded(server.address, "agent-a", outbox) as client:
        no_message = await client.call_tool(SEND_TOOL, {k: v for k, v in good.items() if k != "reply_to_message_id"})
        empty_mailbox = await client.call_tool(SEND_TOOL, {**good, "grant_id": ""})
        not_text = await client.call_tool(SEND_TOOL, {**good, "reply_to_message_id": 42})

    assert no_message.is_error
    assert text(no_message).startswith(f"Invalid arguments for {SEND_TOOL}: reply_to_message_id: missing")
    assert empty_mailbox.is_error
    assert "grant_id: not a non-empty string" in text(empty_mailbox)
    assert not_text.is_error
    assert "reply_to_message_id: not a non-empty string (42)" in text(not_text)
    assert outbox.sends == []


async def test_an_upstream_tool_error_aborts_the_send_and_frees_the_message(
    server: CoordinatorServer, mailbox: str
) -> None:
    outbox = Outbox()
    outbox.mode = "fail"
    async with Client(fake_email_server(outbox)) as direct:
        expected = await raw_call(direct, SEND_TOOL, a_reply(mailbox, "msg-1"))
    async with guarded(server.address, "agent-a", outbox) as client:
        failed = await raw_call(client, SEND_TOOL, a_reply(mailbox, "msg-1"))
        outbox.mode = "send"
        retried = await raw_call(client, SEND_TOOL, a_reply(mailbox, "msg-1"))

    assert failed == expected  # the upstream's own error, as it said it
    assert failed["isError"] is True
    assert retried["structuredContent"]["id"] == "sent-1"
    assert len(outbox.sends) == 1


async def test_a_persons_takeover_refuses_the_guarded_send(server: CoordinatorServer, mailbox: str) -> None:
    outbox = Outbox()
    subject = Subject.message(mailbox, "msg-vip")
    async with (
        guarded(server.address, "agent-a", outbox) as client,
        AsyncCoordinator(server.address, principal="ana@example.com", kind="human") as person,
    ):
        assert (await person.takeover(subject)).holds
        refused = await client.call_tool(SEND_TOOL, a_reply(mailbox, subject.id))

    assert refused.is_error
    assert text(refused).startswith("Being answered by ana@example.com (a person) until ")
    assert outbox.sends == []
