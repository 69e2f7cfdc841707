"""The wire contract a client written from the proto alone relies on: undecodable requests are refused
INVALID_ARGUMENT with a message a person can act on (and counted), and errors carry google.rpc details."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from coordinator.api.service import SERVICE_NAME
from coordinator.api.status import DOMAIN
from coordinator.ops.server import CoordinatorServer
from inbox_wire.v1 import coordinator_pb2 as pb
from tests.helpers import Actor, error_reason, eventually, message, rpc_error

DEV_METADATA = (("x-inbox-principal", "agent-a"), ("x-inbox-principal-kind", "agent"))

# Every RPC of the service, by name, with whether it streams its answer.
RPCS = [(method.name, method.server_streaming) for method in pb.DESCRIPTOR.services_by_name["Coordinator"].methods]

NOT_PROTOBUF = b"\xff\xff\xff\xff"  # field number 0, wire type 7: not protobuf at all
_MARKER = "\u00e9" * 4  # UTF-8 c3 a9 c3 a9 ...
_CUT = b"\xc3\x28" * 4  # as a string cut inside each two-byte character (an unpaired surrogate's fate)


def _set_a_string(request: Any) -> bool:
    """Sets the first string field reachable in ``request`` (through nested and repeated messages)."""
    for field in request.DESCRIPTOR.fields:
        repeated = field.is_repeated
        if field.type == field.TYPE_STRING and not repeated:
            setattr(request, field.name, _MARKER)
            return True
        if field.type == field.TYPE_MESSAGE:
            child = getattr(request, field.name).add() if repeated else getattr(request, field.name)
            if _set_a_string(child):
                return True
    return False


def _not_utf8(name: str) -> bytes:
    """A request of method ``name`` that is valid protobuf but for one string field's bytes."""
    descriptor = pb.DESCRIPTOR.services_by_name["Coordinator"].methods_by_name[name].input_type
    request = getattr(pb, descriptor.name)()
    assert _set_a_string(request), descriptor.full_name
    encoded: bytes = request.SerializeToString()
    assert encoded.count(_MARKER.encode()) == 1
    return encoded.replace(_MARKER.encode(), _CUT)


async def _raw_call(channel: grpc.aio.Channel, name: str, streaming: bool, body: bytes) -> grpc.aio.AioRpcError:
    path = f"/{SERVICE_NAME}/{name}"
    if streaming:
        stream = channel.unary_stream(path, request_serializer=_raw, response_deserializer=_raw)(
            body, metadata=DEV_METADATA
        )

        async def drain() -> None:
            async for _ in stream:
                pass

        return await rpc_error(drain())
    call = channel.unary_unary(path, request_serializer=_raw, response_deserializer=_raw)
    return await rpc_error(call(body, metadata=DEV_METADATA))


def _raw(data: bytes) -> bytes:
    return data


def _counted(server: CoordinatorServer, name: str, result: str) -> float:
    value = server.metrics.registry.get_sample_value(
        "inbox_coordinator_rpcs_total", {"service": SERVICE_NAME, "method": name, "result": result}
    )
    return value or 0.0


def _has_a_string(name: str) -> bool:
    descriptor = pb.DESCRIPTOR.services_by_name["Coordinator"].methods_by_name[name].input_type
    return _set_a_string(getattr(pb, descriptor.name)())


# Every RPC with bytes that are not protobuf; every RPC whose request has a string field (GetCaller's has none)
# with a string that is not UTF-8.
UNDECODABLE = [("not_protobuf", name, streaming) for name, streaming in RPCS] + [
    ("not_utf8", name, streaming) for name, streaming in RPCS if _has_a_string(name)
]


@pytest.mark.parametrize(("kind", "name", "streaming"), UNDECODABLE)
async def test_undecodable_request_is_invalid_argument_and_counted(
    coordinator: CoordinatorServer, channel: grpc.aio.Channel, name: str, streaming: bool, kind: str
) -> None:
    body = NOT_PROTOBUF if kind == "not_protobuf" else _not_utf8(name)
    before = _counted(coordinator, name, "invalid_argument")

    error = await _raw_call(channel, name, streaming, body)

    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error
    details = error.details() or ""
    for python_internal in ("<class", "Traceback", "DecodeError"):
        assert python_internal not in details, details
    if kind == "not_utf8":
        assert "not valid UTF-8" in details, details
    else:
        assert "not a valid protobuf encoding of inbox.coordinator.v1." in details, details
    assert error_reason(error)[:2] == ("UNDECODABLE_REQUEST", DOMAIN)

    async def counted() -> bool:  # the server counts on its way out, which may end after the client hears
        return _counted(coordinator, name, "invalid_argument") == before + 1

    await eventually(counted, within=5)


async def test_a_client_reads_the_reason_of_an_error(agent: Actor, mailbox: str) -> None:
    error = await rpc_error(agent.claim(message(mailbox, "m1"), note="x" * 1025))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert error_reason(error) == ("INVALID_FIELD", DOMAIN, {"field": "note"})

    error = await rpc_error(agent.takeover(message(mailbox, "m1")))
    assert error.code() is grpc.StatusCode.PERMISSION_DENIED
    assert error_reason(error)[0] == "NOT_HUMAN"


async def test_a_batch_call_error_carries_its_reason(agent: Actor, mailbox: str) -> None:
    (result,) = await agent.batch(pb.BatchCall(claim_reply=pb.ClaimReplyRequest(subject=message(mailbox, "m1"))))
    assert result.WhichOneof("result") == "error"
    assert result.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert result.error.reason == "INVALID_FIELD"
