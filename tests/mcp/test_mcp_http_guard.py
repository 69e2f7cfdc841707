"""``inbox-claims-mcp serve --transport http`` behind the coordinator's HTTP guard (inbox_wire/http_guard.py), a
process of its own against a real coordinator, attacked over raw sockets: connections that say nothing or trickle
a head are closed, past the connection cap new ones are refused at once with one log line a minute, a request
for another Host or from another origin is refused, and under a low open-file limit the flood never takes the
descriptors the server needs: once the flood's connections are closed, MCP calls work."""

from __future__ import annotations

import asyncio
import re
import select
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from mcp import Client

from coordinator.ops.server import CoordinatorServer
from tests.helpers import with_descriptor_limit
from tests.mcp.support import REPO, config_file

HEADER_TIMEOUT = 1.0


@asynccontextmanager
async def serving(
    tmp_path: Path, address: str, *flags: str, descriptors: int | None = None
) -> AsyncIterator[tuple[str, Callable[[], str]]]:
    """The server on a free port, its URL, and a function that stops it and answers all it logged."""
    config = config_file(tmp_path, "agent-http", address)
    command = [sys.executable, "-m", "inbox_claims.mcp", "serve", "--config", str(config), "--transport", "http"]
    command += ["--listen", "127.0.0.1:0", "--http-header-timeout", str(HEADER_TIMEOUT), *flags]

    if descriptors is not None:
        command = with_descriptor_limit(command, descriptors, descriptors)
    log = tmp_path / "server.log"
    with log.open("w") as output:
        process = subprocess.Popen(  # noqa: ASYNC220 (started, not waited for)
            command, cwd=REPO, stderr=output, stdout=subprocess.DEVNULL
        )
    try:
        url = await asyncio.wait_for(_announced(log), 60)

        def stopped() -> str:
            process.terminate()
            process.wait(20)
            return log.read_text()

        yield url, stopped
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def _announced(log: Path) -> str:
    while True:
        found = re.search(r"serving MCP on (http://[\w.:]+/mcp)", await asyncio.to_thread(log.read_text))
        if found:
            return found[1]
        await asyncio.sleep(0.05)


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def trickle(port: int, head: bytes) -> bytes:
    """Sends ``head`` a byte every 0.1 s (slowloris) until the server answers; what it answered."""
    with socket.create_connection(("127.0.0.1", port)) as connection:
        for byte in head * 10:
            if select.select([connection], [], [], 0.1)[0]:
                break  # the server spoke (and closes)
            connection.sendall(bytes([byte]))
        connection.settimeout(30)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
        return answer


async def closed_by_server(reader: asyncio.StreamReader) -> bytes:
    """Everything the server said on the connection until it closed it."""
    return await asyncio.wait_for(reader.read(), 30)


async def test_idle_and_slow_connections_are_closed_and_past_the_cap_one_line_says_so(
    server: CoordinatorServer, tmp_path: Path
) -> None:
    async with serving(tmp_path, server.address, "--http-max-connections", "20") as (url, stopped):
        port = port_of(url)
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(20)]
        await asyncio.sleep(0.2)  # (accepted: the cap is full)
        over = [await asyncio.open_connection("127.0.0.1", port) for _ in range(30)]
        refused = await asyncio.gather(*(closed_by_server(reader) for reader, _ in over))
        silent = await asyncio.gather(*(closed_by_server(reader) for reader, _ in idle))  # said nothing: closed
        slow = await asyncio.to_thread(trickle, port, b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        async with Client(url, mode="2026-07-28") as client:  # and the server serves as before
            tools = await client.list_tools()
        for _reader, writer in [*idle, *over]:
            writer.close()
        said = stopped()

    assert all(answer.startswith(b"HTTP/1.1 503 ") for answer in refused)
    assert b"this MCP server has as many HTTP connections open as it allows (--http-max-connections)" in refused[0]
    assert silent == [b""] * 20
    assert slow.startswith(b"HTTP/1.1 408 ")
    assert b"did not arrive within 1 s (--http-header-timeout)" in slow
    assert tools.tools
    assert said.count("connections open, the cap") == 1  # 30 refusals, one line (a minute's worth)


async def test_a_request_for_another_host_or_from_another_origin_is_refused(
    server: CoordinatorServer, tmp_path: Path
) -> None:
    async with serving(tmp_path, server.address) as (url, _):
        port = port_of(url)
        answers = []
        for host, origin in (("evil.example", None), ("127.0.0.1", "http://evil.example")):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            head = f"POST /mcp HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Length: 2\r\nConnection: close\r\n"
            writer.write((head + (f"Origin: {origin}\r\n" if origin else "") + "\r\n{}").encode())
            answers.append(await closed_by_server(reader))
            writer.close()

    assert answers[0].startswith(b"HTTP/1.1 421 ")
    assert b"this MCP server does not answer to the name 'evil.example:" in answers[0]
    assert answers[1].startswith(b"HTTP/1.1 403 ")
    assert b"a page of another origin (http://evil.example) may not call this MCP server" in answers[1]


async def test_under_a_low_open_file_limit_a_flood_never_takes_what_mcp_calls_need(
    server: CoordinatorServer, tmp_path: Path
) -> None:
    # 320 descriptors: 64 for HTTP connections (256 kept for the rest), though --http-max-connections is 1000.
    async with serving(tmp_path, server.address, descriptors=320) as (url, stopped):
        port = port_of(url)
        flood = []
        for _ in range(400):
            flood.append(await asyncio.open_connection("127.0.0.1", port))
        answers = await asyncio.gather(*(closed_by_server(reader) for reader, _ in flood))
        async with Client(url, mode="legacy") as client:  # the flood is gone: a new session and its calls work
            who = await client.call_tool("who_is_answering", {"mailbox": "grant-flood"})
        for _reader, writer in flood:
            writer.close()
        said = stopped()

    refused = [answer for answer in answers if answer.startswith(b"HTTP/1.1 503 ")]
    assert len(refused) >= 400 - 64  # each at once, not left to time out
    assert not who.is_error
    assert len(said.splitlines()) < 10, said[-2000:]  # a line a minute per reason, not a line per connection
