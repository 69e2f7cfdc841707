"""The embedded etcd's database size over many claim cycles: does it level off?

Starts ``inbox-coordinator serve`` as a user does (embedded etcd, its own data dir), drives N claim cycles
(default 200,000) with 64 concurrent clients and reads etcd's Status (``dbSize``: the file; ``dbSizeInUse``:
the pages holding data) every tenth of the run. A cycle is ClaimReply then ReleaseClaim on a subject from a
fixed pool (default 10,000): the live data stays the same size, so every byte of growth is etcd's history of
revisions, which is what periodic auto-compaction must bound. (A reply cycle on fresh message ids adds its
reply record, kept 72 h, on top: that live growth is the sizing formula of docs/operations.md, and levels off
only after the retention.) The baseline is the same run's first tenth: the growth per cycle before any
compaction.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc

from coordinator.store.etcd.process import free_port
from inbox_wire.v1 import coordinator_pb2 as pb
from inbox_wire.v1 import coordinator_pb2_grpc as pb_grpc

from ._common import Environment, SetupError, mib, run_id
from ._load import metadata, subject

SAMPLES = 10
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cycles", type=int, default=200_000, help="claim cycles to run (default %(default)s)")
    parser.add_argument("--subjects", type=int, default=10_000, help="the pool of subjects the cycles reuse")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients")
    parser.add_argument(
        "--compaction",
        default="30s",
        help="the embedded etcd's compaction retention (serve's --embedded-etcd-compaction; default %(default)s, "
        "short so that a run of minutes sees several compactions; 0: none)",
    )


class _EmbeddedServe:
    """``inbox-coordinator serve`` on an embedded etcd in a data dir of its own."""

    def __init__(self, data_dir: Path, compaction: str) -> None:
        self.port = free_port()
        self.data_dir = data_dir
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "coordinator",
                "serve",
                f"--listen=127.0.0.1:{self.port}",
                "--metrics-listen=",
                f"--data-dir={data_dir}",
                f"--embedded-etcd-compaction={compaction}",
                "--log-level=warning",
                "--rate-limit=0",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.process.stdout is not None
        seen = []
        for line in self.process.stdout:
            seen.append(line)
            if "serving gRPC on" in line:
                break
        else:
            raise SetupError("inbox-coordinator serve did not start:\n" + "".join(seen))
        client_port = json.loads((data_dir / "ports.json").read_text())["client"]
        self.etcd_url = f"http://127.0.0.1:{client_port}"

    def status(self) -> dict[str, Any]:
        request = urllib.request.Request(f"{self.etcd_url}/v3/maintenance/status", data=b"{}", method="POST")
        with _HTTP.open(request, timeout=10) as response:
            answer = json.loads(response.read())
        assert isinstance(answer, dict)
        return answer

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.communicate(timeout=60)


async def _cycles(stub: Any, run: str, options: argparse.Namespace, start: int, end: int) -> None:
    numbers = itertools.count(start)

    async def client(index: int) -> None:
        while (n := next(numbers)) < end:
            target = subject(f"db-{run}", f"m{n % options.subjects}")
            claim = await stub.ClaimReply(
                pb.ClaimReplyRequest(request_id=f"c{n}", subject=target, ttl_seconds=60), metadata=metadata(index)
            )
            if claim.result == pb.ClaimReplyResponse.GRANTED:
                await stub.ReleaseClaim(
                    pb.ReleaseClaimRequest(
                        request_id=f"r{n}", subject=target, fencing_token=claim.status.fencing_token
                    ),
                    metadata=metadata(index),
                )

    await asyncio.gather(*(client(i) for i in range(options.clients)))


async def run(options: argparse.Namespace, env: Environment) -> int:
    print(
        f"== embedded-db: the embedded etcd's database over {options.cycles:,} claim cycles (ClaimReply + "
        f"ReleaseClaim on {options.subjects:,} reused subjects, {options.clients} clients), compaction retention "
        f"{options.compaction}"
    )
    serve = _EmbeddedServe(env.tmp / f"embedded-{run_id()}", options.compaction)
    try:
        version = serve.status().get("version", "?")
        print(f"embedded etcd {version}; {os.cpu_count()} CPUs")
        print(f"{'cycles':>10} {'seconds':>8} {'cycles/s':>9} {'dbSize':>12} {'dbSizeInUse':>12} {'revision':>10}")
        run = run_id()
        began = time.perf_counter()
        step = max(1, options.cycles // SAMPLES)
        first_growth: float | None = None
        sizes: list[int] = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{serve.port}") as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            start_size = int(serve.status()["dbSize"])
            done = 0
            while done < options.cycles:
                chunk_began = time.perf_counter()
                end = min(options.cycles, done + step)
                await _cycles(stub, run, options, done, end)
                rate = (end - done) / (time.perf_counter() - chunk_began)
                done = end
                status = serve.status()
                size, in_use = int(status["dbSize"]), int(status.get("dbSizeInUse", 0))
                sizes.append(size)
                if first_growth is None:
                    first_growth = (size - start_size) / done
                print(
                    f"{done:>10,} {time.perf_counter() - began:>8.1f} {rate:>9.0f} {mib(size):>12} {mib(in_use):>12} "
                    f"{int(status['header']['revision']):>10,}"
                )
        half = len(sizes) // 2
        late_growth = (sizes[-1] - sizes[half - 1]) / (step * (len(sizes) - half)) if half else 0.0
        print(
            f"growth per cycle: {first_growth or 0:.0f} bytes over the first tenth (baseline), {late_growth:.0f} bytes "
            f"over the second half ({late_growth / first_growth if first_growth else 0:.2f}x the baseline)"
        )
    finally:
        serve.stop()
    return 0
