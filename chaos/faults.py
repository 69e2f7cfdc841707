"""The faults and their seeded schedule.

Two lanes run side by side, each one fault at a time with a random gap between faults:

* lane **cluster**: ``etcd_kill`` (SIGKILL a follower, restart it), ``etcd_leader_kill`` (the same to the
  leader), ``etcd_slow`` (the proxy adds latency to one member or all), ``etcd_partition`` (cut one member off,
  the leader half of the time; needs network namespaces), ``agent_kill`` (SIGKILL an agent that holds claims and
  measure how long each claim takes to free), ``clock_skew`` (restart one coordinator with its clocks 5 minutes
  fast or slow, under libfaketime, for a while, then without: no decision may depend on a replica's wall clock,
  so sends and claims keep their guarantees while its clock disagrees with the other's). Sequential, so at most
  one member is ever down (quorum holds), and neither an etcd fault nor a skewed clock overlaps a claim-free
  measurement (the checker excuses a measurement that a leader change or a skewed replica's stamp would blur, and
  a run must keep at least one).
* lane **process**: ``coordinator_kill`` (SIGKILL one coordinator, restart it), ``agent_pause`` (SIGSTOP an agent
  that holds claims for longer than its TTL, redeliver its notifications to other agents meanwhile, SIGCONT:
  the GC-pause case, whose late sends must be fenced).

Each lane first runs every kind it has once, in a seeded order (so a short run covers them all), then draws
kinds at random until the fault window closes. Durations and targets come from the lane's seeded generator;
which member leads is only known at run time.

A fault acts on the world only through :class:`chaos.targets.FaultTargets`; the kinds and the timing bounds
are listed in chaos/config.py.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .config import ETCD_EXPIRY_CHECK_S, LEASE_BUCKET_S

if TYPE_CHECKING:
    from .targets import FaultTargets


@dataclass
class FaultRecord:
    kind: str
    target: str
    started: float
    ended: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)
    error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "target": self.target,
            "started": self.started,
            "ended": self.ended,
            "details": self.details,
            "error": self.error,
        }


class Lane:
    def __init__(self, name: str, kinds: Sequence[str], seed: int, gap: tuple[float, float]) -> None:
        self.name = name
        self.kinds = list(kinds)
        self.rng = random.Random(f"faults/{seed}/{name}")
        self.gap = gap
        self.pending = self.kinds[:]
        self.rng.shuffle(self.pending)

    def next_kind(self) -> str:
        if self.pending:
            return self.pending.pop(0)
        return self.rng.choice(self.kinds)

    def next_gap(self) -> float:
        return self.rng.uniform(*self.gap)


async def run_lane(
    targets: FaultTargets,
    lane: Lane,
    start_at: float,
    end_at: float,
    records: list[FaultRecord],
    error: Callable[[str], None],
) -> None:
    """Runs faults until ``end_at`` (a fault that started before it is finished and healed), appending each to
    ``records``; one that could not be injected or healed is also reported to ``error``."""
    await asyncio.sleep(max(start_at - time.time(), 0.0))
    if not lane.kinds:
        return
    while time.time() < end_at:
        kind = lane.next_kind()
        record = FaultRecord(kind, "", time.time())
        records.append(record)
        try:
            await INJECT[kind](targets, lane.rng, record)
        except Exception as failure:  # a fault that could not be injected or healed is a harness error
            record.error = f"{type(failure).__name__}: {failure}"
            error(f"fault {kind} failed: {record.error}")
        finally:
            record.ended = time.time()
        await asyncio.sleep(lane.next_gap())


# ---------------------------------------------------------------------------------------------- etcd


async def etcd_kill(targets: FaultTargets, rng: random.Random, record: FaultRecord, *, leader: bool = False) -> None:
    leader_index = await targets.leader_index()
    followers = [i for i in range(targets.member_count) if i != leader_index]
    index = leader_index if leader else rng.choice(followers)
    downtime = rng.uniform(2.0, 5.0)
    record.target = targets.member_name(index)
    record.details.update(leader=index == leader_index, downtime_s=round(downtime, 2))
    targets.kill_member(index)
    await asyncio.sleep(downtime)
    await targets.restart_member(index)
    record.details["new_leader"] = targets.member_name(await targets.leader_index())


async def etcd_leader_kill(targets: FaultTargets, rng: random.Random, record: FaultRecord) -> None:
    await etcd_kill(targets, rng, record, leader=True)


async def etcd_slow(targets: FaultTargets, rng: random.Random, record: FaultRecord) -> None:
    target = "*" if rng.random() < 0.5 else str(rng.randrange(targets.member_count))
    delay_ms = rng.choice((rng.uniform(50, 400), rng.uniform(400, 1500)))
    duration = rng.uniform(3.0, 7.0)
    record.target = "all members" if target == "*" else targets.member_name(int(target))
    record.details.update(delay_ms=round(delay_ms), duration_s=round(duration, 2))
    await targets.delay_etcd(target, delay_ms)
    try:
        await asyncio.sleep(duration)
    finally:
        await targets.delay_etcd(target, 0)


async def etcd_partition(targets: FaultTargets, rng: random.Random, record: FaultRecord) -> None:
    if targets.partition_unavailable:
        record.target = "-"
        record.details["skipped"] = targets.partition_unavailable
        return
    leader_index = await targets.leader_index()
    index = leader_index if rng.random() < 0.5 else rng.randrange(targets.member_count)
    duration = rng.uniform(3.0, 8.0)
    record.target = targets.member_name(index)
    record.details.update(leader=index == leader_index, duration_s=round(duration, 2))
    await targets.connect_member(index, connected=False)
    try:
        await asyncio.sleep(duration)
    finally:
        await targets.connect_member(index, connected=True)
    record.details["new_leader"] = targets.member_name(await targets.leader_index())


# ------------------------------------------------------------------------------------------- processes


async def coordinator_kill(targets: FaultTargets, rng: random.Random, record: FaultRecord) -> None:
    index = rng.randrange(targets.coordinator_count)
    downtime = rng.uniform(1.0, 4.0)
    record.target = f"coordinator-{index}"
    record.details["downtime_s"] = round(downtime, 2)
    await targets.kill_coordinator(index)
    await asyncio.sleep(downtime)
    await targets.start_coordinator(index)


async def clock_skew(targets: FaultTargets, rng: random.Random, record: FaultRecord) -> None:
    index = rng.randrange(targets.coordinator_count)
    offset = rng.choice(("+5m", "-5m"))
    duration = rng.uniform(10.0, 20.0)
    record.target = f"coordinator-{index}"
    record.details.update(offset=offset, duration_s=round(duration, 2))
    await targets.kill_coordinator(index)
    await targets.start_coordinator(index, clock_offset=offset)
    try:
        await asyncio.sleep(duration)
    finally:
        await targets.kill_coordinator(index)
        await targets.start_coordinator(index)


async def agent_pause(targets: FaultTargets, rng: random.Random, record: FaultRecord) -> None:
    """The GC pause: stopped past its TTL while holding claims; its notifications go to others meanwhile."""
    agent = await targets.agent_with_claims(rng)
    held = agent.open_claims()
    ttl = targets.ttl
    pause = ttl + LEASE_BUCKET_S + ETCD_EXPIRY_CHECK_S + rng.uniform(1.0, 4.0)
    record.target = agent.name
    record.details.update(pause_s=round(pause, 2), claims_held=len(held))
    targets.pause_agent(agent)
    try:
        await asyncio.sleep(ttl + LEASE_BUCKET_S + ETCD_EXPIRY_CHECK_S + 0.5)
        # Seen from Nylas, a paused agent is one that did not answer in time: the notification comes again.
        redelivered = 0
        for claim in held:
            others = [a for a in targets.live_agents() if a is not agent]
            if others and claim.notification_id:
                redelivered += await targets.redeliver(claim.notification_id, rng.choice(others))
        record.details["redelivered"] = redelivered
        await asyncio.sleep(max(record.started + pause - time.time(), 0.0))
    finally:
        targets.resume_agent(agent)
    record.details["resumed_at"] = time.time()


async def agent_kill(targets: FaultTargets, rng: random.Random, record: FaultRecord) -> None:
    """SIGKILL a holder; measure when each of its claims frees (TTL + bucket + etcd's expiry check)."""
    agent = await targets.agent_with_claims(rng)
    record.target = agent.name
    killed_at = time.time()
    await targets.kill_agent(agent)
    held = agent.open_claims()  # read after the kill: every claim it logged before dying
    record.details["claims_held"] = len(held)
    measures = await asyncio.gather(*(targets.measure_free(claim, killed_at) for claim in held))
    record.details["measures"] = list(measures)
    await targets.restart_agent(agent)


INJECT = {
    "etcd_kill": etcd_kill,
    "etcd_leader_kill": etcd_leader_kill,
    "etcd_slow": etcd_slow,
    "etcd_partition": etcd_partition,
    "agent_kill": agent_kill,
    "coordinator_kill": coordinator_kill,
    "agent_pause": agent_pause,
    "clock_skew": clock_skew,
}
