"""The command over stdio, as a desktop MCP client runs it: the SDK's stdio client spawns ``inbox-claims-mcp``
(our tools, or the guard in front of the fake email server, itself a process), against a real coordinator."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp.shared.exceptions import MCPError

from coordinator.ops.server import CoordinatorServer
from examples.agent.fake_nylas import FakeNylas
from inbox_claims import Subject, SubjectState
from tests.helpers import eventually
from tests.mcp.fake_email import SEND_TOOL, SEND_TOOL_SPEC, Outbox
from tests.mcp.support import (
    API_KEY,
    command,
    pid_of,
    renewed_while_alive_then_freed_when_killed,
    reply_arguments,
    state_of,
    text,
)


def answer(result: Any) -> dict[str, Any]:
    assert result.structured_content is not None, result
    return dict(result.structured_content)


async def test_two_agent_processes_racing_send_one_reply_and_an_ended_session_frees_its_claims(
    server: CoordinatorServer, fake: FakeNylas, mailbox: str, tmp_path: Path
) -> None:
    serve = ("serve", "--nylas-api-key", API_KEY, "--nylas-api-base", fake.api_base)
    left = Subject.message(mailbox, "msg-left")
    async with (
        Client(command(tmp_path, "agent-a", server.address, *serve)) as first,
        Client(command(tmp_path, "agent-b", server.address, *serve)) as second,
    ):
        results = await asyncio.gather(
            first.call_tool("send_reply", reply_arguments(mailbox, "msg-1", body="a")),
            second.call_tool("send_reply", reply_arguments(mailbox, "msg-1", body="b")),
        )
        await first.call_tool("claim_message", {"mailbox": mailbox, "message_id": left.id})
        assert await state_of(server.address, left) is SubjectState.CLAIMED

    assert sorted(answer(result)["outcome"] for result in results) in (["held", "sent"], ["already_replied", "sent"])
    assert len(fake.sends_for("msg-1")) == 1
    # The client went away: the process ended and released what it held, at once.
    assert await state_of(server.address, left) is SubjectState.FREE


async def test_a_session_that_dies_has_its_claims_freed_within_the_ttl(
    server: CoordinatorServer, mailbox: str, tmp_path: Path
) -> None:
    subject = Subject.message(mailbox, "msg-crash")
    async with Client(command(tmp_path, "agent-dies", server.address, "serve")) as client:
        claimed = await client.call_tool("claim_message", {"mailbox": mailbox, "message_id": subject.id})
        assert answer(claimed)["outcome"] == "granted"
        pid = pid_of(str(tmp_path / "agent-dies.toml"), program="inbox_claims.mcp")
        await renewed_while_alive_then_freed_when_killed(server.address, subject, pid)


async def test_the_guard_over_stdio_passes_tools_through_fences_sends_and_says_in_doubt_when_the_upstream_dies(
    server: CoordinatorServer, mailbox: str, tmp_path: Path
) -> None:
    outbox = Outbox(tmp_path / "outbox.jsonl")
    upstream = ["--", sys.executable, "-m", "tests.mcp.fake_email", "--outbox", str(outbox.path)]
    guard = command(tmp_path, "agent-g", server.address, "guard", "--send-tool", SEND_TOOL_SPEC, *upstream)
    reply = {"grant_id": mailbox, "to": ["bea@example.org"], "subject": "Re: Order", "body": "Shipped."}
    async with Client(guard) as client:
        names = {tool.name for tool in (await client.list_tools()).tools}
        listed = await client.call_tool("list_messages", {"grant_id": mailbox})
        first = await client.call_tool(SEND_TOOL, {**reply, "reply_to_message_id": "msg-1"})
        again = await client.call_tool(SEND_TOOL, {**reply, "reply_to_message_id": "msg-1"})
        outbox.path.with_suffix(".mode").write_text("hang")  # type: ignore[union-attr]
        call = asyncio.create_task(client.call_tool(SEND_TOOL, {**reply, "reply_to_message_id": "msg-2"}))
        deadline = time.monotonic() + 10
        while not outbox.sends_for("msg-2") and time.monotonic() < deadline:  # noqa: ASYNC110 (another process)
            await asyncio.sleep(0.05)
        os.kill(
            pid_of(str(outbox.path), program="tests.mcp.fake_email"), signal.SIGKILL
        )  # the upstream dies after sending, before answering
        in_doubt = await asyncio.wait_for(call, 20)

    assert names == {"list_messages", "get_message", "export_mailbox", SEND_TOOL}
    assert not listed.is_error
    assert first.structured_content == again.structured_content == {"id": "sent-1", "thread_id": "thread-sent-1"}
    assert len(outbox.sends_for("msg-1")) == 1
    assert in_doubt.is_error
    assert "outcome of the send is unknown" in text(in_doubt)
    assert await state_of(server.address, Subject.message(mailbox, "msg-2")) is SubjectState.SENDING


ERAS = pytest.mark.parametrize("era", ["legacy", "2026-07-28"], ids=["2025-client", "2026-client"])


@ERAS
async def test_a_send_reply_retried_after_its_client_gave_up_gets_the_first_calls_outcome(
    server: CoordinatorServer, fake: FakeNylas, mailbox: str, tmp_path: Path, era: str
) -> None:
    gate = threading.Event()

    def held_back(sent: object) -> None:  # Nylas takes the send, and answers when the test says
        gate.wait(30)

    fake.on_send = held_back
    serve = ("serve", "--nylas-api-key", API_KEY, "--nylas-api-base", fake.api_base)
    arguments = reply_arguments(mailbox, "msg-1")
    async with Client(command(tmp_path, "agent-r", server.address, *serve), mode=era) as client:
        with pytest.raises(MCPError):  # the client gives up waiting (its timeout): the server's call goes on
            await client.call_tool("send_reply", arguments, read_timeout_seconds=1.0)
        await eventually(lambda: _sent(fake, "msg-1"))
        while_running = asyncio.create_task(client.call_tool("send_reply", arguments))  # the model retries
        gate.set()
        joined = await asyncio.wait_for(while_running, 30)
        after = await client.call_tool("send_reply", arguments)  # and once more, after it finished
        other = await client.call_tool("send_reply", {**arguments, "body": "Another answer."})

    assert len(fake.sends_for("msg-1")) == 1
    assert answer(joined)["outcome"] == answer(after)["outcome"] == "sent"
    assert answer(joined)["sent_message_id"] == answer(after)["sent_message_id"] == fake.sends[0].id
    assert "another session" not in text(joined) + text(after)  # the claim was the caller's all along
    assert answer(other)["outcome"] == "already_replied"
    assert "this other reply was not sent" in text(other)
    assert await state_of(server.address, Subject.message(mailbox, "msg-1")) is SubjectState.REPLIED


async def _sent(fake: FakeNylas, message_id: str) -> bool:
    return bool(fake.sends_for(message_id))


@ERAS
async def test_a_guarded_send_retried_after_its_client_gave_up_gets_the_upstreams_first_result(
    server: CoordinatorServer, mailbox: str, tmp_path: Path, era: str
) -> None:
    outbox = Outbox(tmp_path / "outbox.jsonl")
    upstream = ["--", sys.executable, "-m", "tests.mcp.fake_email", "--outbox", str(outbox.path)]
    guard = command(tmp_path, "agent-g", server.address, "guard", "--send-tool", SEND_TOOL_SPEC, *upstream)
    arguments = {
        "grant_id": mailbox,
        "to": ["bea@example.org"],
        "subject": "Re",
        "body": "Hi",
        "reply_to_message_id": "m",
    }
    assert outbox.path is not None
    outbox.path.with_suffix(".mode").write_text("slow")  # sent at once, answered 3 s later
    async with Client(guard, mode=era) as client:
        with pytest.raises(MCPError):
            await client.call_tool(SEND_TOOL, arguments, read_timeout_seconds=1.0)
        retried = await asyncio.wait_for(client.call_tool(SEND_TOOL, arguments), 30)

    assert len(outbox.sends_for("m")) == 1
    assert not retried.is_error
    assert retried.structured_content == {"id": "sent-1", "thread_id": "thread-sent-1"}  # the upstream's own result
    assert await state_of(server.address, Subject.message(mailbox, "m")) is SubjectState.REPLIED
