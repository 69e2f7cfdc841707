"""Small pieces every chaos process shares: append-only JSON-lines logs, a minimal HTTP/1.1 server and client on
asyncio (the webhook channel and the fake mail API need nothing more), and process hygiene (every child dies
with its parent and by its own deadline)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# ------------------------------------------------------------------------------------------------ logs


class JsonlLog:
    """An append-only JSON-lines file; each record is one ``write(2)``, so a SIGKILL loses at most the record
    being written (which :func:`read_jsonl` skips) and never interleaves two records."""

    def __init__(self, path: Path, **fixed: Any) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._fixed = fixed

    def write(self, event: str, **fields: Any) -> None:
        record = {"t": time.time(), "ev": event, **self._fixed, **fields}
        os.write(self._fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete record of a JSON-lines file (a torn last line, from a SIGKILL, is skipped)."""
    try:
        return _records(path.read_bytes())
    except FileNotFoundError:
        return []


def _records(data: bytes) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for line in data.splitlines():
        with contextlib.suppress(ValueError):
            value = json.loads(line)
            if isinstance(value, dict):
                records.append(value)
    return records


class JsonlTail:
    """Reads a JSON-lines file incrementally: each call returns the complete records appended since the last."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def new_records(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        data = self._partial + data
        complete, _, self._partial = data.rpartition(b"\n")
        return _records(complete)


# ------------------------------------------------------------------------------------------- processes


def child_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` wrapped so that the child gets SIGKILL when the process (thread) that spawned it dies.

    ``setpriv --pdeathsig`` sets the signal and then execs, so the pid is the program's own (signals sent to it
    reach the program, not a wrapper).
    """
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return list(argv)
    return [setpriv, "--pdeathsig", "KILL", "--", *argv]


LIBFAKETIME_PLACES = (
    Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"),
    Path("/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1"),
    Path("/usr/lib/faketime/libfaketime.so.1"),
)


def skewed_clock_env(offset: str) -> dict[str, str]:
    """Environment that makes a process's clocks run ``offset`` (e.g. "+5m", "-5m") off: Debian's libfaketime,
    preloaded into the process itself (the ``faketime`` command would stand between it and its signals)."""
    library = next((path for path in LIBFAKETIME_PLACES if path.exists()), None)
    if library is None:
        raise RuntimeError("libfaketime is missing: apt install faketime")
    return {"LD_PRELOAD": str(library), "FAKETIME": offset}


def python_module_argv(module: str, *args: str) -> list[str]:
    return child_argv([sys.executable, "-m", module, *args])


async def exit_at(deadline: float) -> None:
    """Ends this process at ``deadline`` (``time.time()``) whatever it is doing: every chaos child is bounded."""
    await asyncio.sleep(max(deadline - time.time(), 0.0))
    print(f"{sys.argv[0]}: lifetime deadline reached, exiting", file=sys.stderr, flush=True)
    os._exit(3)


# ------------------------------------------------------------------------------------------------ HTTP

MAX_BODY = 1 << 20


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    abort: bool = False
    """Close the connection without answering (an outcome the caller cannot know)."""


Handler = Callable[[Request], Awaitable[Response]]

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 409: "Conflict", 500: "Internal Server Error"}


async def _read_head(reader: asyncio.StreamReader) -> tuple[str, dict[str, str]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return lines[0], headers


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    length = int(headers.get("content-length", "0") or "0")
    if length < 0 or length > MAX_BODY:
        raise ValueError(f"content-length {length} out of range")
    return await reader.readexactly(length) if length else b""


async def serve_http(host: str, port: int, handler: Handler) -> asyncio.Server:
    """One request per connection (``Connection: close``), which is all the chaos processes need."""

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line, headers = await asyncio.wait_for(_read_head(reader), 30)
            method, path, _ = [*request_line.split(" ", 2), "", ""][:3]
            body = await asyncio.wait_for(_read_body(reader, headers), 30)
            response = await handler(Request(method, path, headers, body))
            if response.abort:
                transport = writer.transport
                transport.abort()
                return
            reason = _REASONS.get(response.status, "Status")
            head = (
                f"HTTP/1.1 {response.status} {reason}\r\nContent-Type: {response.content_type}\r\n"
                f"Content-Length: {len(response.body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode("latin-1") + response.body)
            await writer.drain()
        except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    return await asyncio.start_server(on_connection, host, port, backlog=256)


async def http_request(
    address: str,
    method: str,
    path: str,
    *,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    within: float = 5.0,
) -> tuple[int, bytes]:
    """One HTTP/1.1 exchange with ``address`` (HOST:PORT); raises ``OSError``/``TimeoutError`` when it fails."""
    host, _, port = address.rpartition(":")

    async def exchange() -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            lines = [
                f"{method} {path} HTTP/1.1",
                f"Host: {address}",
                f"Content-Length: {len(body)}",
                "Connection: close",
            ]
            lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
            await writer.drain()
            status_line, response_headers = await _read_head(reader)
            parts = status_line.split(" ", 2)
            status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
            return status, await _read_body(reader, response_headers)
        except asyncio.IncompleteReadError as error:
            raise ConnectionResetError(f"{address} closed the connection: {error}") from None
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    return await asyncio.wait_for(exchange(), within)


async def http_json(address: str, method: str, path: str, payload: Any = None, within: float = 5.0) -> Any:
    body = b"" if payload is None else json.dumps(payload).encode()
    status, answer = await http_request(address, method, path, body=body, within=within)
    if status != 200:
        raise OSError(f"{method} {address}{path}: HTTP {status}: {answer[:200]!r}")
    return json.loads(answer) if answer else None


def announce(line: str) -> None:
    """The one line a child prints on stdout when it is ready (the harness waits for it)."""
    print(line, flush=True)


@contextlib.contextmanager
def timed() -> Iterator[Callable[[], float]]:
    start = time.monotonic()
    yield lambda: time.monotonic() - start
