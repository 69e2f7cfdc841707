"""The HTTP face under attack: what a stranger on the network can do to a coordinator with bytes alone.

Three attacks, each against a coordinator of its own (``--only`` picks some):

- ``headers``: request headers that never end, read before any authentication: one connection sends a single
  header line of --line-mib MiB (default 200), then two connections send --lines-mib MiB each (default 400)
  in 1 KB header lines. Measured: the coordinator's RSS before, and its peak while each attack runs (sampled
  every 20 ms), and how many bytes it took before it closed the connection.
- ``held``: connections that hold a descriptor and never finish a request: --idle connections that send
  nothing (default 2,000), --slowloris connections that send a header line every 5 s (default 1,000), and
  --bodies connections that announce a body and never finish it (default 500). Measured: how many of each are
  still open after --hold seconds (default 60), and whether a gRPC call and the health check answer meanwhile.
- ``descriptors``: ``inbox-coordinator serve`` started with a descriptor limit of --nofile (default 1,024, soft
  and hard), and --held connections (default 1,100) that each send a header line every second. Measured:
  ``inbox-coordinator health`` and a gRPC ClaimReply while they are open, how many the coordinator took.

The baseline is the same coordinator before the attack (its RSS, its answers). The figures of the current code
and of the code before issue 22 are in docs/security.md ("The HTTP face under attack"), with this command.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc

from coordinator.store.etcd.process import free_port
from inbox_wire.v1 import coordinator_pb2 as pb
from inbox_wire.v1 import coordinator_pb2_grpc as pb_grpc

from ._common import CoordinatorProcess, Environment, SetupError, _stop, mib, rss_bytes, run_id
from ._load import subject

PATH = b"/inbox.coordinator.v1.Coordinator/GetCaller"
ATTACKS = ("headers", "held", "descriptors")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", default=",".join(ATTACKS), help="comma-separated: headers, held, descriptors")
    parser.add_argument("--line-mib", type=int, default=200, help="headers: the one long header line, MiB")
    parser.add_argument("--lines-mib", type=int, default=400, help="headers: each of two connections, MiB")
    parser.add_argument("--idle", type=int, default=2000, help="held: connections that send nothing")
    parser.add_argument("--slowloris", type=int, default=1000, help="held: a header line every 5 s")
    parser.add_argument("--bodies", type=int, default=500, help="held: bodies that never finish")
    parser.add_argument("--hold", type=float, default=60.0, help="held: seconds to wait before counting")
    parser.add_argument("--nofile", type=int, default=1024, help="descriptors: the coordinator's limit")
    parser.add_argument("--held", type=int, default=1100, help="descriptors: connections held open")


def _raise_own_descriptor_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _head(host: str, method: bytes = b"POST") -> bytes:
    return method + b" " + PATH + b" HTTP/1.1\r\nHost: " + host.encode() + b"\r\nx-inbox-principal: attacker\r\n"


class _RssSampler:
    """The peak RSS of a process over a stretch of time, sampled every 20 ms on a task of its own."""

    def __init__(self, pid: int) -> None:
        self._pid = pid
        self.peak = rss_bytes(pid)
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> _RssSampler:
        self.peak = rss_bytes(self._pid)
        self._task = asyncio.create_task(self._sample())
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.peak = max(self.peak, rss_bytes(self._pid))

    async def _sample(self) -> None:
        while True:
            with contextlib.suppress(OSError):
                self.peak = max(self.peak, rss_bytes(self._pid))
            await asyncio.sleep(0.02)


async def _send_until_refused(address: str, head: bytes, chunks: Any, seconds: float) -> tuple[int, str]:
    """Sends ``head`` then each chunk until the server closes the connection or ``seconds`` pass; the bytes it
    took and how it ended."""
    host, port = _host_port(address)
    reader, writer = await asyncio.open_connection(host, port)
    sent = 0
    deadline = time.monotonic() + seconds
    ending = "sent everything"
    try:
        writer.write(head)
        for chunk in chunks:
            writer.write(chunk)
            await writer.drain()
            sent += len(chunk)
            if reader.at_eof():
                ending = "closed by the coordinator"
                break
            if time.monotonic() > deadline:
                ending = f"still reading after {seconds:g} s"
                break
    except (ConnectionError, OSError):
        ending = "closed by the coordinator"
    answer = b""
    with contextlib.suppress(ConnectionError, OSError, asyncio.TimeoutError):
        answer = await asyncio.wait_for(reader.read(200), 1.0)
    writer.close()
    with contextlib.suppress(ConnectionError, OSError):
        await writer.wait_closed()
    status = answer.split(b"\r\n", 1)[0].decode(errors="replace")
    return sent, f"{ending}{f' ({status})' if status else ''}"


def _one_line(total_mib: int) -> Any:
    yield b"X-Big: "
    block = b"a" * (1 << 20)
    for _ in range(total_mib):
        yield block


def _many_lines(total_mib: int) -> Any:
    line = b"X-Pad: " + b"b" * 1015 + b"\r\n"  # 1 KiB lines
    block = line * 64
    for _ in range(total_mib * 16):
        yield block


async def _headers(options: argparse.Namespace, env: Environment) -> None:
    coordinator = CoordinatorProcess(env.tmp, env.etcd.endpoint, f"bench/{run_id()}/", http=True)
    try:
        address = coordinator.http_address
        before = coordinator.rss()
        print(f"coordinator RSS before: {mib(before)}")
        async with _RssSampler(coordinator.pid) as one:
            sent, ending = await _send_until_refused(address, _head(address), _one_line(options.line_mib), 60)
        print(
            f"one {options.line_mib} MiB header line: peak RSS {mib(one.peak)} ({one.peak / before:.2f}x before); "
            f"{mib(sent)} taken, {ending}"
        )
        async with _RssSampler(coordinator.pid) as two:
            started = time.monotonic()
            results = await asyncio.gather(
                *(_send_until_refused(address, _head(address), _many_lines(options.lines_mib), 60) for _ in range(2))
            )
            seconds = time.monotonic() - started
        taken = ", ".join(f"{mib(sent)} taken, {ending}" for sent, ending in results)
        print(
            f"two connections of {options.lines_mib} MiB in 1 KB header lines: peak RSS {mib(two.peak)} "
            f"({two.peak / before:.2f}x before) in {seconds:.1f} s; {taken}"
        )
        print(f"coordinator RSS after: {mib(coordinator.rss())}")
    finally:
        coordinator.stop()


@dataclass
class _Held:
    kind: str
    opened: int = 0
    failed: int = 0
    closed_at: list[float] = field(default_factory=list)
    answers: Counter[str] = field(default_factory=Counter)


async def _hold(
    address: str, kind: _Held, first: bytes, every: float, line: bytes, stop: asyncio.Event, start: float
) -> None:
    """One connection: ``first`` once, then ``line`` every ``every`` seconds (never, when 0), until ``stop``;
    records when (after ``start``) the server closed it and its answer's status line, if any."""
    host, port = _host_port(address)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
    except (TimeoutError, OSError):
        kind.failed += 1
        return
    kind.opened += 1

    async def trickle() -> None:
        with contextlib.suppress(ConnectionError, OSError):
            if first:
                writer.write(first)
            while every > 0:
                await asyncio.sleep(every)
                writer.write(line)
                await writer.drain()

    feeding = asyncio.create_task(trickle())
    reading = asyncio.create_task(reader.read(200))
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({reading, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if reading.done():
            kind.closed_at.append(time.monotonic() - start)
            answer = b""
            with contextlib.suppress(ConnectionError, OSError):
                answer = reading.result()
            kind.answers[answer.split(b"\r\n", 1)[0].decode(errors="replace") or "(closed, no answer)"] += 1
    finally:
        for task in (feeding, reading, stopped):
            task.cancel()
        writer.close()


async def _grpc_answers(address: str) -> str:
    """A ClaimReply on a new connection, with a 5 s deadline: what a new agent meets."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        try:
            response = await stub.ClaimReply(
                pb.ClaimReplyRequest(request_id=run_id(), subject=subject("bench-attacks", run_id())),
                metadata=(("x-inbox-principal", "bystander"),),
                timeout=5,
            )
        except grpc.aio.AioRpcError as error:
            return f"{error.code().name}: {error.details()}"
        return str(pb.ClaimReplyResponse.Result.Name(response.result))


def _health(address: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "coordinator", "health", "--address", address, "--timeout", "3"],
        capture_output=True,
        text=True,
        check=False,
    )
    return (done.stdout.strip() or done.stderr.strip()).splitlines()[-1]


async def _open_all(kinds: list[tuple[_Held, bytes, float, bytes, int]], address: str, stop: asyncio.Event) -> Any:
    start = time.monotonic()
    tasks = []
    for kind, first, every, line, count in kinds:
        for index in range(count):
            tasks.append(asyncio.create_task(_hold(address, kind, first, every, line, stop, start)))
            if index % 100 == 99:
                await asyncio.sleep(0.05)  # a listen backlog's worth at a time
    return tasks, start


async def _held(options: argparse.Namespace, env: Environment) -> None:
    coordinator = CoordinatorProcess(env.tmp, env.etcd.endpoint, f"bench/{run_id()}/", http=True)
    try:
        address = coordinator.http_address
        host = address.encode()
        idle, slow, body = _Held("idle (send nothing)"), _Held("slowloris (a line every 5 s)"), _Held("unfinished body")
        stop = asyncio.Event()
        post = _head(address) + b"content-type: application/json\r\ncontent-length: 100000\r\n\r\n{"
        tasks, start = await _open_all(
            [
                (idle, b"", 0.0, b"", options.idle),
                (slow, b"GET / HTTP/1.1\r\nHost: " + host + b"\r\n", 5.0, b"X-a: b\r\n", options.slowloris),
                (body, post, 0.0, b"", options.bodies),
            ],
            address,
            stop,
        )
        await asyncio.sleep(min(5.0, options.hold))
        answered = await _grpc_answers(coordinator.address)
        health = await asyncio.to_thread(_health, coordinator.address)
        print(f"while they are open: gRPC ClaimReply {answered}; health: {health}")
        await asyncio.sleep(max(0.0, options.hold - (time.monotonic() - start)))
        for kind in (idle, slow, body):
            held = kind.opened - len(kind.closed_at)
            closed = sorted(kind.closed_at)
            when = f", closed after {closed[0]:.1f}-{closed[-1]:.1f} s" if closed else ""
            answers = "; ".join(f"{count} {status}" for status, count in kind.answers.most_common(3))
            print(
                f"{kind.kind:<30} opened {kind.opened:>5} (refused at connect {kind.failed}), still open after "
                f"{options.hold:g} s: {held:>5}{when}{f' [{answers}]' if answers else ''}"
            )
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        coordinator.stop()


def _limited(nofile: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))


async def _descriptors(options: argparse.Namespace, env: Environment) -> None:
    grpc_address, http_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    log_path = env.tmp / f"serve-{run_id()}.log"
    command = [sys.executable, "-m", "coordinator", "serve", "--listen", grpc_address]
    command += ["--http-listen", http_address, "--metrics-listen", "", "--etcd-endpoints", env.etcd.endpoint]
    command += ["--prefix", f"bench/{run_id()}/", "--log-format", "json"]
    with log_path.open("w") as log:
        process = subprocess.Popen(  # noqa: ASYNC220 - started once, before the measurement
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=lambda: _limited(options.nofile),  # the child's limit, set before it runs anything
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        deadline = time.monotonic() + 30
        while "serving gRPC on" not in log_path.read_text():
            if process.poll() is not None or time.monotonic() > deadline:
                raise SetupError(f"serve did not start:\n{log_path.read_text()[-3000:]}")
            await asyncio.sleep(0.1)
        health = await asyncio.to_thread(_health, grpc_address)
        print(f"serve with a descriptor limit of {options.nofile}: health {health}")
        held = _Held(f"held (a header line every 1 s), {options.held}")
        stop = asyncio.Event()
        line = b"GET / HTTP/1.1\r\nHost: " + http_address.encode() + b"\r\n"
        tasks, _start = await _open_all([(held, line, 1.0, b"X-a: b\r\n", options.held)], http_address, stop)
        await asyncio.sleep(3.0)
        started = time.monotonic()
        answered = await _grpc_answers(grpc_address)
        health = await asyncio.to_thread(_health, grpc_address)
        print(
            f"with {options.held} HTTP connections held ({held.opened} connected, {held.failed} not, "
            f"{len(held.closed_at)} closed by the coordinator): gRPC ClaimReply {answered}; health: {health} "
            f"({time.monotonic() - started:.1f} s for both)"
        )
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        print(f"after they closed: health {await asyncio.to_thread(_health, grpc_address)}")
    finally:
        _stop(process, process.terminate)
    log_lines = log_path.read_text().splitlines()
    refusals = [line for line in log_lines if "descriptor" in line or "EMFILE" in line or "Too many open" in line]
    if refusals:
        print(f"its log said ({len(refusals)} lines like it): {refusals[0][:300]}")


async def run(options: argparse.Namespace, env: Environment) -> int:
    _raise_own_descriptor_limit()
    chosen = [name.strip() for name in options.only.split(",") if name.strip()]
    unknown = set(chosen) - set(ATTACKS)
    if unknown:
        raise SetupError(f"--only: unknown {sorted(unknown)}; choose from {', '.join(ATTACKS)}")
    print(f"== the HTTP face under attack: {', '.join(chosen)}")
    print(env.describe())
    for name in chosen:
        print(f"\n-- {name}", flush=True)
        await {"headers": _headers, "held": _held, "descriptors": _descriptors}[name](options, env)
    return 0
