"""Delivery dedup on the notification id (docs/design.md#invariants, invariant 4)."""

from __future__ import annotations

import asyncio
import collections

import grpc

from inbox_wire.v1 import coordinator_pb2 as pb
from tests.helpers import Actor, eventually, message, new_request_id

GRANTED = pb.ClaimReplyResponse.GRANTED
DUPLICATE = pb.ClaimReplyResponse.DUPLICATE_DELIVERY


async def test_record_delivery_new_then_duplicate(agent: Actor, other_agent: Actor, mailbox: str) -> None:
    first = await agent.record_delivery(mailbox, "notif-1")
    assert first.result == pb.RecordDeliveryResponse.NEW
    second = await other_agent.record_delivery(mailbox, "notif-1")
    assert second.result == pb.RecordDeliveryResponse.DUPLICATE
    assert second.first.recorded_by == "agent-a"
    assert second.first.recorded_at == first.first.recorded_at
    # Retried with its own request id, the first caller is told NEW again: its answer was lost, not repeated.
    request_id = new_request_id()
    assert (await agent.record_delivery(mailbox, "notif-2", request_id)).result == pb.RecordDeliveryResponse.NEW
    assert (await agent.record_delivery(mailbox, "notif-2", request_id)).result == pb.RecordDeliveryResponse.NEW


async def test_redelivered_notification_has_one_effect(channel: grpc.aio.Channel, mailbox: str) -> None:
    """The same webhook delivered three times, to three workers at once, then once more later."""
    workers = [Actor(channel, f"worker-{i}") for i in range(3)]
    subject = message(mailbox, "msg-1")
    responses = await asyncio.gather(*(w.claim(subject, notification_id="notif-1") for w in workers))
    counts = collections.Counter(r.result for r in responses)
    assert counts[GRANTED] == 1
    assert counts[GRANTED] + counts[DUPLICATE] + counts[pb.ClaimReplyResponse.HELD] == 3
    winner = next(r for r in responses if r.result == GRANTED)
    holder = next(w for w in workers if w.name == winner.status.holder)
    await holder.release(subject, winner.status.fencing_token)
    # The claim was released, but the notification stays consumed: a late redelivery does nothing.
    late = await workers[0].claim(subject, notification_id="notif-1")
    assert late.result == DUPLICATE
    assert late.delivery.recorded_by == winner.status.holder
    assert late.delivery.subject == subject


async def test_several_notifications_for_one_message_are_not_duplicates(agent: Actor, mailbox: str) -> None:
    """message.created and message.updated are different notifications about the same message."""
    subject = message(mailbox, "msg-1")
    created = await agent.claim(subject, notification_id="notif-created")
    assert created.result == GRANTED
    updated = await agent.claim(subject, notification_id="notif-updated")
    assert updated.result == pb.ClaimReplyResponse.HELD  # not DUPLICATE_DELIVERY: the message guard answers


async def test_retried_claim_with_notification_returns_the_same_grant(agent: Actor, mailbox: str) -> None:
    subject = message(mailbox, "msg-1")
    request_id = new_request_id()
    first = await agent.claim(subject, notification_id="n-1", request_id=request_id)
    again = await agent.claim(subject, notification_id="n-1", request_id=request_id)
    assert (again.result, again.status.fencing_token) == (GRANTED, first.status.fencing_token)


async def test_delivery_records_are_per_mailbox(agent: Actor, mailbox: str) -> None:
    assert (await agent.record_delivery(mailbox, "same-id")).result == pb.RecordDeliveryResponse.NEW
    assert (await agent.record_delivery(mailbox + "-other", "same-id")).result == pb.RecordDeliveryResponse.NEW


async def test_redelivery_after_the_holder_crashed_claims_again(channel: grpc.aio.Channel, mailbox: str) -> None:
    """The first worker claims, then dies mid-draft: its claim lapses. The notification had no effect, so
    its redelivery (Nylas retries; an operator's replay) is not dropped: another worker claims and replies."""
    subject = message(mailbox, "msg-1")
    crashed, rescuer = Actor(channel, "crashed"), Actor(channel, "rescuer")
    first = await crashed.claim(subject, notification_id="notif-1", ttl=2)
    assert first.result == GRANTED
    early = await rescuer.claim(subject, notification_id="notif-1")
    assert early.result == DUPLICATE, "while the claim lives, a redelivery is a duplicate"

    async def claimed_again() -> pb.ClaimReplyResponse | None:
        response = await rescuer.claim(subject, notification_id="notif-1")
        return response if response.result == GRANTED else None

    rescued = await eventually(claimed_again, within=10)
    assert rescued.status.fencing_token > first.status.fencing_token
    await rescuer.begin(subject, rescued.status.fencing_token)
    await rescuer.confirm(subject, rescued.status.fencing_token)
    late = await Actor(channel, "third").claim(subject, notification_id="notif-1")
    assert late.result == DUPLICATE


async def test_redelivery_after_a_deliberate_release_stays_a_duplicate(
    agent: Actor, other_agent: Actor, mailbox: str
) -> None:
    """An agent that looked and decided not to reply releases: redeliveries must not make others try again."""
    subject = message(mailbox, "spam")
    token = (await agent.claim(subject, notification_id="notif-spam")).status.fencing_token
    await agent.release(subject, token)
    assert (await other_agent.claim(subject, notification_id="notif-spam")).result == DUPLICATE
    # A different notification about the same message (message.updated) is not a duplicate.
    assert (await other_agent.claim(subject, notification_id="notif-spam-updated")).result == GRANTED


async def test_a_redeliverable_release_or_abort_lets_the_notification_claim_again(
    agent: Actor, other_agent: Actor, mailbox: str
) -> None:
    """Giving up because the work failed is not a decision about the message: redeliveries may claim again."""
    released, aborted = message(mailbox, "released"), message(mailbox, "aborted")
    token = (await agent.claim(released, notification_id="n-rel")).status.fencing_token
    response = await agent.stub.ReleaseClaim(
        pb.ReleaseClaimRequest(request_id=new_request_id(), subject=released, fencing_token=token, redeliverable=True),
        metadata=agent.metadata,
    )
    assert response.result == pb.FENCE_RESULT_OK
    assert (await other_agent.claim(released, notification_id="n-rel")).result == GRANTED

    token = (await agent.claim(aborted, notification_id="n-abort")).status.fencing_token
    await agent.begin(aborted, token)
    await agent.stub.AbortSend(
        pb.AbortSendRequest(
            request_id=new_request_id(), subject=aborted, fencing_token=token, reason="lost", redeliverable=True
        ),
        metadata=agent.metadata,
    )
    assert (await other_agent.claim(aborted, notification_id="n-abort")).result == GRANTED
