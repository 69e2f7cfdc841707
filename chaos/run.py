"""The phases of one chaos run, over its processes (chaos/processes.py) and what the faults may touch
(chaos/targets.py): start; main phase (deliveries on the seeded plan, the two fault lanes, the human's takeovers);
settle (every fault healed, then TTL + bound, so lapsed claims are free); final round (every notification
delivered once more); drain (agents idle, no subject left SENDING); final reads; stop; record and check."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from . import checker, faults, leases, netns
from .common import http_json, read_jsonl
from .config import CLUSTER_LANE, ETCD_EXPIRY_CHECK_S, LEASE_BUCKET_S, PROCESS_LANE, Config, choose_etcd, replay_command
from .correspondents import Correspondents
from .monitor import Monitor
from .processes import Processes
from .targets import FaultTargets
from .webhooks import Webhooks
from .workload import SubjectKey, Workload, plan


class Run:
    def __init__(self, config: Config, workdir: Path, spaces: netns.Namespaces | None, netns_problem: str) -> None:
        self.config = config
        self.workdir = workdir
        self.spaces = spaces
        self.netns_problem = netns_problem
        self.rng = random.Random(f"harness/{config.seed}")
        self.workload: Workload = plan(
            config.seed,
            duration=config.duration,
            messages=config.messages,
            mailboxes=config.mailboxes,
            agents=config.agents,
            thread_fraction=config.thread_fraction,
            outside_fraction=config.outside_fraction,
            storms=config.storms,
        )
        self.correspondents = Correspondents(self.workload, workdir / "sink.jsonl", config.seed)
        self.faults: list[faults.FaultRecord] = []
        self.errors: list[str] = []
        self.final: dict[SubjectKey, checker.FinalState] = {}
        self.etcd_binary, self.etcd_version = choose_etcd(config)
        self.processes = Processes(config, workdir, spaces, self.etcd_binary)
        self.webhooks = Webhooks(self.workload, self.processes)
        self.monitor: Monitor | None = None

    def mailboxes(self) -> list[str]:
        return sorted({m.mailbox for m in self.workload.messages})

    def error(self, message: str) -> None:
        print(f"chaos: ERROR: {message}", file=sys.stderr, flush=True)
        self.errors.append(message)

    def say(self, message: str) -> None:
        print(f"chaos [{time.strftime('%H:%M:%S')}] {message}", flush=True)

    # -- phases ---------------------------------------------------------------------------------------------

    async def start(self) -> None:
        c = self.config
        self.say(
            f"workdir {self.workdir}; etcd {self.etcd_version} ({self.etcd_binary}); "
            f"network: {'namespaces ' + self.spaces.tag if self.spaces else 'loopback (' + self.netns_problem + ')'}"
        )
        await self.processes.start()
        self.monitor = Monitor(
            self.processes.coordinator_targets(), self.processes.cluster.endpoints, self.processes.prefix
        )
        self.monitor.watch_all(self.mailboxes())
        self.say(
            f"started: 3 etcd members, 2 coordinators, {len(self.processes.agents)} "
            f"{'UNFENCED ' if c.unfenced else ''}agents, "
            f"sink {self.processes.sink_address}; {len(self.workload.messages)} messages, "
            f"{len(self.workload.notifications)} notifications, {len(self.workload.outside)} replies from Gmail"
            + (" (agents IGNORE OUTGOING)" if c.ignore_outgoing else "")
            + (" (agents IGNORE THE REPLY RULES)" if c.ignore_reply_rules else "")
            + f"; storm actors: {len(self.workload.responders)} threads answering every reply"
        )

    async def main_phase(self) -> None:
        """The seeded deliveries, the two fault lanes and the human's takeovers, for ``duration`` seconds."""
        c = self.config
        assert self.monitor is not None
        t0 = time.time()
        fault_end = t0 + c.duration - 4.0
        partition_unavailable = "" if self.spaces else self.netns_problem
        targets = FaultTargets(self.processes, self.monitor, self.webhooks, partition_unavailable)
        cluster_kinds = [k for k in CLUSTER_LANE if k in c.faults]
        process_kinds = [k for k in PROCESS_LANE if k in c.faults]
        cluster = faults.Lane("cluster", cluster_kinds, c.seed, (1.0, 3.0))
        process = faults.Lane("process", process_kinds, c.seed, (2.0, 6.0))
        await self.processes.start_human(self.mailboxes(), start_at=t0 + 3.0, stop_at=fault_end)
        progress = asyncio.create_task(self.progress(t0))
        await asyncio.gather(
            self.webhooks.run_plan(t0),
            self.webhooks.run_outside(t0),
            self.webhooks.run_arrivals(t0),
            faults.run_lane(targets, cluster, t0 + 3.0, fault_end, self.faults, self.error),
            faults.run_lane(targets, process, t0 + 4.0, fault_end, self.faults, self.error),
            self.correspondents.run(t0, fault_end, lambda n: self.webhooks.deliver_new(n, self.rng)),
        )
        progress.cancel()
        # The correspondents' answers are messages of the workload from now on: delivered again in the final
        # round (they are in self.webhooks.notifications), read at the end, judged.
        self.workload = dataclasses.replace(
            self.workload,
            messages=self.workload.messages + tuple(self.correspondents.messages),
            notifications=self.workload.notifications + tuple(self.correspondents.notifications),
        )
        self.say(f"main phase over after {time.time() - t0:.0f} s; {len(self.faults)} faults injected")

    async def progress(self, t0: float) -> None:
        while True:
            await asyncio.sleep(30)
            kinds: dict[str, int] = {}
            for fault in self.faults:
                kinds[fault.kind] = kinds.get(fault.kind, 0) + 1
            self.say(f"t+{time.time() - t0:.0f}s: {len(self.webhooks.deliveries)} deliveries, faults {kinds}")

    async def finish(self) -> None:
        """Settle, final round, drain, final reads."""
        # Every fault has healed (the lanes returned); make sure, then let lapsed claims expire.
        await self.processes.heal()
        await asyncio.sleep(self.config.ttl + LEASE_BUCKET_S + ETCD_EXPIRY_CHECK_S + 1.0)
        self.say("final round: every notification once more")
        await self.webhooks.final_round(self.rng)
        await self.drain()
        await self.read_final()

    async def drain(self) -> None:
        """Waits (bounded) until no agent works on anything, the human is done, and nothing is SENDING."""
        c = self.config
        deadline = time.time() + 4 * c.ttl + 60
        while time.time() < deadline:
            busy = 0
            for agent in self.processes.live_agents():
                with contextlib.suppress(OSError, TimeoutError, ValueError):
                    busy += int((await http_json(agent.address, "GET", "/idle", within=2.0))["inflight"])
            if busy == 0 and self.processes.human_done:
                break
            await asyncio.sleep(1.0)
        else:
            self.error("agents still busy at the end of the drain")
        assert self.monitor is not None
        deadline = time.time() + c.send_timeout + 15
        mailboxes = self.mailboxes()
        while time.time() < deadline:
            if await self.monitor.count_sending(mailboxes) == 0:
                return
            await asyncio.sleep(1.0)
        self.error("subjects still SENDING after the send timeout")

    async def read_final(self) -> None:
        assert self.monitor is not None
        for key in self.workload.subjects():
            state = await self.monitor.final_state(key)
            if state is None:
                self.error(f"could not read the final state of {key}")
            else:
                self.final[key] = state

    async def stop(self) -> None:
        if self.monitor is not None:
            await self.monitor.close()
        await self.processes.stop()

    # -- results --------------------------------------------------------------------------------------------

    def record(self) -> checker.RunRecord:
        events: list[dict[str, Any]] = []
        for agent in self.processes.agents:
            events += read_jsonl(agent.log_path)
        events += read_jsonl(self.workdir / "human.jsonl")
        monitor = self.monitor
        grants: list[leases.LeaseGrant] = []
        seen: list[leases.TermSeen] = []
        for index in range(len(self.processes.coordinators)):
            name = f"coordinator-{index}"
            more_grants, more_seen = leases.coordinator_evidence(name, self.workdir / f"{name}.log")
            grants += more_grants
            seen += more_seen
        return checker.RunRecord(
            config=self.describe(),
            workload=self.workload,
            sends=read_jsonl(self.workdir / "sink.jsonl"),
            events=events,
            final=self.final,
            faults=[f.as_dict() for f in self.faults],
            deliveries=self.webhooks.deliveries,
            watch_events=dict(monitor.watch_counts) if monitor else {},
            early_expiries=monitor.early_expiries if monitor else [],
            leader_changes=leases.leader_changes([(m.spec.name, m.log_path) for m in self.processes.cluster.members]),
            lease_grants=grants,
            terms_seen=seen,
            errors=self.errors + self.webhooks.outside_errors,
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
            "mode": "UNFENCED (negative control)"
            if c.unfenced
            else "IGNORING OUTGOING (negative control)"
            if c.ignore_outgoing
            else "IGNORING THE REPLY RULES (negative control)"
            if c.ignore_reply_rules
            else "fenced",
            "t0": self.webhooks.t0,
            "storms": c.storms,
            "look": c.look,
            "etcd_version": self.etcd_version,
            "etcd_binary": " ".join((str(self.etcd_binary), *c.etcd_args)),
            "etcd_election_timeout_ms": election_timeout_ms(c.etcd_args),
            "network": f"network namespaces ({self.spaces.tag})"
            if self.spaces
            else f"loopback only: {self.netns_problem}",
            "workdir": str(self.workdir),
            "replay": replay_command(c),
        }


def election_timeout_ms(etcd_args: tuple[str, ...]) -> int:
    """The members' --election-timeout (etcd's default: 1000 ms)."""
    value = "1000"
    for index, arg in enumerate(etcd_args):
        if arg.startswith("--election-timeout="):
            value = arg.split("=", 1)[1]
        elif arg == "--election-timeout" and index + 1 < len(etcd_args):
            value = etcd_args[index + 1]
    return int(value)


async def run_world(config: Config, workdir: Path, spaces: netns.Namespaces | None, netns_problem: str) -> int:
    """One whole run: the phases, then the checker's report (printed, and written to summary.json); the exit
    status is 0 (no violation), 1 (a violation) or 2 (the harness itself failed)."""
    run = Run(config, workdir, spaces, netns_problem)
    try:
        async with asyncio.timeout(config.duration + 600):
            await run.start()
            await run.main_phase()
            await run.finish()
    except TimeoutError:
        run.error("the run did not finish within its overall bound (duration + 600 s)")
    except Exception as error:
        run.error(f"{type(error).__name__}: {error}")
    finally:
        await run.stop()
    report = checker.check(run.record())
    print(report.table, flush=True)
    summary = {"config": run.describe(), **report.as_dict(), "faults": [f.as_dict() for f in run.faults]}
    text = json.dumps(summary, indent=2, default=str)
    (workdir / "summary.json").write_text(text)
    if config.json_out is not None:
        config.json_out.write_text(text)
    if report.violations:
        return 1
    return 2 if report.errors else 0
