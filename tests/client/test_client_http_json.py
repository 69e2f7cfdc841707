"""The Python client over the coordinator's HTTP/JSON face (``protocol="http-json"``, docs/client.md#over-http-json):
the same calls with the same answers and the same errors as over gRPC, against a real coordinator process on a
real etcd serving both faces; what it cannot do (a stream, mutual TLS) refused with a message naming the fix.
The guarded reply's trace over it: tests/client/test_guard_traces.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from coordinator.store.etcd.process import EtcdServer, free_ports
from inbox_claims import AsyncCoordinator, Coordinator, RetryPolicy, Subject, SubjectState
from inbox_claims.errors import CoordinatorUnavailable, InboxClaimsError
from tests.helpers import new_request_id
from tests.tracing import serve_traced

MAILBOX = "http-json@shop.example"


@pytest.fixture(scope="module")
def faces(shared_etcd: EtcdServer) -> Iterator[tuple[str, str]]:
    """A coordinator's gRPC and HTTP/JSON addresses."""
    with serve_traced(shared_etcd, f"test/http-json-{new_request_id()}/", {}) as addresses:
        yield addresses


def test_a_reply_cycle_over_http_json_is_recorded_as_over_grpc(faces: tuple[str, str]) -> None:
    grpc_address, http_address = faces
    subject = Subject.message(MAILBOX, f"cycle-{new_request_id()}")
    with Coordinator(http_address, principal="agent-1", protocol="http-json") as coord:
        with coord.reply_to(mailbox=MAILBOX, message_id=subject.id, notification_id=f"n-{subject.id}") as claim:
            assert claim.token > 0
            assert claim.send(lambda: "sent-1") == "sent-1"
        again = coord.claim(subject, notification_id=f"n-{subject.id}")
        assert again.outcome.name == "DUPLICATE_DELIVERY"
    with Coordinator(grpc_address, principal="agent-2") as over_grpc:
        status = over_grpc.status(subject)
    assert status.state is SubjectState.REPLIED
    assert status.holder == "agent-1"
    assert status.sent_message_id == "sent-1"


async def test_a_refusal_is_the_same_error_with_the_same_message_over_either_face(faces: tuple[str, str]) -> None:
    grpc_address, http_address = faces
    too_long = "n" * 5000  # past the coordinator's limit on a notification id
    errors: list[InboxClaimsError] = []
    for target, protocol in ((grpc_address, "grpc"), (http_address, "http-json")):
        async with AsyncCoordinator(target, principal="agent-1", protocol=protocol) as coord:  # type: ignore[arg-type]
            with pytest.raises(InboxClaimsError) as raised:
                await coord.record_delivery(MAILBOX, too_long)
            errors.append(raised.value)
    over_grpc, over_http = errors
    assert type(over_http) is type(over_grpc)
    assert str(over_http) == str(over_grpc)
    assert "notification" in str(over_http).lower()


def test_an_http_face_nobody_answers_is_unavailable_after_the_retries() -> None:
    (port,) = free_ports(1)
    retry = RetryPolicy(attempts=2, initial_backoff=0.01, max_backoff=0.02)
    coord = Coordinator(f"127.0.0.1:{port}", principal="agent-1", protocol="http-json", retry=retry)
    with coord, pytest.raises(CoordinatorUnavailable) as raised:
        coord.status(Subject.message(MAILBOX, "m-1"))
    assert "HTTP face could not be reached" in str(raised.value)


def test_what_http_json_cannot_do_is_refused_naming_the_fix(faces: tuple[str, str]) -> None:
    _grpc, http_address = faces
    coord = Coordinator(http_address, principal="agent-1", protocol="http-json")
    with coord, pytest.raises(RuntimeError, match=r"Watch is a stream: it needs protocol='grpc'"):
        next(coord.watch(MAILBOX, reconnect=False))
    with pytest.raises(ValueError, match=r"protocol must be 'grpc' or 'http-json', not 'h3'"):
        Coordinator(http_address, principal="agent-1", protocol="h3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"mutual TLS\): use protocol='grpc'"):
        Coordinator(http_address, principal="a", protocol="http-json", client_certificate=b"c", client_key=b"k")
