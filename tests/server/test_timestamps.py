"""Every google.protobuf.Timestamp a request carries, found by walking the proto's descriptors (every RPC's
request, nested messages, every call a Batch may carry), is refused INVALID_ARGUMENT naming its field when it lies
outside protobuf's range or outside what a message's date may be (before 1970, or further ahead of the
coordinator's clock than the stated tolerance): over gRPC, and over HTTP as JSON and as binary protobuf. A new
Timestamp field fails this test until it has a valid request here, and then is held to the same."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf import json_format
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from google.rpc import error_details_pb2

from coordinator.core.limits import TIME_AHEAD_TOLERANCE_MS
from coordinator.ops.server import CoordinatorServer
from coordinator.store.etcd.process import EtcdServer
from inbox_wire.v1 import coordinator_pb2 as pb
from tests.helpers import Actor, error_reason
from tests.server.test_http import DEV_HUMAN, PATH, serve

SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"]
TIMESTAMP = Timestamp.DESCRIPTOR.full_name
PAST_S = 1_700_000_000  # 2023-11-14: a message's date well in the past
YEAR_10000_S = 253_402_300_800
BEFORE_YEAR_1_S = -62_135_596_801
LAST_SECOND_OF_9999_S = 253_402_300_799
DAY_S = 86_400


def _valid_requests(mailbox: str) -> dict[str, Message]:
    """A request that succeeds, for every RPC whose request holds a Timestamp (Batch: built from these)."""
    subject = pb.Subject(mailbox=mailbox, kind=pb.SUBJECT_KIND_MESSAGE, id=f"m-{uuid.uuid4().hex[:8]}")
    at = Timestamp(seconds=PAST_S)
    summary = pb.MessageSummary(subject_line="Refund", sender="Bo <bo@example.com>", received_at=at)
    return {
        "ClaimReply": pb.ClaimReplyRequest(
            request_id=uuid.uuid4().hex, subject=subject, summary=summary, thread_id="t-1", received_at=at
        ),
        "Takeover": pb.TakeoverRequest(request_id=uuid.uuid4().hex, subject=subject, summary=summary),
        "RecordOutgoing": pb.RecordOutgoingRequest(
            request_id=uuid.uuid4().hex, mailbox=mailbox, message_id="gmail-1", thread_id="t-1", sent_at=at
        ),
        "RecordIncoming": pb.RecordIncomingRequest(
            request_id=uuid.uuid4().hex,
            mailbox=mailbox,
            message_id="ooo-1",
            thread_id="t-1",
            received_at=at,
            summary=pb.MessageSummary(received_at=at),
        ),
    }


def _paths(descriptor: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every path to a Timestamp field, through singular and repeated messages (a repeated one as ``name[0]``)."""
    for field in descriptor.fields:
        if field.message_type is None:
            continue
        name = f"{field.name}[0]" if field.is_repeated else field.name
        if field.message_type.full_name == TIMESTAMP:
            yield (*path, name)
        else:
            yield from _paths(field.message_type, (*path, name))


def _rpc_of(message_type: Any) -> str:
    return next(method.name for method in SERVICE.methods if method.input_type is message_type)


@dataclass(frozen=True)
class Case:
    """One request with one Timestamp set to a value it must be refused for."""

    rpc: str
    path: tuple[str, ...]
    request: Message
    # The field the refusal must name: for a call inside a Batch, the call's own field (as that RPC alone names it).
    field: str

    @property
    def batched(self) -> bool:
        return self.rpc == "Batch"


def _stamp_at(request: Message, path: tuple[str, ...]) -> Timestamp:
    container: Any = request
    for part in path:
        name, repeated = part.removesuffix("[0]"), part.endswith("[0]")
        container = getattr(container, name)
        if repeated:
            container = container[0] if len(container) else container.add()
    assert isinstance(container, Timestamp)
    return container


def _cases(mailbox: str, values: dict[str, tuple[int, int]], *, field_suffix: Callable[[str], str]) -> list[Case]:
    """Every Timestamp field of every RPC's request set to each of ``values`` (label -> (seconds, nanos))."""
    cases = []
    for method in SERVICE.methods:
        for path in _paths(method.input_type):
            for label, (seconds, nanos) in values.items():
                valid = _valid_requests(mailbox)  # each case a request (and a subject) of its own
                if method.name == "Batch":
                    # calls[0].<call>.<field...>: a Batch of one call, of the RPC that call stands for.
                    call_field = pb.BatchCall.DESCRIPTOR.fields_by_name[path[1]]
                    inner_rpc = _rpc_of(call_field.message_type)
                    assert inner_rpc in valid, f"no valid {inner_rpc} request here: add one to _valid_requests"
                    call = pb.BatchCall()
                    getattr(call, path[1]).CopyFrom(valid[inner_rpc])
                    request: Message = pb.BatchRequest(calls=[call])
                    field = ".".join(path[2:])
                else:
                    assert method.name in valid, (
                        f"{method.name}'s request holds a Timestamp ({'.'.join(path)}): add a valid {method.name} "
                        "request to _valid_requests, so that its times are held to the same limits"
                    )
                    request = valid[method.name]
                    field = ".".join(path)
                stamp = _stamp_at(request, path)
                stamp.seconds, stamp.nanos = seconds, nanos
                named = field_suffix(field) if label.startswith("nanos") else field
                cases.append(Case(method.name, path, request, named))
    return cases


def _bad_values(now_s: int) -> dict[str, tuple[int, int]]:
    ahead_s = TIME_AHEAD_TOLERANCE_MS // 1000
    return {
        "year 10000": (YEAR_10000_S, 0),
        "before year 1": (BEFORE_YEAR_1_S, 0),
        "nanos below 0": (PAST_S, -1),
        "nanos of a whole second": (PAST_S, 1_000_000_000),
        "the last second of 9999": (LAST_SECOND_OF_9999_S, 0),
        "a year ahead": (now_s + 365 * DAY_S, 0),
        "just past the tolerance": (now_s + ahead_s + 120, 0),
        "1969": (-DAY_S, 0),
    }


@pytest.fixture
async def server(etcd: EtcdServer, prefix: str) -> AsyncIterator[CoordinatorServer]:
    started = await serve(etcd, prefix)
    yield started
    await started.stop(grace=0.5)


def test_the_walk_finds_the_timestamps_requests_carry() -> None:
    """The walk itself: it reaches the fields known today, nested ones and those inside Batch included."""
    found = {(method.name, ".".join(path)) for method in SERVICE.methods for path in _paths(method.input_type)}
    assert {
        ("ClaimReply", "received_at"),
        ("ClaimReply", "summary.received_at"),
        ("Takeover", "summary.received_at"),
        ("RecordOutgoing", "sent_at"),
        ("RecordIncoming", "received_at"),
        ("RecordIncoming", "summary.received_at"),
        ("Batch", "calls[0].claim_reply.received_at"),
        ("Batch", "calls[0].claim_reply.summary.received_at"),
        ("Batch", "calls[0].record_outgoing.sent_at"),
    } <= found


@dataclass(frozen=True)
class Refusal:
    code: grpc.StatusCode
    message: str
    reason: str
    field: str  # the ErrorInfo's; a call inside a Batch has none, and names the field in its message only


async def _refusal(ana: Actor, case: Case) -> Refusal | None:
    """How the call was refused over gRPC (alone, or as the one call of a Batch); None when it was taken."""
    if case.batched:
        assert isinstance(case.request, pb.BatchRequest)
        (result,) = await ana.batch(*case.request.calls)
        if result.WhichOneof("result") != "error":
            return None
        error = result.error
        return Refusal(
            grpc.StatusCode(next(c for c in grpc.StatusCode if c.value[0] == error.code)),
            error.message,
            error.reason,
            case.field,
        )
    try:
        await getattr(ana.stub, case.rpc)(case.request, metadata=ana.metadata)
    except grpc.aio.AioRpcError as failure:
        reason, _, metadata = error_reason(failure)
        return Refusal(failure.code(), failure.details() or "", reason, metadata.get("field", ""))
    return None


async def test_every_timestamp_out_of_range_is_refused_over_grpc_naming_its_field(
    server: CoordinatorServer, mailbox: str
) -> None:
    cases = _cases(mailbox, _bad_values(int(time.time())), field_suffix=lambda field: f"{field}.nanos")
    assert len({(case.rpc, case.path) for case in cases}) >= 7
    async with grpc.aio.insecure_channel(server.address) as channel:
        ana = Actor(channel, "ana", kind="human")
        for case in cases:
            refusal = await _refusal(ana, case)
            assert refusal is not None, case
            assert (refusal.code, refusal.reason, refusal.field) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                "INVALID_FIELD",
                case.field,
            ), (case, refusal)
            assert refusal.message.startswith(f"{case.field}: "), (case, refusal)
        # Refused, so nothing was stored.
        assert list((await ana.list(mailbox)).subjects) == []


async def test_dates_within_the_tolerance_and_the_past_are_taken(server: CoordinatorServer, mailbox: str) -> None:
    """The other side of the bound: a date a few minutes ahead (a provider's clock a little fast) is taken."""
    now_s = int(time.time())
    taken = _cases(mailbox, {"ahead within the tolerance": (now_s + 300, 0)}, field_suffix=str)
    async with grpc.aio.insecure_channel(server.address) as channel:
        ana = Actor(channel, "ana", kind="human")
        for case in taken:
            assert await _refusal(ana, case) is None, case


def _http_error(response: httpx.Response) -> tuple[str, str]:
    """(message, the ErrorInfo's field) of a Connect error body."""
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["code"] == "invalid_argument", body
    fields = [
        error_details_pb2.ErrorInfo.FromString(base64.b64decode(d["value"] + "=" * (-len(d["value"]) % 4)))
        for d in body.get("details", [])
        if d["type"] == "google.rpc.ErrorInfo"
    ]
    assert len(fields) == 1, body
    assert fields[0].reason == "INVALID_FIELD", body
    return body["message"], fields[0].metadata["field"]


async def test_every_timestamp_out_of_range_is_refused_over_http_naming_its_field(
    server: CoordinatorServer, mailbox: str
) -> None:
    assert server.http is not None
    now_s = int(time.time())
    # Binary protobuf carries any seconds and nanos, as gRPC does.
    binary = _cases(mailbox, _bad_values(now_s), field_suffix=lambda field: f"{field}.nanos")
    # JSON carries a time as RFC 3339 text: years 0001 to 9999 and 0 to 9 fractional digits. What lies outside is
    # written as text no time parses: the placeholder second is replaced by it.
    placeholder_s = 12_345
    in_json = {
        "year 10000": ("10000-01-01T00:00:00Z", False),
        "year 0": ("0000-12-31T00:00:00Z", False),
        "the last second of 9999": ("9999-12-31T23:59:59Z", True),
        "a year ahead": (json_format.MessageToDict(Timestamp(seconds=now_s + 365 * DAY_S)), True),
        "1969": ("1969-12-31T00:00:00Z", True),
    }
    json_cases = [
        (case, text, parsed)
        for label, (text, parsed) in in_json.items()
        for case in _cases(mailbox, {label: (placeholder_s, 0)}, field_suffix=str)
    ]
    async with httpx.AsyncClient(base_url=f"http://{server.http.address}", timeout=10) as http:
        for case in binary:
            response = await http.post(
                PATH + case.rpc,
                content=case.request.SerializeToString(),
                headers={**DEV_HUMAN, "content-type": "application/proto"},
            )
            if case.batched:
                assert response.status_code == 200, (case, response.text)
                (result,) = pb.BatchResponse.FromString(response.content).results
                assert result.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], (case, result)
                assert result.error.message.startswith(f"{case.field}: "), (case, result.error.message)
                continue
            message, field = _http_error(response)
            assert (message.startswith(f"{case.field}: "), field) == (True, case.field), (case, message)
        for case, text, parsed in json_cases:
            document = json.dumps(json_format.MessageToDict(case.request))
            placeholder = json.dumps(json_format.MessageToDict(Timestamp(seconds=placeholder_s)))
            assert document.count(placeholder) == 1, document
            document = document.replace(placeholder, json.dumps(text))
            response = await http.post(
                PATH + case.rpc, content=document.encode(), headers={**DEV_HUMAN, "content-type": "application/json"}
            )
            if case.batched and parsed:  # read, then refused by the call: the call's error, as over gRPC
                assert response.status_code == 200, (case, response.text)
                error = response.json()["results"][0]["error"]
                assert (error["code"], error["message"].split(":")[0]) == (3, case.field), (case, text, error)
                continue
            # Not readable as JSON's time: the body is refused whole, naming the field by its path in the body.
            message, field = _http_error(response)
            named = case.field if parsed else ".".join(case.path)
            assert (message.split(":")[0], field) == (named, named), (case, text, message)
        async with grpc.aio.insecure_channel(server.address) as channel:
            assert list((await Actor(channel, "ana", kind="human").list(mailbox)).subjects) == []
