"""The gRPC service over the in-memory store and over etcd, the same tests: protobuf in and out, status codes
and page tokens on the wire. The memory runs are in the fast loop; the etcd runs carry the etcd marker."""

from __future__ import annotations

import base64
import uuid
from collections.abc import AsyncIterator

import grpc
import pytest

from coordinator.api.service import CoordinatorServicer
from coordinator.core.domain import Subject, SubjectKind
from coordinator.core.engine import Engine
from coordinator.core.limits import PAGE_TOKEN_MAX_BYTES
from coordinator.core.storage import Store, encode_cursor
from coordinator.ops.server import wall_clock_ms
from inbox_wire.v1 import coordinator_pb2 as pb
from inbox_wire.v1 import coordinator_pb2_grpc as pb_grpc
from tests.conftest import test_rules
from tests.helpers import Actor, message, rpc_error


@pytest.fixture
async def channel(store: Store) -> AsyncIterator[grpc.aio.Channel]:
    server = grpc.aio.server()
    pb_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(Engine(store, test_rules(), wall_clock_ms)), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as opened:
        yield opened
    await server.stop(0)


async def test_claim_send_and_confirm_over_the_wire(channel: grpc.aio.Channel) -> None:
    agent, other = Actor(channel, "agent-a"), Actor(channel, "agent-b")
    subject = message("box", "m-1")
    granted = await agent.claim(subject)
    assert granted.result == pb.ClaimReplyResponse.GRANTED
    assert (await other.claim(subject)).result == pb.ClaimReplyResponse.HELD
    token = granted.status.fencing_token
    assert (await agent.begin(subject, token + 1)).result == pb.FENCE_RESULT_STALE_TOKEN
    assert (await agent.begin(subject, token)).result == pb.FENCE_RESULT_OK
    assert (await agent.status(subject)).state == pb.SUBJECT_STATE_SENDING


async def test_page_tokens_are_opaque_and_checked(channel: grpc.aio.Channel) -> None:
    agent = Actor(channel, "agent-a")
    for n in range(5):
        await agent.claim(message("box", f"m-{n}"))
    first = await agent.list("box", page_size=2)
    assert first.next_page_token.startswith("v1:")
    ids = [s.subject.id for s in first.subjects]
    token = first.next_page_token
    while token:
        page = await agent.list("box", page_size=2, page_token=token)
        ids.extend(s.subject.id for s in page.subjects)
        token = page.next_page_token
    assert ids == [f"m-{n}" for n in range(5)]
    for bad, words in ((first.next_page_token, "does not belong"), ("YWJj", "start without one")):
        error = await rpc_error(agent.list("other-box", page_token=bad))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in (error.details() or "")


def _crafted(body: bytes, version: str = "v1:") -> str:
    return version + base64.urlsafe_b64encode(body).decode().rstrip("=")


# Tokens nobody issued, each as an attacker would shape it; "box" is the mailbox listed.
CRAFTED_TOKENS = {
    "nested arrays": _crafted(b"[" * 5000 + b"]" * 5000),
    "nested arrays within the length limit": _crafted(b"[" * 1400 + b"]" * 1400),
    "nested objects": _crafted(b'{"a":' * 3000 + b"1" + b"}" * 3000),
    "arrays nested in the fields": _crafted(b'["box","m",' + b"[" * 1200 + b"]" * 1200 + b"]"),
    "huge": _crafted(b'["box","m","' + b"x" * 600_000 + b'"]'),
    "just over the limit": "v1:" + "A" * (PAGE_TOKEN_MAX_BYTES - 2),
    "another version": "v2:" + encode_cursor(Subject("box", SubjectKind.MESSAGE, "m"))[3:],
    "no version": encode_cursor(Subject("box", SubjectKind.MESSAGE, "m"))[3:],
    "another tenant's": encode_cursor(Subject("other-tenant", SubjectKind.MESSAGE, "m")),
    "numbers": _crafted(b'["box",1,2]'),
    "four fields": _crafted(b'["box","m","m-1","x"]'),
    "an unknown kind": _crafted(b'["box","letter","m-1"]'),
    "not UTF-8": _crafted(b'["box","m","\xff\xfe"]'),
    "a lone surrogate": _crafted(b'["box","m","\\ud800"]'),
    "not base64": "v1:!!!",
    "empty body": "v1:",
}


@pytest.mark.parametrize("name", sorted(CRAFTED_TOKENS))
async def test_a_crafted_page_token_is_invalid_argument(channel: grpc.aio.Channel, name: str) -> None:
    agent = Actor(channel, "agent-a")
    await agent.claim(message("box", "m-1"))
    error = await rpc_error(agent.list("box", states=(pb.SUBJECT_STATE_CLAIMED,), page_token=CRAFTED_TOKENS[name]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "page_token" in (error.details() or "")
    # Whatever the tokens did, the listing still answers.
    assert [s.subject.id for s in (await agent.list("box")).subjects] == ["m-1"]


async def test_a_batch_answers_each_call(channel: grpc.aio.Channel) -> None:
    agent = Actor(channel, "agent-a")
    calls = [
        pb.BatchCall(claim_reply=pb.ClaimReplyRequest(request_id=uuid.uuid4().hex, subject=message("box", "b"))),
        pb.BatchCall(claim_reply=pb.ClaimReplyRequest(request_id=uuid.uuid4().hex, subject=message("box", "b"))),
        pb.BatchCall(claim_reply=pb.ClaimReplyRequest(request_id="", subject=message("box", "c"))),
    ]
    results = await agent.batch(*calls)
    answers = sorted(r.claim_reply.result for r in results[:2])
    assert answers == sorted([pb.ClaimReplyResponse.GRANTED, pb.ClaimReplyResponse.HELD])
    assert results[2].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]


async def test_recent_messages_and_a_takeover_from_a_named_colleague_over_the_wire(channel: grpc.aio.Channel) -> None:
    mailbox = f"wire-{uuid.uuid4().hex}"
    agent = Actor(channel, "agent-a")
    bo, ana = Actor(channel, "bo", kind="human"), Actor(channel, "ana", kind="human")
    summary = pb.MessageSummary(subject_line="Refund for order 1182?", sender="Bea <bea@example.org>")
    await agent.stub.ClaimReply(
        pb.ClaimReplyRequest(
            request_id=uuid.uuid4().hex, subject=message(mailbox, "m-1"), notification_id="n-1", summary=summary
        ),
        metadata=agent.metadata,
    )
    (recent,) = (await ana.recent(mailbox, query="refund")).messages
    assert (recent.subject.id, recent.summary.subject_line, recent.seen_by) == (
        "m-1",
        "Refund for order 1182?",
        "agent-a",
    )
    assert recent.first_seen_at.seconds > 0
    error = await rpc_error(ana.recent(mailbox, page_size=101))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "page_size" in (error.details() or "")

    held = await bo.claim(message(mailbox, "m-2"))
    assert (await ana.takeover(message(mailbox, "m-2"))).result == pb.TakeoverResponse.HELD
    taken = await ana.takeover(message(mailbox, "m-2"), from_person="bo")
    assert (taken.result, taken.previous_holder) == (pb.TakeoverResponse.TAKEN_OVER, "bo")
    assert taken.previous_token == held.status.fencing_token
    assert taken.status.holder == "ana"
