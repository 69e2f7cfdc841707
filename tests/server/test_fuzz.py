"""Property-based fuzzing of every request field against a running coordinator: whatever comes in, the
answer is a result or a deliberate error status (never INTERNAL or UNKNOWN), and no key lands outside the
deployment's prefix. The HTTP face is fuzzed below the API too: request lines, headers (names, values, bytes
no header should hold, duplicates) and framing (lengths that lie, chunked bodies, both at once, Connect
envelopes), sent as raw bytes: the answer is never a server error, and the coordinator keeps answering."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.store.etcd.process import EtcdServer, free_ports
from inbox_claims._batch import BATCHABLE
from inbox_wire.v1 import coordinator_pb2 as pb
from inbox_wire.v1 import coordinator_pb2_grpc as pb_grpc

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


@dataclass(frozen=True)
class FuzzTarget:
    etcd: EtcdServer
    stub: Stub
    http: tuple[str, int]


@pytest.fixture(scope="module")
def fuzz_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzTarget]:
    """A private etcd and a coordinator process on it (its HTTP face too): nothing else writes to this etcd. A
    request that stops short is cut off within a second."""
    etcd = EtcdServer(tmp_path_factory.mktemp("fuzz") / "etcd")
    etcd.start()
    port, http_port = free_ports(2)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "coordinator",
            "serve",
            "--listen",
            f"127.0.0.1:{port}",
            "--http-listen",
            f"127.0.0.1:{http_port}",
            "--http-header-timeout",
            "1s",
            "--request-timeout",
            "1s",
            "--metrics-listen",
            "",
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
        yield FuzzTarget(etcd, Stub(channel), ("127.0.0.1", http_port))
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
    fuzz_target: FuzzTarget, call: tuple[str, Any], extra_metadata: list[tuple[str, str]]
) -> None:
    stub = fuzz_target.stub
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


# --- the HTTP face, below the API --------------------------------------------------------------------------

_METHODS = [method.name for method in pb.DESCRIPTOR.services_by_name["Coordinator"].methods]
_TOKEN_CHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
header_names = st.one_of(
    st.sampled_from(
        [
            "host", "content-type", "content-length", "transfer-encoding", "x-inbox-principal",
            "x-inbox-principal-kind", "authorization", "origin", "connection", "expect", "content-encoding",
            "connect-protocol-version", "connect-timeout-ms", "upgrade", "te", "accept-encoding",
        ]
    ),
    st.text(alphabet=_TOKEN_CHARS, min_size=1, max_size=40),
)  # fmt: skip
known_values = st.sampled_from(
    [
        b"application/json", b"application/connect+json", b"application/proto", b"application/connect+proto",
        b"chunked", b"gzip", b"identity", b"100-continue", b"close", b"websocket", b"fuzzer", b"human",
        b"Bearer ict_x", b"http://evil.example", b"null", b"-1", b"0", b"18446744073709551616", b"1, 2",
        # bytes no header should hold: the parser's refusal is an answer too
        b"\x00", b"a\x7fb", b"\xff\xfe", b"Jos\xe9", "Jos\u00e9".encode(), b"\x1b[2J",
    ]
)  # fmt: skip
# Most values printable, so that most requests get past the parser to the guard and the API.
header_values = st.one_of(
    known_values,
    st.text(alphabet=st.characters(min_codepoint=0x20, blacklist_categories=["Cs", "Cc"]), max_size=100).map(
        str.encode
    ),
)
bodies = st.one_of(
    st.binary(max_size=2000),
    st.builds(lambda body: json.dumps(body).encode(), st.dictionaries(st.text(max_size=20), st.text(max_size=50))),
    st.just(b'{"mailbox": "fuzz-box"}'),
    # A Connect envelope, its length right or wrong.
    st.builds(
        lambda flags, message, slack: struct.pack(">BI", flags, max(len(message) + slack, 0)) + message,
        st.integers(min_value=0, max_value=255),
        st.sampled_from([b'{"mailbox": "fuzz-box"}', b"{}", b"", b"\x00" * 9]),
        st.integers(min_value=-3, max_value=3),
    ),
)
framings = st.sampled_from(
    ["length"] * 4 + ["chunked"] * 2 + ["none", "short length", "long length", "both", "bad chunks"]
)


def _frame(framing: str, body: bytes) -> tuple[list[bytes], bytes]:
    """The framing headers and the bytes on the wire for ``body``."""
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:7], body[7:]) if part) + b"0\r\n\r\n"
    if framing == "length":
        return [b"content-length: %d" % len(body)], body
    if framing == "chunked":
        return [b"transfer-encoding: chunked"], chunked
    if framing == "short length":
        return [b"content-length: %d" % max(len(body) - 3, 0)], body
    if framing == "long length":
        return [b"content-length: %d" % (len(body) + 5)], body  # the body never completes: cut off at 1 s
    if framing == "both":
        return [b"content-length: %d" % len(body), b"transfer-encoding: chunked"], chunked
    if framing == "bad chunks":
        return [b"transfer-encoding: chunked"], b"zz\r\n" + body + b"\r\n0\r\n\r\n"
    return [], body


def _exchange(address: tuple[str, int], data: bytes) -> bytes:
    """Sends ``data`` and reads what comes back until the coordinator closes (or pauses for 3 s: a Watch
    stream that started)."""
    answer = b""
    with socket.create_connection(address, timeout=5) as connection:
        connection.sendall(data)
        connection.settimeout(3)
        with contextlib.suppress(TimeoutError, ConnectionError):
            while chunk := connection.recv(65536):
                answer += chunk
    return answer


paths = st.one_of(
    st.sampled_from(_METHODS).map(lambda name: f"/inbox.coordinator.v1.Coordinator/{name}".encode()),
    st.sampled_from([b"/", b"/index.html", b"*", b"//x", b"/%00", b"/\x00", b"/\xff", b"/a b", b"/?q=1"]),
)
_STATUS = re.compile(rb"HTTP/1\.[01] (\d{3}) ")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    verb=st.sampled_from([b"POST"] * 6 + [b"GET", b"PUT", b"OPTIONS", b"HEAD", b"PRI"]),
    path=paths,
    version=st.sampled_from([b"HTTP/1.1"] * 6 + [b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1x"]),
    headers=st.lists(st.tuples(header_names, header_values), max_size=6),
    content_type=st.sampled_from([b"application/json"] * 3 + [b"application/connect+json", b"application/proto", None]),
    framing=framings,
    body=bodies,
)
def test_no_request_head_or_framing_makes_the_http_face_fail(
    fuzz_target: FuzzTarget,
    verb: bytes,
    path: bytes,
    version: bytes,
    headers: list[tuple[str, bytes]],
    content_type: bytes | None,
    framing: str,
    body: bytes,
) -> None:
    host, port = fuzz_target.http
    lines = [verb + b" " + path + b" " + version, b"host: %s:%d" % (host.encode(), port)]
    # One request per connection: the answer is whole when the coordinator closes.
    lines += [b"x-inbox-principal: fuzzer", b"connection: close"]
    lines += [b"content-type: " + content_type] if content_type else []
    lines += [name.encode() + b": " + value for name, value in headers]
    framing_headers, payload = _frame(framing, body)
    answer = _exchange(fuzz_target.http, b"\r\n".join([*lines, *framing_headers]) + b"\r\n\r\n" + payload)
    for match in _STATUS.finditer(answer):
        status = int(match.group(1))
        assert status < 500 or status == 501, f"{status} for {lines[0]!r}: {answer[:600]!r}"
    for code in (b'"code": "unknown"', b'"code":"unknown"', b'"code": "internal"', b'"code":"internal"'):
        assert code not in answer, answer[:600]


def test_the_http_face_answers_after_the_fuzzing(fuzz_target: FuzzTarget) -> None:
    body = b"{}"
    head = b"POST /inbox.coordinator.v1.Coordinator/GetCaller HTTP/1.1\r\nhost: %s:%d\r\n" % (
        fuzz_target.http[0].encode(),
        fuzz_target.http[1],
    )
    head += b"x-inbox-principal: fuzzer\r\ncontent-type: application/json\r\nconnection: close\r\n"
    answer = _exchange(fuzz_target.http, head + b"content-length: 2\r\n\r\n" + body)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    assert b'"principal":"fuzzer"' in answer


def test_fuzzed_keys_all_stay_under_the_prefix(fuzz_target: FuzzTarget) -> None:
    """Runs after the fuzzing above (file order): every key it made is under the prefix and well formed."""
    etcd, stub = fuzz_target.etcd, fuzz_target.stub
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
