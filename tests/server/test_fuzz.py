"""Property-based fuzzing of every request field against a running coordinator: whatever comes in, the
answer is a result or a deliberate error status (never INTERNAL or UNKNOWN), and no key lands outside the
deployment's prefix."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.etcd_process import EtcdServer, free_port
from inbox_claims._batch import BATCHABLE
from inbox_claims._proto import coordinator_pb2 as pb
from inbox_claims._proto import coordinator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.etcd  # starts etcd (or a coordinator with its own) itself

PREFIX = "fuzz/v1/"
DELIBERATE = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
}

# Valid UTF-8 only: protobuf refuses to even encode a lone surrogate, so none can reach the server.
texts = st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=600)
short_texts = st.one_of(texts, st.sampled_from(["", "a", "a/b", "%2F", "..", "/", "\x00", "é" * 300, "x" * 513]))
subjects = st.builds(
    pb.Subject,
    mailbox=short_texts,
    kind=st.integers(min_value=0, max_value=7),  # includes values the enum does not define
    id=short_texts,
)
tokens = st.one_of(st.integers(min_value=-(2**63), max_value=2**63 - 1), st.integers(min_value=0, max_value=50))
ttls = st.one_of(st.integers(min_value=0, max_value=2**32 - 1), st.integers(min_value=0, max_value=70))
metadata = st.lists(
    st.tuples(
        st.sampled_from(["x-inbox-principal", "x-inbox-principal-kind", "authorization"]),
        st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=200),
    ),
    max_size=3,
)

Stub = pb_grpc.CoordinatorStub
Requests = st.one_of(
    st.builds(
        lambda r, m, n: ("RecordDelivery", pb.RecordDeliveryRequest(request_id=r, mailbox=m, notification_id=n)),
        short_texts,
        short_texts,
        short_texts,
    ),
    st.builds(
        lambda r, s, n, t, note: (
            "ClaimReply",
            pb.ClaimReplyRequest(request_id=r, subject=s, notification_id=n, ttl_seconds=t, note=note),
        ),
        short_texts,
        subjects,
        short_texts,
        ttls,
        texts,
    ),
    st.builds(
        lambda r, s, tok, t: (
            "RenewClaim",
            pb.RenewClaimRequest(request_id=r, subject=s, fencing_token=tok, ttl_seconds=t),
        ),
        short_texts,
        subjects,
        tokens,
        ttls,
    ),
    st.builds(
        lambda r, s, tok: ("ReleaseClaim", pb.ReleaseClaimRequest(request_id=r, subject=s, fencing_token=tok)),
        short_texts,
        subjects,
        tokens,
    ),
    st.builds(
        lambda r, s, tok: ("BeginSend", pb.BeginSendRequest(request_id=r, subject=s, fencing_token=tok)),
        short_texts,
        subjects,
        tokens,
    ),
    st.builds(
        lambda r, s, tok, i: (
            "ConfirmSent",
            pb.ConfirmSentRequest(request_id=r, subject=s, fencing_token=tok, sent_message_id=i),
        ),
        short_texts,
        subjects,
        tokens,
        short_texts,
    ),
    st.builds(
        lambda r, s, tok, why: (
            "AbortSend",
            pb.AbortSendRequest(request_id=r, subject=s, fencing_token=tok, reason=why),
        ),
        short_texts,
        subjects,
        tokens,
        texts,
    ),
    st.builds(lambda s: ("GetStatus", pb.GetStatusRequest(subject=s)), subjects),
    st.builds(
        lambda m, states, size, page: (
            "ListClaims",
            pb.ListClaimsRequest(mailbox=m, states=states, page_size=size, page_token=page),
        ),
        short_texts,
        st.lists(st.integers(min_value=0, max_value=9), max_size=4),
        st.integers(min_value=0, max_value=2**32 - 1),
        short_texts,
    ),
    st.builds(
        lambda r, s, t, note: ("Takeover", pb.TakeoverRequest(request_id=r, subject=s, ttl_seconds=t, note=note)),
        short_texts,
        subjects,
        ttls,
        texts,
    ),
    st.builds(
        lambda r, s, o, i, note: (
            "ResolveInDoubt",
            pb.ResolveInDoubtRequest(request_id=r, subject=s, outcome=o, sent_message_id=i, note=note),
        ),
        short_texts,
        subjects,
        st.integers(min_value=0, max_value=5),
        short_texts,
        texts,
    ),
)


batch_calls = st.one_of(
    Requests.filter(lambda call: call[0] in BATCHABLE).map(lambda call: pb.BatchCall(**{BATCHABLE[call[0]]: call[1]})),
    st.just(pb.BatchCall()),  # no call at all
)
Calls = st.one_of(
    Requests,
    st.builds(lambda calls: ("Batch", pb.BatchRequest(calls=calls)), st.lists(batch_calls, max_size=5)),
)


@pytest.fixture(scope="module")
def fuzz_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EtcdServer, Stub]]:
    """A private etcd and a coordinator process on it: nothing else writes to this etcd."""
    etcd = EtcdServer(tmp_path_factory.mktemp("fuzz") / "etcd")
    etcd.start()
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "coordinator.cli",
            "serve",
            "--listen",
            f"127.0.0.1:{port}",
            "--etcd-endpoints",
            etcd.endpoint,
            "--prefix",
            PREFIX,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stdout is not None
    for line in process.stdout:
        if "serving gRPC on" in line:
            break
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield etcd, Stub(channel)
    finally:
        channel.close()
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=30)
        etcd.stop()


def _all_keys(etcd: EtcdServer) -> list[bytes]:
    body = json.dumps(
        {"key": base64.b64encode(b"\0").decode(), "range_end": base64.b64encode(b"\0").decode(), "keys_only": True}
    ).encode()
    request = urllib.request.Request(f"{etcd.client_url}/v3/kv/range", data=body, method="POST")
    with urllib.request.urlopen(request, timeout=5) as response:
        return [base64.b64decode(kv["key"]) for kv in json.load(response).get("kvs", [])]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(call=Calls, extra_metadata=metadata)
def test_no_request_crashes_the_service(
    fuzz_target: tuple[EtcdServer, Stub], call: tuple[str, Any], extra_metadata: list[tuple[str, str]]
) -> None:
    _etcd, stub = fuzz_target
    method_name, request = call
    method: Callable[..., Any] = getattr(stub, method_name)
    base = [("x-inbox-principal", "fuzzer"), ("x-inbox-principal-kind", "human")]
    failure: Any = None
    response: Any = None
    try:
        response = method(request, metadata=base + extra_metadata, timeout=10)
    except grpc.RpcError as error:
        failure = error
    if failure is not None:
        assert failure.code() in DELIBERATE, f"{method_name} answered {failure.code()}: {failure.details()}"
        assert failure.details(), "an error without a message a person can act on"
    elif method_name == "Batch":
        assert len(response.results) == len(request.calls)
        deliberate = {code.value[0] for code in DELIBERATE}
        for batched, result in zip(request.calls, response.results, strict=True):
            if result.WhichOneof("result") == "error":
                assert result.error.code in deliberate, f"{batched} answered {result.error}"
                assert result.error.message, "an error without a message a person can act on"
            else:
                assert result.WhichOneof("result") == batched.WhichOneof("call")


def test_fuzzed_keys_all_stay_under_the_prefix(fuzz_target: tuple[EtcdServer, Stub]) -> None:
    """Runs after the fuzzing above (file order): every key it made is under the prefix and well formed."""
    etcd, stub = fuzz_target
    stub.ClaimReply(
        pb.ClaimReplyRequest(
            request_id="r", subject=pb.Subject(mailbox="../../x", kind=pb.SUBJECT_KIND_MESSAGE, id="/../y")
        ),
        metadata=(("x-inbox-principal", "fuzzer"),),
    )
    keys = _all_keys(etcd)
    assert keys, "the fuzzing wrote nothing at all"
    for key in keys:
        assert key.startswith(PREFIX.encode()), key
        section, _, rest = key[len(PREFIX) :].partition(b"/")
        # Ids are percent-encoded, so each key has exactly its layout's number of components.
        expected_parts = {b"m": 4, b"d": 2, b"x": 4}
        assert section in expected_parts, key
        assert len(rest.split(b"/")) == expected_parts[section], key
