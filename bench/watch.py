"""Watch fan-out: how long an event takes to reach every watcher of a mailbox.

W Watch streams (default 1,000) are opened in this process on one mailbox (or spread over --mailboxes), each
as a principal of its own, over one HTTP/2 connection per 100 streams. Then E claims (default 50) are made one
after another; after each, the benchmark waits until every watcher of that mailbox has the CLAIMED event (at
most 10 s) before the next. The delay of one delivery is the time from the ClaimReply being sent to one
watcher's stream yielding the event. It is also shown counted from the ClaimReply's answer, as the issue asks;
but the coordinator handles etcd's watch event, and fans it out, before the ClaimReply's own answer (both come
from etcd at once, into one event loop), so counted that way most delays are negative and say little.

Baseline, alternating with it in the same run: as many raw etcd watches (one gRPC Watch stream each, on the
same kind of key prefix, from this process) and E puts, the delay measured the same way.

This process decodes every delivery of every watcher: its CPU per event (the load column) is part of every
measured delay, for the baseline as much as for the coordinator.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from aetcd import rpc

from inbox_wire.v1 import coordinator_pb2 as pb
from inbox_wire.v1 import coordinator_pb2_grpc as pb_grpc

from ._common import CoordinatorProcess, CpuMeter, Environment, mib, percentile, run_id
from ._load import channel, metadata, subject

STREAMS_PER_CONNECTION = 100
FANOUT_TIMEOUT_S = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--watchers", default="1000", help="comma-separated watcher counts, one measurement each (%(default)s)"
    )
    parser.add_argument("--mailboxes", type=int, default=1, help="mailboxes the watchers are spread over")
    parser.add_argument("--events", type=int, default=50, help="claims per round, one after another")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default %(default)s)")


@dataclass
class _Fanout:
    """Arrival times of each event at the watchers, and who is waiting for an event to be complete."""

    expected: int
    arrivals: dict[str, list[float]] = field(default_factory=dict)
    complete: dict[str, asyncio.Event] = field(default_factory=dict)
    ready: int = 0
    failures: list[BaseException] = field(default_factory=list)

    def arrived(self, event_id: str) -> None:
        times = self.arrivals.setdefault(event_id, [])
        times.append(time.perf_counter())
        if len(times) == self.expected:
            self.complete.setdefault(event_id, asyncio.Event()).set()

    async def wait(self, event_id: str) -> bool:
        event = self.complete.setdefault(event_id, asyncio.Event())
        try:
            async with asyncio.timeout(FANOUT_TIMEOUT_S):
                await event.wait()
            return True
        except TimeoutError:
            return False


@dataclass
class _Round:
    delays_ms: list[float] = field(default_factory=list)  # from the write being sent
    after_answer_ms: list[float] = field(default_factory=list)  # from its answer reaching this process
    write_ms: list[float] = field(default_factory=list)
    last_ms: list[float] = field(default_factory=list)
    missing: int = 0
    events: int = 0
    cpu_seconds: float | None = None
    etcd_cpu_seconds: float | None = None
    load_cpu_seconds: float | None = None


class _Side:
    """Watchers of one kind (coordinator or raw etcd) on ``mailboxes`` mailboxes, and how to make an event."""

    def __init__(self, name: str, watchers: int, mailboxes: int) -> None:
        self.name = name
        self.watchers = watchers
        self.mailboxes = mailboxes
        self.fanouts = [_Fanout(len(range(m, watchers, mailboxes))) for m in range(mailboxes)]
        self.tasks: list[asyncio.Task[None]] = []
        self.rounds: list[_Round] = []
        self.sequence = 0

    async def wait_ready(self, limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        while sum(f.ready for f in self.fanouts) < self.watchers:
            failures = [e for f in self.fanouts for e in f.failures]
            if failures:
                raise RuntimeError(f"{self.name}: a watcher failed: {failures[0]!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.name}: only {sum(f.ready for f in self.fanouts)} of {self.watchers} watchers started "
                    f"within {limit_s:.0f} s"
                )
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await task


def watch_channels(address: str, watchers: int, stack: contextlib.AsyncExitStack) -> list[grpc.aio.Channel]:
    """One connection per STREAMS_PER_CONNECTION watchers, as separate clients would have."""
    channels = []
    for _ in range(max(1, math.ceil(watchers / STREAMS_PER_CONNECTION))):
        # A local subchannel pool keeps gRPC from sharing one connection among the channels.
        ch = grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        stack.push_async_callback(ch.close)
        channels.append(ch)
    return channels


async def _coordinator_side(
    address: str, watchers: int, mailboxes: int, run: str, stack: contextlib.AsyncExitStack
) -> tuple[_Side, Callable[[int, str], Awaitable[None]]]:
    side = _Side("coordinator Watch", watchers, mailboxes)
    stubs = [pb_grpc.CoordinatorStub(ch) for ch in watch_channels(address, watchers, stack)]

    async def watch(index: int) -> None:
        fanout = side.fanouts[index % mailboxes]
        try:
            call = stubs[index % len(stubs)].Watch(
                pb.WatchRequest(mailbox=f"watch-{run}-{index % mailboxes}"),
                metadata=(("x-inbox-principal", f"bench-watcher-{index}"),),
            )
            async for response in call:
                if response.HasField("snapshot"):
                    fanout.ready += 1
                elif response.event.type == pb.EVENT_TYPE_CLAIMED:
                    fanout.arrived(response.event.status.subject.id)
        except grpc.aio.AioRpcError as error:
            if error.code() is not grpc.StatusCode.CANCELLED:
                fanout.failures.append(error)

    side.tasks = [asyncio.create_task(watch(i)) for i in range(watchers)]
    claimer = pb_grpc.CoordinatorStub(await stack.enter_async_context(channel(address)))

    async def make_event(mailbox: int, event_id: str) -> None:
        response = await claimer.ClaimReply(
            pb.ClaimReplyRequest(
                request_id=event_id, subject=subject(f"watch-{run}-{mailbox}", event_id), ttl_seconds=60
            ),
            metadata=metadata(0),
        )
        assert response.result == pb.ClaimReplyResponse.GRANTED, response

    return side, make_event


async def _raw_side(
    endpoint: str, watchers: int, mailboxes: int, run: str, stack: contextlib.AsyncExitStack
) -> tuple[_Side, Callable[[int, str], Awaitable[None]]]:
    side = _Side("raw etcd watch", watchers, mailboxes)
    stubs = [rpc.WatchStub(ch) for ch in watch_channels(endpoint, watchers, stack)]

    def prefix(mailbox: int) -> bytes:
        return f"bench-raw/{run}/watch/{mailbox}/".encode()

    async def watch(index: int) -> None:
        fanout = side.fanouts[index % mailboxes]
        key = prefix(index % mailboxes)
        end = key[:-1] + bytes([key[-1] + 1])

        async def requests() -> AsyncIterator[Any]:
            yield rpc.WatchRequest(create_request=rpc.WatchCreateRequest(key=key, range_end=end))
            await asyncio.Event().wait()

        try:
            async for response in stubs[index % len(stubs)].Watch(requests()):
                if response.created:
                    fanout.ready += 1
                for event in response.events:
                    fanout.arrived(event.kv.key[len(key) :].decode())
        except grpc.aio.AioRpcError as error:
            if error.code() is not grpc.StatusCode.CANCELLED:
                fanout.failures.append(error)

    side.tasks = [asyncio.create_task(watch(i)) for i in range(watchers)]
    kv = rpc.KVStub(await stack.enter_async_context(channel(endpoint)))

    async def make_event(mailbox: int, event_id: str) -> None:
        await kv.Put(rpc.PutRequest(key=prefix(mailbox) + event_id.encode(), value=b"holder"))

    return side, make_event


async def _measure(
    side: _Side, make_event: Callable[[int, str], Awaitable[None]], events: int, meter: CpuMeter
) -> _Round:
    result = _Round()
    for _ in range(events):
        side.sequence += 1
        mailbox = side.sequence % side.mailboxes
        event_id = f"e{side.sequence}"
        fanout = side.fanouts[mailbox]
        sent = time.perf_counter()
        await make_event(mailbox, event_id)
        answered = time.perf_counter()
        complete = await fanout.wait(event_id)
        arrivals = fanout.arrivals.pop(event_id, [])
        fanout.complete.pop(event_id, None)
        result.events += 1
        result.missing += 0 if complete else fanout.expected - len(arrivals)
        result.delays_ms.extend((t - sent) * 1000 for t in arrivals)
        result.after_answer_ms.extend((t - answered) * 1000 for t in arrivals)
        result.write_ms.append((answered - sent) * 1000)
        if arrivals:
            result.last_ms.append((max(arrivals) - sent) * 1000)
    stamped = meter.stamp_values()
    result.cpu_seconds, result.etcd_cpu_seconds, result.load_cpu_seconds = stamped
    return result


def _row(name: str, watchers: int, rounds: list[_Round]) -> str:
    delays = sorted(d for r in rounds for d in r.delays_ms)
    last = sorted(d for r in rounds for d in r.last_ms)
    after_answer = sorted(d for r in rounds for d in r.after_answer_ms)
    writes = sorted(d for r in rounds for d in r.write_ms)
    events = sum(r.events for r in rounds)
    missing = sum(r.missing for r in rounds)

    def per_event(values: list[float | None]) -> str:
        if any(v is None for v in values) or not events:
            return f"{'-':>9}"
        return f"{sum(v for v in values if v is not None) / events * 1000:>9.1f}"

    return (
        f"{name:<22} {watchers:>8} {events:>6} {len(delays):>8} {percentile(delays, 50):>8.1f} "
        f"{percentile(delays, 99):>8.1f} {percentile(delays, 99.9):>8.1f} {percentile(last, 50):>8.1f} "
        f"{percentile(after_answer, 99):>8.1f} {percentile(writes, 50):>8.1f} "
        f"{per_event([r.cpu_seconds for r in rounds])} {per_event([r.etcd_cpu_seconds for r in rounds])} "
        f"{per_event([r.load_cpu_seconds for r in rounds])} {missing:>7}"
    )


HEADER = (
    f"{'watchers of':<22} {'watchers':>8} {'events':>6} {'deliv.':>8} {'p50 ms':>8} {'p99 ms':>8} {'p99.9 ms':>8} "
    f"{'all p50':>8} {'p99 ans':>8} {'write':>8} {'srv cpu':>9} {'etcd cpu':>9} {'load cpu':>9} {'missing':>7}"
)
HEADER_NOTE = (
    "(p50/p99/p99.9: delay from the event's write (ClaimReply or etcd put) being sent to each watcher receiving it;\n"
    " 'all p50': median delay until the last watcher has it; 'p99 ans': p99 of the delay counted from the write's\n"
    " answer instead (negative: the watchers had it first); 'write': median latency of the write itself;\n"
    " cpu columns: CPU milliseconds per event of the coordinator, etcd and this process)"
)


async def run(options: argparse.Namespace, env: Environment) -> int:
    counts = [int(w) for w in options.watchers.split(",")]
    print(
        f"== watch: fan-out of one event to the watchers of a mailbox ({options.mailboxes} mailbox(es)), "
        f"{options.events} events per round, {options.rounds} rounds"
    )
    print(env.describe())
    coordinator = CoordinatorProcess(env.tmp, env.etcd.endpoint, f"bench/{run_id()}/")
    try:
        rss_idle = coordinator.rss()
        summary: list[str] = []
        for watchers in counts:
            async with contextlib.AsyncExitStack() as stack:
                run = run_id()
                coord_side, coord_event = await _coordinator_side(
                    coordinator.address, watchers, options.mailboxes, run, stack
                )
                stack.push_async_callback(coord_side.close)
                raw_side, raw_event = await _raw_side(env.etcd.endpoint, watchers, options.mailboxes, run, stack)
                stack.push_async_callback(raw_side.close)
                started = time.perf_counter()
                await coord_side.wait_ready(120.0)
                await raw_side.wait_ready(120.0)
                setup_s = time.perf_counter() - started
                stats = coordinator.stats()
                print(
                    f"\n{watchers} watchers ready in {setup_s:.1f} s; coordinator RSS {mib(coordinator.rss())} "
                    f"(idle before any watcher: {mib(rss_idle)}), {stats['feeds']} etcd watch(es) shared by "
                    f"{stats['subscribers']} watchers"
                )
                # Warm both paths once.
                await _measure(coord_side, coord_event, 2, CpuMeter(None, None))
                await _measure(raw_side, raw_event, 2, CpuMeter(None, None))
                print(HEADER)
                sides = [
                    (raw_side, raw_event, CpuMeter.factory(None, env.etcd)),
                    (coord_side, coord_event, CpuMeter.factory(coordinator.cpu_seconds, env.etcd)),
                ]
                for index in range(options.rounds):
                    order = sides if index % 2 == 0 else sides[::-1]
                    for side, make_event, meter in order:
                        side.rounds.append(await _measure(side, make_event, options.events, meter()))
                        print(_row(side.name, watchers, side.rounds[-1:]), flush=True)
                summary += [_row(side.name, watchers, side.rounds) for side, _, _ in sides]
                coord_p99 = percentile(sorted(d for r in coord_side.rounds for d in r.delays_ms), 99)
                raw_p99 = percentile(sorted(d for r in raw_side.rounds for d in r.delays_ms), 99)
                summary.append(
                    f"{'':<22} {watchers:>8} watchers: coordinator p99 {coord_p99:.1f} ms (target < 250 ms), "
                    f"{coord_p99 / raw_p99:.2f}x the raw etcd watches' {raw_p99:.1f} ms"
                )
        print(f"\nsummary over all rounds\n{HEADER}")
        print("\n".join(summary))
        print(HEADER_NOTE)
    finally:
        coordinator.stop()
    return 0
