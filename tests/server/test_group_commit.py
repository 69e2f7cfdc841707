"""Group commit: claims that arrive together share one etcd request, with exactly the outcomes they would
have had one transaction each."""

from __future__ import annotations

import asyncio
import collections
import uuid

import grpc

from coordinator.ops.server import CoordinatorServer
from inbox_wire.v1 import coordinator_pb2 as pb
from tests.conftest import StartCoordinator
from tests.helpers import Actor, etcd_store_of, message

UNBATCHED = {"max_batch": 1}
BATCHED = {"max_batch": 64, "max_batches_in_flight": 1}


async def _sequential_script(server: CoordinatorServer, mailbox: str) -> list[tuple[str, ...]]:
    """Every kind of call, one after another: outcomes are fully determined."""
    async with grpc.aio.insecure_channel(server.address) as channel:
        a, b, h = Actor(channel, "a"), Actor(channel, "b"), Actor(channel, "h", kind="human")
        s1, s2, s3 = message(mailbox, "1"), message(mailbox, "2"), message(mailbox, "3")
        out: list[tuple[str, ...]] = []

        def note(name: str, result: int, status: pb.SubjectStatus) -> None:
            out.append((name, str(result), str(status.state), status.holder, status.note))

        r = await a.claim(s1, notification_id="n1", note="x")
        note("claim", r.result, r.status)
        token = r.status.fencing_token
        r = await b.claim(s1, notification_id="n1")
        note("dup", r.result, r.status)
        r = await b.claim(s1, notification_id="n2")
        note("held", r.result, r.status)
        r2 = await a.renew(s1, token, ttl=30)
        note("renew", r2.result, r2.status)
        r3 = await a.begin(s1, token)
        note("begin", r3.result, r3.status)
        r4 = await a.confirm(s1, token, sent_message_id="sent")
        note("confirm", r4.result, r4.status)
        r = await b.claim(s1)
        note("replied", r.result, r.status)
        t2 = (await a.claim(s2)).status.fencing_token
        t = await h.takeover(s2)
        note("takeover", t.result, t.status)
        r5 = await a.begin(s2, t2)
        note("fenced", r5.result, r5.status)
        t3 = (await b.claim(s3)).status.fencing_token
        r6 = await b.release(s3, t3)
        note("release", r6.result, r6.status)
        r6 = await b.release(s3, t3)
        note("stale release", r6.result, r6.status)
        d = await a.record_delivery(mailbox, "n3")
        out.append(("delivery", str(d.result)))
        d = await b.record_delivery(mailbox, "n3")
        out.append(("delivery dup", str(d.result), d.first.recorded_by))
        return out


async def _concurrent_script(server: CoordinatorServer, mailbox: str) -> dict[str, collections.Counter[int]]:
    """40 subjects, each claimed by 8 workers at once; for half of them all 8 carry one notification id."""
    async with grpc.aio.insecure_channel(server.address) as channel:
        workers = [Actor(channel, f"w{i}") for i in range(8)]

        async def one(subject_index: int, worker: int) -> tuple[str, int]:
            subject = message(mailbox, f"s{subject_index}")
            notification = f"n{subject_index}" if subject_index % 2 else ""
            response = await workers[worker].claim(subject, notification_id=notification)
            return subject.id.replace(mailbox, ""), response.result

        results = await asyncio.gather(*(one(s, w) for s in range(40) for w in range(8)))
        by_subject: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
        for subject_id, result in results:
            by_subject[subject_id][result] += 1
        return dict(by_subject)


async def test_batched_and_unbatched_claims_give_identical_outcomes(start_coordinator: StartCoordinator) -> None:
    unbatched = await start_coordinator(etcd_options=UNBATCHED)
    batched = await start_coordinator(etcd_options=BATCHED)
    name = f"mb-{uuid.uuid4().hex[:6]}"
    assert await _sequential_script(unbatched, name + "-u") == await _sequential_script(batched, name + "-b")

    plain = await _concurrent_script(unbatched, name + "-cu")
    grouped = await _concurrent_script(batched, name + "-cb")
    for counts in (*plain.values(), *grouped.values()):
        assert counts[pb.ClaimReplyResponse.GRANTED] == 1
    # Order decides which worker wins, so compare what every subject saw, not who won.
    assert plain == grouped
    assert plain["s1"] == {pb.ClaimReplyResponse.GRANTED: 1, pb.ClaimReplyResponse.DUPLICATE_DELIVERY: 7}
    assert plain["s2"] == {pb.ClaimReplyResponse.GRANTED: 1, pb.ClaimReplyResponse.HELD: 7}
    requests, transactions = etcd_store_of(batched).batch_stats
    assert transactions > requests, "concurrent claims were not grouped"
    assert etcd_store_of(unbatched).batch_stats == (0, 0)


async def test_one_subject_never_twice_in_a_batch(start_coordinator: StartCoordinator, mailbox: str) -> None:
    """etcd refuses a request that writes one key twice; the batcher must keep such claims apart."""
    server = await start_coordinator(etcd_options=BATCHED)
    async with grpc.aio.insecure_channel(server.address) as channel:
        subject = message(mailbox, "hot")
        others = [message(mailbox, f"cold-{n}") for n in range(30)]
        calls = [Actor(channel, f"w{i}").claim(subject) for i in range(60)]
        calls += [Actor(channel, "x").claim(s) for s in others]
        responses = await asyncio.gather(*calls)
    results = collections.Counter(r.result for r in responses[:60])
    assert results == {pb.ClaimReplyResponse.GRANTED: 1, pb.ClaimReplyResponse.HELD: 59}
    assert all(r.result == pb.ClaimReplyResponse.GRANTED for r in responses[60:])
    requests, transactions = etcd_store_of(server).batch_stats
    assert transactions >= 90
    assert requests < transactions


async def test_claims_in_one_batch_share_a_revision_and_stay_fenced(
    start_coordinator: StartCoordinator, mailbox: str
) -> None:
    server = await start_coordinator(etcd_options=BATCHED)
    async with grpc.aio.insecure_channel(server.address) as channel:
        agent = Actor(channel, "a")
        subjects = [message(mailbox, f"m{n}") for n in range(40)]
        granted = await asyncio.gather(*(agent.claim(s) for s in subjects))
        tokens = [g.status.fencing_token for g in granted]
        assert len(set(tokens)) < len(tokens), "some claims committed together, at one revision"
        # Each token still fences only its own subject: release one, claim again, the old token is stale.
        await agent.release(subjects[0], tokens[0])
        again = await Actor(channel, "b").claim(subjects[0])
        assert again.status.fencing_token > max(tokens)
        assert (await agent.begin(subjects[0], tokens[0])).result == pb.FENCE_RESULT_STALE_TOKEN
        assert (await agent.begin(subjects[1], tokens[1])).result == pb.FENCE_RESULT_OK
