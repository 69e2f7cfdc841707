"""Shared pieces of the benchmarks: latency statistics, a closed-loop driver, alternating rounds with ratios
against a baseline, and the servers to measure, each in a process of its own.

This machine is small and shared: every benchmark measures its baseline in the same run, alternating rounds
with what it compares, and prints ratios. Every server it needs is started here, on loopback, with its data
in a temporary directory on the same disk as etcd's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from coordinator.store.etcd.process import EtcdServer, etcd_version, free_port


class SetupError(RuntimeError):
    """A server or client library the benchmark needs is missing or would not start."""


# --- results -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    name: str
    ops: int
    seconds: float
    latencies_ms: list[float]
    # CPU seconds used during the measurement by the server under test (the coordinator, redis, postgres, the
    # empty gRPC server), by etcd, and by this load-generating process.
    cpu_seconds: float | None = None
    etcd_cpu_seconds: float | None = None
    load_cpu_seconds: float | None = None
    note: str = ""

    @property
    def rate(self) -> float:
        return self.ops / self.seconds if self.seconds > 0 else 0.0

    def percentile(self, p: float) -> float:
        return percentile(sorted(self.latencies_ms), p)

    def row(self) -> str:
        ordered = sorted(self.latencies_ms)
        return (
            f"{self.name:<44} {self.rate:>8.0f} {percentile(ordered, 50):>8.2f} {percentile(ordered, 99):>8.2f} "
            f"{percentile(ordered, 99.9):>8.2f} {_per_10k(self.cpu_seconds, self.ops)} "
            f"{_per_10k(self.etcd_cpu_seconds, self.ops)} {_per_10k(self.load_cpu_seconds, self.ops)}"
            + (f"  {self.note}" if self.note else "")
        )


def percentile(ordered: Sequence[float], p: float) -> float:
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def _per_10k(cpu: float | None, ops: int) -> str:
    return f"{cpu / ops * 10_000:>9.2f}" if cpu is not None and ops else f"{'-':>9}"


HEADER = (
    f"{'workload':<44} {'ops/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'p99.9 ms':>8} "
    f"{'srv cpu':>9} {'etcd cpu':>9} {'load cpu':>9}"
)
HEADER_NOTE = "(cpu columns: CPU seconds per 10,000 operations of the server under test, of etcd, of this load process)"


_sequence = itertools.count()


async def closed_loop(
    name: str, clients: int, seconds: float, operation: Callable[[int, int], Awaitable[None]]
) -> Result:
    """``clients`` tasks each run ``operation(client, n)`` back to back for ``seconds``; ``n`` never repeats
    within this process, so ``n`` alone makes a fresh key."""
    latencies: list[float] = []
    stop_at = time.perf_counter() + seconds

    async def client(index: int) -> None:
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            await operation(index, next(_sequence))
            latencies.append((time.perf_counter() - started) * 1000)

    started = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    return Result(name, len(latencies), time.perf_counter() - started, latencies)


# --- CPU and memory of processes, from /proc (Linux) ------------------------------------------------------


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def _process_tree(root: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                parents.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(parents.get(pid, []))
    return tree


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds of a process and all its live descendants (postgres runs a process per connection)."""
    total = 0.0
    for pid in _process_tree(root):
        with contextlib.suppress(OSError):
            total += process_cpu_seconds(pid)
    return total


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def mib(size: float) -> str:
    return f"{size / (1 << 20):.1f} MiB"


class CpuMeter:
    """CPU seconds of the server under test, etcd and this process over a measurement."""

    def __init__(self, server: Callable[[], float] | None, etcd: EtcdServer | None) -> None:
        self._server = server
        self._etcd_pid = etcd.pid if etcd is not None else None
        self._start = self._read()

    def _read(self) -> tuple[float | None, float | None, float]:
        return (
            self._server() if self._server is not None else None,
            process_cpu_seconds(self._etcd_pid) if self._etcd_pid is not None else None,
            time.process_time(),
        )

    @classmethod
    def factory(cls, server: Callable[[], float] | None, etcd: EtcdServer | None) -> Callable[[], CpuMeter]:
        return lambda: cls(server, etcd)

    def stamp_values(self) -> tuple[float | None, float | None, float | None]:
        """CPU seconds since the start: (server, etcd, this process)."""
        end = self._read()
        server, etcd, load = (None if b is None or a is None else b - a for a, b in zip(self._start, end, strict=True))
        return server, etcd, load

    def stamp(self, result: Result) -> Result:
        server, etcd, load = self.stamp_values()
        return replace(result, cpu_seconds=server, etcd_cpu_seconds=etcd, load_cpu_seconds=load)


# --- alternating rounds ------------------------------------------------------------------------------------


@dataclass
class Workload:
    """One row of a comparison: ``run(seconds)`` measures once; rounds alternate between workloads."""

    name: str
    run: Callable[[float], Awaitable[Result]]
    durability: str = ""
    results: list[Result] = field(default_factory=list)

    def rate(self) -> float:
        return sum(r.ops for r in self.results) / sum(r.seconds for r in self.results)

    def p99(self) -> float:
        return statistics.median(r.percentile(99) for r in self.results)

    def cpu_per_10k(self, attribute: str) -> float | None:
        values = [getattr(r, attribute) for r in self.results]
        if any(v is None for v in values):
            return None
        return float(sum(values)) / sum(r.ops for r in self.results) * 10_000


async def alternate(workloads: Sequence[Workload], rounds: int, seconds: float, warmup: float = 1.0) -> None:
    """Warms each workload, then runs ``rounds`` rounds; each round runs every workload once, the order rotated
    every round so that none always runs first (or right after the most expensive one). Prints every result,
    then a summary with each workload's ratios against the first, which is the baseline."""
    for workload in workloads:
        await workload.run(min(warmup, seconds))
    print(HEADER)
    for index in range(rounds):
        shift = index % len(workloads)
        for workload in [*workloads[shift:], *workloads[:shift]]:
            result = await workload.run(seconds)
            workload.results.append(result)
            print(result.row(), flush=True)
    print(HEADER_NOTE)
    summarize(workloads)


def _cpu(value: float | None) -> str:
    return f"{value:>9.2f}" if value is not None else f"{'-':>9}"


def summarize(workloads: Sequence[Workload]) -> None:
    baseline = workloads[0]
    rounds = len(baseline.results)
    print(
        f"\nsummary over {rounds} round(s): ops/s over all rounds, p99 the median round's; ratios against "
        f"'{baseline.name}'"
    )
    print(
        f"{'workload':<44} {'ops/s':>8} {'x base':>7} {'p99 ms':>8} {'x base':>7} {'srv cpu':>9} {'etcd cpu':>9}"
        "  durability"
    )
    for workload in workloads:
        server = workload.cpu_per_10k("cpu_seconds")
        etcd = workload.cpu_per_10k("etcd_cpu_seconds")
        print(
            f"{workload.name:<44} {workload.rate():>8.0f} {workload.rate() / baseline.rate():>6.2f}x "
            f"{workload.p99():>8.2f} {workload.p99() / baseline.p99():>6.2f}x "
            f"{_cpu(server)} {_cpu(etcd)}"
            f"  {workload.durability}"
        )


# --- the environment: etcd, and facts about the machine ----------------------------------------------------


def fsync_latency_us(directory: Path, seconds: float = 0.5) -> float:
    """Mean time of a 4 KiB write + fdatasync in ``directory`` (what etcd's WAL pays per batch)."""
    path = directory / f"fsync-probe-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        count, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            os.pwrite(fd, b"x" * 4096, (count % 256) * 4096)
            os.fdatasync(fd)
            count += 1
        return (time.perf_counter() - started) / count * 1e6
    finally:
        os.close(fd)
        path.unlink()


class Environment:
    """A temporary directory on this machine's disk and an etcd in it, for one benchmark run."""

    def __init__(self, tmp: Path, etcd: EtcdServer) -> None:
        self.tmp = tmp
        self.etcd = etcd
        self._fsync_us: float | None = None

    @property
    def etcd_version(self) -> str:
        return etcd_version(self.etcd.binary)

    def fsync_us(self) -> float:
        if self._fsync_us is None:
            self._fsync_us = fsync_latency_us(self.tmp)
        return self._fsync_us

    def describe(self) -> str:
        return (
            f"etcd {self.etcd_version} ({self.etcd.binary}); {os.cpu_count()} CPUs; "
            f"4 KiB write+fdatasync {self.fsync_us():.0f} us in {self.tmp}"
        )


@contextlib.asynccontextmanager
async def environment() -> AsyncIterator[Environment]:
    # The data lives under the system's temp dir: on this machine the same disk (ext4) as everything else.
    with tempfile.TemporaryDirectory(prefix="inbox-bench-") as tmp:
        etcd = EtcdServer(Path(tmp) / "etcd", extra_args=["--quota-backend-bytes", str(8 << 30)])
        etcd.start()
        try:
            yield Environment(Path(tmp), etcd)
        finally:
            etcd.stop()


def add_common_arguments(parser: argparse.ArgumentParser, *, clients: int = 64, seconds: float = 5.0) -> None:
    parser.add_argument("--clients", type=int, default=clients, help="concurrent clients (default %(default)s)")
    parser.add_argument("--seconds", type=float, default=seconds, help="per round and workload (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default %(default)s)")


# --- servers in processes of their own ---------------------------------------------------------------------


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class CoordinatorProcess:
    """A coordinator (or, with ``empty``, a gRPC server with only the health service) in its own process, so
    that the load generator does not share its event loop. Runs ``python -m bench._serve``."""

    def __init__(
        self,
        workdir: Path,
        etcd_endpoint: str = "",
        prefix: str = "",
        *,
        max_batch: int | None = None,
        in_flight: int | None = None,
        empty: bool = False,
        uvloop: bool = False,
        rate_limit: float | None = None,
        http: bool = False,
        serve_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        code: Path | None = None,
    ) -> None:
        """``extra_env``: added to the process's environment (the OTEL_* variables of a traced coordinator).
        ``code``: another checkout of this project (a git archive of an earlier commit) to run the coordinator
        from, to compare with the code as it was."""
        name = f"serve-{uuid.uuid4().hex[:8]}"
        self.status_path = workdir / f"{name}.status"
        self.log_path = workdir / f"{name}.log"
        command = [sys.executable, "-m", "bench._serve", "--status-file", str(self.status_path)]
        command += ["--listen", f"127.0.0.1:{free_port()}"]
        if empty:
            command.append("--empty")
        else:
            command += ["--etcd-endpoints", etcd_endpoint, "--prefix", prefix]
        if max_batch is not None:
            command += ["--max-batch", str(max_batch)]
        if in_flight is not None:
            command += ["--in-flight", str(in_flight)]
        if uvloop:
            command.append("--uvloop")
        if rate_limit is not None:
            command += ["--rate-limit", str(rate_limit)]
            if rate_limit == 0 and code is None:  # the per-principal limits lifted: the work budget too
                command += ["--work-rate", "0"]
        if http:
            command += ["--http-listen", f"127.0.0.1:{free_port()}"]
        command += serve_args
        env = {**os.environ, **extra_env} if extra_env else None
        if code is not None:  # python -m looks in its working directory first: the other checkout's
            env = {**(env or os.environ), "PYTHONPATH": os.pathsep.join((str(code), str(code / "clients" / "python")))}
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=code
            )
        serving = self._next_status(0, timeout=30.0)
        if serving is None or serving.get("event") != "serving":
            self.stop()
            raise SetupError(f"the coordinator did not start; its log:\n{_log_tail(self.log_path)}")
        self.address = str(serving["address"])
        self.http_address = str(serving.get("http", ""))
        self._lines = 1

    @property
    def pid(self) -> int:
        return self.process.pid

    def _next_status(self, seen: int, timeout: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError):
                lines = self.status_path.read_text().splitlines()
                if len(lines) > seen and lines[seen].endswith("}"):
                    parsed: dict[str, Any] = json.loads(lines[seen])
                    return parsed
            if self.process.poll() is not None:
                return None
            time.sleep(0.02)
        return None

    def stats(self) -> dict[str, Any]:
        """Batch counters, watch feeds and RSS, as the process reports them on SIGUSR1."""
        self.process.send_signal(signal.SIGUSR1)
        answer = self._next_status(self._lines, timeout=10.0)
        if answer is None:
            raise SetupError(f"the coordinator did not report its stats; its log:\n{_log_tail(self.log_path)}")
        self._lines += 1
        return answer

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.process.pid)

    def rss(self) -> int:
        return rss_bytes(self.process.pid)

    def stop(self) -> None:
        _stop(self.process, self.process.terminate)


def _stop(process: subprocess.Popen[bytes], ask: Callable[[], None], timeout: float = 20.0) -> None:
    """Asks a server to stop, waits up to ``timeout``, then kills it; always reaps it."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            ask()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _wait_for_port(port: int, process: subprocess.Popen[bytes], log: Path, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SetupError(f"{what} exited with {process.returncode}; its log:\n{_log_tail(log)}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    raise SetupError(f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f} s; its log:\n{_log_tail(log)}")


class RedisProcess:
    """A private redis-server on a free loopback port, its data in a temp dir; no RDB snapshots.

    ``appendfsync``: "off" (no AOF: nothing is durable), "everysec" (AOF, fsync once a second: up to a second
    of acknowledged writes lost on a crash) or "always" (AOF, fsync before answering: durable)."""

    DURABILITY: ClassVar[dict[str, str]] = {
        "off": "none: AOF off, no RDB (memory only)",
        "everysec": "AOF fsync every second (loses <=1 s)",
        "always": "AOF fsync before each reply batch",
    }

    def __init__(self, workdir: Path, appendfsync: str) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SetupError(
                "redis-server is not installed (Debian: apt-get install redis-server); or leave out the redis "
                "baselines with --baselines"
            )
        self.directory = workdir / f"redis-{appendfsync}"
        self.directory.mkdir()
        self.port = free_port()
        self.log_path = self.directory / "redis.log"
        command = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory)]
        command += ["--save", "", "--daemonize", "no", "--protected-mode", "yes", "--logfile", str(self.log_path)]
        if appendfsync == "off":
            command += ["--appendonly", "no"]
        else:
            command += ["--appendonly", "yes", "--appendfsync", appendfsync]
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        _wait_for_port(self.port, self.process, self.log_path, "redis-server", 20.0)

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.process.pid)

    def stop(self) -> None:
        _stop(self.process, self.process.terminate)


def postgres_bindir() -> Path:
    configured = os.environ.get("INBOX_BENCH_PG_BIN")
    candidates = [Path(configured)] if configured else sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    on_path = shutil.which("initdb")
    if on_path and not configured:
        candidates.append(Path(on_path).parent)
    for candidate in candidates:
        if (candidate / "initdb").exists() and (candidate / "postgres").exists():
            return candidate
    raise SetupError(
        "PostgreSQL server binaries (initdb, postgres) not found under /usr/lib/postgresql/*/bin or on PATH "
        "(Debian: apt-get install postgresql); set INBOX_BENCH_PG_BIN to their directory, or leave out the "
        "postgres baseline with --baselines"
    )


class PostgresProcess:
    """A private PostgreSQL cluster (initdb in a temp dir, a free loopback port), fsync and synchronous_commit
    on (the defaults). As root it runs as the ``postgres`` system user (or $INBOX_BENCH_PG_USER) through
    runuser, since postgres refuses to run as root."""

    def __init__(self, workdir: Path) -> None:
        bindir = postgres_bindir()
        self.directory = workdir / "postgres"
        self.directory.mkdir()
        self.data = self.directory / "data"
        self.port = free_port()
        self.log_path = self.directory / "postgres.log"
        prefix: list[str] = []
        if os.geteuid() == 0:
            user = os.environ.get("INBOX_BENCH_PG_USER", "postgres")
            try:
                import pwd

                entry = pwd.getpwnam(user)
            except KeyError:
                raise SetupError(
                    f"postgres cannot run as root and there is no user {user!r} to run it as: create one "
                    "(useradd --system postgres) or set INBOX_BENCH_PG_USER"
                ) from None
            runuser = shutil.which("runuser")
            if runuser is None:
                raise SetupError("running postgres as root's benchmark needs runuser (util-linux)")
            prefix = [runuser, "-u", user, "--"]
            os.chown(self.directory, entry.pw_uid, entry.pw_gid)
            # Our own temp dir must let that user through; its parents must already.
            os.chmod(workdir, workdir.stat().st_mode | 0o001)
            blocked = [p for p in workdir.parents if not p.stat().st_mode & 0o001]
            if blocked:
                raise SetupError(f"user {user!r} cannot reach {workdir}: {blocked[0]} is not searchable by others")
        initdb = subprocess.run(
            [*prefix, str(bindir / "initdb"), "-D", str(self.data), "-U", "bench", "--auth=trust", "-E", "UTF8"],
            capture_output=True,
            text=True,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        if initdb.returncode != 0:
            raise SetupError(f"initdb failed ({initdb.returncode}):\n{initdb.stdout[-2000:]}{initdb.stderr[-2000:]}")
        command = [*prefix, str(bindir / "postgres"), "-D", str(self.data), "-p", str(self.port)]
        settings = {
            "listen_addresses": "127.0.0.1",
            "unix_socket_directories": str(self.directory),
            "fsync": "on",
            "synchronous_commit": "on",
            "max_connections": "200",
            "shared_buffers": "256MB",
        }
        for key, value in settings.items():
            command += ["-c", f"{key}={value}"]
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        _wait_for_port(self.port, self.process, self.log_path, "postgres", 30.0)
        self.dsn = f"postgresql://bench@127.0.0.1:{self.port}/postgres"

    def cpu_seconds(self) -> float:
        """The postmaster and all its backends (a process per connection)."""
        return tree_cpu_seconds(self.process.pid)

    def _signal_postmaster(self, signum: int) -> None:
        # The postmaster runs under runuser as root, so it is signalled by the pid it recorded.
        with contextlib.suppress(OSError, ValueError):
            os.kill(int((self.data / "postmaster.pid").read_text().split()[0]), signum)

    def stop(self) -> None:
        # SIGINT: fast shutdown (it removes postmaster.pid); if that hangs, SIGQUIT: immediate shutdown.
        _stop(self.process, lambda: self._signal_postmaster(signal.SIGINT), 30.0)
        if self.process.returncode is not None and self.process.returncode < 0:
            self._signal_postmaster(signal.SIGQUIT)


def run_id() -> str:
    return uuid.uuid4().hex[:12]
