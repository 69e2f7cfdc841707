"""Who may say a reply was written outside the coordinator (docs/design.md#replies-written-outside, "What a
reporter vouches for"), with tokens, on a real coordinator and etcd, over gRPC and HTTP:

- RecordOutgoing needs the role `report` (the principals that report a mailbox's mail: its webhook workers); an
  agent or a person without it is refused PERMISSION_DENIED with the reason, alone and inside a Batch, and ends
  nothing; a reporter acts only in the mailboxes it is granted.
- A thread named for a message by a principal without `report` is its word alone: it cannot make another's
  message answered, nor end another's claim through a reply recorded in that thread.
- Every record shows who recorded it beside what its sender field says.
- A person with `resolve` undoes a wrong record: the message is answerable again, and the undo is recorded and
  sent to watchers."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from coordinator.api.auth import TokenAuthenticator, hash_token, new_token
from coordinator.ops.server import CoordinatorServer
from coordinator.store.etcd.process import EtcdServer
from inbox_wire.v1 import coordinator_pb2 as pb
from tests.helpers import Actor, error_reason, message, new_request_id, rpc_error
from tests.server.test_http import Json, serve, subject_json

# name: (kind, mailboxes, roles)
PRINCIPALS: dict[str, tuple[str, list[str], list[str]]] = {
    "worker-acme": ("agent", ["acme-*"], ["report"]),  # acme's webhook worker
    "worker-globex": ("agent", ["globex"], ["report"]),  # another tenant's
    "agent-x": ("agent", ["acme-*"], []),  # an agent of acme that reports nothing (an MCP agent, say)
    "ana": ("human", ["acme-*"], ["takeover"]),
    "bo": ("human", ["acme-*"], ["resolve"]),  # the supervisor who settles what is wrong
    "sam": ("agent", ["acme-*"], ["resolve"]),  # an agent with resolve: still not a person
}
TOKENS = {name: new_token()[0] for name in PRINCIPALS}
ANA_SENDER = "Ana Lima <ana@acme.example>"
ASKED, ANSWERED, LATER = 1_700_000_000, 1_700_000_300, 1_700_000_600  # provider times, in seconds


def _token_file(path: Path) -> Path:
    path.write_text(
        "".join(
            f'[[principals]]\nid = "{name}"\nkind = "{kind}"\nmailboxes = {mailboxes}\nroles = {roles}\n'
            f'token_sha256 = ["{hash_token(TOKENS[name])}"]\n'.replace("'", '"')
            for name, (kind, mailboxes, roles) in PRINCIPALS.items()
        )
    )
    return path


@dataclass
class World:
    server: CoordinatorServer
    channel: grpc.aio.Channel
    http: httpx.AsyncClient
    mailbox: str

    def actor(self, name: str) -> Actor:
        return Actor(self.channel, name, token=TOKENS[name])

    def json(self, name: str) -> Json:
        return Json(self.http, {"authorization": f"Bearer {TOKENS[name]}"})


@pytest.fixture
async def world(etcd: EtcdServer, prefix: str, tmp_path: Path) -> AsyncIterator[World]:
    server = await serve(etcd, prefix, authenticator=TokenAuthenticator(_token_file(tmp_path / "tokens.toml")))
    assert server.http is not None
    try:
        async with (
            grpc.aio.insecure_channel(server.address) as channel,
            httpx.AsyncClient(base_url=f"http://{server.http.address}", timeout=10) as http,
        ):
            yield World(server, channel, http, f"acme-{uuid.uuid4().hex[:8]}")
    finally:
        await server.stop(grace=0.5)


async def _claim_in_thread(
    actor: Actor, subject: pb.Subject, thread_id: str, received_s: int = ASKED
) -> pb.ClaimReplyResponse:
    return await actor.stub.ClaimReply(
        pb.ClaimReplyRequest(
            request_id=new_request_id(),
            subject=subject,
            ttl_seconds=300,
            thread_id=thread_id,
            received_at=Timestamp(seconds=received_s),
        ),
        metadata=actor.metadata,
    )


def _outgoing(mailbox: str, thread_id: str, message_id: str, sent_s: int = ANSWERED) -> pb.RecordOutgoingRequest:
    return pb.RecordOutgoingRequest(
        request_id=new_request_id(),
        mailbox=mailbox,
        message_id=message_id,
        thread_id=thread_id,
        sent_at=Timestamp(seconds=sent_s),
        sender=ANA_SENDER,  # what the message's From says: anyone can write it
    )


async def _record(actor: Actor, request: pb.RecordOutgoingRequest) -> pb.RecordOutgoingResponse:
    return await actor.stub.RecordOutgoing(request, metadata=actor.metadata)


async def test_recording_a_reply_written_outside_needs_the_report_role_over_grpc(world: World) -> None:
    """The finding: an agent and a person without any role recorded a fake 'answered outside' that ended ana's
    claim and silenced the email. Refused now, alone and in a Batch, and nothing changes."""
    ana, agent_x = world.actor("ana"), world.actor("agent-x")
    subject = message(world.mailbox, "m-ana")
    token = (await _claim_in_thread(ana, subject, "t-1")).status.fencing_token
    for intruder in (agent_x, ana, world.actor("bo")):
        error = await rpc_error(_record(intruder, _outgoing(world.mailbox, "t-1", "fake-1")))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error.details()
        assert error_reason(error)[0] == "ROLE_MISSING"
        assert "RecordOutgoing needs the role 'report'" in (error.details() or "")
        assert f"principal {intruder.name!r}" in (error.details() or "")
        assert "webhook workers" in (error.details() or "")  # whom the operator grants it to
    (refused,) = await agent_x.batch(pb.BatchCall(record_outgoing=_outgoing(world.mailbox, "t-1", "fake-2")))
    assert (refused.error.code, refused.error.reason) == (grpc.StatusCode.PERMISSION_DENIED.value[0], "ROLE_MISSING")
    # ana still holds her claim: it renews, and nobody else can claim the email.
    assert (await ana.renew(subject, token, ttl=300)).result == pb.FENCE_RESULT_OK
    assert (await ana.status(subject)).state == pb.SUBJECT_STATE_CLAIMED
    # The webhook worker, which has the role, records a real one: it ends her claim (her own thread, her word).
    answer = await _record(world.actor("worker-acme"), _outgoing(world.mailbox, "t-1", "gmail-1"))
    assert answer.result == pb.RecordOutgoingResponse.ANSWERED_OUTSIDE
    status = await ana.status(subject)
    assert status.replied_outside
    assert (status.outside_reply.sender, status.outside_reply.recorded_by) == (ANA_SENDER, "worker-acme")
    assert status.outside_reply.stopped_holder == "ana"


async def test_recording_needs_the_report_role_over_http_too(world: World) -> None:
    subject = subject_json(world.mailbox, "m-1")
    body: dict[str, Any] = {
        "requestId": "r-1",
        "mailbox": world.mailbox,
        "messageId": "fake-1",
        "threadId": "t-1",
        "sentAt": "2023-11-14T22:18:20Z",
        "sender": ANA_SENDER,
    }
    await world.json("ana").call(
        "ClaimReply",
        {"requestId": "c-1", "subject": subject, "threadId": "t-1", "receivedAt": "2023-11-14T22:13:20Z"},
    )
    for who in ("agent-x", "ana"):
        refused = await world.json(who).post("RecordOutgoing", body)
        assert refused.status_code == 403, refused.text
        assert refused.json()["code"] == "permission_denied"
        assert "needs the role 'report'" in refused.json()["message"]
    batch = await world.json("agent-x").call("Batch", {"calls": [{"recordOutgoing": body}]})
    assert batch["results"][0]["error"]["reason"] == "ROLE_MISSING"
    status = (await world.json("ana").call("GetStatus", {"subject": subject}))["status"]
    assert status["state"] == "SUBJECT_STATE_CLAIMED"
    recorded = await world.json("worker-acme").call("RecordOutgoing", body)
    assert recorded["result"] == "ANSWERED_OUTSIDE"
    assert recorded["subjects"][0]["outsideReply"]["recordedBy"] == "worker-acme"


async def test_a_reporter_acts_only_in_its_own_tenants_mailboxes(world: World) -> None:
    acme_subject, globex_subject = message(world.mailbox, "m-1"), message("globex", f"m-{uuid.uuid4().hex[:6]}")
    await _claim_in_thread(world.actor("worker-acme"), acme_subject, "t-shared")
    await _claim_in_thread(world.actor("worker-globex"), globex_subject, "t-shared")
    for reporter, mailbox in (("worker-globex", world.mailbox), ("worker-acme", "globex")):
        error = await rpc_error(_record(world.actor(reporter), _outgoing(mailbox, "t-shared", "gmail-x")))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert error_reason(error)[0] == "MAILBOX_NOT_GRANTED"
    # A reply recorded in acme's thread t-shared ends nothing of globex's thread of the same name.
    await _record(world.actor("worker-acme"), _outgoing(world.mailbox, "t-shared", "gmail-1"))
    assert (await world.actor("worker-acme").status(acme_subject)).replied_outside
    assert (await world.actor("worker-globex").status(globex_subject)).state == pb.SUBJECT_STATE_CLAIMED


async def test_a_thread_named_by_an_agent_that_reports_nothing_cannot_end_another_s_claim(world: World) -> None:
    """The finding: an agent claims a message with a thread that is not its own, so that a reply in that thread
    ends the claim a person holds on it later. Its naming is its word alone now."""
    agent_x, ana, worker = world.actor("agent-x"), world.actor("ana"), world.actor("worker-acme")
    victim = message(world.mailbox, "m-victim")
    planted = await _claim_in_thread(agent_x, victim, "t-busy")
    assert (await agent_x.release(victim, planted.status.fencing_token)).result == pb.FENCE_RESULT_OK
    # A message agent-x only named into the thread, and left free.
    free = message(world.mailbox, "m-free")
    left = await _claim_in_thread(agent_x, free, "t-busy")
    await agent_x.release(free, left.status.fencing_token)
    # ana claims the victim's message (from the board: without a thread).
    token = (await ana.claim(victim, ttl=300)).status.fencing_token
    # A genuine reply in t-busy, recorded by the webhook worker.
    answer = await _record(worker, _outgoing(world.mailbox, "t-busy", "gmail-busy"))
    assert answer.result == pb.RecordOutgoingResponse.ANSWERED_OUTSIDE
    assert list(answer.subjects) == []
    assert (await ana.renew(victim, token, ttl=300)).result == pb.FENCE_RESULT_OK
    assert (await ana.status(free)).state == pb.SUBJECT_STATE_FREE
    assert (await ana.claim(free)).result == pb.ClaimReplyResponse.GRANTED


async def test_claiming_with_a_thread_answered_outside_silences_nothing_for_others(world: World) -> None:
    """The finding: an agent claims an unrelated message with a thread a reply was recorded in, so that the
    message is recorded answered and every later claim of it answers ALREADY_REPLIED for 72 hours."""
    agent_x, ana, worker = world.actor("agent-x"), world.actor("ana"), world.actor("worker-acme")
    await _record(worker, _outgoing(world.mailbox, "t-answered", "gmail-1"))
    unrelated = message(world.mailbox, "m-unrelated")
    told = await _claim_in_thread(agent_x, unrelated, "t-answered")
    # agent-x is told what the thread it named says (so an honest MCP agent still stops), and nothing is kept.
    assert told.result == pb.ClaimReplyResponse.ALREADY_REPLIED
    assert (told.status.outside_reply.recorded_by, told.status.fencing_token) == ("worker-acme", 0)
    assert (await ana.status(unrelated)).state == pb.SUBJECT_STATE_FREE
    assert (await ana.claim(unrelated)).result == pb.ClaimReplyResponse.GRANTED
    # The webhook worker's naming is the provider's: a message of that thread received before the reply is
    # recorded answered, for everyone.
    answered = message(world.mailbox, "m-answered")
    assert (await _claim_in_thread(worker, answered, "t-answered")).result == pb.ClaimReplyResponse.ALREADY_REPLIED
    assert (await ana.status(answered)).replied_outside


async def _events(stream: AsyncIterator[pb.WatchResponse], wanted: int) -> pb.WatchEvent:
    async with asyncio.timeout(15):
        while True:
            response = await anext(stream)
            if response.WhichOneof("kind") == "event" and response.event.type == wanted:
                return response.event


async def test_a_person_with_resolve_undoes_a_wrong_outside_record_and_the_email_is_answerable_again(
    world: World,
) -> None:
    ana, bo, worker = world.actor("ana"), world.actor("bo"), world.actor("worker-acme")
    subject = message(world.mailbox, "m-1")
    token = (await _claim_in_thread(ana, subject, "t-1")).status.fencing_token
    stream = bo.watch(world.mailbox)
    assert (await anext(stream)).WhichOneof("kind") == "snapshot"
    await _record(worker, _outgoing(world.mailbox, "t-1", "gmail-wrong"))
    answered = await _events(stream, pb.EVENT_TYPE_ANSWERED_OUTSIDE)
    assert (answered.status.outside_reply.sender, answered.status.outside_reply.recorded_by) == (
        ANA_SENDER,
        "worker-acme",
    )
    # Before: her renewal is stale, and the email cannot be claimed or taken over.
    assert (await ana.renew(subject, token)).result == pb.FENCE_RESULT_STALE_TOKEN
    assert (await _claim_in_thread(ana, subject, "t-1")).result == pb.ClaimReplyResponse.ALREADY_REPLIED
    # Who may undo: a person with resolve; not ana (no resolve), not an agent with resolve.
    request = pb.UndoOutsideReplyRequest(subject=subject, note="Ana did not answer this one")
    for who, reason in (("ana", "ROLE_MISSING"), ("sam", "NOT_HUMAN"), ("agent-x", "NOT_HUMAN")):
        someone = world.actor(who)
        request.request_id = new_request_id()
        error = await rpc_error(someone.stub.UndoOutsideReply(request, metadata=someone.metadata))
        assert (error.code(), error_reason(error)[0]) == (grpc.StatusCode.PERMISSION_DENIED, reason), who
    request.request_id = new_request_id()
    undone = await bo.stub.UndoOutsideReply(request, metadata=bo.metadata)
    assert undone.status.state == pb.SUBJECT_STATE_FREE
    assert (undone.undone.message_id, undone.undone.recorded_by, undone.undone_by) == (
        "gmail-wrong",
        "worker-acme",
        "bo",
    )
    assert undone.undone_at.seconds > 0
    assert await bo.stub.UndoOutsideReply(request, metadata=bo.metadata) == undone  # a retry: the first answer
    event = await _events(stream, pb.EVENT_TYPE_OUTSIDE_REPLY_UNDONE)
    assert (event.status.state, event.by, event.reason, event.undone.recorded_by) == (
        pb.SUBJECT_STATE_FREE,
        "bo",
        "Ana did not answer this one",
        "worker-acme",
    )
    assert event.at == undone.undone_at
    # Answerable again: ana claims it with its thread (the thread's record of that reply was withdrawn).
    again = await _claim_in_thread(ana, subject, "t-1")
    assert again.result == pb.ClaimReplyResponse.GRANTED
    # Only a message answered outside can be undone.
    request.request_id = new_request_id()
    error = await rpc_error(bo.stub.UndoOutsideReply(request, metadata=bo.metadata))
    assert (error.code(), error_reason(error)[0]) == (grpc.StatusCode.FAILED_PRECONDITION, "WRONG_STATE")
    assert "only a message recorded as answered outside" in (error.details() or "")


async def test_the_undo_over_http(world: World) -> None:
    subject = subject_json(world.mailbox, "m-1")
    await world.json("worker-acme").call(
        "ClaimReply",
        {"requestId": "c-1", "subject": subject, "threadId": "t-1", "receivedAt": "2023-11-14T22:13:20Z"},
    )
    await world.json("worker-acme").call(
        "RecordOutgoing",
        {
            "requestId": "o-1",
            "mailbox": world.mailbox,
            "messageId": "gmail-1",
            "threadId": "t-1",
            "sentAt": "2023-11-14T22:18:20Z",
            "sender": ANA_SENDER,
        },
    )
    refused = await world.json("ana").post("UndoOutsideReply", {"requestId": "u-0", "subject": subject})
    assert refused.status_code == 403, refused.text
    undone = await world.json("bo").call("UndoOutsideReply", {"requestId": "u-1", "subject": subject, "note": "x"})
    assert undone["status"]["state"] == "SUBJECT_STATE_FREE"
    assert (undone["undoneBy"], undone["undone"]["recordedBy"], undone["undone"]["sender"]) == (
        "bo",
        "worker-acme",
        ANA_SENDER,
    )
    claimed = await world.json("ana").call(
        "ClaimReply",
        {"requestId": "c-2", "subject": subject, "threadId": "t-1", "receivedAt": "2023-11-14T22:13:20Z"},
    )
    assert claimed["result"] == "GRANTED"
