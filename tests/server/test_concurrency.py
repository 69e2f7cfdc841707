"""Many concurrent clients on one subject, and fencing of a holder that outlived its TTL."""

from __future__ import annotations

import asyncio
import collections

import grpc

from inbox_wire.v1 import coordinator_pb2 as pb
from tests.conftest import StartCoordinator
from tests.helpers import Actor, eventually, message, new_request_id, rpc_error

GRANTED = pb.ClaimReplyResponse.GRANTED
HELD = pb.ClaimReplyResponse.HELD
OK = pb.FENCE_RESULT_OK
STALE = pb.FENCE_RESULT_STALE_TOKEN


async def test_200_concurrent_claims_give_exactly_one_grant(channel: grpc.aio.Channel, mailbox: str) -> None:
    subject = message(mailbox, "hot")
    actors = [Actor(channel, f"agent-{i}") for i in range(200)]
    responses = await asyncio.gather(*(actor.claim(subject) for actor in actors))
    results = collections.Counter(r.result for r in responses)
    assert results == {GRANTED: 1, HELD: 199}
    winner = next(r for r in responses if r.result == GRANTED)
    # Every HELD answer names the one winner and its token, read in the same transaction.
    assert {(r.status.holder, r.status.fencing_token) for r in responses} == {
        (winner.status.holder, winner.status.fencing_token)
    }


async def test_concurrent_claims_across_two_coordinators(start_coordinator: StartCoordinator, mailbox: str) -> None:
    first, second = await start_coordinator(), await start_coordinator()
    async with (
        grpc.aio.insecure_channel(first.address) as one,
        grpc.aio.insecure_channel(second.address) as two,
    ):
        subjects = [message(mailbox, f"m-{n}") for n in range(20)]
        actors = [Actor(one if i % 2 else two, f"agent-{i}") for i in range(20)]
        responses = await asyncio.gather(*(a.claim(s) for s in subjects for a in actors))
        grants = collections.Counter(r.status.subject.id for r in responses if r.result == GRANTED)
        assert grants == {s.id: 1 for s in subjects}


async def test_concurrent_begin_send_commits_once(channel: grpc.aio.Channel, mailbox: str) -> None:
    """The holder's own duplicated workers race to the commit point: one SENDING, the rest see it done."""
    subject = message(mailbox, "race")
    holder = Actor(channel, "agent-a")
    token = (await holder.claim(subject)).status.fencing_token
    responses = await asyncio.gather(*(holder.begin(subject, token) for _ in range(50)))
    assert {r.result for r in responses} == {OK}
    revisions = {r.status.revision for r in responses}
    assert len(revisions) == 1, "one BeginSend committed; the retries changed nothing"


async def test_paused_holder_is_fenced_off_after_its_ttl(channel: grpc.aio.Channel, mailbox: str) -> None:
    """A holder stalls (GC pause, slow LLM) past its TTL; another claims; the first one's commit is refused."""
    subject = message(mailbox, "paused")
    slow, fast = Actor(channel, "slow-agent"), Actor(channel, "fast-agent")
    slow_token = (await slow.claim(subject, ttl=2)).status.fencing_token

    async def claimed_by_fast() -> pb.ClaimReplyResponse | None:
        response = await fast.claim(subject, ttl=30)
        return response if response.result == GRANTED else None

    second = await eventually(claimed_by_fast, within=10)
    assert second.status.fencing_token > slow_token
    # The slow holder wakes up and tries to commit: refused, and told who holds it now.
    refused = await slow.begin(subject, slow_token)
    assert refused.result == STALE
    assert refused.status.holder == "fast-agent"
    assert refused.status.fencing_token == second.status.fencing_token
    assert (await fast.begin(subject, second.status.fencing_token)).result == OK
    # Still refused once the other send is under way, and after it completed.
    assert (await slow.begin(subject, slow_token)).result == STALE
    await fast.confirm(subject, second.status.fencing_token)
    assert (await slow.begin(subject, slow_token)).result == STALE
    assert (await slow.confirm(subject, slow_token)).result == STALE


async def test_stale_token_never_renews_or_releases(channel: grpc.aio.Channel, mailbox: str) -> None:
    subject = message(mailbox, "m")
    a, b = Actor(channel, "agent-a"), Actor(channel, "agent-b")
    old = (await a.claim(subject)).status.fencing_token
    assert (await a.release(subject, old)).result == OK
    new = (await b.claim(subject)).status
    renewed = await a.renew(subject, old)
    assert renewed.result == STALE
    assert renewed.status.holder == "agent-b"
    assert (await a.release(subject, old)).result == STALE
    # b's claim is untouched by the refused calls.
    assert await b.status(subject) == new


async def test_token_of_another_principal_is_permission_denied(channel: grpc.aio.Channel, mailbox: str) -> None:
    subject = message(mailbox, "m")
    a, b = Actor(channel, "agent-a"), Actor(channel, "agent-b")
    token = (await a.claim(subject)).status.fencing_token
    for call in (b.renew(subject, token), b.release(subject, token), b.begin(subject, token)):
        error = await rpc_error(call)
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "holder" in (error.details() or "")
    assert (await a.status(subject)).fencing_token == token


async def test_retried_claim_returns_the_same_grant(channel: grpc.aio.Channel, mailbox: str) -> None:
    subject = message(mailbox, "m")
    a, b = Actor(channel, "agent-a"), Actor(channel, "agent-b")
    request_id = new_request_id()
    first = await a.claim(subject, request_id=request_id)
    retries = await asyncio.gather(*(a.claim(subject, request_id=request_id) for _ in range(10)))
    assert {(r.result, r.status.fencing_token) for r in retries} == {(GRANTED, first.status.fencing_token)}
    # The same request id from someone else is not a retry of a's request.
    assert (await b.claim(subject, request_id=request_id)).result == HELD
    # A new request id from the holder itself is a new request: it is HELD (by itself).
    assert (await a.claim(subject)).result == HELD


async def test_retried_release_is_ok_and_other_transitions_are_idempotent(
    channel: grpc.aio.Channel, mailbox: str
) -> None:
    subject = message(mailbox, "m")
    a = Actor(channel, "agent-a")
    token = (await a.claim(subject)).status.fencing_token
    request_id = new_request_id()
    assert (await a.release(subject, token, request_id=request_id)).result == OK
    assert (await a.release(subject, token, request_id=request_id)).result == OK
    # A new request with the same old token is not a retry: the token is stale.
    assert (await a.release(subject, token)).result == STALE
    token = (await a.claim(subject)).status.fencing_token
    await a.begin(subject, token)
    abort_id = new_request_id()
    assert (await a.abort(subject, token, request_id=abort_id)).result == OK
    assert (await a.abort(subject, token, request_id=abort_id)).result == OK


async def test_a_reply_by_hand_racing_a_takeover_ends_one_way_per_message(
    channel: grpc.aio.Channel, mailbox: str
) -> None:
    """An agent's holder marking replied while a person takes the message over: for each of many messages
    exactly one wins, and the final state says which."""
    agent = Actor(channel, "agent-a")
    human = Actor(channel, "ana", kind="human")
    subjects = [message(mailbox, f"race-{n}") for n in range(40)]
    tokens = [(await agent.claim(subject)).status.fencing_token for subject in subjects]

    async def race(subject: pb.Subject, token: int) -> tuple[int, int, pb.SubjectStatus]:
        marked, taken = await asyncio.gather(agent.mark_replied(subject, token), human.takeover(subject))
        return marked.result, taken.result, await agent.status(subject)

    outcomes = await asyncio.gather(*(race(s, t) for s, t in zip(subjects, tokens, strict=True)))
    for marked, taken, final in outcomes:
        if marked == pb.FENCE_RESULT_OK:
            assert taken == pb.TakeoverResponse.ALREADY_REPLIED
            assert (final.state, final.replied_by_hand, final.holder) == (pb.SUBJECT_STATE_REPLIED, True, "agent-a")
        else:
            assert marked == pb.FENCE_RESULT_STALE_TOKEN
            assert taken == pb.TakeoverResponse.TAKEN_OVER
            assert (final.state, final.holder) == (pb.SUBJECT_STATE_CLAIMED, "ana")
