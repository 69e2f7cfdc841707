"""Slow watchers: do Watch streams that never read hurt anyone else?

H Watch streams (default 200) of one principal, on one mailbox, opened by another process
(``python -m bench._hang``), each read its snapshot and then never read again, while C other callers (default
16, a principal each) claim and release subjects of that mailbox at a steady rate (--rate cycles/s in all), so
every claim is an event for every watcher. Measured: the other callers' call latency (p50/p99) with
the hanging watchers against without them (alternating rounds, same process, same etcd), the coordinator's
RSS over the run, how the hanging streams were ended (their final status, read once the round is over), and
whether one healthy watcher of the mailbox still got every event.

The coordinator runs with ``--max-watches 256`` so that one principal may open all of them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc

from inbox_wire.v1 import coordinator_pb2 as pb
from inbox_wire.v1 import coordinator_pb2_grpc as pb_grpc

from ._common import CoordinatorProcess, Environment, SetupError, mib, percentile, run_id
from ._load import channel, metadata, subject

HEALTHY_PRINCIPAL = (("x-inbox-principal", "healthy-watcher"),)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hanging", type=int, default=200, help="watch streams that never read (%(default)s)")
    parser.add_argument("--clients", type=int, default=16, help="other callers, a principal each (%(default)s)")
    parser.add_argument(
        "--rate", type=float, default=100.0, help="claim+release cycles per second of all callers, 0: flat out"
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="per round and case (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (default %(default)s)")
    parser.add_argument(
        "--settle",
        type=float,
        default=30.0,
        help="seconds of claims after the hanging watchers opened and before measuring (default %(default)s)",
    )
    parser.add_argument(
        "--fixed-window",
        action="store_true",
        help="the hanging clients keep a 64 KiB HTTP/2 window (no BDP probing), so they fill it sooner",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        help="the coordinator's --watch-drain-timeout (default: its own default)",
    )


@dataclass
class _Case:
    name: str
    latencies_ms: list[float] = field(default_factory=list)
    calls: int = 0
    seconds: float = 0.0
    rss_start: int = 0
    rss_peak: int = 0
    rss_end: int = 0
    endings: Counter[str] = field(default_factory=Counter)
    healthy_events: int = 0
    expected_events: int = 0
    healthy_progress: asyncio.Event = field(default_factory=asyncio.Event)
    settling_p99: float | None = None


async def _other_callers(address: str, mailbox: str, clients: int, rate: float, seconds: float, case: _Case) -> None:
    """Each caller claims a fresh subject and releases it (two events per cycle), all of them together starting
    ``rate`` cycles a second (0: back to back). Latency counts from when a call was due, so a stalled server
    shows in it even though the callers wait for it (no coordinated omission)."""
    stop_at = time.perf_counter() + seconds
    interval = clients / rate if rate > 0 else 0.0
    cycles = 0
    async with channel(address) as ch:
        stub = pb_grpc.CoordinatorStub(ch)

        async def caller(index: int) -> None:
            nonlocal cycles
            n = 0
            due = time.perf_counter() + interval * index / clients
            while due < stop_at:
                await asyncio.sleep(due - time.perf_counter())
                n += 1
                request_id = f"{run_id()}-{index}-{n}"
                started = due if interval else time.perf_counter()
                due = max(due + interval, time.perf_counter()) if interval else time.perf_counter()
                granted = await stub.ClaimReply(
                    pb.ClaimReplyRequest(request_id=request_id, subject=subject(mailbox, request_id), ttl_seconds=60),
                    metadata=metadata(index),
                )
                middle = time.perf_counter()
                await stub.ReleaseClaim(
                    pb.ReleaseClaimRequest(
                        request_id=request_id + "-r",
                        subject=subject(mailbox, request_id),
                        fencing_token=granted.status.fencing_token,
                    ),
                    metadata=metadata(index),
                )
                ended = time.perf_counter()
                case.latencies_ms += [(middle - started) * 1000, (ended - middle) * 1000]
                cycles += 1

        started = time.perf_counter()
        await asyncio.gather(*(caller(i) for i in range(clients)))
        case.seconds += time.perf_counter() - started
    case.calls += 2 * cycles
    case.expected_events += 2 * cycles


async def _healthy_watcher(stub: pb_grpc.CoordinatorAsyncStub, mailbox: str, ready: asyncio.Event, case: _Case) -> None:
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
        async for response in stub.Watch(pb.WatchRequest(mailbox=mailbox), metadata=HEALTHY_PRINCIPAL):
            if response.HasField("snapshot"):
                ready.set()
            else:
                case.healthy_events += 1
                case.healthy_progress.set()


class _Hanging:
    """``python -m bench._hang``: the hanging streams, in a process of their own."""

    def __init__(self, address: str, mailbox: str, streams: int, fixed_window: bool) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench._hang", address, mailbox, str(streams)]
            + (["--fixed-window"] if fixed_window else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        if self.process.stdout.readline().strip() != "ready":
            self.process.kill()
            raise SetupError("the hanging watchers did not start")

    def finish(self) -> dict[str, Any]:
        """Lets the streams read again; how they ended and the process's peak RSS."""
        answer, _ = self.process.communicate("", timeout=60)
        report: dict[str, Any] = json.loads(answer.strip().splitlines()[-1])
        return report


async def _round(
    coordinator: CoordinatorProcess, mailbox: str, hanging: int, options: argparse.Namespace, case: _Case
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        healthy_ready = asyncio.Event()
        watch_stub = pb_grpc.CoordinatorStub(await stack.enter_async_context(channel(coordinator.address)))
        events_before = case.healthy_events
        healthy = asyncio.create_task(_healthy_watcher(watch_stub, mailbox, healthy_ready, case))
        await asyncio.wait_for(healthy_ready.wait(), 30)
        hanging_process = None
        if hanging:
            hanging_process = await asyncio.to_thread(
                _Hanging, coordinator.address, mailbox, hanging, options.fixed_window
            )
        case.rss_start = coordinator.rss()
        peak = case.rss_start

        async def sample() -> None:
            nonlocal peak
            while True:
                peak = max(peak, coordinator.rss())
                await asyncio.sleep(0.25)

        sampler = asyncio.create_task(sample())
        if hanging_process is not None and options.settle > 0:
            # The claims flow while the coordinator notices the stuck streams (their windows fill, then one write
            # waits the drain timeout); that phase is shown apart, the measurement is what follows.
            settling = _Case(f"  first {options.settle:g} s of them")
            await _other_callers(coordinator.address, mailbox, options.clients, options.rate, options.settle, settling)
            case.settling_p99 = percentile(sorted(settling.latencies_ms), 99)
            case.expected_events += settling.expected_events
        expected_before = case.expected_events
        await _other_callers(coordinator.address, mailbox, options.clients, options.rate, options.seconds, case)
        sampler.cancel()
        case.rss_peak = max(case.rss_peak, peak, coordinator.rss())
        case.rss_end = coordinator.rss()
        # Give the healthy watcher a moment to get the last events.
        wanted = events_before + case.expected_events - expected_before
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10):
                while case.healthy_events < wanted:
                    case.healthy_progress.clear()
                    await case.healthy_progress.wait()
        if hanging_process is not None:
            report = await asyncio.to_thread(hanging_process.finish)
            case.endings.update(report["endings"])
        healthy.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await healthy


def _row(case: _Case) -> str:
    ordered = sorted(case.latencies_ms)
    rate = case.calls / case.seconds if case.seconds else 0.0
    endings = ", ".join(f"{n} {code}" for code, n in sorted(case.endings.items())) or "-"
    return (
        f"{case.name:<24} {rate:>8.0f} {percentile(ordered, 50):>8.2f} {percentile(ordered, 99):>8.2f} "
        f"{mib(case.rss_start):>10} {mib(case.rss_peak):>10} {mib(case.rss_end):>10} "
        f"{case.healthy_events:>7}/{case.expected_events:<7} {endings}"
    )


HEADER = (
    f"{'other callers, with':<24} {'calls/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'RSS start':>10} {'RSS peak':>10} "
    f"{'RSS end':>10} {'healthy watcher':>15} hanging streams ended with"
)


async def run(options: argparse.Namespace, env: Environment) -> int:
    print(
        f"== slow watchers: {options.clients} other callers claim+release on a mailbox that {options.hanging} "
        f"Watch streams of one principal watch without reading, {options.seconds:g} s per case, "
        f"{options.rounds} rounds"
    )
    print(env.describe())
    serve_args = ["--max-watches", "256"]
    if options.drain_timeout is not None:
        serve_args += ["--watch-drain-timeout", str(options.drain_timeout)]
    coordinator = CoordinatorProcess(env.tmp, env.etcd.endpoint, f"bench/{run_id()}/", serve_args=serve_args)
    try:
        mailbox = f"slow-{run_id()}"
        without, with_hanging = _Case("no hanging watcher"), _Case(f"{options.hanging} hanging watchers")
        print(HEADER)
        for index in range(options.rounds):
            order = [(without, 0), (with_hanging, options.hanging)]
            for case, hanging in order if index % 2 == 0 else order[::-1]:
                single = _Case(case.name)
                await _round(coordinator, mailbox, hanging, options, single)
                print(_row(single), flush=True)
                case.latencies_ms += single.latencies_ms
                case.calls += single.calls
                case.seconds += single.seconds
                case.rss_start = case.rss_start or single.rss_start
                case.rss_peak = max(case.rss_peak, single.rss_peak)
                case.rss_end = single.rss_end
                case.endings.update(single.endings)
                case.healthy_events += single.healthy_events
                case.expected_events += single.expected_events
                if single.settling_p99 is not None:
                    print(f"{'':<24} (p99 while the coordinator was still noticing them: {single.settling_p99:.2f} ms)")
        print(f"\nsummary over all rounds\n{HEADER}")
        print(_row(without))
        print(_row(with_hanging))
        base = percentile(sorted(without.latencies_ms), 99)
        slow = percentile(sorted(with_hanging.latencies_ms), 99)
        print(f"other callers' p99 with {options.hanging} hanging watchers: {slow / base:.2f}x without (target <= 2x)")
        print(
            "(latency of each ClaimReply and ReleaseClaim of the other callers; RSS of the coordinator process; "
            "healthy watcher: events one reading watcher got / events made)"
        )
    finally:
        coordinator.stop()
    return 0
