"""Where the coordinator's CPU goes under ClaimReply load: py-spy samples the coordinator process while 64
clients claim fresh subjects, then this prints the share of samples by where they were spent (the leaf frame)
and the functions with the most samples below them.

py-spy sees Python frames only (without --native): time spent in gRPC's Cython core shows on the Python
frame that called into it, so ``Handle._run`` (asyncio running gRPC's completion callbacks), ``Thread.run``
(gRPC's poller thread) and ``UnaryUnaryCall._invoke`` (the etcd client call) stand for gRPC's own work.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import sys
from collections import Counter
from pathlib import Path

from ._common import CpuMeter, Environment, SetupError, closed_loop, run_id
from ._load import Coordinators, channel, coordinator_stub, parse_coordinators
from .claims import claim_operation, shim_claim_operation


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0, help="how long to sample (default %(default)s)")
    parser.add_argument("--coordinator", default="64x2", help="the coordinator variant, as for claims --coordinators")
    parser.add_argument(
        "--shims",
        type=int,
        default=0,
        help="claim through this many inbox_claims.AsyncCoordinator objects (Batch RPCs) instead of one raw "
        "ClaimReply call per claim (default: raw calls)",
    )
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--output", type=Path, default=None, help="keep py-spy's raw (folded) samples here")
    parser.add_argument("--top", type=int, default=25, help="rows per list")


def _py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(found).exists():
        raise SetupError("py-spy is not installed (pip install py-spy)")
    return found


def _frame(text: str) -> tuple[str, str]:
    """'Engine.claim_reply (coordinator/core/engine.py:147)' -> ('Engine.claim_reply', 'coordinator/core/engine.py')."""
    name, _, where = text.partition(" (")
    return name, where.rsplit(":", 1)[0].rstrip(")")


# Where a leaf frame's time goes, first match wins.
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("gRPC: completion callbacks, server calls (Cython)", ("Handle._run",)),
    ("gRPC: poller thread (Cython)", ("Thread.run",)),
    ("gRPC: client calls to etcd (Cython + Python)", ("grpc/aio/_call.py", "grpc/aio/_channel.py", "grpc/")),
    ("asyncio event loop, selectors", ("asyncio/", "selectors.py", "_weakrefset.py", "<frozen abc>")),
    (
        "coordinator: service.py (protobuf in/out, auth, quotas)",
        ("coordinator/api/service.py", "coordinator/api/auth.py"),
    ),
    (
        "coordinator: interceptor / metrics",
        ("coordinator/api/interceptor.py", "coordinator/metrics", "prometheus_client/"),
    ),
    (
        "coordinator: engine.py + domain.py + limits.py",
        ("coordinator/core/engine.py", "coordinator/core/domain.py", "limits.py"),
    ),
    (
        "coordinator: store.py + etcd_client.py, group_commit.py, lease_buckets.py, feeds.py",
        (
            "coordinator/store/etcd/store.py",
            "coordinator/store/etcd/client.py",
            "coordinator/store/etcd/group_commit.py",
            "coordinator/store/etcd/lease_buckets.py",
            "coordinator/store/etcd/feeds.py",
        ),
    ),
    (
        "coordinator: _codec.py + _keys.py (records, keys)",
        ("coordinator/store/etcd/codec.py", "coordinator/store/etcd/keys.py"),
    ),
    ("json, dataclasses, other", ("",)),
]


def summarize(raw: Path, top: int) -> None:
    total = 0
    leaves: Counter[str] = Counter()
    categories: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        total += count
        frames = stack.split(";")
        leaf_name, leaf_file = _frame(frames[-1])
        leaves[f"{leaf_name} ({leaf_file})"] += count
        for category, needles in CATEGORIES:
            if any(n == leaf_name or (n and n in leaf_file) or not n for n in needles):
                categories[category] += count
                break
        for name in {f"{n} ({f})" for n, f in map(_frame, frames) if f.startswith("coordinator/")}:
            inclusive[name] += count
    if not total:
        print("py-spy recorded no samples")
        return
    print(f"\n{total} samples of the coordinator process (all threads)\n\nby where the time was spent (leaf frame):")
    for category, count in categories.most_common():
        print(f"  {count / total:6.1%}  {category}")
    print("\nleaf frames with the most samples:")
    for name, count in leaves.most_common(top):
        print(f"  {count / total:6.1%}  {name}")
    print("\ncoordinator functions, inclusive (their callees counted too):")
    for name, count in inclusive.most_common(top):
        print(f"  {count / total:6.1%}  {name}")


async def run(options: argparse.Namespace, env: Environment) -> int:
    py_spy = _py_spy()
    print(f"== profile: coordinator under ClaimReply load, {options.clients} clients, {options.seconds:g} s of samples")
    print(env.describe())
    variant = parse_coordinators(options.coordinator)[:1]
    output = options.output or env.tmp / "coordinator.raw"
    with Coordinators(env, variant, run_id(), rate_limit=0.0) as coordinators:
        label, process = coordinators.processes[0]
        async with channel(process.address) as ch, contextlib.AsyncExitStack() as stack:
            if options.shims:
                operation = await shim_claim_operation(stack, process.address, options.shims, f"bench-{run_id()}")
                label += f", through {options.shims} inbox_claims client object(s)"
            else:
                operation = claim_operation(coordinator_stub(ch), f"bench-{run_id()}")
            await closed_loop("warm-up", options.clients, 0.5, operation)
            sampler = await asyncio.create_subprocess_exec(
                *(py_spy, "record", "-f", "raw", "-o", str(output), "-r", str(options.rate)),
                *("--pid", str(process.pid), "--duration", str(int(options.seconds)), "--nonblocking"),
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
            meter = CpuMeter(process.cpu_seconds, env.etcd)
            # Load for a little longer than py-spy samples, so that every sample sees the load.
            result = meter.stamp(await closed_loop(label, options.clients, options.seconds + 1.0, operation))
            _, errors = await sampler.communicate()
            if sampler.returncode != 0:
                raise SetupError(f"py-spy failed ({sampler.returncode}): {errors.decode(errors='replace')[-2000:]}")
    cpu = result.cpu_seconds or 0.0
    print(
        f"coordinator ({label}): {result.rate:.0f} claims/s, {cpu / result.ops * 1e6:.0f} us of coordinator CPU per "
        f"claim ({cpu / result.seconds:.2f} cores)"
    )
    summarize(output, options.top)
    if options.output:
        print(f"\nraw samples: {options.output} (flamegraph.pl or speedscope can read them)")
    return 0
