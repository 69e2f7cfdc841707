"""The harness: starts the world, drives the workload and the faults, reads the end state, runs the checker.

The world: a 3-member etcd (real processes; each in its own network namespace when namespaces can be made, so
that one member can really be cut off), the latency proxy in front of it, two coordinators (the real CLI, each
given all three proxied endpoints, in different orders), K agents and a human tool on the real client shim, and
the record-only sink. Every child gets SIGKILL when the harness dies (``setpriv --pdeathsig``) and has a
lifetime of its own, so nothing outlives a run.

Phases: start; main phase (``duration`` seconds: deliveries on the seeded plan, the two fault lanes, the human's
takeovers); settle (every fault healed, then TTL + bound, so lapsed claims are free); final round (every
notification delivered once more); drain (agents idle, no subject left SENDING); final reads; stop; check.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import random
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.etcd_process import (
    EtcdMemberSpec,
    EtcdNotFound,
    EtcdServer,
    etcd_version,
    find_etcd_binary,
    free_port,
    is_broken_version,
)
from coordinator.server import SERVICE_NAME
from coordinator.testing.etcd_cluster import EtcdCluster
from inbox_claims import AsyncCoordinator, InboxClaimsError, RetryPolicy, Subject, SubjectState
from inbox_claims.testing import sign_nylas
from inbox_claims.types import EventType, SubjectKind, WatchEvent, WatchSnapshot

from . import checker, faults, netns
from .common import (
    JsonlTail,
    child_argv,
    http_json,
    http_request,
    python_module_argv,
    read_jsonl,
    skewed_clock_env,
)
from .processes import Child
from .workload import Notification, SubjectKey, Workload, envelope, plan

CRASH_KINDS = {"etcd_kill", "etcd_leader_kill"}


@dataclass
class Config:
    seed: int
    duration: float
    agents: int = 4
    messages: int = 0
    mailboxes: int = 3
    ttl: int = 5
    takeovers: int = -1
    thread_fraction: float = 0.2
    faults: tuple[str, ...] = faults.ALL_KINDS
    unfenced: bool = False
    agent_retry: bool = True
    sink_fail_rate: float = 0.02
    draft_median: float = 1.2
    draft_sigma: float = 1.0
    send_timeout: float = 8.0
    workdir: Path | None = None
    etcd_bin: Path | None = None
    etcd_args: tuple[str, ...] = ()
    allow_unsafe_etcd: bool = False
    json_out: Path | None = None

    def __post_init__(self) -> None:
        if self.messages <= 0:
            self.messages = max(20, int(self.duration * 1.5))
        if self.takeovers < 0:
            self.takeovers = max(2, int(self.duration / 20))


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
    """The current incarnation's open claims, by (notification id, token), kept by ``World.open_claims``."""

    def __post_init__(self) -> None:
        self.tail = JsonlTail(self.log_path)


def choose_etcd(config: Config) -> tuple[Path, str]:
    """An etcd that survives SIGKILL under load when crash faults are on: 3.4.x or 3.5.3+ (never 3.5.0-3.5.2)."""
    crash = bool(CRASH_KINDS & set(config.faults))
    candidates: list[Path] = []
    if config.etcd_bin is not None:
        candidates.append(config.etcd_bin)
    else:
        with contextlib.suppress(EtcdNotFound):
            candidates.append(find_etcd_binary())
        candidates += [Path(p) for p in ("/usr/bin/etcd", "/usr/local/bin/etcd") if Path(p).exists()]
    refused = []
    for binary in candidates:
        version = etcd_version(binary)
        if crash and is_broken_version(version) and not config.allow_unsafe_etcd:
            refused.append(f"{binary} is {version}")
            continue
        return binary, version
    raise SystemExit(
        "no etcd safe for SIGKILL faults (3.4.x or 3.5.3+) found"
        + (f"; refused: {', '.join(refused)}" if refused else "")
        + ". Pass --etcd-bin, or --allow-unsafe-etcd to run etcd 3.5.0-3.5.2 anyway (results then mean little)."
    )


class World:
    def __init__(self, config: Config, workdir: Path, spaces: netns.Namespaces | None, netns_problem: str) -> None:
        self.config = config
        self.workdir = workdir
        self.spaces = spaces
        self.netns_problem = netns_problem
        self.rng = random.Random(f"harness/{config.seed}")
        self.secret = secrets.token_hex(16)
        self.prefix = f"chaos/{config.seed}-{secrets.token_hex(3)}/"
        self.workload: Workload = plan(
            config.seed,
            duration=config.duration,
            messages=config.messages,
            mailboxes=config.mailboxes,
            agents=config.agents,
            thread_fraction=config.thread_fraction,
        )
        self.notifications: dict[str, Notification] = {n.notification_id: n for n in self.workload.notifications}
        self.attempts: dict[str, int] = {}
        self.deliveries: list[dict[str, Any]] = []
        self.faults: list[faults.FaultRecord] = []
        self.errors: list[str] = []
        self.ended: dict[tuple[str, int], tuple[str, float]] = {}
        self.watch_counts: dict[str, int] = {}
        self.expiry: dict[tuple[str, int], float] = {}
        self.early_expiries: list[dict[str, Any]] = []
        self.etcd_binary, self.etcd_version = choose_etcd(config)
        self.cluster: EtcdCluster = self._make_cluster()
        self.proxy: Child | None = None
        self.proxy_ports: list[int] = []
        self.proxy_lock = asyncio.Lock()
        self.sink: Child | None = None
        self.sink_address = ""
        self.coordinator_ports = [free_port() for _ in range(2)]
        self.coordinators: list[Child | None] = [None, None]
        self.agents = [
            AgentHandle(i, f"agent-{i + 1}", free_port(), workdir / f"agent-{i + 1}.jsonl")
            for i in range(config.agents)
        ]
        self.human: Child | None = None
        self.monitor: AsyncCoordinator | None = None
        self.tasks: list[asyncio.Task[Any]] = []
        self.final: dict[SubjectKey, checker.FinalState] = {}
        self.lifetime = config.duration + 900

    # -- etcd -----------------------------------------------------------------------------------------------

    def _make_cluster(self) -> EtcdCluster:
        base = self.workdir / "etcd"
        if self.spaces is None:
            binary = netns.plain_wrapper(self.workdir, self.etcd_binary)
            return EtcdCluster(base, 3, binary=binary, extra_args=self.config.etcd_args)
        wrappers = [netns.etcd_wrapper(self.workdir, ns, self.etcd_binary) for ns in self.spaces.members]
        cluster = EtcdCluster(base, 3, binary=wrappers[0])
        # Each member on its namespace's address (EtcdCluster itself lays members out on loopback only).
        specs = [
            EtcdMemberSpec(name=f"etcd{i}", client_port=2379, peer_port=2380, host=self.spaces.member_ip(i))
            for i in range(3)
        ]
        initial = ",".join(f"{s.name}={s.peer_url}" for s in specs)
        token = f"chaos-{self.spaces.tag}"
        cluster.members = [
            EtcdServer(
                base / spec.name,
                spec=spec,
                binary=wrappers[i],
                log_path=base / f"{spec.name}.log",
                initial_cluster=initial,
                cluster_token=token,
                extra_args=self.config.etcd_args,
            )
            for i, spec in enumerate(specs)
        ]
        return cluster

    async def leader_index(self) -> int:
        return await asyncio.to_thread(self.cluster.leader_index, 20.0)

    async def raft_term(self) -> int:
        statuses = await asyncio.to_thread(self.cluster.member_statuses)
        terms = [int(s.get("raftTerm", s.get("header", {}).get("raft_term", 0))) for s in statuses if s]
        return max(terms, default=0)

    async def restart_member(self, index: int) -> None:
        member = self.cluster.members[index]
        member.start(wait=False)  # spawned from this (the main) thread: its parent-death signal stays armed
        await asyncio.to_thread(member.wait_healthy, 60.0)

    async def set_link(self, index: int, up: bool) -> None:
        await asyncio.to_thread(netns.set_link, index, up)

    async def proxy_command(self, command: str) -> None:
        assert self.proxy is not None
        async with self.proxy_lock:
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
                "coordinator.cli",
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
                "warning",
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

    # -- agents ---------------------------------------------------------------------------------------------

    async def start_agent(self, agent: AgentHandle) -> None:
        self.open_claims(agent)  # read the old incarnation's last records, then forget its claims
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
            f"127.0.0.1:{agent.port}",
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
            str(self.lifetime),
            *(["--unfenced"] if c.unfenced else []),
            *([] if c.agent_retry else ["--no-retry"]),
        )
        child = Child(agent.name, argv, self.workdir / f"{agent.name}.stderr")
        await child.start()
        agent.child, agent.paused, agent.down = child, False, False

    async def kill_agent(self, agent: AgentHandle) -> None:
        agent.down = True
        if agent.child is not None:
            await agent.child.kill()

    async def restart_agent(self, agent: AgentHandle) -> None:
        await self.start_agent(agent)

    async def pause_agent(self, agent: AgentHandle) -> None:
        assert agent.child is not None
        agent.paused = True
        agent.child.signal(signal.SIGSTOP)

    def resume_agent(self, agent: AgentHandle) -> None:
        if agent.child is not None:
            agent.child.signal(signal.SIGCONT)
        agent.paused = False

    def live_agents(self) -> list[AgentHandle]:
        return [a for a in self.agents if not a.down and not a.paused]

    def open_claims(self, agent: AgentHandle) -> list[OpenClaim]:
        """Claims the agent's current incarnation was granted and has not finished with (from its log)."""
        for event in agent.tail.new_records():
            if event.get("inc") != agent.incarnation:
                continue
            claim_id = (str(event.get("nid")), int(event.get("token", 0)))
            if event.get("ev") == "granted":
                key = SubjectKey(event["mailbox"], event["kind"], event["id"])
                agent.open[claim_id] = OpenClaim(event["nid"], key, int(event["token"]), event["expires"])
            elif event.get("ev") in ("done", "sending", "lost", "loss_seen"):
                agent.open.pop(claim_id, None)
        return list(agent.open.values())

    async def agent_with_claims(self, rng: random.Random, wait: float = 10.0) -> AgentHandle:
        deadline = time.time() + wait
        while True:
            live = self.live_agents()
            if not live:
                raise RuntimeError("no live agent to inject a fault into")
            held = [(len(self.open_claims(a)), a) for a in live]
            best = max(n for n, _ in held)
            if best > 0 or time.time() >= deadline:
                return rng.choice([a for n, a in held if n == best])
            await asyncio.sleep(0.5)

    async def measure_free(self, claim: OpenClaim, killed_at: float) -> dict[str, Any]:
        """Polls the subject until the dead holder's claim is gone: when was it last seen held, when free."""
        assert self.monitor is not None
        subject = Subject(claim.key.mailbox, SubjectKind(claim.key.kind), claim.key.id)
        result: dict[str, Any] = {"subject": str(claim.key), "token": claim.token, "killed_at": killed_at}
        expires = claim.expires
        last_held: float | None = None
        freed_at: float | None = None
        first = True
        deadline = killed_at + self.config.ttl + 20
        while time.time() < deadline:
            asked = time.time()
            try:
                status = await self.monitor.status(subject)
            except InboxClaimsError:
                await asyncio.sleep(0.1)
                continue
            held = status.state is SubjectState.CLAIMED and status.fencing_token == claim.token
            if first and not held:
                result.update(result="not_held", state=status.state.value)
                return result
            first = False
            if held:
                last_held = asked
                if status.expires_at is not None:
                    expires = max(expires, status.expires_at.timestamp())
            else:
                freed_at = time.time()
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # let the watch report why it ended
        end = self.ended.get((str(claim.key), claim.token))
        result.update(
            result="measured",
            expires=expires,
            last_held=last_held,
            freed_at=freed_at,
            end_type=end[0] if end else None,
            end_seen_at=end[1] if end else None,
            latency_s=None if freed_at is None else round(freed_at - expires, 3),
        )
        return result

    # -- deliveries -----------------------------------------------------------------------------------------

    async def deliver(self, notification_id: str, agent: AgentHandle, *, reason: str) -> int:
        """POSTs one delivery attempt, signed like Nylas; 1 if the agent answered 200."""
        attempt = self.attempts.get(notification_id, 0) + 1
        self.attempts[notification_id] = attempt
        body = envelope(self.notifications[notification_id], attempt, sent_at=int(time.time()))
        headers = {"Content-Type": "application/json", "x-nylas-signature": sign_nylas(body, self.secret)}
        at = time.time()
        error = ""
        try:
            status, _ = await http_request(
                f"127.0.0.1:{agent.port}", "POST", "/webhook", body=body, headers=headers, within=2.0
            )
            ok = status == 200
            error = "" if ok else f"HTTP {status}"
        except (OSError, TimeoutError) as failure:
            ok, error = False, type(failure).__name__
        self.deliveries.append(
            {
                "t": at,
                "nid": notification_id,
                "attempt": attempt,
                "agent": agent.name,
                "ok": ok,
                "phase": reason,
                "error": error,
            }
        )
        return int(ok)

    async def run_plan(self, t0: float) -> None:
        pending: set[asyncio.Task[int]] = set()
        for delivery in self.workload.deliveries:
            await asyncio.sleep(max(t0 + delivery.at - time.time(), 0.0))
            task = asyncio.create_task(
                self.deliver(delivery.notification_id, self.agents[delivery.agent], reason="main")
            )
            pending.add(task)
            task.add_done_callback(pending.discard)
        if pending:
            await asyncio.wait(pending)

    async def final_round(self) -> None:
        """Every notification once more, as Nylas's last attempt: to a live agent, trying others on failure."""
        order = list(self.notifications)
        self.rng.shuffle(order)
        spread = max(5.0, len(order) / 20)  # about 20 deliveries a second
        start = time.time()

        async def one(index: int, nid: str) -> None:
            await asyncio.sleep(max(start + spread * index / len(order) - time.time(), 0.0))
            for _ in range(3):
                if await self.deliver(nid, self.rng.choice(self.live_agents()), reason="final"):
                    return
                await asyncio.sleep(0.5)

        await asyncio.gather(*(one(i, nid) for i, nid in enumerate(order)))

    # -- watching -------------------------------------------------------------------------------------------

    async def watch(self, mailbox: str) -> None:
        """Follows one mailbox: why and when each claim ended, and whether any lease ended before its expiry."""
        assert self.monitor is not None
        while True:
            try:
                async for item in self.monitor.watch(mailbox):
                    now = time.time()
                    statuses = item.subjects if isinstance(item, WatchSnapshot) else (item.status,)
                    for status in statuses:
                        if status.state is SubjectState.CLAIMED and status.expires_at is not None:
                            claim = (str(_key(status.subject)), status.fencing_token)
                            self.expiry[claim] = max(self.expiry.get(claim, 0.0), status.expires_at.timestamp())
                    if not isinstance(item, WatchEvent):
                        continue
                    name = item.type.value
                    self.watch_counts[name] = self.watch_counts.get(name, 0) + 1
                    if item.previous_token:
                        claim = (str(_key(item.status.subject)), item.previous_token)
                        self.ended.setdefault(claim, (name, now))
                        expires = self.expiry.pop(claim, None)
                        if item.type is EventType.EXPIRED and expires is not None and now < expires - 0.1:
                            self.early_expiries.append(
                                {"subject": claim[0], "token": claim[1], "seen_at": now, "expires": expires}
                            )
            except InboxClaimsError:
                await asyncio.sleep(0.5)

    # -- the run --------------------------------------------------------------------------------------------

    def mailboxes(self) -> list[str]:
        return sorted({m.mailbox for m in self.workload.messages})

    def error(self, message: str) -> None:
        print(f"chaos: ERROR: {message}", file=sys.stderr, flush=True)
        self.errors.append(message)

    def say(self, message: str) -> None:
        print(f"chaos [{time.strftime('%H:%M:%S')}] {message}", flush=True)

    async def start(self) -> None:
        c = self.config
        self.say(
            f"workdir {self.workdir}; etcd {self.etcd_version} ({self.etcd_binary}); "
            f"network: {'namespaces ' + self.spaces.tag if self.spaces else 'loopback (' + self.netns_problem + ')'}"
        )
        self.cluster.start()  # from the main thread: the members' parent-death signal follows the harness
        self.proxy = Child(
            "proxy",
            python_module_argv(
                "chaos", "proxy", "--targets", ",".join(self.cluster.endpoints), "--lifetime", str(self.lifetime)
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
                str(c.sink_fail_rate),
                "--seed",
                str(c.seed),
                "--lifetime",
                str(self.lifetime),
            ),
            self.workdir / "sink.log",
        )
        self.sink_address = (await self.sink.start()).split()[1]
        await asyncio.gather(*(self.start_coordinator(i) for i in range(2)))
        await asyncio.gather(*(self.start_agent(a) for a in self.agents))
        self.monitor = AsyncCoordinator(
            "ipv4:" + self.coordinator_targets(),
            principal="chaos-monitor",
            kind="human",
            timeout=3.0,
            retry=RetryPolicy(attempts=4, initial_backoff=0.1, max_backoff=1.0),
            channel_options=[("grpc.lb_policy_name", "round_robin")],
        )
        for mailbox in self.mailboxes():
            self.tasks.append(asyncio.create_task(self.watch(mailbox)))
        self.say(
            f"started: 3 etcd members, 2 coordinators, {len(self.agents)} {'UNFENCED ' if c.unfenced else ''}agents, "
            f"sink {self.sink_address}; {len(self.workload.messages)} messages, "
            f"{len(self.workload.notifications)} notifications"
        )

    async def run(self) -> None:
        c = self.config
        t0 = time.time()
        fault_end = t0 + c.duration - 4.0
        cluster_kinds = [k for k in faults.CLUSTER_LANE if k in c.faults]
        process_kinds = [k for k in faults.PROCESS_LANE if k in c.faults]
        lanes = [
            faults.run_lane(self, faults.Lane("cluster", cluster_kinds, c.seed, (1.0, 3.0)), t0 + 3.0, fault_end),
            faults.run_lane(self, faults.Lane("process", process_kinds, c.seed, (2.0, 6.0)), t0 + 4.0, fault_end),
        ]
        human_argv = python_module_argv(
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
            ",".join(self.mailboxes()),
            "--seed",
            str(c.seed),
            "--takeovers",
            str(c.takeovers),
            "--start-at",
            str(t0 + 3.0),
            "--stop-at",
            str(fault_end),
            "--lifetime",
            str(self.lifetime),
        )
        self.human = Child("human", human_argv, self.workdir / "human.log")
        await self.human.start()
        progress = asyncio.create_task(self.progress(t0))
        await asyncio.gather(self.run_plan(t0), *lanes)
        progress.cancel()
        self.say(f"main phase over after {time.time() - t0:.0f} s; {len(self.faults)} faults injected")

    async def progress(self, t0: float) -> None:
        while True:
            await asyncio.sleep(30)
            kinds: dict[str, int] = {}
            for fault in self.faults:
                kinds[fault.kind] = kinds.get(fault.kind, 0) + 1
            self.say(f"t+{time.time() - t0:.0f}s: {len(self.deliveries)} deliveries, faults {kinds}")

    async def finish(self) -> None:
        c = self.config
        # Every fault has healed (the lanes returned); make sure, then let lapsed claims expire.
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
        await asyncio.sleep(c.ttl + faults.LEASE_BUCKET_S + faults.ETCD_EXPIRY_CHECK_S + 1.0)
        self.say("final round: every notification once more")
        await self.final_round()
        await self.drain()
        await self.read_final()

    async def drain(self) -> None:
        """Waits (bounded) until no agent works on anything, the human is done, and nothing is SENDING."""
        c = self.config
        deadline = time.time() + 4 * c.ttl + 60
        while time.time() < deadline:
            busy = 0
            for agent in self.live_agents():
                with contextlib.suppress(OSError, TimeoutError, ValueError):
                    busy += int((await http_json(f"127.0.0.1:{agent.port}", "GET", "/idle", within=2.0))["inflight"])
            human_done = self.human is None or self.human.proc is None or self.human.proc.returncode is not None
            if busy == 0 and human_done:
                break
            await asyncio.sleep(1.0)
        else:
            self.error("agents still busy at the end of the drain")
        assert self.monitor is not None
        deadline = time.time() + c.send_timeout + 15
        mailboxes = self.mailboxes()
        while time.time() < deadline:
            sending = 0
            try:
                for mailbox in mailboxes:
                    page = await self.monitor.list_claims(mailbox, states=[SubjectState.SENDING], page_size=1000)
                    sending += len(page.subjects)
            except InboxClaimsError:
                sending = -1
            if sending == 0:
                return
            await asyncio.sleep(1.0)
        self.error("subjects still SENDING after the send timeout")

    async def read_final(self) -> None:
        assert self.monitor is not None
        for key in self.workload.subjects():
            subject = Subject(key.mailbox, SubjectKind(key.kind), key.id)
            for _ in range(5):
                try:
                    status = await self.monitor.status(subject)
                except InboxClaimsError:
                    await asyncio.sleep(0.5)
                    continue
                self.final[key] = checker.FinalState(status.state.value, status.fencing_token, status.holder)
                break
            else:
                self.error(f"could not read the final state of {key}")

    async def stop(self) -> None:
        await faults.cancel_quietly(self.tasks)
        if self.monitor is not None:
            await self.monitor.close()
        children = [a.child for a in self.agents] + [self.human, *self.coordinators, self.sink, self.proxy]
        await asyncio.gather(*(child.stop() for child in children if child is not None))
        await asyncio.to_thread(self.cluster.stop)

    def record(self) -> checker.RunRecord:
        events: list[dict[str, Any]] = []
        for agent in self.agents:
            events += read_jsonl(agent.log_path)
        events += read_jsonl(self.workdir / "human.jsonl")
        return checker.RunRecord(
            config=self.describe(),
            workload=self.workload,
            sends=read_jsonl(self.workdir / "sink.jsonl"),
            events=events,
            final=self.final,
            faults=[f.as_dict() for f in self.faults],
            deliveries=self.deliveries,
            watch_events=dict(self.watch_counts),
            early_expiries=self.early_expiries,
            leader_changes=leader_changes(self.cluster),
            errors=self.errors,
        )

    def describe(self) -> dict[str, Any]:
        c = self.config
        return {
            "seed": c.seed,
            "duration": c.duration,
            "agents": c.agents,
            "messages": c.messages,
            "mailboxes": c.mailboxes,
            "ttl": c.ttl,
            "faults": list(c.faults),
            "mode": "UNFENCED (negative control)" if c.unfenced else "fenced",
            "etcd_version": self.etcd_version,
            "etcd_binary": " ".join((str(self.etcd_binary), *c.etcd_args)),
            "network": f"network namespaces ({self.spaces.tag})"
            if self.spaces
            else f"loopback only: {self.netns_problem}",
            "workdir": str(self.workdir),
            "replay": replay_command(c),
        }


def leader_changes(cluster: EtcdCluster) -> list[float]:
    """When a member became leader, from the members' logs (etcd 3.4+ logs JSON lines with an ISO ``ts``)."""
    times = []
    for member in cluster.members:
        with contextlib.suppress(OSError):
            for line in member.log_path.read_text(errors="replace").splitlines():
                if "became leader at term" not in line or not line.startswith("{"):
                    continue
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    times.append(datetime.fromisoformat(json.loads(line)["ts"]).timestamp())
    return sorted(times)


def _key(subject: Subject) -> SubjectKey:
    return SubjectKey(subject.mailbox, subject.kind.value, subject.id)


def replay_command(config: Config) -> str:
    parts = [
        "python -m chaos run",
        f"--seed {config.seed}",
        f"--duration {config.duration:g}",
        f"--agents {config.agents}",
        f"--messages {config.messages}",
        f"--mailboxes {config.mailboxes}",
        f"--ttl {config.ttl}",
        f"--takeovers {config.takeovers}",
    ]
    if tuple(config.faults) != faults.ALL_KINDS:
        parts.append(f"--faults {','.join(config.faults) or 'none'}")
    if config.unfenced:
        parts.append("--unfenced")
    if not config.agent_retry:
        parts.append("--no-agent-retry")
    parts += [f"--etcd-arg={arg}" for arg in config.etcd_args]
    return " ".join(parts)


async def run_world(config: Config, workdir: Path, spaces: netns.Namespaces | None, netns_problem: str) -> int:
    world = World(config, workdir, spaces, netns_problem)
    try:
        async with asyncio.timeout(config.duration + 600):
            await world.start()
            await world.run()
            await world.finish()
    except TimeoutError:
        world.error("the run did not finish within its overall bound (duration + 600 s)")
    except Exception as error:
        world.error(f"{type(error).__name__}: {error}")
    finally:
        await world.stop()
    report = checker.check(world.record())
    print(report.table, flush=True)
    summary = {"config": world.describe(), **report.as_dict(), "faults": [f.as_dict() for f in world.faults]}
    text = json.dumps(summary, indent=2, default=str)
    (workdir / "summary.json").write_text(text)
    if config.json_out is not None:
        config.json_out.write_text(text)
    if report.violations:
        return 1
    return 2 if report.errors else 0


# -------------------------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of main phase (default 180)")
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--messages", type=int, default=0, help="default: 1.5 per second of duration")
    parser.add_argument("--mailboxes", type=int, default=3)
    parser.add_argument("--ttl", type=int, default=5, help="claim TTL of the agents, seconds (default 5)")
    parser.add_argument("--takeovers", type=int, default=-1, help="human takeovers (default: one per 20 s)")
    parser.add_argument("--thread-fraction", type=float, default=0.2)
    parser.add_argument(
        "--faults", default="all", help=f"comma-separated kinds, 'all' or 'none' (kinds: {', '.join(faults.ALL_KINDS)})"
    )
    parser.add_argument("--unfenced", action="store_true", help="NEGATIVE CONTROL: agents send without BeginSend")
    parser.add_argument(
        "--no-agent-retry",
        action="store_true",
        help="agents never retry a notification after the coordinator was unreachable (shows a silent drop)",
    )
    parser.add_argument("--sink-fail-rate", type=float, default=0.02, help="sends with an unknown outcome")
    parser.add_argument("--no-netns", action="store_true", help="loopback only (the partition fault is skipped)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--etcd-bin", type=Path, default=None)
    parser.add_argument("--allow-unsafe-etcd", action="store_true")
    parser.add_argument(
        "--etcd-arg", action="append", default=[], help="an extra etcd flag, e.g. --etcd-arg=--pre-vote (repeatable)"
    )
    parser.add_argument("--json-out", type=Path, default=None, help="also write the summary JSON here")
    parser.add_argument("--inner", default="", help=argparse.SUPPRESS)


def config_from(options: argparse.Namespace) -> Config:
    kinds: tuple[str, ...] = ()
    if options.faults == "all":
        kinds = faults.ALL_KINDS
    elif options.faults == "none":
        kinds = ()
    else:
        kinds = tuple(k.strip() for k in options.faults.split(",") if k.strip())
        unknown = set(kinds) - set(faults.ALL_KINDS)
        if unknown:
            raise SystemExit(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(faults.ALL_KINDS)}")
    return Config(
        seed=options.seed,
        duration=options.duration,
        agents=options.agents,
        messages=options.messages,
        mailboxes=options.mailboxes,
        ttl=options.ttl,
        takeovers=options.takeovers,
        thread_fraction=options.thread_fraction,
        faults=kinds,
        unfenced=options.unfenced,
        agent_retry=not options.no_agent_retry,
        sink_fail_rate=options.sink_fail_rate,
        workdir=options.workdir,
        etcd_bin=options.etcd_bin,
        allow_unsafe_etcd=options.allow_unsafe_etcd,
        etcd_args=tuple(options.etcd_arg),
        json_out=options.json_out,
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos run", description=__doc__)
    add_arguments(parser)
    options = parser.parse_args(argv)
    config = config_from(options)
    workdir = config.workdir or Path(f"/tmp/chaos-{config.seed}-{int(time.time())}-{secrets.token_hex(2)}")
    if not options.inner and workdir.exists() and any(workdir.iterdir()):
        # The logs are append-only and agents replay unfinished work from theirs: never mix two runs.
        raise SystemExit(f"chaos: --workdir {workdir} is not empty; give a new directory")
    workdir.mkdir(parents=True, exist_ok=True)
    if options.inner:  # inside the world namespace, started by the outer process below
        world_ns, *members = options.inner.split(",")
        spaces = netns.Namespaces(world_ns.removeprefix(netns.PREFIX).removesuffix("-w"), world_ns, tuple(members))
        return asyncio.run(run_world(dataclasses.replace(config, workdir=workdir), workdir, spaces, ""))
    if options.no_netns or "etcd_partition" not in config.faults:
        problem = "--no-netns given" if options.no_netns else "no partition fault asked for"
        return asyncio.run(run_world(dataclasses.replace(config, workdir=workdir), workdir, None, problem))
    netns.reap_stale()
    try:
        spaces = netns.create()
    except netns.NetnsUnavailable as error:
        problem = f"network namespaces unavailable: {error}"
        print(f"chaos: {problem}; the partition fault will be skipped", file=sys.stderr)
        return asyncio.run(run_world(dataclasses.replace(config, workdir=workdir), workdir, None, problem))
    return run_in_namespaces(spaces, argv, workdir, config.duration)


def run_in_namespaces(spaces: netns.Namespaces, argv: list[str], workdir: Path, duration: float) -> int:
    """Re-runs this command inside the world namespace, then removes the namespaces whatever happened."""

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    inner = ",".join((spaces.world, *spaces.members))
    command = netns.exec_argv(
        spaces.world,
        child_argv([sys.executable, "-m", "chaos", "run", *argv, "--workdir", str(workdir), "--inner", inner]),
    )
    try:
        return subprocess.run(command, check=False, timeout=duration + 1200).returncode
    except subprocess.TimeoutExpired:
        print("chaos: the run exceeded its bound and was killed", file=sys.stderr)
        return 2
    finally:
        netns.destroy(spaces)
        signal.signal(signal.SIGTERM, previous)
