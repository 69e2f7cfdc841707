"""The HTTP/JSON face (Connect protocol), as curl or a browser would use it, against a real coordinator and etcd:
every RPC, the same answers as gRPC, the same refusals, bad bodies answered 4xx, Watch as a stream."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import socket
import struct
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from aetcd import rpc
from google.protobuf import json_format
from google.rpc import error_details_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.api.auth import TokenAuthenticator
from coordinator.api.quotas import QuotaSettings
from coordinator.ops.cli import board_line
from coordinator.ops.server import CoordinatorServer, ServerSettings
from coordinator.store.etcd.process import EtcdServer
from coordinator.store.etcd.settings import EtcdSettings
from inbox_wire.v1 import coordinator_pb2 as pb
from tests.conftest import test_rules
from tests.helpers import Actor
from tests.server.test_auth import TOKENS, _token_file

PATH = "/inbox.coordinator.v1.Coordinator/"
DEV_AGENT = {"x-inbox-principal": "agent-a", "x-inbox-principal-kind": "agent"}
DEV_HUMAN = {"x-inbox-principal": "ana", "x-inbox-principal-kind": "human"}


async def serve(etcd: EtcdServer, prefix: str, **options: Any) -> CoordinatorServer:
    server = CoordinatorServer(
        ServerSettings(
            EtcdSettings([etcd.endpoint], prefix=prefix, call_timeout_s=2.0),
            listen="127.0.0.1:0",
            rules=test_rules(send_timeout_ms=500),
            sweep_interval_s=0.2,
            health_interval_s=0.3,
            shutdown_grace_s=1.0,
            **{"http_listen": "127.0.0.1:0", **options},
        )
    )
    await server.start()
    return server


@pytest.fixture
async def server(etcd: EtcdServer, prefix: str) -> AsyncIterator[CoordinatorServer]:
    started = await serve(etcd, prefix)
    yield started
    await started.stop(grace=0.5)


@pytest.fixture
async def http(server: CoordinatorServer) -> AsyncIterator[httpx.AsyncClient]:
    assert server.http is not None
    async with httpx.AsyncClient(base_url=f"http://{server.http.address}", timeout=10) as client:
        yield client


class Json:
    """One principal calling the JSON API, as ``curl -H 'Content-Type: application/json' -d '{...}'`` would."""

    def __init__(self, client: httpx.AsyncClient, headers: dict[str, str]) -> None:
        self.client = client
        self.headers = {"content-type": "application/json", **headers}

    async def post(self, method: str, body: dict[str, Any] | bytes) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return await self.client.post(PATH + method, content=content, headers=self.headers)

    async def call(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await self.post(method, body)
        assert response.status_code == 200, response.text
        answer: dict[str, Any] = response.json()
        return answer

    async def watch(self, mailbox: str, after_revision: int = 0) -> AsyncGenerator[dict[str, Any], None]:
        """The Watch stream's messages (Connect's streaming framing: a flags byte, a length, the JSON)."""
        request = json.dumps({"mailbox": mailbox, "afterRevision": after_revision}).encode()
        headers = {**self.headers, "content-type": "application/connect+json"}
        body = struct.pack(">BI", 0, len(request)) + request
        async with self.client.stream("POST", PATH + "Watch", content=body, headers=headers) as response:
            assert response.status_code == 200
            buffer = b""
            async for chunk in response.aiter_bytes():
                buffer += chunk
                while len(buffer) >= 5:
                    flags, size = struct.unpack(">BI", buffer[:5])
                    if len(buffer) < 5 + size:
                        break
                    frame, buffer = json.loads(buffer[5 : 5 + size]), buffer[5 + size :]
                    yield {"end": frame} if flags & 0x02 else frame


def subject_json(mailbox: str, message_id: str) -> dict[str, str]:
    return {"mailbox": mailbox, "kind": "SUBJECT_KIND_MESSAGE", "id": message_id}


# Fields that differ between two runs of one script on two subjects: ids, tokens, revisions, times.
_VOLATILE = {"fencingToken", "revision", "previousToken", "acquiredAt", "expiresAt", "sendStartedAt", "sendDeadline"}
_VOLATILE |= {"sentAt", "recordedAt", "mailbox", "requestId", "notificationId"}


def _steady(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _steady(item) for key, item in value.items() if key not in _VOLATILE}
    if isinstance(value, list):
        return [_steady(item) for item in value]
    return value


async def _script(call: Callable[[str, str, dict[str, Any]], Any], mailbox: str) -> list[dict[str, Any]]:
    """Every unary RPC, in an order that exercises each; ``call(who, method, body)`` answers JSON."""
    s1, s2, s3 = (subject_json(mailbox, f"m{n}") for n in (1, 2, 3))
    answers = [await call("agent", "RecordDelivery", {"requestId": "r0", "mailbox": mailbox, "notificationId": "n0"})]
    claimed = await call(
        "agent",
        "ClaimReply",
        {"requestId": "r1", "subject": s1, "ttlSeconds": 30, "note": "drafting", "summary": {"subjectLine": "Hi"}},
    )
    token = int(claimed["status"]["fencingToken"])
    answers.append(claimed)
    answers.append(await call("agent", "RenewClaim", {"requestId": "r2", "subject": s1, "fencingToken": token}))
    answers.append(await call("agent", "BeginSend", {"requestId": "r3", "subject": s1, "fencingToken": token}))
    answers.append(
        await call(
            "agent", "ConfirmSent", {"requestId": "r4", "subject": s1, "fencingToken": token, "sentMessageId": "x"}
        )
    )
    answers.append(await call("agent", "GetStatus", {"subject": s1}))
    second = int((await call("agent", "ClaimReply", {"requestId": "r5", "subject": s2}))["status"]["fencingToken"])
    answers.append(await call("agent", "ReleaseClaim", {"requestId": "r6", "subject": s2, "fencingToken": second}))
    third = int((await call("agent", "ClaimReply", {"requestId": "r7", "subject": s3}))["status"]["fencingToken"])
    answers.append(await call("agent", "BeginSend", {"requestId": "r8", "subject": s3, "fencingToken": third}))
    answers.append(await call("agent", "AbortSend", {"requestId": "r9", "subject": s3, "fencingToken": third}))
    answers.append(await call("agent", "ClaimReply", {"requestId": "r10", "subject": s2}))
    taken = await call("human", "Takeover", {"requestId": "r11", "subject": s2, "note": "mine"})
    answers.append(taken)
    mine = int(taken["status"]["fencingToken"])
    answers.append(await call("human", "MarkReplied", {"requestId": "r12", "subject": s2, "fencingToken": mine}))
    answers.append(await call("agent", "ListClaims", {"mailbox": mailbox}))
    fourth = int((await call("agent", "ClaimReply", {"requestId": "r13", "subject": s3}))["status"]["fencingToken"])
    await call("agent", "BeginSend", {"requestId": "r14", "subject": s3, "fencingToken": fourth})
    for _ in range(100):  # the send deadline is 500 ms; the sweeper runs every 200 ms
        if (await call("agent", "GetStatus", {"subject": s3}))["status"]["state"] == "SUBJECT_STATE_IN_DOUBT":
            break
        await asyncio.sleep(0.05)
    answers.append(
        await call("human", "ResolveInDoubt", {"requestId": "r15", "subject": s3, "outcome": "OUTCOME_NOT_SENT"})
    )
    batch = {"calls": [{"getStatus": {"subject": s1}}, {"claimReply": {"requestId": "r16", "subject": s1}}]}
    answers.append(await call("agent", "Batch", batch))
    answers.append(await call("human", "GetCaller", {}))
    return answers


async def test_every_rpc_answers_over_json_as_over_grpc(
    server: CoordinatorServer, http: httpx.AsyncClient, mailbox: str
) -> None:
    callers = {"agent": Json(http, DEV_AGENT), "human": Json(http, DEV_HUMAN)}

    async def over_http(who: str, method: str, body: dict[str, Any]) -> dict[str, Any]:
        return await callers[who].call(method, body)

    async with grpc.aio.insecure_channel(server.address) as channel:
        actors = {"agent": Actor(channel, "agent-a"), "human": Actor(channel, "ana", kind="human")}

        async def over_grpc(who: str, method: str, body: dict[str, Any]) -> dict[str, Any]:
            rpc = getattr(actors[who].stub, method)
            request = json_format.ParseDict(body, getattr(pb, f"{method}Request")())
            response = await rpc(request, metadata=actors[who].metadata)
            return json_format.MessageToDict(response)

        grpc_answers = await _script(over_grpc, mailbox + "-grpc")
    http_answers = await _script(over_http, mailbox + "-http")
    assert len(http_answers) == 16
    assert http_answers[15] == {
        "principal": "ana",
        "kind": "HOLDER_KIND_HUMAN",
        "roles": ["admin", "report", "resolve", "takeover"],
        "mailboxes": ["*"],
        "developmentMode": True,
    }
    assert [_steady(answer) for answer in http_answers] == [_steady(answer) for answer in grpc_answers]
    results = [answer.get("result") for answer in http_answers]
    assert results[:5] == ["NEW", "GRANTED", "FENCE_RESULT_OK", "FENCE_RESULT_OK", "FENCE_RESULT_OK"]
    assert http_answers[11]["status"]["repliedByHand"] is True  # MarkReplied, by JSON


async def test_watch_streams_a_snapshot_then_events_and_starts_over_after_a_reconnect(
    http: httpx.AsyncClient, mailbox: str
) -> None:
    agent = Json(http, DEV_AGENT)
    await agent.call("ClaimReply", {"requestId": "w0", "subject": subject_json(mailbox, "held")})
    stream = agent.watch(mailbox)
    snapshot = (await anext(stream))["snapshot"]
    assert [s["subject"]["id"] for s in snapshot["subjects"]] == ["held"]
    claimed = await agent.call("ClaimReply", {"requestId": "w1", "subject": subject_json(mailbox, "new")})
    event = (await asyncio.wait_for(anext(stream), 5))["event"]
    assert (event["type"], event["status"]["subject"]["id"]) == ("EVENT_TYPE_CLAIMED", "new")
    assert int(event["revision"]) > int(snapshot["revision"])
    await stream.aclose()
    # A reconnecting page starts from a fresh snapshot at a later revision: nothing it missed is lost.
    token = int(claimed["status"]["fencingToken"])
    await agent.call(
        "ReleaseClaim", {"requestId": "w2", "subject": subject_json(mailbox, "new"), "fencingToken": token}
    )
    again = agent.watch(mailbox)
    resumed = (await anext(again))["snapshot"]
    assert [s["subject"]["id"] for s in resumed["subjects"]] == ["held"]
    assert int(resumed["revision"]) > int(event["revision"])
    await again.aclose()


async def test_bad_bodies_get_a_4xx_naming_the_problem_and_store_nothing(http: httpx.AsyncClient, mailbox: str) -> None:
    agent = Json(http, DEV_AGENT)
    subject = subject_json(mailbox, "m1")
    cases: list[tuple[bytes, int, str]] = [
        (b"{not json", 400, "the body is not JSON"),
        (b"[1, 2]", 400, "must be a JSON object"),
        (json.dumps({"requestId": "r", "subject": subject, "colour": "blue"}).encode(), 400, "colour"),
        (json.dumps({"requestId": "r", "subject": subject, "ttlSeconds": "soon"}).encode(), 400, "ttlSeconds"),
        (json.dumps({"requestId": "r", "subject": {**subject, "id": ""}}).encode(), 400, "subject.id"),
        (json.dumps({"requestId": "r", "subject": subject, "note": "n" * 2000}).encode(), 400, "note"),
        (b"{" + b" " * (1 << 20) + b"}", 413, "the limit is 1048576"),
    ]
    for body, status, named in cases:
        response = await agent.post("ClaimReply", body)
        assert response.status_code == status, (body[:60], response.text)
        assert named in response.json()["message"]
    listing = await agent.call("ListClaims", {"mailbox": mailbox})
    assert listing.get("subjects", []) == []
    unauthenticated = await Json(http, {}).post("ClaimReply", {"requestId": "r", "subject": subject})
    assert unauthenticated.status_code == 401
    assert "x-inbox-principal" in unauthenticated.json()["message"]


async def test_http_calls_are_counted_and_logged_as_grpc_calls_are(
    server: CoordinatorServer, http: httpx.AsyncClient, mailbox: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="inbox_coordinator.rpc")  # answered calls: debug lines
    before = server.metrics.rpcs.labels("inbox.coordinator.v1.Coordinator", "ClaimReply", "granted")._value.get()
    await Json(http, DEV_AGENT).call("ClaimReply", {"requestId": "log-1", "subject": subject_json(mailbox, "m1")})
    after = server.metrics.rpcs.labels("inbox.coordinator.v1.Coordinator", "ClaimReply", "granted")._value.get()
    assert after == before + 1
    (record,) = [r for r in caplog.records if getattr(r, "fields", {}).get("request_id") == "log-1"]
    fields = record.fields  # type: ignore[attr-defined]
    assert (fields["method"], fields["result"], fields["principal"], fields["mailbox"]) == (
        "ClaimReply",
        "granted",
        "agent-a",
        mailbox,
    )
    assert fields["peer"].startswith("http:127.0.0.1:")


@pytest.fixture
async def secured(etcd: EtcdServer, prefix: str, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    started = await serve(etcd, prefix, authenticator=TokenAuthenticator(_token_file(tmp_path / "tokens.toml")))
    assert started.http is not None
    async with httpx.AsyncClient(base_url=f"http://{started.http.address}", timeout=10) as client:
        yield client
    await started.stop(grace=0.5)


def bearer(client: httpx.AsyncClient, name: str) -> Json:
    return Json(client, {"authorization": f"Bearer {TOKENS[name]}"})


@pytest.mark.parametrize(
    ("who", "method", "body"),
    [
        ("agent-a", "ClaimReply", {"requestId": "x", "subject": subject_json("globex", "m")}),
        ("agent-b", "ClaimReply", {"requestId": "x", "subject": subject_json("acme-1", "m")}),
        ("agent-b", "GetStatus", {"subject": subject_json("acme-1", "m")}),
        ("agent-b", "ListClaims", {"mailbox": "acme-1"}),
        ("agent-b", "RecordDelivery", {"requestId": "x", "mailbox": "acme-1", "notificationId": "n"}),
        ("ana", "Takeover", {"requestId": "x", "subject": subject_json("globex", "m")}),
        ("bo", "Takeover", {"requestId": "x", "subject": subject_json("acme-1", "m")}),
        ("agent-b", "MarkReplied", {"requestId": "x", "subject": subject_json("acme-1", "m"), "fencingToken": 1}),
    ],
)
async def test_tokens_reach_the_same_principals_and_grants_over_http(
    secured: httpx.AsyncClient, who: str, method: str, body: dict[str, Any]
) -> None:
    refused = await bearer(secured, who).post(method, body)
    assert refused.status_code == 403, refused.text
    assert refused.json()["code"] == "permission_denied"
    assert f"{who!r}" in refused.json()["message"]  # the gRPC refusal's words: who, and what they lack


@pytest.mark.parametrize(
    ("who", "kind", "roles", "mailboxes"),
    [
        ("agent-a", "HOLDER_KIND_AGENT", [], ["acme-*"]),
        ("ana", "HOLDER_KIND_HUMAN", ["resolve", "takeover"], ["acme-*"]),
        ("bo", "HOLDER_KIND_HUMAN", [], ["acme-*"]),
        ("root", "HOLDER_KIND_HUMAN", ["admin", "report", "resolve", "takeover"], ["*"]),
    ],
)
async def test_get_caller_tells_a_token_principal_who_it_is_over_grpc_and_http(
    etcd: EtcdServer, prefix: str, tmp_path: Path, who: str, kind: str, roles: list[str], mailboxes: list[str]
) -> None:
    started = await serve(etcd, prefix, authenticator=TokenAuthenticator(_token_file(tmp_path / "tokens.toml")))
    assert started.http is not None
    try:
        async with (
            httpx.AsyncClient(base_url=f"http://{started.http.address}", timeout=10) as client,
            grpc.aio.insecure_channel(started.address) as channel,
        ):
            over_http = await bearer(client, who).call("GetCaller", {})
            actor = Actor(channel, who, token=TOKENS[who])
            over_grpc = json_format.MessageToDict(
                await actor.stub.GetCaller(pb.GetCallerRequest(), metadata=actor.metadata)
            )
            unknown = await Json(client, {"authorization": "Bearer nope"}).post("GetCaller", {})
    finally:
        await started.stop(grace=0.5)
    expected: dict[str, Any] = {"principal": who, "kind": kind, "mailboxes": mailboxes}
    if roles:
        expected["roles"] = roles  # proto3 JSON leaves an empty list out
    assert over_http == expected
    assert over_grpc == expected
    assert unknown.status_code == 401


async def test_a_token_is_required_and_a_granted_one_works_over_http(secured: httpx.AsyncClient) -> None:
    assert (
        await Json(secured, DEV_AGENT).post("GetStatus", {"subject": subject_json("acme-1", "m")})
    ).status_code == 401
    wrong = await Json(secured, {"authorization": "Bearer nope"}).post(
        "GetStatus", {"subject": subject_json("acme-1", "m")}
    )
    assert wrong.status_code == 401
    granted = await bearer(secured, "agent-a").call(
        "ClaimReply", {"requestId": "ok", "subject": subject_json("acme-1", "m")}
    )
    assert (granted["result"], granted["status"]["holder"]) == ("GRANTED", "agent-a")


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
_fields = st.sampled_from(
    [
        "requestId",
        "subject",
        "mailbox",
        "kind",
        "id",
        "fencingToken",
        "ttlSeconds",
        "note",
        "summary",
        "states",
        "calls",
    ]
)
_bodies = st.one_of(
    st.binary(max_size=64),
    _json_values.map(lambda value: json.dumps(value).encode()),
    st.dictionaries(_fields, _json_values, max_size=5).map(lambda value: json.dumps(value).encode()),
)
_methods = st.sampled_from([m.name for m in pb.DESCRIPTOR.services_by_name["Coordinator"].methods if m.name != "Watch"])


async def test_fuzzed_json_bodies_never_get_a_5xx(server: CoordinatorServer, mailbox: str) -> None:
    assert server.http is not None
    address = server.http.address
    failures: list[str] = []

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(method=_methods, body=_bodies)
    def probe(method: str, body: bytes) -> None:
        response = httpx.post(
            f"http://{address}{PATH}{method}",
            content=body,
            headers={"content-type": "application/json", **DEV_AGENT},
            timeout=10,
        )
        if response.status_code >= 500:
            failures.append(f"{method} {body[:80]!r}: {response.status_code} {response.text[:200]}")

    await asyncio.to_thread(probe)
    assert failures == []


async def test_a_taken_default_port_moves_to_a_free_one_said_plainly_and_an_asked_for_one_is_an_error(
    etcd: EtcdServer, prefix: str, server: CoordinatorServer
) -> None:
    assert server.http is not None
    taken = server.http.address
    with pytest.raises(OSError, match=f"cannot serve HTTP on {taken}"):
        await serve(etcd, prefix, http_listen=taken)
    # The default address of development mode (http_optional): the board is served on the next free port...
    moved = await serve(etcd, prefix, http_listen=taken, http_optional=True)
    try:
        assert moved.http is not None
        assert moved.http.address != taken
        taken_port = int(taken.rpartition(":")[2])
        assert moved.http.taken_port == taken_port
        async with httpx.AsyncClient(base_url=f"http://{moved.http.address}") as client:
            page = await client.get("/")
        assert page.status_code == 200
        assert "Who is answering what" in page.text
        # ... and the banner says where, and why there, in the words the person reads.
        line = board_line(moved)
        assert line.startswith(
            f"inbox-coordinator: claims board on http://{moved.http.address}/ (HTTP/JSON API under "
            "/inbox.coordinator.v1.Coordinator/; at most "
        ), line
        assert line.endswith(
            f"; port {taken_port} is taken by another program, so this coordinator took the next free one "
            "(--http-listen chooses))"
        ), line
    finally:
        await moved.stop(grace=0.5)
    line = board_line(server)
    assert line.startswith(f"inbox-coordinator: claims board on http://{taken}/ (HTTP/JSON API under "), line
    assert "is taken" not in line


async def test_an_optional_http_face_that_cannot_be_served_at_all_is_said_in_the_banner(
    etcd: EtcdServer, prefix: str
) -> None:
    # Not a taken port (that moves) but an address this machine does not have.
    quiet = await serve(etcd, prefix, http_listen="192.0.2.1:8080", http_optional=True)
    try:
        assert quiet.http is None  # serving gRPC without the HTTP face
        assert board_line(quiet).startswith("inbox-coordinator: no claims board: cannot serve HTTP on 192.0.2.1:8080 (")
    finally:
        await quiet.stop(grace=0.5)


async def test_watch_resumes_after_a_reconnect_from_the_last_revision_it_sent(
    http: httpx.AsyncClient, etcd: EtcdServer, mailbox: str
) -> None:
    agent = Json(http, DEV_AGENT)
    held = await agent.call("ClaimReply", {"requestId": "a", "subject": subject_json(mailbox, "a")})
    stream = agent.watch(mailbox)
    last = int((await anext(stream))["snapshot"]["revision"])
    await stream.aclose()
    # While the page is away: a release, a new claim, and a claim made and released (no net change).
    token = int(held["status"]["fencingToken"])
    await agent.call("ReleaseClaim", {"requestId": "b", "subject": subject_json(mailbox, "a"), "fencingToken": token})
    await agent.call("ClaimReply", {"requestId": "c", "subject": subject_json(mailbox, "b")})
    brief = await agent.call("ClaimReply", {"requestId": "d", "subject": subject_json(mailbox, "brief")})
    token = int(brief["status"]["fencingToken"])
    await agent.call(
        "ReleaseClaim", {"requestId": "e", "subject": subject_json(mailbox, "brief"), "fencingToken": token}
    )
    resumed = agent.watch(mailbox, after_revision=last)
    missed = [(await asyncio.wait_for(anext(resumed), 5))["event"] for _ in range(2)]
    assert [(e["type"], e["status"]["subject"]["id"]) for e in missed] == [
        ("EVENT_TYPE_RELEASED", "a"),
        ("EVENT_TYPE_CLAIMED", "b"),
    ]
    assert last < int(missed[0]["revision"]) < int(missed[1]["revision"])
    # Then live, with nothing repeated.
    await agent.call("ClaimReply", {"requestId": "f", "subject": subject_json(mailbox, "c")})
    live = (await asyncio.wait_for(anext(resumed), 5))["event"]
    assert (live["type"], live["status"]["subject"]["id"]) == ("EVENT_TYPE_CLAIMED", "c")
    await resumed.aclose()

    # A revision etcd compacted away: a snapshot, as for a first connection.
    async with grpc.aio.insecure_channel(etcd.endpoint) as channel:
        kv = rpc.KVStub(channel)
        now = (await kv.Range(rpc.RangeRequest(key=b"x", count_only=True))).header.revision
        await kv.Compact(rpc.CompactionRequest(revision=now, physical=True))
    compacted = agent.watch(mailbox, after_revision=last)
    snapshot = (await asyncio.wait_for(anext(compacted), 5))["snapshot"]
    assert sorted(s["subject"]["id"] for s in snapshot["subjects"]) == ["b", "c"]
    await compacted.aclose()
    ahead = agent.watch(mailbox, after_revision=int(snapshot["revision"]) + 1000)
    ended = await asyncio.wait_for(anext(ahead), 5)
    assert ended["end"]["error"]["code"] == "invalid_argument"
    assert "after_revision" in ended["end"]["error"]["message"]
    await ahead.aclose()


async def test_the_rate_limit_answers_429_with_when_to_retry(etcd: EtcdServer, prefix: str, mailbox: str) -> None:
    limited = await serve(etcd, prefix, quotas=QuotaSettings(calls_per_second=1, burst=1))
    try:
        assert limited.http is not None
        async with httpx.AsyncClient(base_url=f"http://{limited.http.address}") as client:
            agent = Json(client, DEV_AGENT)
            answers = [await agent.post("GetStatus", {"subject": subject_json(mailbox, "m")}) for _ in range(3)]
        refused = answers[-1]
        assert refused.status_code == 429
        assert refused.json()["code"] == "resource_exhausted"
        assert "over its limit of 1 calls/s" in refused.json()["message"]
        assert 0 < int(refused.headers["retry-after-ms"]) <= 1000
        assert _error_reasons(refused) == ["RATE_LIMITED"]
    finally:
        await limited.stop(grace=0.5)


def _error_reasons(response: httpx.Response) -> list[str]:
    """The google.rpc.ErrorInfo reasons a Connect error body carries in its details."""
    reasons = []
    for detail in response.json().get("details", []):
        assert detail["type"] in ("google.rpc.ErrorInfo", "google.rpc.RetryInfo"), detail
        if detail["type"] == "google.rpc.ErrorInfo":
            value = base64.b64decode(detail["value"] + "=" * (-len(detail["value"]) % 4))
            reasons.append(error_details_pb2.ErrorInfo.FromString(value).reason)
    return reasons


async def test_an_error_over_http_carries_the_same_machine_readable_reason_as_over_grpc(
    http: httpx.AsyncClient, mailbox: str
) -> None:
    agent = Json(http, DEV_AGENT)
    await agent.call("ClaimReply", {"requestId": "c1", "subject": subject_json(mailbox, "m"), "ttlSeconds": 30})
    reused = await agent.post(
        "ClaimReply", {"requestId": "c1", "subject": subject_json(mailbox, "m"), "ttlSeconds": 40}
    )
    assert reused.status_code == 400
    assert _error_reasons(reused) == ["REQUEST_ID_REUSED"]
    too_long = await agent.post("GetStatus", {"subject": subject_json(mailbox, "m" * 600)})
    assert too_long.status_code == 400
    assert _error_reasons(too_long) == ["INVALID_FIELD"]


async def test_errors_read_the_same_from_the_json_fast_path_as_from_connect_python(
    http: httpx.AsyncClient, mailbox: str
) -> None:
    """The JSON fast path writes Connect's error bodies itself; connect-python answers application/proto calls.
    One failing request each way: the same HTTP status and the same JSON (code, message, details with debug)."""
    agent = Json(http, DEV_AGENT)
    await agent.call("ClaimReply", {"requestId": "c1", "subject": subject_json(mailbox, "m"), "ttlSeconds": 30})
    subject = pb.Subject(mailbox=mailbox, kind=pb.SUBJECT_KIND_MESSAGE, id="m")
    failing = [
        ("ClaimReply", pb.ClaimReplyRequest(request_id="c1", subject=subject, ttl_seconds=40)),  # REQUEST_ID_REUSED
        (
            "GetStatus",
            pb.GetStatusRequest(subject=pb.Subject(mailbox=mailbox, kind=pb.SUBJECT_KIND_MESSAGE, id="m" * 600)),
        ),
        ("Takeover", pb.TakeoverRequest(request_id="t1", subject=subject)),  # an agent may not take over
        ("ListClaims", pb.ListClaimsRequest(mailbox=mailbox, page_token="not-a-token")),
    ]
    for method, request in failing:
        as_json = await agent.post(method, json_format.MessageToDict(request))
        as_proto = await http.post(
            PATH + method,
            content=request.SerializeToString(),
            headers={**DEV_AGENT, "content-type": "application/proto"},
        )
        assert as_json.status_code == as_proto.status_code, method
        assert as_json.status_code >= 400, method
        assert as_json.json() == as_proto.json(), method
        assert as_json.json()["details"][0]["debug"]["reason"], method


async def test_the_http_listener_turns_nagle_off_for_the_connections_it_accepts(server: CoordinatorServer) -> None:
    """uvicorn writes an answer's head and body apart: with Nagle's algorithm on (asyncio leaves it on for the
    sockets of a listener made by socket.create_server), the body waited for the client's delayed ACK, 40 ms
    on every call of a kept-alive connection. Linux hands the listener's TCP_NODELAY to accepted sockets."""
    assert server.http is not None
    listener = server.http._socket
    assert listener is not None
    assert listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
