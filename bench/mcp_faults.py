"""python -m bench mcp-faults: the MCP guard and server under the faults of issue 32, as figures for docs/mcp.md.

Four runs (``--only`` picks some), each against ``inbox-claims-mcp`` processes and a coordinator on this run's
etcd; the upstream is the fake email server of tests/mcp/fake_email.py (every send one line of an outbox file):

- ``crash``: the guard over stdio in front of the upstream; one send, then the upstream is killed (SIGKILL),
  then --sends more sends. Counted: the sends that reached an upstream after the kill, and the messages left
  SENDING or IN_DOUBT (a person must check them).
- ``idle``: ``serve --transport http``; --idle connections that send nothing and --slowloris ones that send a
  header line every 5 s. Counted after --hold seconds (default 60): how many the server closed.
- ``answer``: the guard in front of an upstream tool that answers --answer-mib MiB (default 64). Measured: the
  guard's peak resident memory (VmHWM) before and after, how long the call took, and what it answered.
- ``sessions``: ``serve --transport http``; --sessions calls of claim_message (2026-07-28 protocol), each with a
  made-up ``Mcp-Session-Id`` and a message of its own. Counted: the claims held afterwards by the server's one
  principal (each renewed for as long as its session lives).

``--code DIR`` runs the ``inbox-claims-mcp`` processes from the code in DIR (``git archive COMMIT | tar -x -C
DIR``): the figures before a change, with the same command. Only flags both versions know are given.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import resource
import signal
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from inbox_claims import AsyncCoordinator, Subject, SubjectState
from inbox_claims.testing import async_running_coordinator
from tests.mcp.fake_email import a_reply

from ._common import Environment

RUNS = ("crash", "idle", "answer", "sessions")
ROOT = Path(__file__).resolve().parent.parent
SEND = "send_message"
SPEC = "send_message,message=reply_to_message_id,mailbox=grant_id,thread=thread_id"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", default=",".join(RUNS), help="comma-separated: " + ", ".join(RUNS))
    parser.add_argument("--code", type=Path, default=None, help="run the MCP processes from the code in this folder")
    parser.add_argument("--sends", type=int, default=4, help="crash: sends after the upstream is killed")
    parser.add_argument("--idle", type=int, default=1000, help="idle: connections that send nothing")
    parser.add_argument("--slowloris", type=int, default=500, help="idle: connections sending a line every 5 s")
    parser.add_argument("--hold", type=float, default=60.0, help="idle: seconds before counting")
    parser.add_argument("--answer-mib", type=int, default=64, help="answer: the upstream answer's size, MiB")
    parser.add_argument("--sessions", type=int, default=2000, help="sessions: calls with a made-up session id")


def _environment(code: Path | None) -> dict[str, str]:
    env = {**os.environ}
    if code is not None:
        env["PYTHONPATH"] = f"{code / 'clients' / 'python'}{os.pathsep}{code}"
    return env


def _config(directory: Path, target: str, name: str) -> Path:
    path = directory / f"{name}.toml"
    path.write_text(f'target = "{target}"\nprincipal = "{name}"\n')
    return path


def _guard(directory: Path, target: str, outbox: Path, code: Path | None) -> StdioServerParameters:
    config = _config(directory, target, "bench-guard")
    # The same upstream whichever code the guard runs (this checkout's fake, not the other code's).
    upstream = [
        "/usr/bin/env",
        f"PYTHONPATH={ROOT}",
        sys.executable,
        "-m",
        "tests.mcp.fake_email",
        "--outbox",
        str(outbox),
    ]
    return StdioServerParameters(
        command=sys.executable,
        args=["-m", "inbox_claims.mcp", "guard", "--config", str(config), "--send-tool", SPEC, "--", *upstream],
        env=_environment(code),
        cwd=ROOT,  # the upstream is this checkout's fake; PYTHONPATH alone picks the code under test
    )


def _pid(marker: str, program: str) -> int:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                words = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
                if words[1:3] == ["-m", program] and marker in words:
                    return int(entry.name)
    raise RuntimeError(f"no {program} process with {marker}")


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _crash(options: argparse.Namespace, target: str, directory: Path) -> None:
    outbox = directory / "outbox.jsonl"
    mailbox = f"bench-crash-{os.getpid()}"
    messages = [f"after-{n}" for n in range(options.sends)]
    async with Client(_guard(directory, target, outbox, options.code), mode="legacy") as client:
        await client.call_tool(SEND, a_reply(mailbox, "before"))
        os.kill(_pid(str(outbox), "tests.mcp.fake_email"), signal.SIGKILL)
        results = []
        for message in messages:
            began = time.monotonic()
            result = await asyncio.wait_for(client.call_tool(SEND, a_reply(mailbox, message)), 180)
            results.append((result, time.monotonic() - began))
    sent = outbox.read_text().splitlines() if outbox.exists() else []
    reached = sum(1 for message in messages if any(f'"{message}"' in line for line in sent))
    async with AsyncCoordinator(target, principal="bench-observer") as observer:
        states = [(await observer.status(Subject.message(mailbox, message))).state for message in messages]
    doubtful = sum(1 for state in states if state in (SubjectState.SENDING, SubjectState.IN_DOUBT))
    print(f"crash: the upstream killed after one send; then {options.sends} sends:")
    print(f"  reached an upstream       {reached} of {options.sends}")
    print(f"  left SENDING or IN_DOUBT  {doubtful} of {options.sends}")
    print(f"  answered as sent          {sum(1 for result, _ in results if not result.is_error)}")
    print(f"  slowest answer            {max(took for _, took in results):.1f} s")


@contextlib.asynccontextmanager
async def _http_server(
    directory: Path, target: str, code: Path | None
) -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    config = _config(directory, target, "bench-http")
    command = ["-m", "inbox_claims.mcp", "serve", "--config", str(config), "--transport", "http"]
    log = (directory / "http.log").open("w")
    process = await asyncio.create_subprocess_exec(
        sys.executable, *command, "--listen", "127.0.0.1:0", env=_environment(code), cwd=ROOT, stderr=log
    )
    try:
        yield await _announced(directory / "http.log"), process
    finally:
        process.terminate()
        with contextlib.suppress(ProcessLookupError):
            await asyncio.wait_for(process.wait(), 20)
        log.close()


async def _announced(log: Path) -> str:
    """The URL the server says it serves on, once it says it."""
    for _ in range(1200):
        found = re.search(r"http://[\d.:]+/mcp", await asyncio.to_thread(log.read_text))
        if found:
            return found[0]
        await asyncio.sleep(0.05)
    said = await asyncio.to_thread(log.read_text)
    raise RuntimeError(f"the MCP server never said where it serves: {said[-500:]}")


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def _still_open(connection: socket.socket) -> bool:
    """Whether the server still holds the connection (what it said before closing it is read and dropped)."""
    connection.setblocking(False)
    while True:
        try:
            if connection.recv(1 << 16) == b"":
                return False
        except BlockingIOError:
            return True
        except OSError:
            return False


async def _idle(options: argparse.Namespace, target: str, directory: Path) -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    async with _http_server(directory, target, options.code) as (url, _):
        port = _port(url)
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(options.idle)]
        slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(options.slowloris)]
        for connection in slow:
            connection.sendall(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        began = time.monotonic()
        while time.monotonic() - began < options.hold:
            for number, connection in enumerate(slow):
                with contextlib.suppress(OSError):
                    connection.sendall(b"X-Slow-%d: 1\r\n" % number)
            await asyncio.sleep(5)
        closed_idle = sum(1 for connection in idle if not _still_open(connection))
        closed_slow = sum(1 for connection in slow if not _still_open(connection))
        for connection in idle + slow:
            connection.close()
    print(f"idle: after {options.hold:g} s, closed by the server:")
    print(f"  connections that sent nothing   {closed_idle} of {options.idle}")
    print(f"  slowloris (a line every 5 s)    {closed_slow} of {options.slowloris}")


async def _answer(options: argparse.Namespace, target: str, directory: Path) -> None:
    outbox = directory / "answer-outbox.jsonl"
    async with Client(_guard(directory, target, outbox, options.code), mode="legacy") as client:
        await client.call_tool("list_messages", {"grant_id": "bench"})
        guard = _pid(str(directory / "bench-guard.toml"), "inbox_claims.mcp")
        before = _peak_rss_mib(guard)
        began = time.monotonic()
        try:
            result = await asyncio.wait_for(
                client.call_tool("export_mailbox", {"grant_id": "bench", "megabytes": options.answer_mib}), 600
            )
            said = f"answered ({sum(len(getattr(block, 'text', '')) for block in result.content) >> 20} MiB)"
        except Exception as error:  # the guard's refusal, as the client sees it
            said = f"refused: {str(error)[:100]}"
        took = time.monotonic() - began
        after = _peak_rss_mib(guard)
    print(f"answer: an upstream answer of {options.answer_mib} MiB through the guard:")
    print(f"  the call             {said}, in {took:.1f} s")
    print(f"  guard's peak RSS     {before:.0f} MiB before, {after:.0f} MiB after (+{after - before:.0f} MiB)")


@contextlib.asynccontextmanager
async def _with_session_id(url: str, session_id: str) -> AsyncIterator[Any]:
    """The SDK's streamable HTTP transport, sending ``Mcp-Session-Id: session_id`` with every request."""
    async with (
        httpx2.AsyncClient(headers={"mcp-session-id": session_id}, timeout=30) as http,
        streamable_http_client(url, http_client=http) as streams,
    ):
        yield streams


async def _sessions(options: argparse.Namespace, target: str, directory: Path) -> None:
    mailbox = f"bench-sessions-{os.getpid()}"
    async with _http_server(directory, target, options.code) as (url, _):
        answers = {"granted": 0, "refused": 0}
        began = time.monotonic()
        for number in range(options.sessions):
            async with Client(_with_session_id(url, f"made-up-{number}"), mode="2026-07-28") as client:
                result = await client.call_tool("claim_message", {"mailbox": mailbox, "message_id": f"m-{number}"})
                answers["refused" if result.is_error else "granted"] += 1
        took = time.monotonic() - began
        async with AsyncCoordinator(target, principal="bench-observer") as observer:
            held = [status async for status in observer.iter_claims(mailbox, states=[SubjectState.CLAIMED])]
        refusal = ""
        if answers["refused"]:
            refusal = " (refused: as the cap says)"
    print(f"sessions: {options.sessions} claim_message calls with made-up session ids (2026 protocol), {took:.0f} s:")
    print(f"  granted {answers['granted']}, refused {answers['refused']}{refusal}")
    print(f"  claims held by the server's principal afterwards: {len(held)}")


async def run(options: argparse.Namespace, env: Environment) -> int:
    chosen = [name for name in options.only.split(",") if name]
    unknown = set(chosen) - set(RUNS)
    if unknown:
        print(f"bench mcp-faults: no run {', '.join(sorted(unknown))} (the runs: {', '.join(RUNS)})")
        return 2
    code = f" (the MCP processes from {options.code})" if options.code else ""
    print(f"== mcp-faults{code}")
    with tempfile.TemporaryDirectory(prefix="bench-mcp-") as temporary:
        async with async_running_coordinator(etcd_endpoint=env.etcd.endpoint) as running:
            for name in chosen:
                directory = Path(temporary) / name
                directory.mkdir()
                await {"crash": _crash, "idle": _idle, "answer": _answer, "sessions": _sessions}[name](
                    options, running.target, directory
                )
    return 0
