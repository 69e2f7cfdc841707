"""A conversation that moved on, for a claim on the whole thread (docs/design.md#reply-storms): found by the chaos
run (chaos/storms.py's reply_after_moved_on). A thread claim's message has no id of its own, nor has the thread's
newest inbound message recorded by a thread claim's ClaimReply, so comparing the two ids let every thread claim
send after the customer wrote again."""

from __future__ import annotations

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from inbox_wire.v1 import coordinator_pb2 as pb
from tests.helpers import thread
from tests.server.test_reply_storms import ASKED, MOVED_ON, OK, REFUSED, Pair, claim, incoming, replicas

__all__ = ["replicas"]  # the fixture: two replicas on one etcd prefix

pytestmark = pytest.mark.etcd


async def test_a_thread_claim_is_refused_once_the_customer_wrote_again(replicas: Pair, mailbox: str) -> None:
    agent, other = replicas.agent("agent-a"), replicas.agent("agent-b", second=True)
    conversation = thread(mailbox, "t-1")
    token = await claim(agent, conversation, "t-1", received_s=ASKED)
    # The customer writes again in the thread: the newer message's ClaimReply finds the thread held (and records
    # the thread's newest inbound message) on the other replica.
    held = await other.stub.ClaimReply(
        pb.ClaimReplyRequest(
            request_id="r-held",
            subject=conversation,
            ttl_seconds=60,
            thread_id="t-1",
            received_at=Timestamp(seconds=ASKED + 30),
        ),
        metadata=other.metadata,
    )
    assert held.result == pb.ClaimReplyResponse.HELD
    refused = await agent.begin(conversation, token)
    assert (refused.result, refused.refusal.kind) == (REFUSED, MOVED_ON), refused
    assert refused.refusal.newer_received_at.seconds == ASKED + 30
    assert (await agent.release(conversation, token)).result == OK
    # The newest message's claim sends; a message nobody claims (RecordIncoming) moves a thread claim on too.
    newest = await claim(other, conversation, "t-1", received_s=ASKED + 30)
    await other.stub.RecordIncoming(incoming(mailbox, "m-9", "t-1", ASKED + 90), metadata=other.metadata)
    assert (await other.begin(conversation, newest)).result == REFUSED
    assert (await other.release(conversation, newest)).result == OK
    last = await claim(agent, conversation, "t-1", received_s=ASKED + 90)
    assert (await agent.begin(conversation, last)).result == OK
