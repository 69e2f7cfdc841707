"""The world's processes and who owns them: :class:`Child` (one child process: started with its readiness line
awaited, stopped with a grace period, killed by pid) and :class:`Processes` (the etcd cluster, the latency proxy,
the sink, the coordinator replicas, the agents and the human tool: start, stop, restart, kill, addresses).
What runs when is the run's business (chaos/run.py); what a fault may do to them goes through chaos/targets.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.ops.server import SERVICE_NAME
from coordinator.store.etcd.cluster import EtcdCluster, MemberPlacement
from coordinator.store.etcd.process import free_port

from . import netns
from .common import JsonlTail, child_argv, python_module_argv, skewed_clock_env
from .config import Config
from .workload import SubjectKey


class Child:
    """One child process: started with its readiness line (if any) awaited, stopped and killed by pid."""

    def __init__(
        self, name: str, argv: list[str], log_path: Path, *, stdin: bool = False, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.want_stdin = stdin
        self.proc: asyncio.subprocess.Process | None = None
        self._log: IO[bytes] | None = None

    async def start(self, ready_timeout: float | None = 30.0) -> str:
        self._log = self.log_path.open("ab")
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.PIPE if self.want_stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE if ready_timeout is not None else self._log,
            stderr=self._log,
            start_new_session=True,
            env={**os.environ, **self.env} if self.env else None,
        )
        if ready_timeout is None:
            return ""
        assert self.proc.stdout is not None
        try:
            line = await asyncio.wait_for(self.proc.stdout.readline(), ready_timeout)
        except TimeoutError:
            line = b""
        if not line.startswith(b"ready"):
            await self.kill()
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{self.name} did not start ({line!r}); its log:\n{tail}")
        return line.decode().strip()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.returncode is None else None

    def signal(self, signum: signal.Signals) -> None:
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    async def kill(self) -> None:
        if self.proc is not None:
            self.signal(signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                await self.proc.wait()
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    async def stop(self, grace: float = 5.0) -> None:
        if self.proc is None:
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), grace)
        except TimeoutError:
            await self.kill()
        self._close_log()

    async def read_line(self, within: float = 10.0) -> str:
        assert self.proc is not None
        assert self.proc.stdout is not None
        return (await asyncio.wait_for(self.proc.stdout.readline(), within)).decode().strip()

    async def write_line(self, line: str) -> None:
        assert self.proc is not None
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()


@dataclass
class OpenClaim:
    notification_id: str
    key: SubjectKey
    token: int
    expires: float


@dataclass
class AgentHandle:
    index: int
    name: str
    port: int
    log_path: Path
    incarnation: int = 0
    child: Child | None = None
    paused: bool = False
    down: bool = True
    open: dict[tuple[str, int], OpenClaim] = dataclasses.field(default_factory=dict)
    """The current incarnation's open claims, by (notification id, token), kept by :meth:`open_claims`."""

    def __post_init__(self) -> None:
        self.tail = JsonlTail(self.log_path)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def open_claims(self) -> list[OpenClaim]:
        """Claims the current incarnation was granted and has not finished with (from its log)."""
        for event in self.tail.new_records():
            if event.get("inc") != self.incarnation:
                continue
            claim_id = (str(event.get("nid")), int(event.get("token", 0)))
            if event.get("ev") == "granted":
                key = SubjectKey(event["mailbox"], event["kind"], event["id"])
                self.open[claim_id] = OpenClaim(event["nid"], key, int(event["token"]), event["expires"])
            elif event.get("ev") in ("done", "sending", "lost", "loss_seen"):
                self.open.pop(claim_id, None)
        return list(self.open.values())


class Processes:
    """Every process of one run: a 3-member etcd (each member in its own network namespace when ``spaces`` is
    given), the latency proxy in front of it, the record-only sink, two coordinators, the agents and the human."""

    def __init__(self, config: Config, workdir: Path, spaces: netns.Namespaces | None, etcd_binary: Path) -> None:
        self.config = config
        self.workdir = workdir
        self.spaces = spaces
        self.secret = secrets.token_hex(16)
        """The webhook signing secret the agents verify."""
        self.prefix = f"chaos/{config.seed}-{secrets.token_hex(3)}/"
        self.cluster = self._make_cluster(etcd_binary)
        self.proxy: Child | None = None
        self.proxy_ports: list[int] = []
        self._proxy_lock = asyncio.Lock()
        self.sink: Child | None = None
        self.sink_address = ""
        self.coordinator_ports = [free_port() for _ in range(2)]
        self.coordinators: list[Child | None] = [None, None]
        self.agents = [
            AgentHandle(i, f"agent-{i + 1}", free_port(), workdir / f"agent-{i + 1}.jsonl")
            for i in range(config.agents)
        ]
        self.human: Child | None = None

    def _make_cluster(self, etcd_binary: Path) -> EtcdCluster:
        base = self.workdir / "etcd"
        if self.spaces is None:
            binary = netns.plain_wrapper(self.workdir, etcd_binary)
            return EtcdCluster(base, 3, binary=binary, extra_args=self.config.etcd_args)
        placements = [
            MemberPlacement(self.spaces.member_ip(i), netns.etcd_wrapper(self.workdir, ns, etcd_binary))
            for i, ns in enumerate(self.spaces.members)
        ]
        return EtcdCluster(base, 3, extra_args=self.config.etcd_args, placements=placements)

    async def start(self) -> None:
        """etcd, then the proxy and the sink, then the coordinators, then the agents."""
        self.cluster.start()  # from the main thread: the members' parent-death signal follows the harness
        self.proxy = Child(
            "proxy",
            python_module_argv(
                "chaos", "proxy", "--targets", ",".join(self.cluster.endpoints), "--lifetime", str(self.config.lifetime)
            ),
            self.workdir / "proxy.log",
            stdin=True,
        )
        ready = await self.proxy.start()
        self.proxy_ports = [int(p) for p in ready.split()[1].split(",")]
        self.sink = Child(
            "sink",
            python_module_argv(
                "chaos",
                "sink",
                "--log",
                str(self.workdir / "sink.jsonl"),
                "--fail-rate",
                str(self.config.sink_fail_rate),
                "--seed",
                str(self.config.seed),
                "--lifetime",
                str(self.config.lifetime),
            ),
            self.workdir / "sink.log",
        )
        self.sink_address = (await self.sink.start()).split()[1]
        await asyncio.gather(*(self.start_coordinator(i) for i in range(2)))
        await asyncio.gather(*(self.start_agent(a) for a in self.agents))

    async def heal(self) -> None:
        """Everything running again: paused agents resumed, dead agents, members and coordinators restarted."""
        for agent in self.agents:
            if agent.paused:
                self.resume_agent(agent)
            if agent.down:
                await self.start_agent(agent)
        for index, member in enumerate(self.cluster.members):
            if not member.is_running:
                await self.restart_member(index)
        for index, child in enumerate(self.coordinators):
            if child is None or child.pid is None:
                await self.start_coordinator(index)

    async def stop(self) -> None:
        children = [a.child for a in self.agents] + [self.human, *self.coordinators, self.sink, self.proxy]
        await asyncio.gather(*(child.stop() for child in children if child is not None))
        await asyncio.to_thread(self.cluster.stop)

    # -- etcd -----------------------------------------------------------------------------------------------

    async def leader_index(self) -> int:
        return await asyncio.to_thread(self.cluster.leader_index, 20.0)

    def kill_member(self, index: int) -> None:
        self.cluster.members[index].kill()

    async def restart_member(self, index: int) -> None:
        member = self.cluster.members[index]
        member.start(wait=False)  # spawned from this (the main) thread: its parent-death signal stays armed
        await asyncio.to_thread(member.wait_healthy, 60.0)

    async def set_link(self, index: int, up: bool) -> None:
        await asyncio.to_thread(netns.set_link, index, up)

    async def proxy_command(self, command: str) -> None:
        assert self.proxy is not None
        async with self._proxy_lock:
            await self.proxy.write_line(command)
            answer = await self.proxy.read_line()
        if not answer.startswith("ok"):
            raise RuntimeError(f"proxy: {command!r} -> {answer!r}")

    # -- coordinators ---------------------------------------------------------------------------------------

    def coordinator_targets(self) -> str:
        return ",".join(f"127.0.0.1:{port}" for port in self.coordinator_ports)

    async def start_coordinator(self, index: int, clock_offset: str = "") -> None:
        """Starts (or restarts) coordinator ``index``; ``clock_offset`` ("+5m") runs its clocks that far off."""
        endpoints = [f"127.0.0.1:{port}" for port in self.proxy_ports]
        endpoints = endpoints[index:] + endpoints[:index]  # each coordinator prefers another member
        argv = child_argv(
            [
                sys.executable,
                "-m",
                "coordinator",
                "serve",
                "--listen",
                f"127.0.0.1:{self.coordinator_ports[index]}",
                "--etcd-endpoints",
                ",".join(endpoints),
                "--prefix",
                self.prefix,
                "--send-timeout",
                f"{self.config.send_timeout:g}",
                "--metrics-listen",
                "",
                "--log-format",
                "json",
                "--log-level",
                "debug",  # the lease grants, which the checker's excuse for a late free reads (chaos/leases.py)
                "--shutdown-grace",
                "1",
            ]
        )
        env = skewed_clock_env(clock_offset) if clock_offset else None
        child = Child(f"coordinator-{index}", argv, self.workdir / f"coordinator-{index}.log", env=env)
        await child.start(ready_timeout=None)
        self.coordinators[index] = child
        await self._await_serving(index, 60.0)

    async def _await_serving(self, index: int, within: float) -> None:
        deadline = time.time() + within
        address = f"127.0.0.1:{self.coordinator_ports[index]}"
        last = ""
        async with grpc.aio.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.time() < deadline:
                try:
                    answer = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=1.0)
                    if answer.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                    last = str(answer.status)
                except grpc.aio.AioRpcError as error:
                    last = error.code().name
                await asyncio.sleep(0.2)
        raise RuntimeError(f"coordinator-{index} at {address} not SERVING after {within:g} s (last: {last})")

    async def kill_coordinator(self, index: int) -> None:
        child = self.coordinators[index]
        if child is not None:
            await child.kill()

    # -- agents and the human -------------------------------------------------------------------------------

    async def start_agent(self, agent: AgentHandle) -> None:
        agent.open_claims()  # read the old incarnation's last records, then forget its claims
        agent.open.clear()
        agent.incarnation += 1
        c = self.config
        argv = python_module_argv(
            "chaos",
            "agent",
            "--name",
            agent.name,
            "--incarnation",
            str(agent.incarnation),
            "--listen",
            agent.address,
            "--coordinators",
            self.coordinator_targets(),
            "--sink",
            self.sink_address,
            "--log",
            str(agent.log_path),
            "--secret",
            self.secret,
            "--seed",
            str(c.seed),
            "--ttl",
            str(c.ttl),
            "--draft-median",
            str(c.draft_median),
            "--draft-sigma",
            str(c.draft_sigma),
            "--draft-cap",
            str(4 * c.ttl),
            "--lifetime",
            str(c.lifetime),
            *(["--unfenced"] if c.unfenced else []),
            *(["--ignore-outgoing"] if c.ignore_outgoing else []),
            *(["--ignore-reply-rules"] if c.ignore_reply_rules else []),
            *([] if c.look else ["--no-look"]),
            *([] if c.agent_retry else ["--no-retry"]),
        )
        child = Child(agent.name, argv, self.workdir / f"{agent.name}.stderr")
        await child.start()
        agent.child, agent.paused, agent.down = child, False, False

    async def kill_agent(self, agent: AgentHandle) -> None:
        agent.down = True
        if agent.child is not None:
            await agent.child.kill()

    def pause_agent(self, agent: AgentHandle) -> None:
        assert agent.child is not None
        agent.paused = True
        agent.child.signal(signal.SIGSTOP)

    def resume_agent(self, agent: AgentHandle) -> None:
        if agent.child is not None:
            agent.child.signal(signal.SIGCONT)
        agent.paused = False

    def live_agents(self) -> list[AgentHandle]:
        return [a for a in self.agents if not a.down and not a.paused]

    async def start_human(self, mailboxes: list[str], start_at: float, stop_at: float) -> None:
        """The human tool: takes ``config.takeovers`` messages over between ``start_at`` and ``stop_at``."""
        c = self.config
        argv = python_module_argv(
            "chaos",
            "human",
            "--name",
            "ana",
            "--coordinators",
            self.coordinator_targets(),
            "--sink",
            self.sink_address,
            "--log",
            str(self.workdir / "human.jsonl"),
            "--mailboxes",
            ",".join(mailboxes),
            "--seed",
            str(c.seed),
            "--takeovers",
            str(c.takeovers),
            "--start-at",
            str(start_at),
            "--stop-at",
            str(stop_at),
            "--lifetime",
            str(c.lifetime),
        )
        self.human = Child("human", argv, self.workdir / "human.log")
        await self.human.start()

    @property
    def human_done(self) -> bool:
        return self.human is None or self.human.proc is None or self.human.proc.returncode is not None
