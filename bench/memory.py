"""Coordinator memory (RSS from /proc) as live claims and watchers grow, and what claims cost as they pile up.

Makes N live claims (default 100,000, TTL one hour) through the coordinator, spread over M mailboxes (default
1,000), in four equal stages with 64 concurrent clients; after each stage it prints the stage's ClaimReply rate
and p99 and the RSS of the coordinator and etcd, and etcd's database size. Then it opens W Watch streams
(default 1,000): first all on one mailbox (one shared etcd watch), then one per mailbox (W etcd watches),
printing the RSS with each. The baseline is the idle coordinator's RSS, measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import time
from typing import Any

import grpc
from aetcd import rpc

from inbox_wire.v1 import coordinator_pb2 as pb
from inbox_wire.v1 import coordinator_pb2_grpc as pb_grpc

from ._common import CoordinatorProcess, CpuMeter, Environment, Result, mib, percentile, rss_bytes, run_id
from ._load import channel, metadata, subject
from .watch import watch_channels

STAGES = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--claims", type=int, default=100_000, help="live claims to make (default %(default)s)")
    parser.add_argument("--mailboxes", type=int, default=1_000, help="mailboxes they are spread over")
    parser.add_argument("--watchers", type=int, default=1_000, help="Watch streams to open (default %(default)s)")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients making the claims")


async def _claim_stage(stub: Any, run: str, options: argparse.Namespace, start: int, end: int) -> Result:
    numbers = itertools.count(start)
    latencies: list[float] = []

    async def client(index: int) -> None:
        while (n := next(numbers)) < end:
            began = time.perf_counter()
            response = await stub.ClaimReply(
                pb.ClaimReplyRequest(
                    request_id=f"{n}", subject=subject(f"mem-{run}-{n % options.mailboxes}", f"{n}"), ttl_seconds=3600
                ),
                metadata=metadata(index),
            )
            assert response.result == pb.ClaimReplyResponse.GRANTED, response
            latencies.append((time.perf_counter() - began) * 1000)

    began = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(options.clients)))
    return Result("claims", len(latencies), time.perf_counter() - began, latencies)


async def _open_watchers(
    address: str, mailboxes: list[str], count: int, stack: contextlib.AsyncExitStack
) -> list[asyncio.Task[None]]:
    """``count`` Watch streams, round-robin over ``mailboxes``; returns once each has its snapshot."""
    channels = watch_channels(address, count, stack)
    stubs = [pb_grpc.CoordinatorStub(ch) for ch in channels]
    ready = asyncio.Semaphore(0)

    async def watch(index: int) -> None:
        call = stubs[index % len(stubs)].Watch(
            pb.WatchRequest(mailbox=mailboxes[index % len(mailboxes)]),
            metadata=(("x-inbox-principal", f"bench-watcher-{index}"),),
        )
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            async for response in call:
                if response.HasField("snapshot"):
                    ready.release()

    tasks = [asyncio.create_task(watch(i)) for i in range(count)]
    async with asyncio.timeout(120):
        for _ in range(count):
            await ready.acquire()
    return tasks


async def _close(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def run(options: argparse.Namespace, env: Environment) -> int:
    print(
        f"== memory: coordinator RSS with {options.claims:,} live claims over {options.mailboxes:,} mailboxes and "
        f"{options.watchers:,} watchers"
    )
    print(env.describe())
    coordinator = CoordinatorProcess(env.tmp, env.etcd.endpoint, f"bench/{run_id()}/")
    try:
        async with contextlib.AsyncExitStack() as stack:
            run = run_id()
            stub = pb_grpc.CoordinatorStub(await stack.enter_async_context(channel(coordinator.address)))
            maintenance = rpc.MaintenanceStub(await stack.enter_async_context(channel(env.etcd.endpoint)))
            etcd_pid = env.etcd.pid
            assert etcd_pid is not None

            async def state() -> str:
                status = await maintenance.Status(rpc.StatusRequest())
                return (
                    f"coordinator RSS {mib(coordinator.rss()):>10}   etcd RSS {mib(rss_bytes(etcd_pid)):>10}   "
                    f"etcd db {mib(status.dbSize):>10}"
                )

            idle = coordinator.rss()
            print(f"{'idle (no claims, no watchers)':<44} {await state()}")
            print(
                f"\n{'live claims after stage':<24} {'ops/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'srv cpu':>8}   "
                "(srv cpu: coordinator CPU s per 10,000 claims)"
            )
            step = options.claims // STAGES
            for stage in range(STAGES):
                start, end = stage * step, options.claims if stage == STAGES - 1 else (stage + 1) * step
                meter = CpuMeter(coordinator.cpu_seconds, None)
                result = meter.stamp(await _claim_stage(stub, run, options, start, end))
                ordered = sorted(result.latencies_ms)
                cpu = (result.cpu_seconds or 0.0) / max(result.ops, 1) * 10_000
                print(
                    f"{end:<24,} {result.rate:>8.0f} {percentile(ordered, 50):>8.2f} {percentile(ordered, 99):>8.2f} "
                    f"{cpu:>8.2f}   {await state()}",
                    flush=True,
                )
            with_claims = coordinator.rss()
            print()
            shapes = [
                (f"{options.watchers:,} watchers of one mailbox", [f"mem-{run}-0"]),
                (
                    f"{options.watchers:,} watchers over {min(options.watchers, options.mailboxes):,} mailboxes",
                    [f"mem-{run}-{m}" for m in range(min(options.watchers, options.mailboxes))],
                ),
            ]
            for label, mailboxes in shapes:
                began = time.perf_counter()
                tasks = await _open_watchers(coordinator.address, mailboxes, options.watchers, stack)
                opened = time.perf_counter() - began
                stats = coordinator.stats()
                print(
                    f"{label:<44} {await state()}   ({stats['feeds']} etcd watch(es), opened in {opened:.1f} s)",
                    flush=True,
                )
                await _close(tasks)
                await asyncio.sleep(0.2 + options.watchers / 1000)
                print(f"{'  ... after they closed':<44} {await state()}", flush=True)
            print(
                f"\ncoordinator RSS: idle {mib(idle)}; with {options.claims:,} live claims {mib(with_claims)} "
                f"({with_claims / idle:.2f}x idle): the coordinator keeps no per-claim state (etcd does)"
            )
    finally:
        coordinator.stop()
    return 0
