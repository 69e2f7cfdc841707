"""Watch: a snapshot, then every transition of the mailbox in commit order."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from inbox_wire.v1 import coordinator_pb2 as pb
from tests.conftest import StartCoordinator
from tests.helpers import Actor, message, rpc_error

E = pb.EventType


async def _next_events(stream: AsyncIterator[pb.WatchResponse], count: int) -> list[pb.WatchEvent]:
    events: list[pb.WatchEvent] = []
    async with asyncio.timeout(15):
        while len(events) < count:
            response = await anext(stream)
            assert response.WhichOneof("kind") == "event"
            events.append(response.event)
    return events


async def test_watch_sends_a_snapshot_then_every_transition_in_order(
    start_coordinator: StartCoordinator, mailbox: str
) -> None:
    server = await start_coordinator(send_timeout_ms=400)
    async with grpc.aio.insecure_channel(server.address) as channel:
        agent, human = Actor(channel, "agent-a"), Actor(channel, "ana", kind="human")
        existing = message(mailbox, "existing")
        await agent.claim(existing, note="before the watch")

        stream = human.watch(mailbox)
        first = await anext(stream)
        assert first.WhichOneof("kind") == "snapshot"
        assert [s.subject.id for s in first.snapshot.subjects] == ["existing"]
        assert first.snapshot.subjects[0].note == "before the watch"

        replied, released, expired = message(mailbox, "replied"), message(mailbox, "released"), message(mailbox, "ttl")
        taken, aborted, doubt = message(mailbox, "taken"), message(mailbox, "aborted"), message(mailbox, "doubt")
        t = (await agent.claim(replied)).status.fencing_token
        await agent.renew(replied, t, ttl=90)
        await agent.begin(replied, t)
        await agent.confirm(replied, t, sent_message_id="s-1")
        t = (await agent.claim(released)).status.fencing_token
        await agent.release(released, t)
        t = (await agent.claim(taken)).status.fencing_token
        await human.takeover(taken)
        t = (await agent.claim(aborted)).status.fencing_token
        await agent.begin(aborted, t)
        await agent.abort(aborted, t, reason="mail API said 400")
        expired_token = (await agent.claim(expired, ttl=2)).status.fencing_token
        t = (await agent.claim(doubt)).status.fencing_token
        await agent.begin(doubt, t)

        events = await _next_events(stream, 17)
        seen = [(e.status.subject.id, e.type) for e in events]
        expected_by_subject = {
            "replied": [E.EVENT_TYPE_CLAIMED, E.EVENT_TYPE_RENEWED, E.EVENT_TYPE_SENDING, E.EVENT_TYPE_REPLIED],
            "released": [E.EVENT_TYPE_CLAIMED, E.EVENT_TYPE_RELEASED],
            "taken": [E.EVENT_TYPE_CLAIMED, E.EVENT_TYPE_TAKEN_OVER, E.EVENT_TYPE_CLAIMED],
            "aborted": [E.EVENT_TYPE_CLAIMED, E.EVENT_TYPE_SENDING, E.EVENT_TYPE_ABORTED],
            "ttl": [E.EVENT_TYPE_CLAIMED, E.EVENT_TYPE_EXPIRED],
            "doubt": [E.EVENT_TYPE_CLAIMED, E.EVENT_TYPE_SENDING, E.EVENT_TYPE_IN_DOUBT],
        }
        for subject_id, types in expected_by_subject.items():
            assert [t for s, t in seen if s == subject_id] == types, subject_id
        # The calls above ran one after another, so their events arrive in exactly that order, by revision.
        revisions = [e.revision for e in events]
        assert revisions == sorted(revisions)
        assert len(set(revisions)) == len(revisions)
        by_type = {(e.status.subject.id, e.type): e for e in events}
        assert by_type[("taken", E.EVENT_TYPE_TAKEN_OVER)].previous_holder == "agent-a"
        assert "ana" in by_type[("taken", E.EVENT_TYPE_TAKEN_OVER)].reason
        assert by_type[("aborted", E.EVENT_TYPE_ABORTED)].reason == "mail API said 400"
        assert by_type[("ttl", E.EVENT_TYPE_EXPIRED)].previous_token == expired_token
        assert by_type[("ttl", E.EVENT_TYPE_EXPIRED)].status.state == pb.SUBJECT_STATE_FREE
        assert by_type[("replied", E.EVENT_TYPE_REPLIED)].status.sent_message_id == "s-1"
        assert by_type[("doubt", E.EVENT_TYPE_IN_DOUBT)].status.state == pb.SUBJECT_STATE_IN_DOUBT


async def test_many_watchers_share_one_etcd_watch(start_coordinator: StartCoordinator, mailbox: str) -> None:
    server = await start_coordinator()
    async with grpc.aio.insecure_channel(server.address) as channel:
        agent = Actor(channel, "agent-a")
        watchers = [Actor(channel, f"human-{i}", kind="human").watch(mailbox) for i in range(50)]
        for stream in watchers:
            assert (await anext(stream)).WhichOneof("kind") == "snapshot"
        other = Actor(channel, "x").watch(mailbox + "-other")
        await anext(other)
        assert server.store.statistics().watched_mailboxes == 2
        assert server.store.statistics().watch_subscribers == 51
        await agent.claim(message(mailbox, "m"))
        events = await asyncio.gather(*(_next_events(s, 1) for s in watchers))
        assert {e[0].type for e in events} == {E.EVENT_TYPE_CLAIMED}
        assert len({e[0].revision for e in events}) == 1


async def test_watch_of_a_mailbox_sees_nothing_of_another(agent: Actor, mailbox: str) -> None:
    stream = agent.watch(mailbox)
    await anext(stream)
    await agent.claim(message(mailbox + "x", "m"))  # a mailbox whose name extends this one's
    await agent.claim(message(mailbox, "mine"))
    (event,) = await _next_events(stream, 1)
    assert event.status.subject.id == "mine"
    assert event.status.subject.mailbox == mailbox


async def test_watch_ends_with_unavailable_when_the_coordinator_stops(
    start_coordinator: StartCoordinator, mailbox: str
) -> None:
    server = await start_coordinator()
    async with grpc.aio.insecure_channel(server.address) as channel:
        stream = Actor(channel, "ana", kind="human").watch(mailbox)
        await anext(stream)
        await server.stop(grace=0.5)
        async with asyncio.timeout(10):
            error = await rpc_error(anext(stream))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
