"""A claim whose time passed while its store was unavailable frees within the stated bound once the store is back,
and never earlier than its TTL after its last renewal (docs/design.md#leases-and-expiry, "Across an outage or a
restart"): etcd starts every lease's TTL again when it starts, or elects a new leader, so without the coordinator
a claim is held a whole TTL after the store is back.

- ``serve`` on its embedded etcd, stopped for longer than a claim's TTL and started again, its clock 5 minutes
  slow before and 5 minutes fast after (libfaketime): the claim that expired is freed as soon as it serves, the
  one with time left is held until its time, never earlier (a comparison of the two runs' clocks would free it
  at once).
- A 3-member etcd cluster stopped as a whole while two coordinators stay up, one 5 minutes fast, one 5 minutes
  slow: the same, decided by each coordinator's monotonic clock.

Real processes, real etcd; the times asserted are bounds only a coordinator that does not end such claims misses
(it frees a claim a whole TTL after the store is back), not speed targets."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from chaos.common import skewed_clock_env
from coordinator.store.etcd.cluster import EtcdCluster
from coordinator.store.etcd.process import ENV_ETCD_BIN, free_ports
from inbox_wire.v1 import coordinator_pb2 as pb
from tests.helpers import Actor, message, serve_process
from tests.ops.test_embedded_etcd import Serve, data_dir  # noqa: F401  (the fixture: a data dir, cleaned up)
from tests.ops.test_ops_cluster import cluster  # noqa: F401  (the fixture: a 3-member cluster)

pytestmark = pytest.mark.etcd  # starts etcd and coordinator processes itself

SHORT_TTL_S = 6  # a claim whose time passes while the store is down
LONG_TTL_S = 16  # a claim with time left when the store is back
DOWN_UNTIL_S = 8  # the store is back no earlier than this long after the claims
# Once the store answers again, a claim whose time has passed is freed within this: the check runs every second
# (one read for etcd's term, then the delete). Without it a claim is freed a whole TTL (and more) later.
FREED_WITHIN_S = 4.0


@dataclass
class Timeline:
    """Every state each subject was seen in, and when (this test's monotonic clock, which every process of the
    machine shares: libfaketime's offset moves the wall clock, and a constant offset changes no difference)."""

    seen: dict[str, list[tuple[float, int]]] = field(default_factory=dict)

    def first(self, subject_id: str, state: int) -> float | None:
        return next((at for at, seen in self.seen.get(subject_id, []) if seen == state), None)

    def last(self, subject_id: str, state: int) -> float | None:
        return next((at for at, seen in reversed(self.seen.get(subject_id, [])) if seen == state), None)


async def _follow(target: str, subjects: list[pb.Subject], timeline: Timeline, until: float) -> None:
    """Polls the subjects' states through ``target`` until ``until`` (monotonic), ignoring the times it cannot
    answer (the store down, the coordinator restarting)."""
    async with grpc.aio.insecure_channel(target) as channel:
        watcher = Actor(channel, "watcher", kind="human")
        while time.monotonic() < until:
            for subject in subjects:
                try:
                    answer = await watcher.stub.GetStatus(
                        pb.GetStatusRequest(subject=subject), metadata=watcher.metadata, timeout=0.5
                    )
                    state = answer.status.state
                except grpc.aio.AioRpcError:
                    continue
                timeline.seen.setdefault(subject.id, []).append((time.monotonic(), state))
            await asyncio.sleep(0.1)


def _machine(offset: str) -> dict[str, str]:
    """A process environment with its clock ``offset`` off, and this suite's etcd."""
    env = skewed_clock_env(offset)
    if os.environ.get(ENV_ETCD_BIN):
        env[ENV_ETCD_BIN] = os.environ[ENV_ETCD_BIN]
    return env


def _assert_freed_in_time(timeline: Timeline, short: str, long: str, claimed: float, back: float) -> None:
    """``short``'s time passed while the store was down: freed within the bound of the store being back.
    ``long`` had time left: held until its time (never early), then freed within the bound."""
    freed_short = timeline.first(short, pb.SUBJECT_STATE_FREE)
    assert freed_short is not None, timeline.seen
    freed_long = timeline.first(long, pb.SUBJECT_STATE_FREE)
    print(
        f"\n{short}: freed {freed_short - back:.2f} s after the store was back; {long}: freed "
        f"{(freed_long or 0) - claimed - LONG_TTL_S:.2f} s after its TTL"
    )
    assert claimed + SHORT_TTL_S <= freed_short < back + FREED_WITHIN_S, (freed_short - back, timeline.seen[short])
    held_long = timeline.last(long, pb.SUBJECT_STATE_CLAIMED)
    assert held_long is not None, timeline.seen
    assert freed_long is not None, timeline.seen
    assert freed_long >= claimed + LONG_TTL_S, ("freed early", freed_long - claimed)
    assert held_long >= claimed + LONG_TTL_S - 1.0, ("not seen held until its time", held_long - claimed)
    assert freed_long < claimed + LONG_TTL_S + FREED_WITHIN_S, freed_long - claimed


async def test_serve_stopped_longer_than_a_claims_ttl_frees_it_when_started_again_and_never_early(
    data_dir: Path,  # noqa: F811
) -> None:
    slow = Serve(data_dir, "--min-ttl=2", "--http-listen=", machine=_machine("-5m")).wait_serving()
    short, long = message("mb", "short"), message("mb", "long")
    claimed = time.monotonic()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{slow.port}") as channel:
        agent = Actor(channel, "agent-a")
        assert (await agent.claim(short, ttl=SHORT_TTL_S)).result == pb.ClaimReplyResponse.GRANTED
        assert (await agent.claim(long, ttl=LONG_TTL_S)).result == pb.ClaimReplyResponse.GRANTED
    code, out = slow.stop()
    assert code == 0, out
    await asyncio.sleep(max(claimed + DOWN_UNTIL_S - time.monotonic(), 0))
    # Started again, its clock now 10 minutes ahead of the one that wrote the claims.
    fast = Serve(data_dir, "--min-ttl=2", "--http-listen=", machine=_machine("+5m"))
    try:
        fast.wait_serving()
        back = time.monotonic()
        timeline = Timeline()
        await _follow(f"127.0.0.1:{fast.port}", [short, long], timeline, claimed + LONG_TTL_S + FREED_WITHIN_S + 1)
    finally:
        code, out = fast.stop()
    assert code == 0, out
    _assert_freed_in_time(timeline, "short", "long", claimed, back)


@pytest.fixture
async def skewed_replicas(cluster: EtcdCluster) -> AsyncIterator[tuple[str, str]]:  # noqa: F811
    """Two coordinators on the cluster: (one 5 minutes fast, one 5 minutes slow)."""
    fast_port, slow_port = free_ports(2)

    def flags(port: int) -> list[str]:
        return [
            f"--listen=127.0.0.1:{port}",
            f"--etcd-endpoints={','.join(cluster.endpoints)}",
            "--etcd-prefix=restarts/",
            "--min-ttl=2",
            "--metrics-listen=",
            "--log-level=warning",
        ]

    with (
        serve_process(*flags(fast_port), env=skewed_clock_env("+5m")),
        serve_process(*flags(slow_port), env=skewed_clock_env("-5m")),
    ):
        yield f"127.0.0.1:{fast_port}", f"127.0.0.1:{slow_port}"


async def test_a_cluster_stopped_as_a_whole_while_coordinators_5_minutes_off_stay_up_frees_on_time(
    cluster: EtcdCluster,  # noqa: F811
    skewed_replicas: tuple[str, str],
) -> None:
    fast, slow = skewed_replicas
    subjects = {}
    claimed = time.monotonic()
    for name, target in (("fast", fast), ("slow", slow)):
        async with grpc.aio.insecure_channel(target) as channel:
            agent = Actor(channel, f"agent-{name}")
            for kind, ttl in (("short", SHORT_TTL_S), ("long", LONG_TTL_S)):
                subject = message("mb", f"{kind}-via-{name}")
                assert (await agent.claim(subject, ttl=ttl)).result == pb.ClaimReplyResponse.GRANTED
                subjects[subject.id] = subject
    await asyncio.to_thread(cluster.stop)
    await asyncio.sleep(max(claimed + DOWN_UNTIL_S - time.monotonic(), 0))
    await asyncio.to_thread(cluster.start)
    back = time.monotonic()
    timeline = Timeline()
    # Seen through the slow replica: a wall clock compared across replicas would disagree by 10 minutes.
    await _follow(slow, list(subjects.values()), timeline, claimed + LONG_TTL_S + FREED_WITHIN_S + 1)
    for name in ("fast", "slow"):
        _assert_freed_in_time(timeline, f"short-via-{name}", f"long-via-{name}", claimed, back)
