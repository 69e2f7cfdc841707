"""The command over streamable HTTP, through the SDK's own HTTP client, against a real coordinator: our tools
(``serve --transport http``) and the guard (``guard --transport http``, its upstream itself given as a URL),
each a process of its own. Sessions are MCP sessions (clients of the handshake era, ``mode="legacy"``) or, for
2026-07-28 clients, which have none, the server's one shared session."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from coordinator.ops.server import CoordinatorServer
from examples.agent.fake_nylas import FakeNylas
from inbox_claims import AsyncCoordinator, Subject, SubjectState
from tests.helpers import eventually, spawn, wait_for_line
from tests.mcp.fake_email import SEND_TOOL, SEND_TOOL_SPEC, Outbox, a_reply
from tests.mcp.support import (
    API_KEY,
    REPO,
    TTL,
    config_file,
    pid_of,
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


@contextlib.asynccontextmanager
async def with_header(url: str, **headers: str) -> AsyncIterator[Any]:
    """The SDK's streamable HTTP transport to ``url``, sending ``headers`` with every request."""
    async with (
        httpx2.AsyncClient(headers=headers, timeout=30) as http,
        streamable_http_client(url, http_client=http) as streams,
    ):
        yield streams


@contextlib.asynccontextmanager
async def telling_session_id(url: str, said: dict[str, str]) -> AsyncIterator[Any]:
    """The SDK's streamable HTTP transport to ``url``; the MCP session id the server gives goes into ``said``."""

    async def seen(response: httpx2.Response) -> None:
        if "mcp-session-id" in response.headers:
            said["id"] = response.headers["mcp-session-id"]

    async with (
        httpx2.AsyncClient(event_hooks={"response": [seen]}, timeout=30) as http,
        streamable_http_client(url, http_client=http) as streams,
    ):
        yield streams


def handle_of(result: Any) -> str:
    assert result.structured_content is not None, result
    return str(result.structured_content["claim_handle"])


async def test_sessionless_clients_hold_claims_through_handles_and_never_share_one(
    server: CoordinatorServer, fake: FakeNylas, mailbox: str, tmp_path: Path
) -> None:
    said: dict[str, str] = {}
    async with (
        serving(tmp_path, server.address, fake) as (_, url),
        sessions(url, 2, "2026-07-28") as (ana, bo),
        Client(telling_session_id(url, said), mode="legacy") as legacy,
    ):
        claimed = await ana.call_tool("claim_message", {"mailbox": mailbox, "message_id": "msg-1"})
        handle = handle_of(claimed)
        other = await bo.call_tool("claim_message", {"mailbox": mailbox, "message_id": "msg-1"})
        bo_sends = await bo.call_tool("send_reply", reply_arguments(mailbox, "msg-1", body="from bo"))
        without = await ana.call_tool("send_reply", reply_arguments(mailbox, "msg-1", body="from ana"))
        sent = await ana.call_tool(
            "send_reply", {**reply_arguments(mailbox, "msg-1", body="from ana"), "claim_handle": handle}
        )
        # A session id on a request of the 2026 protocol is not read: a stale one touches nobody's claims.
        await legacy.call_tool("claim_message", {"mailbox": mailbox, "message_id": "msg-2"})
        async with Client(with_header(url, **{"mcp-session-id": said["id"]}), mode="2026-07-28") as stale:
            released = await stale.call_tool("release_message", {"mailbox": mailbox, "message_id": "msg-2"})
        async with httpx2.AsyncClient() as http:  # and a DELETE of the 2026 protocol ends no session
            headers = {"mcp-session-id": said["id"], "mcp-protocol-version": "2026-07-28"}
            await http.request("DELETE", url, headers=headers)
        still = await state_of(server.address, Subject.message(mailbox, "msg-2"))

    assert outcome(claimed) == "granted"
    assert handle.startswith("ch-")
    assert f'pass claim_handle "{handle}"' in text(claimed)
    assert outcome(other) == "held"  # another conversation of the same agent: its own, not a shared claim
    assert "another session of agent-http (this agent)" in text(other)
    assert "If you claimed it yourself, call again with the claim_handle" in text(other)
    assert outcome(bo_sends) == "held"
    assert outcome(without) == "held"  # without its handle, a call is not the claim's
    assert outcome(sent) == "sent"
    assert [send.payload["body"] for send in fake.sends_for("msg-1")] == ["from ana"]
    assert outcome(released) == "not_held"
    assert still is SubjectState.CLAIMED


async def test_sessions_and_handles_are_capped_with_a_clear_error(
    server: CoordinatorServer, mailbox: str, tmp_path: Path
) -> None:
    command = mcp_http(tmp_path, "agent-cap", server.address, "serve", "--max-sessions", "2", "--max-handles", "3")
    async with running(command) as (_, url), sessions(url, 5, "2026-07-28") as sessionless:
        held = [
            await client.call_tool("claim_message", {"mailbox": mailbox, "message_id": f"msg-{n}"})
            for n, client in enumerate(sessionless)
        ]
        async with Client(url, mode="legacy") as first, Client(url, mode="legacy") as second:
            for n, client in enumerate((first, second)):
                await client.call_tool("claim_message", {"mailbox": mailbox, "message_id": f"legacy-{n}"})
            with pytest.raises(BaseExceptionGroup) as third:  # the third MCP session is refused at its opening
                async with Client(url, mode="legacy"):
                    pass
            async with AsyncCoordinator(server.address, principal="observer") as observer:
                claimed = [status async for status in observer.iter_claims(mailbox, states=[SubjectState.CLAIMED])]
        # Made-up session ids on 2026 requests create nothing: each call is its own, and keeps no claim.
        async with Client(with_header(url, **{"mcp-session-id": "made-up"}), mode="2026-07-28") as madeup:
            for _ in range(3):
                await madeup.call_tool("who_is_answering", {"mailbox": mailbox})
            refused_too = await madeup.call_tool("claim_message", {"mailbox": mailbox, "message_id": "msg-x"})

    granted = [result for result in held if not result.is_error]
    refused = [result for result in held if result.is_error]
    assert len(granted) == 3
    assert len(refused) == 2
    for result in refused:
        assert text(result).startswith("Nothing was done: 3 claims of this agent are held by handle on this server")
    assert "--max-handles 3" in text(refused[0])
    said = str(third.value.exceptions[0].exceptions[0])
    assert said.startswith("No new session: 2 sessions of this agent are open on this server, its most (--max-sessions")
    assert refused_too.is_error
    assert len(claimed) == 3 + 2


@pytest.mark.parametrize("mode", ["legacy", "2026-07-28"], ids=["mcp-sessions", "2026-sessionless"])
async def test_the_guard_over_http_starts_a_killed_stdio_upstream_again_and_every_later_send_reaches_it(
    server: CoordinatorServer, mailbox: str, tmp_path: Path, mode: str
) -> None:
    outbox = Outbox(tmp_path / "outbox.jsonl")
    upstream = [sys.executable, "-m", "tests.mcp.fake_email", "--outbox", str(outbox.path)]
    guard = mcp_http(tmp_path, "agent-g", server.address, "guard", "--send-tool", SEND_TOOL_SPEC, "--", *upstream)
    async with running(guard) as (_, url), Client(url, mode=mode) as client:
        first = await client.call_tool(SEND_TOOL, a_reply(mailbox, "msg-0"))
        os.kill(pid_of(str(outbox.path), program="tests.mcp.fake_email"), signal.SIGKILL)
        later = [await client.call_tool(SEND_TOOL, a_reply(mailbox, f"msg-{n}")) for n in (1, 2, 3)]

    assert not first.is_error
    assert [result.is_error for result in later] == [False, False, False]
    assert [len(outbox.sends_for(f"msg-{n}")) for n in range(4)] == [1, 1, 1, 1]


async def test_a_send_reply_retried_over_http_after_its_client_gave_up_gets_the_first_calls_outcome(
    server: CoordinatorServer, fake: FakeNylas, mailbox: str, tmp_path: Path
) -> None:
    gate = threading.Event()

    def held_back(sent: object) -> None:  # Nylas takes the send, and answers when the test says
        gate.wait(30)

    fake.on_send = held_back
    arguments = reply_arguments(mailbox, "msg-1")
    async with serving(tmp_path, server.address, fake) as (_, url), Client(url, mode="legacy") as client:
        with pytest.raises(MCPError):
            await client.call_tool("send_reply", arguments, read_timeout_seconds=1.0)
        retried = asyncio.create_task(client.call_tool("send_reply", arguments))
        await eventually(lambda: _sent_to(fake, "msg-1"))
        gate.set()
        result = await asyncio.wait_for(retried, 30)

    assert outcome(result) == "sent"
    assert "another session" not in text(result)
    assert len(fake.sends_for("msg-1")) == 1


async def _sent_to(fake: FakeNylas, message_id: str) -> bool:
    return bool(fake.sends_for(message_id))
