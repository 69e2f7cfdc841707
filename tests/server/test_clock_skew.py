"""Clock skew between coordinator replicas: one 5 minutes fast, one 5 minutes slow (libfaketime on real
processes). No decision may depend on a replica's wall clock (docs/design.md#invariants, invariant 7): no
early IN_DOUBT, no early free, and the send path works through either replica."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from chaos.common import skewed_clock_env
from coordinator.store.etcd.process import EtcdServer, free_ports
from inbox_wire.v1 import coordinator_pb2 as pb
from tests.helpers import Actor, message, serve_process

SEND_TIMEOUT_S = 6.0
CLAIM_TTL_S = 4
# What may come on top of a lease's TTL: the 1 s expiry bucket, etcd's lease checking, the 0.5 s sweep.
LATE_BY_S = 4.0
SKEW = "5m"


@pytest.fixture
async def replicas(etcd: EtcdServer, prefix: str) -> AsyncIterator[tuple[grpc.aio.Channel, grpc.aio.Channel]]:
    """(the fast replica's channel, the slow replica's channel)."""
    fast_port, slow_port = free_ports(2)

    def flags(port: int) -> list[str]:
        return [
            f"--listen=127.0.0.1:{port}",
            f"--etcd-endpoints={etcd.endpoint}",
            f"--etcd-prefix={prefix}",
            f"--send-timeout={SEND_TIMEOUT_S}s",
            "--min-ttl=2",
            "--metrics-listen=",
            "--log-level=warning",
        ]

    with (
        serve_process(*flags(fast_port), env=skewed_clock_env(f"+{SKEW}")),
        serve_process(*flags(slow_port), env=skewed_clock_env(f"-{SKEW}")),
    ):
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{fast_port}") as fast,
            grpc.aio.insecure_channel(f"127.0.0.1:{slow_port}") as slow,
        ):
            yield fast, slow


async def _states_over_time(actors: list[Actor], subjects: list[pb.Subject], until: float) -> dict[str, set[int]]:
    """Every state any replica reports for each subject until the monotonic time ``until``."""
    seen: dict[str, set[int]] = {subject.id: set() for subject in subjects}
    while time.monotonic() < until:
        for actor in actors:
            for subject in subjects:
                seen[subject.id].add((await actor.status(subject)).state)
        await asyncio.sleep(0.2)
    return seen


async def _wait_for_state(actor: Actor, subject: pb.Subject, state: int, within: float) -> float:
    """Seconds until ``actor`` reports ``state``."""
    started = time.monotonic()
    while (await actor.status(subject)).state != state:
        assert time.monotonic() - started < within, f"{subject.id} not in state {state} within {within} s"
        await asyncio.sleep(0.1)
    return time.monotonic() - started


async def test_no_early_in_doubt_whichever_replica_began_the_send(
    replicas: tuple[grpc.aio.Channel, grpc.aio.Channel], mailbox: str
) -> None:
    fast, slow = replicas
    via_fast, via_slow = Actor(fast, "agent-a"), Actor(slow, "agent-a")
    began_on_slow, began_on_fast = message(mailbox, "begun-on-slow"), message(mailbox, "begun-on-fast")
    for actor, subject in ((via_slow, began_on_slow), (via_fast, began_on_fast)):
        token = (await actor.claim(subject, ttl=60)).status.fencing_token
        assert (await actor.begin(subject, token)).result == pb.FENCE_RESULT_OK
    begun = time.monotonic()
    # Both replicas sweep every second; the fast one, deciding on its clock, would have called the send begun on
    # the slow one overdue at once (its deadline lay 10 minutes in the fast one's past).
    seen = await _states_over_time([via_fast, via_slow], [began_on_slow, began_on_fast], begun + SEND_TIMEOUT_S - 0.5)
    assert seen == {began_on_slow.id: {pb.SUBJECT_STATE_SENDING}, began_on_fast.id: {pb.SUBJECT_STATE_SENDING}}
    for subject in (began_on_slow, began_on_fast):
        await _wait_for_state(via_fast, subject, pb.SUBJECT_STATE_IN_DOUBT, within=LATE_BY_S + 1)
        assert time.monotonic() - begun >= SEND_TIMEOUT_S


async def test_no_early_free_of_a_claim_made_through_either_replica(
    replicas: tuple[grpc.aio.Channel, grpc.aio.Channel], mailbox: str
) -> None:
    fast, slow = replicas
    via_fast, via_slow = Actor(fast, "agent-a"), Actor(slow, "agent-b")
    on_fast, on_slow = message(mailbox, "claimed-on-fast"), message(mailbox, "claimed-on-slow")
    await via_fast.claim(on_fast, ttl=CLAIM_TTL_S)
    await via_slow.claim(on_slow, ttl=CLAIM_TTL_S)
    claimed = time.monotonic()
    for subject in (on_fast, on_slow):
        # Nobody else gets it before it expired.
        for other in (Actor(fast, "agent-c"), Actor(slow, "agent-c")):
            assert (await other.claim(subject, ttl=CLAIM_TTL_S)).result == pb.ClaimReplyResponse.HELD
    seen = await _states_over_time([via_fast, via_slow], [on_fast, on_slow], claimed + CLAIM_TTL_S - 0.5)
    assert seen == {on_fast.id: {pb.SUBJECT_STATE_CLAIMED}, on_slow.id: {pb.SUBJECT_STATE_CLAIMED}}
    for subject in (on_fast, on_slow):
        await _wait_for_state(via_slow, subject, pb.SUBJECT_STATE_FREE, within=LATE_BY_S + 1)
    assert time.monotonic() - claimed >= CLAIM_TTL_S


async def test_the_send_path_through_skewed_replicas(
    replicas: tuple[grpc.aio.Channel, grpc.aio.Channel], mailbox: str
) -> None:
    fast, slow = replicas
    via_fast, via_slow = Actor(fast, "agent-a"), Actor(slow, "agent-a")
    subject = message(mailbox, "sent")
    token = (await via_slow.claim(subject, ttl=60)).status.fencing_token
    assert (await via_fast.renew(subject, token, ttl=60)).result == pb.FENCE_RESULT_OK
    assert (await via_fast.begin(subject, token)).result == pb.FENCE_RESULT_OK
    # A retried BeginSend on the other replica is the same commit point, not a stale token.
    request = "begin-retry"
    assert (await via_slow.begin(subject, token, request_id=request)).result == pb.FENCE_RESULT_OK
    assert (await via_slow.confirm(subject, token, sent_message_id="s-1")).result == pb.FENCE_RESULT_OK
    assert (await via_fast.status(subject)).state == pb.SUBJECT_STATE_REPLIED
    assert (await Actor(fast, "agent-b").claim(subject)).result == pb.ClaimReplyResponse.ALREADY_REPLIED
    # The abort path, begun on the fast replica and aborted on the slow one.
    other = message(mailbox, "aborted")
    token = (await via_fast.claim(other, ttl=60)).status.fencing_token
    assert (await via_fast.begin(other, token)).result == pb.FENCE_RESULT_OK
    assert (await via_slow.abort(other, token, reason="mail API said 400")).result == pb.FENCE_RESULT_OK
    assert (await via_fast.status(other)).state == pb.SUBJECT_STATE_FREE
