"""Every mutation is retry-safe (docs/design.md#invariants, invariant 8): a retry with the same request id and
the same arguments answers what the first attempt answered, through the same replica, through another
one, and after every replica restarted (the evidence is in etcd, in what each transition writes); the same
request id with other arguments is refused INVALID_ARGUMENT, reason REQUEST_ID_REUSED."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from coordinator.core import commands, domain
from coordinator.ops.server import wall_clock_ms
from inbox_wire.v1 import coordinator_pb2 as pb
from tests.conftest import StartCoordinator
from tests.helpers import Actor, error_reason, eventually, message, new_request_id, rpc_error

SEND_TIMEOUT_MS = 1_000  # short, so that a send goes IN_DOUBT within the test


@dataclass
class Caller:
    """An agent and a human, as one replica sees them."""

    agent: Actor
    human: Actor


async def _nothing(_caller: Caller, _subject: pb.Subject) -> int:
    return 0


async def _claimed(caller: Caller, subject: pb.Subject) -> int:
    return (await caller.agent.claim(subject, ttl=60)).status.fencing_token


async def _sending(caller: Caller, subject: pb.Subject) -> int:
    token = await _claimed(caller, subject)
    assert (await caller.agent.begin(subject, token)).result == pb.FENCE_RESULT_OK
    return token


async def _in_doubt(caller: Caller, subject: pb.Subject) -> int:
    token = await _sending(caller, subject)

    async def in_doubt() -> bool:
        return (await caller.agent.status(subject)).state == pb.SUBJECT_STATE_IN_DOUBT

    await eventually(in_doubt, within=10)
    return token


async def _answered_outside(caller: Caller, subject: pb.Subject) -> int:
    """Claimed in a thread, then answered there from the mailbox (RecordOutgoing): REPLIED, answered outside."""
    asked = Timestamp(seconds=1_700_000_000)
    claimed = await caller.agent.stub.ClaimReply(
        pb.ClaimReplyRequest(
            request_id=new_request_id(), subject=subject, thread_id="t-" + subject.id, received_at=asked, ttl_seconds=60
        ),
        metadata=caller.agent.metadata,
    )
    outgoing = pb.RecordOutgoingRequest(
        request_id=new_request_id(),
        mailbox=subject.mailbox,
        message_id="gmail-" + subject.id,
        thread_id="t-" + subject.id,
        sent_at=Timestamp(seconds=1_700_000_300),
        sender="Ana Lima <ana@shop.example>",
    )
    answered = await caller.agent.stub.RecordOutgoing(outgoing, metadata=caller.agent.metadata)
    assert answered.result == pb.RecordOutgoingResponse.ANSWERED_OUTSIDE
    return claimed.status.fencing_token


def _request(rpc: str, subject: pb.Subject, token: int, request_id: str, variant: bool) -> Any:
    """The request message of a mutation; ``variant`` changes one argument."""
    fence: dict[str, Any] = {"request_id": request_id, "subject": subject, "fencing_token": token}
    if rpc == "RecordDelivery":
        return pb.RecordDeliveryRequest(request_id=request_id, mailbox=subject.mailbox, notification_id=subject.id)
    if rpc == "ClaimReply":
        return pb.ClaimReplyRequest(
            request_id=request_id, subject=subject, notification_id="n-" + subject.id, ttl_seconds=90 if variant else 60
        )
    if rpc == "RenewClaim":
        return pb.RenewClaimRequest(**fence, ttl_seconds=120 if variant else 60)
    if rpc == "ReleaseClaim":
        return pb.ReleaseClaimRequest(**fence, redeliverable=variant)
    if rpc == "BeginSend":
        return pb.BeginSendRequest(**{**fence, "fencing_token": token + 1 if variant else token})
    if rpc == "ConfirmSent":
        return pb.ConfirmSentRequest(**fence, sent_message_id="other" if variant else "sent-1")
    if rpc == "AbortSend":
        return pb.AbortSendRequest(**fence, reason="other" if variant else "refused by the mail API")
    if rpc == "Takeover":
        return pb.TakeoverRequest(request_id=request_id, subject=subject, ttl_seconds=60, note="x" if variant else "")
    if rpc == "ResolveInDoubt":
        return pb.ResolveInDoubtRequest(
            request_id=request_id,
            subject=subject,
            outcome=pb.ResolveInDoubtRequest.OUTCOME_SENT,
            sent_message_id="other" if variant else "found-in-sent-folder",
        )
    if rpc == "UndoOutsideReply":
        return pb.UndoOutsideReplyRequest(request_id=request_id, subject=subject, note="other" if variant else "")
    raise AssertionError(rpc)


# What brings the subject to where each mutation applies; it returns the fencing token, if any.
_PREPARE: dict[str, Callable[[Caller, pb.Subject], Awaitable[int]]] = {
    "RecordDelivery": _nothing,
    "ClaimReply": _nothing,
    "RenewClaim": _claimed,
    "ReleaseClaim": _claimed,
    "BeginSend": _claimed,
    "ConfirmSent": _sending,
    "AbortSend": _sending,
    "Takeover": _claimed,
    "ResolveInDoubt": _in_doubt,
    "UndoOutsideReply": _answered_outside,
}
_HUMAN_CALLS = frozenset({"Takeover", "ResolveInDoubt", "UndoOutsideReply"})
_BATCHED = {
    "RecordDelivery": "record_delivery",
    "ClaimReply": "claim_reply",
    "RenewClaim": "renew_claim",
    "ReleaseClaim": "release_claim",
    "BeginSend": "begin_send",
    "ConfirmSent": "confirm_sent",
    "AbortSend": "abort_send",
}
CASES = [(rpc, "unary") for rpc in _PREPARE] + [(rpc, "batch") for rpc in _BATCHED]
# RecordDelivery's arguments are its key (mailbox, notification id): other arguments are another record.
REUSE_CASES = [case for case in CASES if case[0] != "RecordDelivery"]


async def _call(caller: Caller, rpc: str, via: str, request: Any) -> Any:
    actor = caller.human if rpc in _HUMAN_CALLS else caller.agent
    if via == "batch":
        (result,) = await actor.batch(pb.BatchCall(**{_BATCHED[rpc]: request}))
        if result.WhichOneof("result") == "error":
            return result.error
        return getattr(result, _BATCHED[rpc])
    return await getattr(actor.stub, rpc)(request, metadata=actor.metadata)


def _caller(channel: grpc.aio.Channel) -> Caller:
    return Caller(Actor(channel, "agent-a"), Actor(channel, "ana@example.com", kind="human"))


@pytest.mark.parametrize(("rpc", "via"), CASES)
async def test_a_retry_answers_the_first_answer_everywhere_and_after_a_restart(
    start_coordinator: StartCoordinator, mailbox: str, rpc: str, via: str
) -> None:
    first_replica = await start_coordinator(send_timeout_ms=SEND_TIMEOUT_MS)
    second_replica = await start_coordinator(send_timeout_ms=SEND_TIMEOUT_MS)
    subject = message(mailbox, f"m-{uuid.uuid4().hex[:6]}")
    request_id = new_request_id()
    async with (
        grpc.aio.insecure_channel(first_replica.address) as first_channel,
        grpc.aio.insecure_channel(second_replica.address) as second_channel,
    ):
        first, second = _caller(first_channel), _caller(second_channel)
        token = await _PREPARE[rpc](first, subject)
        request = _request(rpc, subject, token, request_id, variant=False)
        answer = await _call(first, rpc, via, request)
        assert not isinstance(answer, pb.CallError), answer
        assert await _call(first, rpc, via, request) == answer, "retry through the same replica"
        assert await _call(second, rpc, via, request) == answer, "retry through another replica"
    await first_replica.stop(grace=0)
    await second_replica.stop(grace=0)
    restarted = await start_coordinator(send_timeout_ms=SEND_TIMEOUT_MS)
    async with grpc.aio.insecure_channel(restarted.address) as channel:
        assert await _call(_caller(channel), rpc, via, request) == answer, "retry after every replica restarted"


@pytest.mark.parametrize(("rpc", "via"), REUSE_CASES)
async def test_a_request_id_reused_with_other_arguments_is_refused(
    start_coordinator: StartCoordinator, mailbox: str, rpc: str, via: str
) -> None:
    coordinator = await start_coordinator(send_timeout_ms=SEND_TIMEOUT_MS)
    subject = message(mailbox, "m1")
    request_id = new_request_id()
    async with grpc.aio.insecure_channel(coordinator.address) as channel:
        caller = _caller(channel)
        token = await _PREPARE[rpc](caller, subject)
        before = await _call(caller, rpc, via, _request(rpc, subject, token, request_id, variant=False))
        assert not isinstance(before, pb.CallError), before
        other = _request(rpc, subject, token, request_id, variant=True)
        if via == "batch":
            refused = await _call(caller, rpc, via, other)
            assert isinstance(refused, pb.CallError), refused
            assert (refused.code, refused.reason) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], "REQUEST_ID_REUSED")
            details = refused.message
        else:
            error = await rpc_error(_call(caller, rpc, via, other))
            assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error
            assert error_reason(error)[0] == "REQUEST_ID_REUSED"
            details = error.details() or ""
        # ConfirmSent's reply record keeps no request id: its refusal names the argument that differs.
        expected = "already confirmed with sent message id" if rpc == "ConfirmSent" else "was already used for a"
        assert expected in details, details
        # The refusal changed nothing: the first call's retry still gets its answer.
        assert await _call(caller, rpc, via, _request(rpc, subject, token, request_id, variant=False)) == before


async def test_a_takeover_retried_after_only_its_first_step_landed_still_reports_the_agent(
    start_coordinator: StartCoordinator, mailbox: str
) -> None:
    """A Takeover ends the agent's claim, then claims: when the second step's answer is lost (or it never
    ran), the retry claims and reports the agent it took the subject from, as the first attempt would have."""
    coordinator = await start_coordinator()
    subject = message(mailbox, "m1")
    async with grpc.aio.insecure_channel(coordinator.address) as channel:
        caller = _caller(channel)
        token = await _claimed(caller, subject)
        request_id = new_request_id()
        request = _request("Takeover", subject, token, request_id, variant=False)
        # The first step alone, as the engine makes it, then nothing more (a crash in between).
        human = domain.Caller("ana@example.com", domain.HolderKind.HUMAN)
        taken = domain.Subject(mailbox, domain.SubjectKind.MESSAGE, "m1")
        takeover = commands.Takeover(request_id=request_id, subject=taken, ttl_seconds=60)
        store, now = coordinator.engine.store, wall_clock_ms()
        await store.apply(
            taken,
            lambda current, _end: domain.takeover_release(current, human, takeover, now_ms=now),
            coordinator.engine.rules.end_mark_expiry(now),
        )
        assert (await caller.agent.status(subject)).state == pb.SUBJECT_STATE_FREE
        answer = await _call(caller, "Takeover", "unary", request)
        assert answer.result == pb.TakeoverResponse.TAKEN_OVER
        assert (answer.previous_holder, answer.previous_token) == ("agent-a", token)
        assert await _call(caller, "Takeover", "unary", request) == answer
