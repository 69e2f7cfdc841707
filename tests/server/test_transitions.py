"""Every transition of docs/design.md#states-of-a-subject, through the gRPC API, on a real etcd."""

from __future__ import annotations

import asyncio
import time

import grpc

from coordinator.ops.server import CoordinatorServer
from inbox_wire.v1 import coordinator_pb2 as pb
from tests.conftest import StartCoordinator
from tests.helpers import Actor, eventually, message, rpc_error, thread

GRANTED = pb.ClaimReplyResponse.GRANTED
HELD = pb.ClaimReplyResponse.HELD
ALREADY_REPLIED = pb.ClaimReplyResponse.ALREADY_REPLIED
OK = pb.FENCE_RESULT_OK
STALE = pb.FENCE_RESULT_STALE_TOKEN


async def test_claim_grants_a_token_and_an_expiry(agent: Actor, mailbox: str) -> None:
    subject = message(mailbox, "msg-1")
    before_ms = time.time() * 1000
    response = await agent.claim(subject, ttl=30, note="drafting")
    assert response.result == GRANTED
    status = response.status
    assert status.state == pb.SUBJECT_STATE_CLAIMED
    assert status.holder == "agent-a"
    assert status.holder_kind == pb.HOLDER_KIND_AGENT
    assert status.fencing_token > 0
    assert status.note == "drafting"
    # Expiry is the TTL rounded up to the 1 s lease bucket: never earlier than asked, at most 1 s later.
    expires_ms = status.expires_at.ToMilliseconds()
    assert before_ms + 30_000 <= expires_ms <= time.time() * 1000 + 31_000
    assert await agent.status(subject) == status


async def test_second_claim_is_held_and_names_the_holder(agent: Actor, other_agent: Actor, mailbox: str) -> None:
    subject = message(mailbox, "msg-1")
    granted = await agent.claim(subject)
    held = await other_agent.claim(subject)
    assert held.result == HELD
    assert held.status.holder == "agent-a"
    assert held.status.fencing_token == granted.status.fencing_token
    assert held.status.expires_at == granted.status.expires_at


async def test_renew_keeps_the_token_and_pushes_the_expiry(agent: Actor, mailbox: str) -> None:
    subject = message(mailbox, "msg-1")
    granted = (await agent.claim(subject, ttl=10)).status
    renewed = await agent.renew(subject, granted.fencing_token, ttl=120)
    assert renewed.result == OK
    assert renewed.status.fencing_token == granted.fencing_token
    assert renewed.status.ttl_seconds == 120
    assert renewed.status.expires_at.ToMilliseconds() >= granted.expires_at.ToMilliseconds() + 100_000
    assert renewed.status.revision > granted.revision


async def test_release_frees_and_a_new_claim_gets_a_larger_token(
    agent: Actor, other_agent: Actor, mailbox: str
) -> None:
    subject = message(mailbox, "msg-1")
    first = (await agent.claim(subject)).status.fencing_token
    released = await agent.release(subject, first)
    assert released.result == OK
    assert released.status.state == pb.SUBJECT_STATE_FREE
    assert (await agent.status(subject)).state == pb.SUBJECT_STATE_FREE
    second = await other_agent.claim(subject)
    assert second.result == GRANTED
    assert second.status.fencing_token > first


async def test_ttl_running_out_frees_the_subject_and_stales_the_token(
    agent: Actor, other_agent: Actor, mailbox: str
) -> None:
    subject = message(mailbox, "msg-1")
    granted = (await agent.claim(subject, ttl=2)).status
    started = time.monotonic()

    async def freed() -> bool:
        return (await agent.status(subject)).state == pb.SUBJECT_STATE_FREE

    await eventually(freed, within=10, interval=0.05)
    # Stated bound: TTL + lease bucket (1 s) + etcd's expiry check and revoke (about 1 s).
    assert time.monotonic() - started <= 2 + 1 + 1.5
    assert (await agent.renew(subject, granted.fencing_token)).result == STALE
    assert (await agent.begin(subject, granted.fencing_token)).result == STALE
    assert (await agent.release(subject, granted.fencing_token)).result == STALE
    assert (await other_agent.claim(subject)).result == GRANTED


async def test_send_cycle_ends_replied_and_blocks_later_claims(agent: Actor, other_agent: Actor, mailbox: str) -> None:
    subject = message(mailbox, "msg-1")
    token = (await agent.claim(subject)).status.fencing_token
    begun = await agent.begin(subject, token)
    assert begun.result == OK
    assert begun.status.state == pb.SUBJECT_STATE_SENDING
    assert begun.status.send_deadline.ToMilliseconds() > begun.status.send_started_at.ToMilliseconds()
    # While SENDING, nobody can claim, and the holder cannot renew or release it.
    assert (await other_agent.claim(subject)).result == ALREADY_REPLIED
    error = await rpc_error(agent.renew(subject, token))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "SENDING" in (error.details() or "")
    confirmed = await agent.confirm(subject, token, sent_message_id="nylas-sent-9")
    assert confirmed.result == OK
    status = confirmed.status
    assert status.state == pb.SUBJECT_STATE_REPLIED
    assert status.sent_message_id == "nylas-sent-9"
    assert status.fencing_token == token
    assert status.expires_at.ToMilliseconds() >= status.sent_at.ToMilliseconds() + 72 * 3600 * 1000
    later = await other_agent.claim(subject)
    assert later.result == ALREADY_REPLIED
    assert later.status.holder == "agent-a"
    assert later.status.sent_message_id == "nylas-sent-9"
    # Confirm and BeginSend retried after the fact are answered OK without changing anything.
    assert (await agent.confirm(subject, token, sent_message_id="nylas-sent-9")).result == OK
    assert (await agent.status(subject)).revision == status.revision


async def test_confirm_before_begin_is_a_failed_precondition(agent: Actor, mailbox: str) -> None:
    subject = message(mailbox, "msg-1")
    token = (await agent.claim(subject)).status.fencing_token
    error = await rpc_error(agent.confirm(subject, token))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "BeginSend" in (error.details() or "")


async def test_abort_frees_the_subject(agent: Actor, other_agent: Actor, mailbox: str) -> None:
    subject = message(mailbox, "msg-1")
    token = (await agent.claim(subject)).status.fencing_token
    assert (await agent.begin(subject, token)).result == OK
    aborted = await agent.abort(subject, token, reason="422 from the mail API")
    assert aborted.result == OK
    assert aborted.status.state == pb.SUBJECT_STATE_FREE
    again = await other_agent.claim(subject)
    assert again.result == GRANTED
    assert again.status.fencing_token > token


async def test_reply_record_frees_when_retention_ends(start_coordinator: StartCoordinator, mailbox: str) -> None:
    server = await start_coordinator(reply_retention_ms=2_000, record_bucket_ms=1_000)
    async with grpc.aio.insecure_channel(server.address) as channel:
        agent = Actor(channel, "agent-a")
        subject = message(mailbox, "msg-1")
        token = (await agent.claim(subject)).status.fencing_token
        await agent.begin(subject, token)
        assert (await agent.confirm(subject, token)).status.state == pb.SUBJECT_STATE_REPLIED

        async def freed() -> bool:
            return (await agent.status(subject)).state == pb.SUBJECT_STATE_FREE

        await eventually(freed, within=10)
        assert (await agent.claim(subject)).result == GRANTED


async def test_unconfirmed_send_becomes_in_doubt_and_a_human_resolves_it(
    start_coordinator: StartCoordinator, mailbox: str
) -> None:
    server = await start_coordinator(send_timeout_ms=500)
    async with grpc.aio.insecure_channel(server.address) as channel:
        agent = Actor(channel, "agent-a")
        human = Actor(channel, "ana", kind="human")
        sent, not_sent = message(mailbox, "sent"), message(mailbox, "not-sent")
        tokens = {}
        for subject in (sent, not_sent):
            tokens[subject.id] = (await agent.claim(subject)).status.fencing_token
            await agent.begin(subject, tokens[subject.id])

        async def in_doubt() -> bool:
            states = [(await agent.status(s)).state for s in (sent, not_sent)]
            return states == [pb.SUBJECT_STATE_IN_DOUBT] * 2

        await eventually(in_doubt, within=10)
        # IN_DOUBT is never freed by itself and blocks claims: the reply may have gone out.
        assert (await agent.claim(sent)).result == ALREADY_REPLIED
        resolved = await human.resolve(sent, pb.ResolveInDoubtRequest.OUTCOME_SENT, sent_message_id="found-it")
        assert resolved.status.state == pb.SUBJECT_STATE_REPLIED
        assert resolved.status.sent_message_id == "found-it"
        freed = await human.resolve(not_sent, pb.ResolveInDoubtRequest.OUTCOME_NOT_SENT, note="not in Sent")
        assert freed.status.state == pb.SUBJECT_STATE_FREE
        assert (await agent.claim(not_sent)).result == GRANTED
        # Resolving what is not in doubt is refused.
        error = await rpc_error(human.resolve(sent, pb.ResolveInDoubtRequest.OUTCOME_NOT_SENT))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_late_confirm_of_an_in_doubt_send_still_records_it(
    start_coordinator: StartCoordinator, mailbox: str
) -> None:
    server = await start_coordinator(send_timeout_ms=300)
    async with grpc.aio.insecure_channel(server.address) as channel:
        agent = Actor(channel, "agent-a")
        subject = message(mailbox, "slow")
        token = (await agent.claim(subject)).status.fencing_token
        await agent.begin(subject, token)

        async def in_doubt() -> bool:
            return (await agent.status(subject)).state == pb.SUBJECT_STATE_IN_DOUBT

        await eventually(in_doubt, within=10)
        confirmed = await agent.confirm(subject, token, sent_message_id="late")
        assert confirmed.result == OK
        assert confirmed.status.state == pb.SUBJECT_STATE_REPLIED


async def test_takeover_fences_the_agent_off(agent: Actor, human: Actor, mailbox: str) -> None:
    subject = message(mailbox, "msg-1")
    agent_token = (await agent.claim(subject)).status.fencing_token
    taken = await human.takeover(subject, note="I'm answering this")
    assert taken.result == pb.TakeoverResponse.TAKEN_OVER
    assert taken.previous_holder == "agent-a"
    assert taken.previous_token == agent_token
    assert taken.status.holder == "ana@example.com"
    assert taken.status.holder_kind == pb.HOLDER_KIND_HUMAN
    assert taken.status.fencing_token > agent_token
    assert (await agent.begin(subject, agent_token)).result == STALE
    assert (await agent.renew(subject, agent_token)).result == STALE
    held = await agent.claim(subject)
    assert held.result == HELD
    assert held.status.holder == "ana@example.com"
    assert (await human.begin(subject, taken.status.fencing_token)).result == OK


async def test_takeover_rules(agent: Actor, human: Actor, channel: grpc.aio.Channel, mailbox: str) -> None:
    free = message(mailbox, "free")
    assert (await human.takeover(free)).result == pb.TakeoverResponse.GRANTED
    # From another human: never.
    other_human = Actor(channel, "bo", kind="human")
    refused = await other_human.takeover(free)
    assert refused.result == pb.TakeoverResponse.HELD
    assert refused.status.holder == "ana@example.com"
    # After the commit point: too late.
    sending = message(mailbox, "sending")
    token = (await agent.claim(sending)).status.fencing_token
    await agent.begin(sending, token)
    assert (await human.takeover(sending)).result == pb.TakeoverResponse.ALREADY_REPLIED
    # Agents may not take over at all.
    error = await rpc_error(agent.takeover(message(mailbox, "x")))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_human_claims_like_an_agent(human: Actor, agent: Actor, mailbox: str) -> None:
    subject = message(mailbox, "msg-1")
    claimed = await human.claim(subject, note="calling them back")
    assert claimed.result == GRANTED
    assert claimed.status.holder_kind == pb.HOLDER_KIND_HUMAN
    held = await agent.claim(subject)
    assert held.result == HELD
    assert held.status.holder_kind == pb.HOLDER_KIND_HUMAN
    assert held.status.note == "calling them back"


async def test_thread_and_message_claims_are_separate_subjects(agent: Actor, other_agent: Actor, mailbox: str) -> None:
    assert (await agent.claim(thread(mailbox, "t-1"))).result == GRANTED
    # Another message of the same conversation: the thread claim stops a second reply to the thread ...
    assert (await other_agent.claim(thread(mailbox, "t-1"))).result == HELD
    # ... while a message claim with the same id is a different subject.
    assert (await other_agent.claim(message(mailbox, "t-1"))).result == GRANTED


async def test_coordinator_serves_health(coordinator: CoordinatorServer) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(coordinator.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inbox.coordinator.v1.Coordinator"):
            response = await stub.Check(health_pb2.HealthCheckRequest(service=service))
            assert response.status == health_pb2.HealthCheckResponse.SERVING


async def test_begin_send_retried_after_the_deadline_is_refused(
    start_coordinator: StartCoordinator, mailbox: str
) -> None:
    """A BeginSend whose answer came too late (the holder was paused past the send deadline) must not send
    now: the subject is IN_DOUBT and a person may be resolving it."""
    server = await start_coordinator(send_timeout_ms=300)
    async with grpc.aio.insecure_channel(server.address) as channel:
        agent = Actor(channel, "agent-a")
        subject = message(mailbox, "m")
        token = (await agent.claim(subject)).status.fencing_token
        assert (await agent.begin(subject, token)).result == OK

        async def in_doubt() -> bool:
            return (await agent.status(subject)).state == pb.SUBJECT_STATE_IN_DOUBT

        await eventually(in_doubt, within=10)
        retried = await agent.begin(subject, token)
        assert retried.result == STALE
        assert retried.status.state == pb.SUBJECT_STATE_IN_DOUBT


async def test_a_reply_by_hand_after_a_takeover_stops_the_agent_replying_on_top(
    start_coordinator: StartCoordinator, mailbox: str
) -> None:
    """The reproduction of issue 14: takeover, the human answers in their mail client and says so, the claim
    would have lapsed, then a `message.updated` notification for the same message reaches the agent."""
    server = await start_coordinator()
    async with grpc.aio.insecure_channel(server.address) as channel:
        agent = Actor(channel, "agent-a")
        human = Actor(channel, "ana", kind="human")
        subject = message(mailbox, "msg-1")
        agent_claim = await agent.claim(subject, notification_id="created-1", ttl=5)
        taken = await human.takeover(subject, ttl=5, note="VIP, I'll answer")
        assert taken.result == pb.TakeoverResponse.TAKEN_OVER
        token = taken.status.fencing_token
        watch = agent.watch(mailbox)
        assert (await anext(watch)).HasField("snapshot")
        request_id = "mark-1"
        marked = await human.mark_replied(
            subject, token, sent_message_id="gmail-77", note="replied from Gmail", request_id=request_id
        )
        assert marked.result == OK
        status = marked.status
        assert status.state == pb.SUBJECT_STATE_REPLIED
        assert status.replied_by_hand
        assert status.holder == "ana"
        assert status.holder_kind == pb.HOLDER_KIND_HUMAN
        assert status.sent_message_id == "gmail-77"
        assert status.note == "replied from Gmail"
        assert status.fencing_token == token
        assert status.expires_at.ToMilliseconds() >= status.sent_at.ToMilliseconds() + 72 * 3600 * 1000
        # Watchers see it as its own event: answered by hand.
        event = (await anext(watch)).event
        assert event.type == pb.EVENT_TYPE_MARKED_REPLIED
        assert event.status.replied_by_hand
        # A retry of the same request (its first answer lost) gets the first answer and changes nothing.
        again = await human.mark_replied(subject, token, "gmail-77", "replied from Gmail", request_id=request_id)
        assert again.result == OK
        assert again.status == status
        # Past the claim's TTL and bucket: the reply record stays, where the claim would have lapsed.
        await asyncio.sleep(5 + 1 + 1.5)
        assert await human.status(subject) == status
        # The agent's old token stays stale, and the notification for the same message is answered.
        assert (await agent.begin(subject, agent_claim.status.fencing_token)).result == STALE
        updated = await agent.claim(subject, notification_id="updated-1")
        assert updated.result == ALREADY_REPLIED
        assert updated.status.replied_by_hand
        assert updated.status.holder == "ana"


async def test_mark_replied_is_fenced_like_begin_send(agent: Actor, other_agent: Actor, mailbox: str) -> None:
    subject = message(mailbox, "msg-1")
    token = (await agent.claim(subject)).status.fencing_token
    # Not the holder: refused outright, nothing recorded.
    error = await rpc_error(other_agent.mark_replied(subject, token))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    # A stale token (released, then claimed by another): STALE_TOKEN, the new claim untouched.
    assert (await agent.release(subject, token)).result == OK
    newer = (await other_agent.claim(subject)).status
    stale = await agent.mark_replied(subject, token)
    assert stale.result == STALE
    assert stale.status == newer
    # After BeginSend the send path owns the outcome: ConfirmSent, not MarkReplied.
    assert (await other_agent.begin(subject, newer.fencing_token)).result == OK
    error = await rpc_error(other_agent.mark_replied(subject, newer.fencing_token))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "ConfirmSent" in (error.details() or "")
    # A second, different request on a subject already marked is refused as not CLAIMED.
    other = message(mailbox, "msg-2")
    mine = (await agent.claim(other)).status.fencing_token
    assert (await agent.mark_replied(other, mine)).result == OK
    error = await rpc_error(agent.mark_replied(other, mine))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    # Bad input names the field.
    error = await rpc_error(agent.mark_replied(message(mailbox, "m3"), 0))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "fencing_token" in (error.details() or "")
    error = await rpc_error(agent.mark_replied(other, mine, note="x" * 1025))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "note" in (error.details() or "")


async def test_mark_replied_in_a_batch(agent: Actor, mailbox: str) -> None:
    subject = message(mailbox, "msg-1")
    token = (await agent.claim(subject)).status.fencing_token
    call = pb.MarkRepliedRequest(request_id="b-1", subject=subject, fencing_token=token, note="by phone")
    (result,) = await agent.batch(pb.BatchCall(mark_replied=call))
    assert result.mark_replied.result == OK
    assert result.mark_replied.status.replied_by_hand
    assert (await agent.claim(subject)).result == ALREADY_REPLIED
