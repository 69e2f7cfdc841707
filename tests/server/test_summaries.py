"""Which email is which: the optional summary (subject line, sender, received time) on claims and replies,
its limits, where it is shown, that it goes when its record goes, and the setting that stops storing it."""

from __future__ import annotations

import grpc
from aetcd import rpc
from google.protobuf.timestamp_pb2 import Timestamp

from coordinator.core import limits
from coordinator.ops.config import load
from coordinator.store.etcd.keys import prefix_end
from coordinator.store.etcd.process import EtcdServer
from inbox_wire.v1 import coordinator_pb2 as pb
from tests.conftest import StartCoordinator
from tests.helpers import Actor, message, new_request_id, rpc_error

RECEIVED = Timestamp(seconds=1_796_000_000)
SUMMARY = pb.MessageSummary(
    subject_line="Refund for order 1182?", sender="Bea Costa <bea@example.org>", received_at=RECEIVED
)


async def claim_with(actor: Actor, subject: pb.Subject, summary: pb.MessageSummary) -> pb.ClaimReplyResponse:
    return await actor.stub.ClaimReply(
        pb.ClaimReplyRequest(request_id=new_request_id(), subject=subject, summary=summary), metadata=actor.metadata
    )


async def takeover_with(actor: Actor, subject: pb.Subject, summary: pb.MessageSummary) -> pb.TakeoverResponse:
    return await actor.stub.Takeover(
        pb.TakeoverRequest(request_id=new_request_id(), subject=subject, summary=summary), metadata=actor.metadata
    )


async def stored_values(etcd: EtcdServer, prefix: str) -> bytes:
    """Every value under the deployment prefix, as etcd holds them now, joined."""
    async with grpc.aio.insecure_channel(etcd.endpoint) as channel:
        response = await rpc.KVStub(channel).Range(
            rpc.RangeRequest(key=prefix.encode(), range_end=prefix_end(prefix.encode()))
        )
    return b"\n".join(kv.value for kv in response.kvs)


async def test_a_summary_travels_with_the_claim_to_every_view_and_onto_the_reply_record(
    agent: Actor, human: Actor, mailbox: str
) -> None:
    watch = human.watch(mailbox)
    assert (await anext(watch)).HasField("snapshot")
    subject = message(mailbox, "msg-1")
    granted = await claim_with(agent, subject, SUMMARY)
    assert granted.status.summary == SUMMARY
    assert (await anext(watch)).event.status.summary == SUMMARY
    assert (await human.status(subject)).summary == SUMMARY
    (listed,) = (await human.list(mailbox)).subjects
    assert listed.summary == SUMMARY
    snapshot = await anext(human.watch(mailbox))
    assert [s.summary for s in snapshot.snapshot.subjects] == [SUMMARY]
    # Who asks second sees which email is held, as well as by whom.
    assert (await claim_with(human, subject, pb.MessageSummary())).status.summary == SUMMARY

    token = granted.status.fencing_token
    assert (await agent.begin(subject, token)).status.summary == SUMMARY
    replied = await agent.confirm(subject, token)
    assert replied.status.state == pb.SUBJECT_STATE_REPLIED
    assert replied.status.summary == SUMMARY
    assert (await agent.claim(subject)).status.summary == SUMMARY  # ALREADY_REPLIED names the email too


async def test_a_takeover_keeps_the_agents_summary_unless_it_brings_its_own(
    agent: Actor, human: Actor, mailbox: str
) -> None:
    kept, replaced = message(mailbox, "kept"), message(mailbox, "replaced")
    await claim_with(agent, kept, SUMMARY)
    await claim_with(agent, replaced, SUMMARY)
    assert (await human.takeover(kept)).status.summary == SUMMARY
    own = pb.MessageSummary(subject_line="Re: refund", sender="bea@example.org")
    taken = await takeover_with(human, replaced, own)
    assert taken.result == pb.TakeoverResponse.TAKEN_OVER
    assert taken.status.summary == own
    marked = await human.mark_replied(replaced, taken.status.fencing_token, note="phoned her")
    assert marked.status.summary == own


async def test_summary_limits_are_named_and_enforced(agent: Actor, mailbox: str) -> None:
    cases = [
        (pb.MessageSummary(subject_line="s" * (limits.SUMMARY_SUBJECT_LINE_MAX_BYTES + 1)), "summary.subject_line"),
        (pb.MessageSummary(sender="é" * (limits.SUMMARY_SENDER_MAX_BYTES // 2 + 1)), "summary.sender"),
        (pb.MessageSummary(subject_line="line\nbreak"), "summary.subject_line"),
        (pb.MessageSummary(received_at=Timestamp(seconds=-5)), "summary.received_at"),
    ]
    for summary, field in cases:
        error = await rpc_error(claim_with(agent, message(mailbox, "m"), summary))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in (error.details() or "")
    at_limit = pb.MessageSummary(
        subject_line="s" * limits.SUMMARY_SUBJECT_LINE_MAX_BYTES, sender="x" * limits.SUMMARY_SENDER_MAX_BYTES
    )
    assert (await claim_with(agent, message(mailbox, "m"), at_limit)).status.summary == at_limit


async def test_the_summary_is_deleted_with_its_record(
    agent: Actor, etcd: EtcdServer, prefix: str, mailbox: str
) -> None:
    released, replied = message(mailbox, "released"), message(mailbox, "replied")
    token = (await claim_with(agent, released, SUMMARY)).status.fencing_token
    assert b"Refund for order 1182?" in await stored_values(etcd, prefix)
    await agent.release(released, token)
    other = pb.MessageSummary(subject_line="Invoice 77", sender="carl@example.net")
    token = (await claim_with(agent, replied, other)).status.fencing_token
    await agent.mark_replied(replied, token)
    values = await stored_values(etcd, prefix)
    assert b"Refund for order 1182?" not in values
    assert b"bea@example.org" not in values
    assert b"Invoice 77" in values  # the reply record keeps it, for its retention only


async def test_store_summaries_off_keeps_nothing(
    start_coordinator: StartCoordinator, etcd: EtcdServer, prefix: str, mailbox: str
) -> None:
    server = await start_coordinator(store_summaries=False)
    async with grpc.aio.insecure_channel(server.address) as channel:
        agent = Actor(channel, "agent-a")
        granted = await claim_with(agent, message(mailbox, "msg-1"), SUMMARY)
        assert granted.result == pb.ClaimReplyResponse.GRANTED
        assert not granted.status.HasField("summary")
        # Still checked: a client learns of a bad value even where nothing is kept.
        error = await rpc_error(claim_with(agent, message(mailbox, "m2"), pb.MessageSummary(sender="x" * 600)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    values = await stored_values(etcd, prefix)
    assert b"Refund" not in values
    assert b"bea@example.org" not in values


def test_store_summaries_is_a_setting_like_the_others() -> None:
    assert load({}, {}).rules().store_summaries is True
    assert load({}, {"INBOX_COORDINATOR_STORE_SUMMARIES": "false"}).rules().store_summaries is False
    assert load({"store_summaries": "false"}, {}).store_summaries is False


async def test_invisible_formatting_in_a_summary_is_dropped_so_no_one_sees_a_disguised_subject(
    agent: Actor, human: Actor, mailbox: str
) -> None:
    # "Invoice \u202egnp.exe" shows as "Invoice exe.png"; the marks, isolates and zero-width spaces of a spoof
    # go too. Joiners stay: without them the family emoji falls apart and the Persian word is misspelt.
    persian = "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645"
    disguised = pb.MessageSummary(
        subject_line=f"Invoice \u202egnp.exe \u2066x\u2069\u200b\ufeff \U0001f468\u200d\U0001f469 {persian}",
        sender="Bea\u200f Costa\u2028<bea@example.org>",
    )
    subject = message(mailbox, "disguised")
    granted = await claim_with(agent, subject, disguised)
    expected = f"Invoice gnp.exe x \U0001f468\u200d\U0001f469 {persian}"
    assert granted.status.summary.subject_line == expected
    assert granted.status.summary.sender == "Bea Costa<bea@example.org>"
    assert (await human.status(subject)).summary.subject_line == expected
    # A takeover's summary is cleaned the same way.
    other = message(mailbox, "taken")
    taken = await takeover_with(human, other, pb.MessageSummary(subject_line="Pay \u202etxt.exe"))
    assert taken.status.summary.subject_line == "Pay txt.exe"
