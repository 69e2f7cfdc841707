"""Shared pieces of the benchmarks: latency statistics, a closed-loop driver, servers to measure."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from coordinator.etcd_process import free_port


@dataclass(frozen=True)
class Result:
    name: str
    ops: int
    seconds: float
    latencies_ms: list[float]
    cpu_seconds: float | None = None

    @property
    def rate(self) -> float:
        return self.ops / self.seconds

    def percentile(self, p: float) -> float:
        ordered = sorted(self.latencies_ms)
        if not ordered:
            return float("nan")
        return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]

    def row(self) -> str:
        cpu = f"{self.cpu_seconds / self.ops * 10_000:8.2f}" if self.cpu_seconds is not None else "       -"
        return (
            f"{self.name:<34} {self.rate:>9.0f} {self.percentile(50):>8.2f} {self.percentile(99):>8.2f} "
            f"{self.percentile(99.9):>8.2f} {cpu}"
        )


HEADER = f"{'workload':<34} {'ops/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'p99.9 ms':>8} {'cpu s/10k':>8}"


async def closed_loop(
    name: str, clients: int, seconds: float, operation: Callable[[int, int], Awaitable[None]]
) -> Result:
    """``clients`` tasks each run ``operation(client, n)`` back to back for ``seconds``."""
    latencies: list[float] = []
    stop_at = time.perf_counter() + seconds

    async def client(index: int) -> None:
        n = 0
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            await operation(index, n)
            latencies.append((time.perf_counter() - started) * 1000)
            n += 1

    started = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    return Result(name, len(latencies), time.perf_counter() - started, latencies)


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


class CoordinatorProcess:
    """A coordinator in its own process, so that the load generator does not share its CPU."""

    def __init__(self, etcd_endpoint: str, prefix: str, extra: list[str] | None = None) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        command = [
            sys.executable,
            "-m",
            "coordinator.cli",
            "serve",
            "--listen",
            self.address,
            "--etcd-endpoints",
            etcd_endpoint,
            "--prefix",
            prefix,
            "--log-level",
            "WARNING",
            *(extra or []),
        ]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if "serving gRPC on" in line:
                break
        else:
            raise RuntimeError("the coordinator did not start")

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.process.pid)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
