"""The command over streamable HTTP, through the SDK's own HTTP client, against a real coordinator: our tools
(``serve --transport http``) and the guard (``guard --transport http``, its upstream itself given as a URL),
each a process of its own. Sessions are MCP sessions (clients of the handshake era, ``mode="legacy"``) or, for
2026-07-28 clients, which have none, the server's one shared session."""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client

from coordinator.ops.server import CoordinatorServer
from examples.agent.fake_nylas import FakeNylas
from inbox_claims import Subject, SubjectState
from tests.helpers import eventually, spawn, wait_for_line
from tests.mcp.fake_email import SEND_TOOL, SEND_TOOL_SPEC, Outbox
from tests.mcp.support import (
    API_KEY,
    REPO,
    TTL,
    config_file,
    renewed_while_alive_then_freed_when_killed,
    reply_arguments,
    state_of,
    text,
)

SESSION_TIMEOUT = 2.0


@contextlib.asynccontextmanager
async def running(
    command: list[str], announced: str = "serving MCP on", *, ours: bool = True
) -> AsyncIterator[tuple[subprocess.Popen[str], str]]:
    """A process that serves MCP over HTTP on a free port, and its URL (from what it says once it serves), waited
    for off the event loop: the coordinator the process talks to runs on it. ``ours``: it must exit 0 on SIGTERM."""
    process = spawn(command, {"PYTHONPATH": str(REPO)})
    try:
        said = await asyncio.to_thread(wait_for_line, process, announced)
        url = re.findall(r"http://[\w.:\[\]]+", said)[-1] + "/mcp"
        yield process, url
    finally:
        if process.poll() is None:
            process.terminate()  # SIGTERM: the process releases what its sessions hold, then exits
            try:
                await asyncio.to_thread(process.wait, 20)
            except subprocess.TimeoutExpired:
                process.kill()
                await asyncio.to_thread(process.wait)
            assert not ours or process.returncode == 0, f"{command} exited with {process.returncode} on SIGTERM"
        assert process.stdout is not None
        process.stdout.close()


def mcp_http(
    tmp_path: Path, name: str, address: str, command: str, *args: str, session_timeout: float = SESSION_TIMEOUT
) -> list[str]:
    """``inbox-claims-mcp COMMAND --transport http`` on a free port, configured by its own config file."""
    config = config_file(tmp_path, name, address)
    options = ["--config", str(config), "--ttl", str(TTL), "--session-timeout", str(session_timeout)]
    return [
        sys.executable,
        "-m",
        "inbox_claims.mcp",
        command,
        *options,
        "--transport",
        "http",
        "--listen",
        "127.0.0.1:0",
        *args,
    ]


@contextlib.asynccontextmanager
async def serving(
    tmp_path: Path, address: str, fake: FakeNylas | None = None, *, session_timeout: float = SESSION_TIMEOUT
) -> AsyncIterator[tuple[subprocess.Popen[str], str]]:
    nylas = ("--nylas-api-key", API_KEY, "--nylas-api-base", fake.api_base) if fake else ()
    command = mcp_http(tmp_path, "agent-http", address, "serve", *nylas, session_timeout=session_timeout)
    async with running(command) as served:
        yield served


@contextlib.asynccontextmanager
async def sessions(url: str, count: int, mode: str) -> AsyncIterator[list[Client]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(Client(url, mode=mode)) for _ in range(count)]


def outcome(result: Any) -> str:
    assert result.structured_content is not None, result
    return str(result.structured_content["outcome"])


@pytest.mark.parametrize("mode", ["legacy", "auto"], ids=["mcp-sessions", "2026-sessionless"])
async def test_two_http_sessions_racing_send_one_reply(
    server: CoordinatorServer, fake: FakeNylas, mailbox: str, tmp_path: Path, mode: str
) -> None:
    async with serving(tmp_path, server.address, fake) as (_, url), sessions(url, 2, mode) as (first, second):
        results = await asyncio.gather(
            first.call_tool("send_reply", reply_arguments(mailbox, "msg-1", body="from the first")),
            second.call_tool("send_reply", reply_arguments(mailbox, "msg-1", body="from the second")),
        )

    assert len(fake.sends_for("msg-1")) == 1
    won, lost = sorted(results, key=lambda result: outcome(result) != "sent")
    assert outcome(won) == "sent"
    assert lost.is_error
    assert outcome(lost) in ("held", "already_replied")
    assert "do not reply" in text(lost)


async def test_an_http_session_closed_or_idle_past_the_session_timeout_has_its_claims_released(
    server: CoordinatorServer, mailbox: str, tmp_path: Path
) -> None:
    idle, busy = Subject.message(mailbox, "msg-idle"), Subject.message(mailbox, "msg-busy")
    left = Subject.message(mailbox, "msg-left")
    async with serving(tmp_path, server.address) as (_, url):
        async with Client(url, mode="legacy") as leaving:  # closing it ends its MCP session (a DELETE)
            await leaving.call_tool("claim_message", {"mailbox": mailbox, "message_id": left.id})
        closed = time.monotonic()
        await eventually(lambda: is_free(server.address, left), within=SESSION_TIMEOUT / 2)
        released_on_close = time.monotonic() - closed
        async with sessions(url, 2, "legacy") as (sleeper, worker):
            # The session's idle time runs from when the server took its last call (after this moment, before the call
            # returned): measured from here, a release before the timeout fails, and the calls' own time cannot.
            last_call = time.monotonic()
            await sleeper.call_tool("claim_message", {"mailbox": mailbox, "message_id": idle.id})
            await worker.call_tool("claim_message", {"mailbox": mailbox, "message_id": busy.id})
            while await state_of(server.address, idle) is SubjectState.CLAIMED:
                assert time.monotonic() - last_call < SESSION_TIMEOUT + TTL, "the idle session's claim was kept"
                await worker.call_tool("who_is_answering", {"mailbox": mailbox})  # the other session stays busy
                await asyncio.sleep(0.2)
            released = time.monotonic() - last_call
            still = await state_of(server.address, busy)
            again = await sleeper.call_tool("claim_message", {"mailbox": mailbox, "message_id": idle.id})
    stopped = [await state_of(server.address, subject) for subject in (idle, busy)]

    assert released_on_close < SESSION_TIMEOUT / 2  # at once, not by the idle timeout
    assert released >= SESSION_TIMEOUT
    assert still is SubjectState.CLAIMED  # a session in use keeps its claims (renewed past their TTL)
    assert outcome(again) == "granted"  # the idle client's next call starts a session of its own
    assert stopped == [SubjectState.FREE, SubjectState.FREE]  # SIGTERM: the server released what it held


async def is_free(address: str, subject: Subject) -> bool:
    return await state_of(address, subject) is SubjectState.FREE


async def test_a_killed_http_server_frees_its_claims_within_the_ttl(
    server: CoordinatorServer, mailbox: str, tmp_path: Path
) -> None:
    subject = Subject.message(mailbox, "msg-killed")
    async with (
        serving(tmp_path, server.address, session_timeout=60) as (process, url),
        Client(url, mode="legacy") as client,
    ):
        assert (
            outcome(await client.call_tool("claim_message", {"mailbox": mailbox, "message_id": subject.id}))
            == "granted"
        )
        await renewed_while_alive_then_freed_when_killed(server.address, subject, process.pid)


async def test_the_guard_over_http_in_front_of_an_http_upstream_sends_one_reply_per_message(
    server: CoordinatorServer, mailbox: str, tmp_path: Path
) -> None:
    outbox = Outbox(tmp_path / "outbox.jsonl")
    upstream_command = [sys.executable, "-m", "tests.mcp.fake_email", "--outbox", str(outbox.path), "--http", "0"]
    reply = {"grant_id": mailbox, "to": ["bea@example.org"], "subject": "Re: Order", "reply_to_message_id": "msg-1"}
    async with running(upstream_command, "Uvicorn running on", ours=False) as (_, upstream_url):
        guard = mcp_http(
            tmp_path, "agent-g", server.address, "guard", "--send-tool", SEND_TOOL_SPEC, "--", upstream_url
        )
        async with (
            running(guard) as (_, url),
            sessions(url, 2, "legacy") as (first, second),
            Client(url) as sessionless,
        ):
            names = {tool.name for tool in (await sessionless.list_tools()).tools}
            listed = await sessionless.call_tool("list_messages", {"grant_id": mailbox})
            raced = await asyncio.gather(
                first.call_tool(SEND_TOOL, {**reply, "body": "from the first"}),
                second.call_tool(SEND_TOOL, {**reply, "body": "from the second"}),
                sessionless.call_tool(SEND_TOOL, {**reply, "body": "from the third"}),
            )

    assert names == {"list_messages", "get_message", "export_mailbox", SEND_TOOL}
    assert not listed.is_error
    assert len(outbox.sends_for("msg-1")) == 1
    assert sorted(result.is_error for result in raced) == [False, True, True]
    assert all("do not reply" in text(result) for result in raced if result.is_error)
    assert await state_of(server.address, Subject.message(mailbox, "msg-1")) is SubjectState.REPLIED
