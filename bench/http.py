"""The HTTP/JSON face: Watch fan-out to browser-style streams, and the coordinator's CPU per call over HTTP.

Fan-out: W Watch streams (default 200) over HTTP/1.1, one connection each as browsers on a board would hold,
all on one mailbox, each a principal of its own; then E claims (gRPC) one after another, each waited for until
every stream has its CLAIMED event. A delay is the time from the ClaimReply being sent to one stream yielding
the event. Baseline, alternating with it: as many gRPC Watch streams (100 per HTTP/2 connection), the same way.

CPU per call: the same number of ClaimReply calls (new subjects, 16 at a time) through HTTP/JSON and through
gRPC, alternating; the coordinator process's CPU seconds per 10,000 calls of each, and their ratio. Both are
offered at the same pace (``--rate``, calls/s, started on a fixed schedule): the coordinator's CPU per call
depends on how many calls arrive together (they share group-committed etcd transactions and event-loop
wake-ups), and unpaced each transport would go at its own load generator's speed (httpx is several times
slower than grpc.aio here, a hand-written HTTP/1.1 client faster), which would compare arrival rates.

``--profile``: after the measured rounds, one more round of calls of each transport with py-spy sampling the
coordinator, and where each transport's samples went, per 1,000 calls (the difference is what HTTP costs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import struct
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx

from inbox_wire.v1 import coordinator_pb2 as pb
from inbox_wire.v1 import coordinator_pb2_grpc as pb_grpc

from ._common import CoordinatorProcess, Environment, percentile, run_id
from ._load import channel, metadata, subject
from .profile import _py_spy

PATH = "/inbox.coordinator.v1.Coordinator/"
STREAMS_PER_GRPC_CONNECTION = 100
FANOUT_TIMEOUT_S = 10.0
CONCURRENCY = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--watchers", type=int, default=200, help="HTTP Watch streams (%(default)s)")
    parser.add_argument("--events", type=int, default=30, help="claims per round, one after another")
    parser.add_argument("--calls", type=int, default=2000, help="ClaimReply calls per transport per round")
    parser.add_argument("--rate", type=float, default=200, help="calls/s offered by each transport; 0: unpaced")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (default %(default)s)")
    parser.add_argument("--uvloop", action="store_true", help="the coordinator on uvloop instead of asyncio's loop")
    parser.add_argument("--profile", action="store_true", help="then py-spy each transport's calls (see above)")


def _headers(index: int) -> dict[str, str]:
    return {"x-inbox-principal": f"bench-board-{index}", "x-inbox-principal-kind": "human"}


async def _http_watch(
    client: httpx.AsyncClient, mailbox: str, index: int, ready: asyncio.Event, on_event: Callable[[str], None]
) -> None:
    request = json.dumps({"mailbox": mailbox}).encode()
    headers = {**_headers(index), "content-type": "application/connect+json"}
    body = struct.pack(">BI", 0, len(request)) + request
    async with client.stream("POST", PATH + "Watch", content=body, headers=headers) as response:
        buffer = b""
        async for chunk in response.aiter_raw():
            buffer += chunk
            while len(buffer) >= 5:
                size = struct.unpack(">I", buffer[1:5])[0]
                if len(buffer) < 5 + size:
                    break
                message, buffer = json.loads(buffer[5 : 5 + size]), buffer[5 + size :]
                if "snapshot" in message:
                    ready.set()
                elif "event" in message and message["event"]["type"] == "EVENT_TYPE_CLAIMED":
                    on_event(message["event"]["status"]["subject"]["id"])


async def _grpc_watch(
    stub: pb_grpc.CoordinatorAsyncStub, mailbox: str, index: int, ready: asyncio.Event, on_event: Callable[[str], None]
) -> None:
    async for message in stub.Watch(pb.WatchRequest(mailbox=mailbox), metadata=metadata(100_000 + index)):
        if message.HasField("snapshot"):
            ready.set()
        elif message.event.type == pb.EVENT_TYPE_CLAIMED:
            on_event(message.event.status.subject.id)


Opener = Callable[[int, asyncio.Event, Callable[[str], None]], Coroutine[Any, Any, None]]


async def _fanout(
    open_stream: Opener, claimer: pb_grpc.CoordinatorAsyncStub, mailbox: str, watchers: int, events: int
) -> list[float]:
    arrivals: dict[str, list[float]] = {}
    complete: dict[str, asyncio.Event] = {}

    def arrived(event_id: str) -> None:
        times = arrivals.setdefault(event_id, [])
        times.append(time.perf_counter())
        if len(times) == watchers:
            complete.setdefault(event_id, asyncio.Event()).set()

    readies = [asyncio.Event() for _ in range(watchers)]
    tasks = [asyncio.create_task(open_stream(i, readies[i], arrived)) for i in range(watchers)]
    try:
        async with asyncio.timeout(60):
            await asyncio.gather(*(ready.wait() for ready in readies))
        delays: list[float] = []
        for n in range(events):
            event_id = f"{mailbox}-e{n}"
            done = complete.setdefault(event_id, asyncio.Event())
            sent = time.perf_counter()
            await claimer.ClaimReply(
                pb.ClaimReplyRequest(request_id=uuid.uuid4().hex, subject=subject(mailbox, event_id), ttl_seconds=60),
                metadata=metadata(0),
            )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FANOUT_TIMEOUT_S):
                    await done.wait()
            delays += [(at - sent) * 1000 for at in arrivals.get(event_id, [])]
            delays += [FANOUT_TIMEOUT_S * 1000] * (watchers - len(arrivals.get(event_id, [])))
        return delays
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _calls_http(client: httpx.AsyncClient, mailbox: str, calls: int, rate: float) -> None:
    async def call(index: int, n: int) -> None:
        body = {
            "requestId": uuid.uuid4().hex,
            "subject": {"mailbox": mailbox, "kind": "SUBJECT_KIND_MESSAGE", "id": f"h{n}"},
        }
        response = await client.post(PATH + "ClaimReply", json=body, headers=_headers(index))
        response.raise_for_status()

    await _paced(call, calls, rate)


async def _calls_grpc(stub: pb_grpc.CoordinatorAsyncStub, mailbox: str, calls: int, rate: float) -> None:
    async def call(index: int, n: int) -> None:
        await stub.ClaimReply(
            pb.ClaimReplyRequest(request_id=uuid.uuid4().hex, subject=subject(mailbox, f"g{n}")),
            metadata=metadata(index),
        )

    await _paced(call, calls, rate)


async def _paced(call: Callable[[int, int], Coroutine[Any, Any, None]], calls: int, rate: float) -> None:
    """``calls`` calls by CONCURRENCY workers, call n started at n / rate seconds (or at once, rate 0) or as soon
    as a worker is free after that."""
    queue = iter(range(calls))
    start = time.perf_counter()

    async def worker(index: int) -> None:
        for n in queue:
            if rate > 0:
                await asyncio.sleep(start + n / rate - time.perf_counter())
            await call(index, n)

    await asyncio.gather(*(worker(i) for i in range(CONCURRENCY)))


@contextlib.asynccontextmanager
async def _grpc_stubs(address: str, connections: int) -> AsyncIterator[list[pb_grpc.CoordinatorAsyncStub]]:
    channels = [channel(address) for _ in range(connections)]
    try:
        yield [pb_grpc.CoordinatorStub(c) for c in channels]
    finally:
        for c in channels:
            await c.close()


# Where a sample of the coordinator went, by the frames on its stack; the first layer that matches wins.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("the call: observer, servicer, engine", ("coordinator/api/interceptor.py",)),
    ("protobuf JSON mapping and json", ("json_format.py", "/json/", "coordinator/api/protojson.py")),
    ("HTTP: uvicorn, httptools, connect-python, http.py", ("uvicorn/", "httptools", "connectrpc/", "/http.py")),
    ("the call's etcd transactions (store, etcd client)", ("coordinator/", "grpc/aio/")),
    ("event loop waiting in epoll", ("EpollSelector.select",)),
    ("event loop dispatch, socket reads and writes", ("asyncio/",)),
    ("gRPC core: poller thread (Cython)", ("threading.py", "grpc/")),
    ("other", ("",)),
]


def _layers(raw: Path) -> dict[str, int]:
    counts = dict.fromkeys((name for name, _ in LAYERS), 0)
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        for name, needles in LAYERS:
            if any(needle in stack for needle in needles):
                counts[name] += int(count)
                break
    return counts


async def _profiled(server: CoordinatorProcess, output: Path, calls: Coroutine[Any, Any, None]) -> dict[str, int]:
    sampler = await asyncio.create_subprocess_exec(
        *(_py_spy(), "record", "-f", "raw", "-r", "250", "-o", str(output), "--pid", str(server.pid), "--nonblocking"),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    await asyncio.sleep(1.0)  # py-spy attaches
    await calls
    sampler.send_signal(signal.SIGINT)
    await sampler.wait()
    return _layers(output)


async def run(options: argparse.Namespace, env: Environment) -> int:
    print(f"http: {options.watchers} browser-style Watch streams, {options.events} events each round; ", end="")
    pace = f"at {options.rate:g} calls/s" if options.rate > 0 else "unpaced"
    print(f"{options.calls} ClaimReply calls per transport each round ({pace}), {options.rounds} rounds")
    print(env.describe())
    server = CoordinatorProcess(
        env.tmp, env.etcd.endpoint, f"bench-http-{run_id()}/", http=True, rate_limit=0, uvloop=options.uvloop
    )
    fanout: dict[str, list[float]] = {"http": [], "grpc": []}
    cpu = {"http": 0.0, "grpc": 0.0}
    wall = {"http": 0.0, "grpc": 0.0}
    try:
        limits = httpx.Limits(
            max_connections=options.watchers + CONCURRENCY + 4,
            max_keepalive_connections=options.watchers + CONCURRENCY + 4,
        )
        connections = max(1, -(-options.watchers // STREAMS_PER_GRPC_CONNECTION))
        async with (
            httpx.AsyncClient(base_url=f"http://{server.http_address}", limits=limits, timeout=None) as client,
            _grpc_stubs(server.address, connections) as stubs,
        ):
            claimer = stubs[0]
            for round_number in range(options.rounds):
                mailbox = f"bench-{run_id()}-{round_number}"
                http_box, grpc_box = mailbox + "-h", mailbox + "-g"

                def http_stream(i: int, ready: asyncio.Event, on: Callable[[str], None], box: str = http_box) -> Any:
                    return _http_watch(client, box, i, ready, on)

                def grpc_stream(i: int, ready: asyncio.Event, on: Callable[[str], None], box: str = grpc_box) -> Any:
                    return _grpc_watch(stubs[i % len(stubs)], box, i, ready, on)

                fanout["http"] += await _fanout(http_stream, claimer, http_box, options.watchers, options.events)
                fanout["grpc"] += await _fanout(grpc_stream, claimer, grpc_box, options.watchers, options.events)
                for transport, calls in (
                    ("http", _calls_http(client, mailbox + "-ch", options.calls, options.rate)),
                    ("grpc", _calls_grpc(claimer, mailbox + "-cg", options.calls, options.rate)),
                ):
                    before, started = server.cpu_seconds(), time.perf_counter()
                    await calls
                    cpu[transport] += server.cpu_seconds() - before
                    wall[transport] += time.perf_counter() - started
            if options.profile:
                box = f"bench-{run_id()}-profile"
                profile = {
                    "http": await _profiled(
                        server, env.tmp / "http.raw", _calls_http(client, box + "-h", options.calls, options.rate)
                    ),
                    "grpc": await _profiled(
                        server, env.tmp / "grpc.raw", _calls_grpc(claimer, box + "-g", options.calls, options.rate)
                    ),
                }
    finally:
        server.stop()
    print(f"{'fan-out to':<28}{'deliveries':>12}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}")
    for transport, label in (("http", "HTTP/1.1 Connect streams"), ("grpc", "gRPC streams (baseline)")):
        ordered = sorted(fanout[transport])
        p50, p99 = percentile(ordered, 50), percentile(ordered, 99)
        print(f"{label:<28}{len(ordered):>12}{p50:>10.1f}{p99:>10.1f}{ordered[-1]:>10.1f}")
    total = options.calls * options.rounds
    per_10k = {transport: seconds / total * 10_000 for transport, seconds in cpu.items()}
    print(f"{'ClaimReply, coordinator CPU':<28}{'calls':>12}{'calls/s':>10}{'s/10k':>10}")
    for transport, label in (("http", "HTTP/JSON"), ("grpc", "gRPC (baseline)")):
        print(f"{label:<28}{total:>12}{total / wall[transport]:>10.0f}{per_10k[transport]:>10.2f}")
    print(f"HTTP/JSON costs {per_10k['http'] / per_10k['grpc']:.2f}x the coordinator CPU of gRPC per call")
    if options.profile:
        print(f"py-spy samples (250/s) of the coordinator per 1,000 calls, {options.calls} calls of each:")
        print(f"{'layer':<60}{'HTTP':>8}{'gRPC':>8}")
        for name, _ in LAYERS:
            http, grpc = (profile[t][name] * 1000 / options.calls for t in ("http", "grpc"))
            print(f"{name:<60}{http:>8.1f}{grpc:>8.1f}")
        totals = [sum(profile[t].values()) * 1000 / options.calls for t in ("http", "grpc")]
        print(f"{'total':<60}{totals[0]:>8.1f}{totals[1]:>8.1f}")
    return 0
