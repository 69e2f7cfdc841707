"""The coordinator against an etcd that stops, crashes and comes back, and coordinators that die."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.store.etcd.process import EtcdServer
from inbox_wire.v1 import coordinator_pb2 as pb
from tests.conftest import StartCoordinator
from tests.helpers import Actor, eventually, message, rpc_error

GRANTED = pb.ClaimReplyResponse.GRANTED
OK = pb.FENCE_RESULT_OK


async def _health(channel: grpc.aio.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    response = await stub.Check(health_pb2.HealthCheckRequest(service=""))
    return int(response.status)


async def test_etcd_stopped_and_started_again(
    start_coordinator: StartCoordinator, private_etcd: EtcdServer, mailbox: str
) -> None:
    server = await start_coordinator(endpoint=private_etcd.endpoint)
    async with grpc.aio.insecure_channel(server.address) as channel:
        agent = Actor(channel, "agent-a")
        held = message(mailbox, "held")
        token = (await agent.claim(held, ttl=120)).status.fencing_token
        replied = message(mailbox, "replied")
        replied_token = (await agent.claim(replied)).status.fencing_token
        await agent.begin(replied, replied_token)
        await agent.confirm(replied, replied_token, sent_message_id="s-1")

        private_etcd.stop()
        error = await rpc_error(agent.claim(message(mailbox, "during")))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "retry" in (error.details() or "")

        async def not_serving() -> bool:
            return bool(await _health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING)

        await eventually(not_serving, within=10)

        private_etcd.start()

        async def serving() -> bool:
            return bool(await _health(channel) == health_pb2.HealthCheckResponse.SERVING)

        await eventually(serving, within=20)
        # The claim and its token survived; so did the reply record.
        assert (await agent.renew(held, token)).result == OK
        assert (await agent.status(replied)).state == pb.SUBJECT_STATE_REPLIED

        async def claims_again() -> bool:
            try:
                return (await agent.claim(message(mailbox, "after"))).result == GRANTED
            except grpc.aio.AioRpcError:
                return False

        await eventually(claims_again, within=20)


async def test_acknowledged_reply_survives_an_etcd_crash(
    start_coordinator: StartCoordinator, private_etcd: EtcdServer, mailbox: str
) -> None:
    server = await start_coordinator(endpoint=private_etcd.endpoint)
    async with grpc.aio.insecure_channel(server.address) as channel:
        agent = Actor(channel, "agent-a")
        subjects = [message(mailbox, f"m-{n}") for n in range(20)]
        for subject in subjects:
            token = (await agent.claim(subject)).status.fencing_token
            await agent.begin(subject, token)
            assert (await agent.confirm(subject, token)).result == OK
        private_etcd.kill()  # SIGKILL: no chance to flush anything it had not already made durable
        private_etcd.start()

        async def all_replied() -> bool:
            try:
                states = [(await agent.status(s)).state for s in subjects]
            except grpc.aio.AioRpcError:
                return False
            return states == [pb.SUBJECT_STATE_REPLIED] * len(subjects)

        await eventually(all_replied, within=20)
        for subject in subjects:
            assert (await agent.claim(subject)).result == pb.ClaimReplyResponse.ALREADY_REPLIED


async def test_watch_resumes_across_an_etcd_restart(
    start_coordinator: StartCoordinator, private_etcd: EtcdServer, mailbox: str
) -> None:
    server = await start_coordinator(endpoint=private_etcd.endpoint)
    async with grpc.aio.insecure_channel(server.address) as channel:
        agent = Actor(channel, "agent-a")
        stream = Actor(channel, "ana", kind="human").watch(mailbox)
        await anext(stream)
        private_etcd.stop()
        await asyncio.sleep(0.5)
        private_etcd.start()

        async def claimed() -> bool:
            try:
                return (await agent.claim(message(mailbox, "after-restart"))).result == GRANTED
            except grpc.aio.AioRpcError:
                return False

        await eventually(claimed, within=20)
        async with asyncio.timeout(15):
            response = await anext(stream)
        assert response.event.type == pb.EVENT_TYPE_CLAIMED
        assert response.event.status.subject.id == "after-restart"


async def test_a_dead_coordinator_loses_nothing(start_coordinator: StartCoordinator, mailbox: str) -> None:
    """Coordinators are stateless: a claim made through one is honoured by the next."""
    first = await start_coordinator()
    subject = message(mailbox, "m")
    async with grpc.aio.insecure_channel(first.address) as channel:
        token = (await Actor(channel, "agent-a").claim(subject)).status.fencing_token
    await first.stop(grace=0)
    second = await start_coordinator()
    async with grpc.aio.insecure_channel(second.address) as channel:
        agent, other = Actor(channel, "agent-a"), Actor(channel, "agent-b")
        assert (await other.claim(subject)).result == pb.ClaimReplyResponse.HELD
        assert (await agent.begin(subject, token)).result == OK
