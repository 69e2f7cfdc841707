"""Several coordinator replicas on one etcd: they share nothing but etcd, so a client may use any of them."""

from __future__ import annotations

import asyncio
import collections

import grpc

from coordinator.ops.server import CoordinatorServer
from inbox_wire.v1 import coordinator_pb2 as pb
from tests.conftest import StartCoordinator
from tests.helpers import Actor, message

GRANTED = pb.ClaimReplyResponse.GRANTED
HELD = pb.ClaimReplyResponse.HELD


async def test_one_grant_per_subject_with_clients_spread_over_two_replicas(
    start_coordinator: StartCoordinator, mailbox: str
) -> None:
    replicas = [await start_coordinator(), await start_coordinator()]
    channels = [grpc.aio.insecure_channel(server.address) for server in replicas]
    try:
        agents = [Actor(channels[n % 2], f"agent-{n}") for n in range(16)]
        subjects = [message(mailbox, f"m-{n}") for n in range(25)]
        calls = [(agent, subject) for subject in subjects for agent in agents]
        answers = await asyncio.gather(*(agent.claim(subject, ttl=60) for agent, subject in calls))
    finally:
        for channel in channels:
            await channel.close()
    winners: dict[str, set[tuple[str, int]]] = collections.defaultdict(set)
    for (agent, subject), answer in zip(calls, answers, strict=True):
        if answer.result == GRANTED:
            winners[subject.id].add((agent.name, answer.status.fencing_token))
    assert {subject.id for subject in subjects} == set(winners)
    assert all(len(grants) == 1 for grants in winners.values()), winners
    for (agent, subject), answer in zip(calls, answers, strict=True):
        if answer.result != GRANTED:
            assert answer.result == HELD
            (holder, token), *_ = winners[subject.id]
            assert (answer.status.holder, answer.status.fencing_token) == (holder, token)
            assert agent.name != holder


async def test_fencing_holds_across_replicas(start_coordinator: StartCoordinator, mailbox: str) -> None:
    a, b = await start_coordinator(), await start_coordinator()
    async with grpc.aio.insecure_channel(a.address) as via_a, grpc.aio.insecure_channel(b.address) as via_b:
        # A human takes over through B what an agent holds through A: the agent's token is stale on A at once.
        subject = message(mailbox, "taken")
        agent_token = (await Actor(via_a, "agent-a").claim(subject, ttl=60)).status.fencing_token
        taken = await Actor(via_b, "ana", kind="human").takeover(subject, ttl=60)
        assert taken.result == pb.TakeoverResponse.TAKEN_OVER
        assert taken.status.fencing_token > agent_token
        assert (await Actor(via_a, "agent-a").begin(subject, agent_token)).result == pb.FENCE_RESULT_STALE_TOKEN
        assert (await Actor(via_a, "ana", kind="human").begin(subject, taken.status.fencing_token)).result == (
            pb.FENCE_RESULT_OK
        )

        # A claim made through A expires; another agent claims through B; the first holder is fenced on both.
        subject = message(mailbox, "expired")
        first = (await Actor(via_a, "agent-a").claim(subject, ttl=2)).status.fencing_token
        second = None
        async with asyncio.timeout(10):
            while second is None:
                answer = await Actor(via_b, "agent-b").claim(subject, ttl=60)
                second = answer.status.fencing_token if answer.result == GRANTED else None
                await asyncio.sleep(0.1)
        assert second > first
        for channel in (via_a, via_b):
            late = Actor(channel, "agent-a")
            assert (await late.renew(subject, first)).result == pb.FENCE_RESULT_STALE_TOKEN
            assert (await late.begin(subject, first)).result == pb.FENCE_RESULT_STALE_TOKEN
        assert (await Actor(via_a, "agent-b").begin(subject, second)).result == pb.FENCE_RESULT_OK


async def test_a_watch_on_one_replica_sees_what_is_done_through_the_other(
    start_coordinator: StartCoordinator, mailbox: str
) -> None:
    a, b = await start_coordinator(), await start_coordinator()
    async with grpc.aio.insecure_channel(a.address) as via_a, grpc.aio.insecure_channel(b.address) as via_b:
        stream = Actor(via_a, "ana", kind="human").watch(mailbox)
        assert (await anext(stream)).HasField("snapshot")
        agent = Actor(via_b, "agent-b")
        subject = message(mailbox, "m-1")
        token = (await agent.claim(subject)).status.fencing_token
        await agent.begin(subject, token)
        await agent.confirm(subject, token, "sent-1")
        other = message(mailbox, "m-2")
        other_token = (await agent.claim(other)).status.fencing_token
        await agent.release(other, other_token)
        seen: list[tuple[int, str, str]] = []
        async with asyncio.timeout(10):
            while len(seen) < 5:
                event = (await anext(stream)).event
                seen.append((event.type, event.status.subject.id, event.status.holder or event.previous_holder))
        assert seen == [
            (pb.EVENT_TYPE_CLAIMED, "m-1", "agent-b"),
            (pb.EVENT_TYPE_SENDING, "m-1", "agent-b"),
            (pb.EVENT_TYPE_REPLIED, "m-1", "agent-b"),
            (pb.EVENT_TYPE_CLAIMED, "m-2", "agent-b"),
            (pb.EVENT_TYPE_RELEASED, "m-2", "agent-b"),
        ]


def _etcd_txns(server: CoordinatorServer) -> float:
    return server.metrics.value("inbox_coordinator_etcd_request_duration_seconds_count", {"method": "Txn"}) or 0.0


async def test_the_send_sequence_costs_three_etcd_requests_and_a_stale_memory_costs_one_more(
    start_coordinator: StartCoordinator, mailbox: str
) -> None:
    # Unbatched, so that every transaction is one etcd request and can be counted.
    a = await start_coordinator(etcd_options={"max_batch": 1}, sweep_interval_s=3600)
    b = await start_coordinator(etcd_options={"max_batch": 1}, sweep_interval_s=3600)
    async with grpc.aio.insecure_channel(a.address) as via_a, grpc.aio.insecure_channel(b.address) as via_b:
        agent = Actor(via_a, "agent-a")
        subject = message(mailbox, "m-1")
        before = _etcd_txns(a)
        token = (await agent.claim(subject, ttl=60)).status.fencing_token
        assert (await agent.begin(subject, token)).result == pb.FENCE_RESULT_OK
        confirmed = await agent.confirm(subject, token, "sent-1")
        assert confirmed.status.state == pb.SUBJECT_STATE_REPLIED
        assert _etcd_txns(a) - before == 3  # create, then two compare-and-writes on the revision A wrote

        # B renews the claim A made: A's memory of the subject is now stale. A's BeginSend tries it, the
        # compare on the revision fails, A reads and decides again: one request more, the right answer.
        other = message(mailbox, "m-2")
        token = (await agent.claim(other, ttl=60)).status.fencing_token
        renewed = await Actor(via_b, "agent-a").renew(other, token, ttl=600)
        before = _etcd_txns(a)
        began = await agent.begin(other, token)
        assert began.result == pb.FENCE_RESULT_OK
        assert began.status.state == pb.SUBJECT_STATE_SENDING
        assert renewed.status.ttl_seconds == 600
        assert began.status.ttl_seconds == 600  # decided on B's renewed record, not on A's memory of the claim
        assert _etcd_txns(a) - before == 3  # the failed compare, the read, the write

        # A refusal is never answered from memory: B released it, so A's memory says CLAIMED but etcd says FREE.
        third = message(mailbox, "m-3")
        token = (await agent.claim(third, ttl=60)).status.fencing_token
        assert (await Actor(via_b, "agent-a").release(third, token)).result == pb.FENCE_RESULT_OK
        assert (await agent.begin(third, token)).result == pb.FENCE_RESULT_STALE_TOKEN
        assert (await agent.status(third)).state == pb.SUBJECT_STATE_FREE
