"""The guard in front of a real upstream process that dies, hangs, answers 64 MiB or lists other tools: the guard
is a process too (``inbox-claims-mcp guard``, spawned over stdio by the SDK's client, in either protocol era), its
upstream the fake email server of tests/mcp/fake_email.py (every send one line of an outbox file, which outlives
the process), against a real coordinator and etcd.

What it shows: a send passes the commit point only towards an upstream that answers (a dead one is started
again, a stopped one replaced); only a send handed over and then lost is IN_DOUBT; a call's deadline ends a hung
one; an answer over the size limit is not read (the guard's memory does not grow with it); the guard does not
start, or pass anything, in front of a server without the send tools it was told to fence.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client, StdioServerParameters
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage
from mcp.types import CallToolRequestParams, JSONRPCRequest

from coordinator.ops.server import CoordinatorServer
from coordinator.store.etcd.process import free_port
from inbox_claims import AsyncCoordinator, Subject, SubjectState
from inbox_claims.mcp import AgentSession, SendTool, Upstream, UpstreamFailed, build_guard
from inbox_claims.mcp._sessions import OneSession
from inbox_claims.mcp._upstream import _ATTEMPT, _Attempt, _Ended, _Writes
from tests.helpers import eventually
from tests.mcp.fake_email import HUGE_MIB, SEND_TOOL, SEND_TOOL_SPEC, Outbox, a_reply, fake_email_server
from tests.mcp.support import REPO, command, pid_of, state_of, text

UPSTREAM_TIMEOUT = 2.0
"""--upstream-timeout of the guards here: what ends a hung call (and the probe before a send)."""
ERAS = pytest.mark.parametrize("era", ["legacy", "2026-07-28"], ids=["2025-client", "2026-client"])


def fake_upstream(outbox: Outbox, *http: str) -> list[str]:
    return [sys.executable, "-m", "tests.mcp.fake_email", "--outbox", str(outbox.path), *http]


def guard(tmp_path: Path, address: str, upstream: list[str], *options: str) -> StdioServerParameters:
    return command(
        tmp_path,
        "agent-g",
        address,
        "guard",
        "--send-tool",
        SEND_TOOL_SPEC,
        "--upstream-timeout",
        str(UPSTREAM_TIMEOUT),
        *options,
        "--",
        *upstream,
    )


def upstream_pid(outbox: Outbox) -> int:
    return pid_of(str(outbox.path), program="tests.mcp.fake_email")


def guard_pid(tmp_path: Path) -> int:
    return pid_of(str(tmp_path / "agent-g.toml"), program="inbox_claims.mcp")


def peak_rss_mib(pid: int) -> float:
    """The most resident memory the process ever had (VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def set_mode(outbox: Outbox, mode: str) -> None:
    assert outbox.path is not None
    outbox.path.with_suffix(".mode").write_text(mode)


async def states(address: str, mailbox: str, ids: list[str]) -> list[SubjectState]:
    return [await state_of(address, Subject.message(mailbox, message_id)) for message_id in ids]


@ERAS
async def test_a_killed_upstream_is_started_again_and_every_later_send_reaches_it(
    server: CoordinatorServer, mailbox: str, tmp_path: Path, era: str
) -> None:
    outbox = Outbox(tmp_path / "outbox.jsonl")
    later = [f"msg-{n}" for n in range(1, 5)]
    async with Client(guard(tmp_path, server.address, fake_upstream(outbox)), mode=era) as client:
        first = await client.call_tool(SEND_TOOL, a_reply(mailbox, "msg-0"))
        killed = upstream_pid(outbox)
        os.kill(killed, signal.SIGKILL)  # between calls: the guard learns it at the next one
        results = [await client.call_tool(SEND_TOOL, a_reply(mailbox, message)) for message in later]
        again = upstream_pid(outbox)

    assert not first.is_error
    assert [result.is_error for result in results] == [False] * 4, [text(result) for result in results]
    assert [len(outbox.sends_for(message)) for message in ["msg-0", *later]] == [1] * 5  # every send reached it
    assert await states(server.address, mailbox, ["msg-0", *later]) == [SubjectState.REPLIED] * 5  # none in doubt
    assert again != killed  # a new upstream process


async def test_a_send_lost_mid_call_is_in_doubt_and_the_next_reaches_a_new_upstream(
    server: CoordinatorServer, mailbox: str, tmp_path: Path
) -> None:
    outbox = Outbox(tmp_path / "outbox.jsonl")
    async with Client(guard(tmp_path, server.address, fake_upstream(outbox), "--upstream-timeout", "60")) as client:
        set_mode(outbox, "hang")  # the send is made, then no answer comes
        call = asyncio.create_task(client.call_tool(SEND_TOOL, a_reply(mailbox, "msg-lost")))
        await eventually(lambda: _sent(outbox, "msg-lost"))
        os.kill(upstream_pid(outbox), signal.SIGKILL)  # the upstream dies after sending, before answering
        lost = await asyncio.wait_for(call, 30)
        set_mode(outbox, "send")
        after = await client.call_tool(SEND_TOOL, a_reply(mailbox, "msg-next"))

    assert lost.is_error
    assert "outcome of the send is unknown" in text(lost)
    assert not after.is_error
    assert len(outbox.sends_for("msg-next")) == 1
    assert await states(server.address, mailbox, ["msg-lost", "msg-next"]) == [
        SubjectState.SENDING,
        SubjectState.REPLIED,
    ]


async def _sent(outbox: Outbox, message_id: str) -> bool:
    return bool(outbox.sends_for(message_id))


async def test_a_hung_call_ends_at_the_deadline_in_doubt_and_a_stopped_upstream_is_replaced_before_the_commit_point(
    server: CoordinatorServer, mailbox: str, tmp_path: Path
) -> None:
    outbox = Outbox(tmp_path / "outbox.jsonl")
    async with Client(guard(tmp_path, server.address, fake_upstream(outbox))) as client:
        set_mode(outbox, "hang")
        hung = await asyncio.wait_for(client.call_tool(SEND_TOOL, a_reply(mailbox, "msg-hung")), 60)
        set_mode(outbox, "send")
        stopped = upstream_pid(outbox)
        os.kill(stopped, signal.SIGSTOP)  # alive, answering nothing: the probe before the next send finds it out
        try:
            replaced = await asyncio.wait_for(client.call_tool(SEND_TOOL, a_reply(mailbox, "msg-after")), 60)
        finally:
            os.kill(stopped, signal.SIGCONT)  # (killed by the guard meanwhile, or now free to be)

    assert hung.is_error
    assert "outcome of the send is unknown" in text(hung)
    assert len(outbox.sends_for("msg-hung")) == 1  # it was handed over: in doubt is the truth
    assert not replaced.is_error
    assert len(outbox.sends_for("msg-after")) == 1
    assert await states(server.address, mailbox, ["msg-hung", "msg-after"]) == [
        SubjectState.SENDING,  # IN_DOUBT once the coordinator's send timeout passes
        SubjectState.REPLIED,
    ]
    await eventually(lambda: _gone(stopped), within=15)


async def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return "State:\tZ" in await asyncio.to_thread(Path(f"/proc/{pid}/status").read_text)


@ERAS
async def test_a_64_mib_answer_is_not_read_and_the_guards_memory_does_not_grow_with_it(
    server: CoordinatorServer, mailbox: str, tmp_path: Path, era: str
) -> None:
    outbox = Outbox(tmp_path / "outbox.jsonl")
    # A deadline far past what writing 16 MiB takes on a loaded machine: what ends the answer is its size.
    upstream = guard(tmp_path, server.address, fake_upstream(outbox), "--upstream-timeout", "30")
    async with Client(upstream, mode=era) as client:
        small = await client.call_tool("export_mailbox", {"grant_id": mailbox, "megabytes": 1})  # under the limit
        before = peak_rss_mib(guard_pid(tmp_path))
        with pytest.raises(MCPError) as refused:
            await client.call_tool("export_mailbox", {"grant_id": mailbox, "megabytes": HUGE_MIB})
        grown = peak_rss_mib(guard_pid(tmp_path)) - before
        set_mode(outbox, "huge")  # a send answered with 64 MiB: it went out, its answer is not read
        huge_send = await client.call_tool(SEND_TOOL, a_reply(mailbox, "msg-huge"))
        set_mode(outbox, "send")
        after = await client.call_tool(SEND_TOOL, a_reply(mailbox, "msg-after"))

    assert not small.is_error
    assert "more than 16 MiB (--upstream-max-bytes)" in refused.value.error.message
    assert grown < 40, f"the guard's peak memory grew {grown:.0f} MiB for a {HUGE_MIB} MiB answer"
    assert huge_send.is_error
    assert "outcome of the send is unknown" in text(huge_send)
    assert not after.is_error
    assert await states(server.address, mailbox, ["msg-huge", "msg-after"]) == [
        SubjectState.SENDING,
        SubjectState.REPLIED,
    ]


async def start_http_upstream(outbox: Outbox, port: int) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(  # noqa: ASYNC220 (started, not waited for)
        fake_upstream(outbox, "--http", str(port)), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    await eventually(lambda: _listening(port), within=30)
    return process


def stop(process: subprocess.Popen[bytes]) -> None:
    process.kill()
    process.wait()


async def _listening(port: int) -> bool:
    try:
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    await writer.wait_closed()
    return True


@ERAS
async def test_a_url_upstream_that_went_away_gets_no_send_past_the_commit_point_and_is_reached_again(
    server: CoordinatorServer, mailbox: str, tmp_path: Path, era: str
) -> None:
    outbox = Outbox(tmp_path / "outbox.jsonl")
    port = free_port()
    upstream = await start_http_upstream(outbox, port)
    try:
        async with Client(guard(tmp_path, server.address, [f"http://127.0.0.1:{port}/mcp"]), mode=era) as client:
            first = await client.call_tool(SEND_TOOL, a_reply(mailbox, "msg-1"))
            stop(upstream)
            refused = await client.call_tool(SEND_TOOL, a_reply(mailbox, "msg-2"))
            while_away = await state_of(server.address, Subject.message(mailbox, "msg-2"))
            upstream = await start_http_upstream(outbox, port)  # the same URL, a new server
            again = await client.call_tool(SEND_TOOL, a_reply(mailbox, "msg-2"))
    finally:
        stop(upstream)

    assert not first.is_error
    assert refused.is_error
    assert text(refused).startswith("Not sent: the email server could not take it (it cannot be reached")
    assert "Nothing went out" in text(refused)
    assert while_away is SubjectState.FREE  # never claimed: the probe came before the commit point
    assert not again.is_error
    assert [len(outbox.sends_for(message)) for message in ("msg-1", "msg-2")] == [1, 1]


def guard_process(*arguments: str) -> subprocess.CompletedProcess[str]:
    """``inbox-claims-mcp guard`` run to its end (a refusal at start needs no coordinator: none is called)."""
    return subprocess.run(
        [sys.executable, "-m", "inbox_claims.mcp", "guard", "--principal", "agent-g", *arguments],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def preset_upstream(tmp_path: Path, preset: str) -> list[str]:
    return [sys.executable, "-m", "tests.mcp.preset_servers", preset, "--outbox", str(tmp_path / "sent.jsonl")]


def test_the_guard_does_not_start_in_front_of_a_server_without_its_send_tool(tmp_path: Path) -> None:
    # GongRzhe's Gmail server, as its published version lists its tools: there is no send_message.
    refused = guard_process("--send-tool", SEND_TOOL_SPEC, "--", *preset_upstream(tmp_path, "gmail"))
    wrong_path = guard_process(
        "--send-tool",
        "send_email,message=replyTo",
        "--mailbox",
        "me@example.com",
        "--",
        *preset_upstream(tmp_path, "gmail"),
    )

    assert refused.returncode == 2
    said = refused.stderr
    assert (
        "the email MCP server (gmail 1.0.0): it lists no tool send_message, which --send-tool names as the tool" in said
    )
    assert "the closest is send_email" in said
    assert "it lists batch_delete_emails, batch_modify_emails, create_filter" in said  # every tool it does list
    assert "The guard does not start: it would fence nothing." in said
    assert wrong_path.returncode == 2
    assert (
        "send_email takes no argument replyTo (--send-tool: message=replyTo); its arguments are attachments, bcc"
        in (wrong_path.stderr)
    )


def test_a_preset_names_the_versions_it_was_checked_against_when_it_is_refused(tmp_path: Path) -> None:
    refused = guard_process("--preset", "email-mcp", "--", *preset_upstream(tmp_path, "resend"))

    assert refused.returncode == 2
    assert "it lists no tool reply_email, which --preset email-mcp names" in refused.stderr
    assert "--preset email-mcp was checked against @codefuturist/email-mcp 0.2.0" in refused.stderr


async def test_a_preset_starts_in_front_of_the_published_tool_list_it_was_checked_against(tmp_path: Path) -> None:
    # No coordinator is called to start and list tools: the guard stands in front of resend-mcp 2.22.0's tools.
    guard_command = StdioServerParameters(
        command=sys.executable,
        args=["-m", "inbox_claims.mcp", "guard", "--principal", "agent-g", "--preset", "resend", "--mailbox",
              "support@shop.example", "--", *preset_upstream(tmp_path, "resend")],
        cwd=REPO,
        env={"PATH": os.environ.get("PATH", "")},
    )  # fmt: skip
    async with Client(guard_command) as client:
        names = {tool.name for tool in (await client.list_tools()).tools}

    assert {"send-email", "send-batch-emails", "send-broadcast", "list-received-emails"} <= names
    assert len(names) == 105


async def test_a_send_tool_gone_from_a_new_upstream_stops_everything_the_guard_would_pass(
    server: CoordinatorServer, mailbox: str, tmp_path: Path
) -> None:
    outbox = Outbox(tmp_path / "outbox.jsonl")
    async with Client(guard(tmp_path, server.address, fake_upstream(outbox))) as client:
        assert outbox.path is not None
        outbox.path.with_suffix(".tools").write_text("no-send")  # the next process lists no send_message
        os.kill(upstream_pid(outbox), signal.SIGKILL)
        refused = await client.call_tool(SEND_TOOL, a_reply(mailbox, "msg-1"))
        with pytest.raises(MCPError) as listing:
            await client.list_tools()
        with pytest.raises(MCPError) as reading:
            await client.call_tool("list_messages", {"grant_id": mailbox})

    assert refused.is_error
    assert "it lists no tool send_message, which --send-tool names as the tool that sends replies" in text(refused)
    assert "Nothing went out" in text(refused)
    assert outbox.sends == []
    assert await state_of(server.address, Subject.message(mailbox, "msg-1")) is SubjectState.FREE
    for error in (listing.value, reading.value):
        assert "it lists no tool send_message" in error.error.message


async def test_a_request_is_handed_over_when_written_to_the_live_process_and_not_when_it_is_gone() -> None:
    request = SessionMessage(JSONRPCRequest(jsonrpc="2.0", id=1, method="tools/call", params={"name": SEND_TOOL}))
    gone = await anyio.open_process([sys.executable, "-c", "pass"])
    await gone.wait()
    alive = await anyio.open_process([sys.executable, "-c", "import sys; sys.stdin.read()"])
    attempts = []
    try:
        for process in (gone, alive):
            attempt = _Attempt()
            token = _ATTEMPT.set(attempt)
            try:
                with contextlib.suppress(anyio.BrokenResourceError):
                    await _Writes(process, _Ended()).send(request)
            finally:
                _ATTEMPT.reset(token)
            attempts.append(attempt.handed_over)
    finally:
        for process in (gone, alive):
            await process.aclose()

    assert attempts == [False, True]  # a send never written is aborted by the guard; one written may have run


class _NeverReached(Upstream):
    """An upstream that answers the probe and never gets a call (its process gone between the two)."""

    async def call_tool(self, params: CallToolRequestParams) -> dict[str, Any]:
        raise UpstreamFailed("it exited (status 0)", handed_over=False)


async def test_a_send_that_never_reached_the_upstream_after_the_commit_point_is_aborted_and_the_message_free(
    server: CoordinatorServer, mailbox: str
) -> None:
    outbox = Outbox()
    upstream_server = fake_email_server(outbox)
    async with (
        AsyncCoordinator(server.address, principal="agent-a") as coordinator,
        _NeverReached(lambda: Client(upstream_server)) as upstream,
    ):
        session = AgentSession(coordinator)
        guard = build_guard(upstream, [SendTool.parse(SEND_TOOL_SPEC)], OneSession(session))
        async with Client(guard) as client:
            result = await client.call_tool(SEND_TOOL, a_reply(mailbox, "msg-1"))
        await session.close()
    state = await state_of(server.address, Subject.message(mailbox, "msg-1"))

    assert result.is_error
    assert text(result).startswith("Not sent: the email server could not take it (it exited (status 0)).")
    assert "the message is free again" in text(result)
    assert state is SubjectState.FREE  # claimed, past BeginSend, aborted: nobody needs to check anything
    assert outbox.sends == []
