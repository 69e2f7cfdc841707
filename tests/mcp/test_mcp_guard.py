"""The guard in front of a fake email MCP server (its send tool counts sends), against a real coordinator and
etcd, through the SDK's own clients in memory: every other tool, the prompts, resources and completions pass
through byte for byte, in either protocol era on either side, and a send tool's calls send at most one reply
per message."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import mcp_types as types
import pytest
from mcp import Client
from mcp.shared.exceptions import MCPError

from coordinator.ops.server import CoordinatorServer
from inbox_claims import AsyncCoordinator, Subject, SubjectState
from inbox_claims.mcp import SendTool
from inbox_claims.mcp._presets import PRESETS
from tests.mcp import support
from tests.mcp.fake_email import SEND_TOOL, SEND_TOOL_SPEC, Outbox, a_reply, fake_email_server
from tests.mcp.preset_servers import FAKES, Recorder
from tests.mcp.support import raw, raw_call, text


def guarded(address: str, principal: str, outbox: Outbox) -> contextlib.AbstractAsyncContextManager[Client]:
    """One agent session behind the guard in front of the fake email server."""
    return support.guarded(address, principal, fake_email_server(outbox), [SendTool.parse(SEND_TOOL_SPEC)])


def _requests(mailbox: str) -> list[types.Request[Any, Any]]:
    """Every kind of request the guard forwards, the upstream's errors included."""

    def call(name: str, **arguments: Any) -> types.CallToolRequest:
        return types.CallToolRequest(params=types.CallToolRequestParams(name=name, arguments=arguments))

    return [
        types.ListToolsRequest(),
        call("list_messages", grant_id=mailbox),
        call("get_message", grant_id=mailbox, message_id="msg-2"),
        call("get_message", grant_id=mailbox, message_id="no-such"),  # the upstream's own tool error
        call("get_message", grant_id=mailbox),  # the upstream's own answer to bad arguments
        types.ListPromptsRequest(),
        types.GetPromptRequest(
            params=types.GetPromptRequestParams(name="draft_reply", arguments={"message_id": "msg-1"})
        ),
        types.ListResourcesRequest(),
        types.ListResourceTemplatesRequest(),
        types.ReadResourceRequest(params=types.ReadResourceRequestParams(uri="mail://signature")),
        types.ReadResourceRequest(params=types.ReadResourceRequestParams(uri="mail://messages/msg-1")),
        types.CompleteRequest(
            params=types.CompleteRequestParams(
                ref=types.PromptReference(type="ref/prompt", name="draft_reply"),
                argument=types.CompletionArgument(name="message_id", value="msg-"),
            )
        ),
    ]


async def _answers(client: Client, requests: list[types.Request[Any, Any]]) -> list[Any]:
    """Each request's result as it came, or the JSON-RPC error it was refused with."""
    answers: list[Any] = []
    for request in requests:
        try:
            answers.append(await raw(client, request))
        except MCPError as error:
            answers.append(("error", error.error.code, error.error.message))
    return answers


@pytest.mark.parametrize(
    ("upstream_mode", "mode"),
    [("auto", "auto"), ("legacy", "legacy"), ("legacy", "auto"), ("auto", "legacy")],
    ids=["2026-both", "handshake-both", "handshake-upstream", "handshake-client"],
)
async def test_tools_prompts_resources_and_completions_pass_through_byte_for_byte_in_either_era(
    server: CoordinatorServer, mailbox: str, upstream_mode: str, mode: str
) -> None:
    outbox = Outbox()
    requests = [*_requests(mailbox), types.ReadResourceRequest(params=types.ReadResourceRequestParams(uri="mail://x"))]
    async with Client(fake_email_server(outbox), mode=mode) as direct:
        expected = await _answers(direct, requests)
        offered = direct.server_capabilities
    send_tools = [SendTool.parse(SEND_TOOL_SPEC)]
    upstream = fake_email_server(outbox)
    async with support.guarded(
        server.address, "agent-a", upstream, send_tools, upstream_mode=upstream_mode, mode=mode
    ) as client:
        through = await _answers(client, requests)
        capabilities = client.server_capabilities

    assert through == expected
    listed = {tool["name"] for tool in through[0]["tools"]}
    assert listed == {"list_messages", "get_message", "export_mailbox", SEND_TOOL}
    assert through[3]["isError"] is True
    assert [prompt["name"] for prompt in through[5]["prompts"]] == ["draft_reply"]
    assert "Where is my order?" in str(through[6])
    assert through[9]["contents"][0]["text"] == "-- \nThe support team"
    assert through[11]["completion"]["values"] == ["msg-1", "msg-2"]
    assert through[-1][0] == "error"  # an unknown resource: the upstream's own refusal
    assert (capabilities.prompts, capabilities.resources, capabilities.completions) != (None, None, None)
    assert (capabilities.prompts is None, capabilities.resources is None, capabilities.completions is None) == (
        offered.prompts is None,
        offered.resources is None,
        offered.completions is None,
    )
    assert outbox.sends == []


async def test_the_guard_offers_no_prompts_or_resources_its_upstream_has_not(server: CoordinatorServer) -> None:
    tools_only = Recorder().server(FAKES["gmail"])  # a low-level server with tools and nothing else

    async with support.guarded(server.address, "agent-a", tools_only, []) as client:
        capabilities = client.server_capabilities
        with pytest.raises(MCPError) as refused:
            await raw(client, types.ListPromptsRequest())

    assert (capabilities.prompts, capabilities.resources, capabilities.completions) == (None, None, None)
    assert capabilities.tools is not None
    assert refused.value.error.code == types.METHOD_NOT_FOUND


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


async def test_a_send_tool_that_asks_for_input_first_sends_only_on_the_retry_that_answers(
    server: CoordinatorServer, mailbox: str
) -> None:
    recorder, fake = Recorder(), FAKES["agentmail"]
    recorder.confirming = True
    name, arguments = fake.reply(mailbox, "msg-1")
    subject = Subject.message(mailbox, "msg-1")

    def call(**answers: types.ElicitResult) -> types.CallToolRequest:
        responses: dict[str, Any] = dict(answers)
        params = types.CallToolRequestParams(name=name, arguments=arguments, input_responses=responses or None)
        return types.CallToolRequest(params=params)

    async with (
        support.guarded(server.address, "agent-a", recorder.server(fake), PRESETS["agentmail"].tools) as client,
        AsyncCoordinator(server.address, principal="observer") as observer,
    ):
        asked = await raw(client, call())
        while_asking = (await observer.status(subject)).state
        confirmed = await raw(client, call(confirm=types.ElicitResult(action="accept", content={})))
        status = await observer.status(subject)

    assert asked["resultType"] == "input_required"  # the upstream's question, passed on; nothing sent yet
    assert while_asking is SubjectState.FREE
    assert confirmed["structuredContent"] == {"messageId": "sent-1", "threadId": "thread-sent-1"}
    assert (status.state, status.sent_message_id) == (SubjectState.REPLIED, "sent-1")
    assert len(recorder.sends) == 1


@pytest.mark.parametrize("era", ["legacy", "auto"], ids=["2025-client", "2026-client"])
async def test_a_spelling_of_an_answered_message_is_that_message_and_reaches_no_upstream(
    server: CoordinatorServer, mailbox: str, era: str
) -> None:
    """The message-id rule of conformance/message_ids.json, through the guard: after <m1@x> was answered, its
    spellings (spaces around, no brackets, brackets and spaces) are answered, and nothing more is sent; another
    session of the same agent is told so too, and a different agent too."""
    outbox = Outbox()
    spellings = [" <m1@shop.example>", "m1@shop.example ", "\n m1@shop.example", "< m1@shop.example >"]
    async with (
        support.guarded(
            server.address, "agent-a", fake_email_server(outbox), [SendTool.parse(SEND_TOOL_SPEC)], mode=era
        ) as first,
        support.guarded(
            server.address, "agent-b", fake_email_server(outbox), [SendTool.parse(SEND_TOOL_SPEC)], mode=era
        ) as other,
    ):
        sent = await first.call_tool(SEND_TOOL, a_reply(mailbox, "<m1@shop.example>"))
        again = [await first.call_tool(SEND_TOOL, a_reply(mailbox, spelling)) for spelling in spellings]
        theirs = [await other.call_tool(SEND_TOOL, a_reply(mailbox, spelling)) for spelling in spellings]
    async with AsyncCoordinator(server.address, principal="observer") as coord:
        status = await coord.status(Subject.message(mailbox, "m1@shop.example"))

    assert not sent.is_error
    assert len(outbox.sends) == 1  # one reply for the message, however its id was written
    assert all(result.is_error for result in again + theirs)
    assert all("this other reply was not sent" in text(result) for result in again)  # a different call: refused
    assert all(text(result).startswith("Already answered by agent-a (an agent)") for result in theirs)
    assert (status.state, status.holder) == (SubjectState.REPLIED, "agent-a")
