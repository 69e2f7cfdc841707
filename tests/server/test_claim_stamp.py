"""RecordOutgoing's claim_token on etcd (docs/design.md#providers): the stamped copy of a send that is SENDING or
IN_DOUBT settles it (REPLIED with the copy's id, settled by the principal that reported it, the evidence in the
note), and the holder's late ConfirmSent of that id is answered as a retry; a token that names no send in flight
in the message's thread settles nothing (the usual rules of replies written outside apply)."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from inbox_wire.v1 import coordinator_pb2 as pb
from tests.helpers import Actor, message, new_request_id, rpc_error

pytestmark = pytest.mark.etcd
ASKED, SENT = Timestamp(seconds=1_796_220_000), Timestamp(seconds=1_796_220_060)


async def claim_in_thread(agent: Actor, subject: pb.Subject, thread: str) -> int:
    answer = await agent.stub.ClaimReply(
        pb.ClaimReplyRequest(
            request_id=new_request_id(), subject=subject, ttl_seconds=60, thread_id=thread, received_at=ASKED
        ),
        metadata=agent.metadata,
    )
    assert answer.result == pb.ClaimReplyResponse.GRANTED
    return int(answer.status.fencing_token)


async def copy_reported(
    reporter: Actor, mailbox: str, message_id: str, thread: str, token: int
) -> pb.RecordOutgoingResponse:
    return await reporter.stub.RecordOutgoing(
        pb.RecordOutgoingRequest(
            request_id=new_request_id(),
            mailbox=mailbox,
            notification_id=f"n-{message_id}",
            message_id=message_id,
            thread_id=thread,
            sent_at=SENT,
            sender="support@shop.example",
            claim_token=token,
        ),
        metadata=reporter.metadata,
    )


async def test_a_stamped_copy_settles_a_send_still_sending_and_the_holders_confirmation_is_a_retry(
    agent: Actor, other_agent: Actor, mailbox: str
) -> None:
    subject = message(mailbox, "m-1")
    token = await claim_in_thread(agent, subject, "t-1")
    assert (await agent.begin(subject, token)).result == pb.FENCE_RESULT_OK
    reported = await copy_reported(other_agent, mailbox, "copy-1", "t-1", token)
    assert reported.result == pb.RecordOutgoingResponse.OWN_REPLY
    status = await agent.status(subject)
    assert status.state == pb.SUBJECT_STATE_REPLIED
    assert (status.sent_message_id, status.settled_by) == ("copy-1", "agent-b")
    assert "copy-1" in status.note
    # The holder's ConfirmSent arrives after its copy: the same reply, answered as a retry, with or without its id.
    assert (await agent.confirm(subject, token, "copy-1")).result == pb.FENCE_RESULT_OK
    assert (await agent.confirm(subject, token, "")).result == pb.FENCE_RESULT_OK
    error = await rpc_error(agent.confirm(subject, token, "another-id"))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    again = await copy_reported(other_agent, mailbox, "copy-1", "t-1", token)  # the copy's notification again
    assert again.result == pb.RecordOutgoingResponse.DUPLICATE_DELIVERY


async def test_a_token_that_names_no_send_in_flight_in_the_thread_settles_nothing(
    agent: Actor, other_agent: Actor, mailbox: str
) -> None:
    sending, drafting = message(mailbox, "m-2"), message(mailbox, "m-3")
    sending_token = await claim_in_thread(agent, sending, "t-2")
    assert (await agent.begin(sending, sending_token)).result == pb.FENCE_RESULT_OK
    drafting_token = await claim_in_thread(agent, drafting, "t-3")
    # Another thread's send's token: that send is untouched, and the message is a reply written outside in t-3.
    elsewhere = await copy_reported(other_agent, mailbox, "copy-2", "t-3", sending_token)
    assert elsewhere.result == pb.RecordOutgoingResponse.ANSWERED_OUTSIDE
    assert (await agent.status(sending)).state == pb.SUBJECT_STATE_SENDING
    ended = await agent.status(drafting)
    assert (ended.state, ended.replied_outside, ended.settled_by) == (pb.SUBJECT_STATE_REPLIED, True, "")
    assert drafting_token > 0
