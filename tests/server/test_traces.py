"""Traces of a real coordinator process on a real etcd, exported by OpenTelemetry's SDK to a real OTLP receiver on
loopback (coordinator/testing/otlp.py): the caller's trace continued over gRPC and over HTTP/JSON, the store's
spans under each call's, a group commit's span linked to every call it carried, no summary, token or secret in
any attribute, and a receiver that stops or hangs never slowing or failing a claim (docs/operations.md#traces)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from coordinator.store.etcd.process import EtcdServer, free_ports
from coordinator.testing.otlp import OtlpReceiver, ReceivedSpan, black_hole
from inbox_wire.v1 import coordinator_pb2 as pb
from inbox_wire.v1 import coordinator_pb2_grpc as pb_grpc
from tests.helpers import message, new_request_id
from tests.tracing import (
    COORDINATOR_SERVICE,
    SERVICE,
    assert_store_beneath,
    calls_traced,
    new_ids,
    serve_traced,
    traceparent,
    under,
)

SUMMARY = pb.MessageSummary(subject_line="Refund for order 4411", sender="Ana Lima <ana@shop.example>")
BEARER = "secret-token-never-in-a-span"


@dataclass(frozen=True)
class Traced:
    grpc_address: str
    http_address: str
    receiver: OtlpReceiver
    metrics_url: str


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as started:
        yield started


@pytest.fixture(scope="module")
def traced(shared_etcd: EtcdServer, receiver: OtlpReceiver) -> Iterator[Traced]:
    """A coordinator exporting every span (sampler parentbased_always_on, the default) over OTLP/HTTP."""
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.http_endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    (metrics_port,) = free_ports(1)
    with serve_traced(
        shared_etcd, f"test/traces-{new_request_id()}/", env, f"--metrics-listen=127.0.0.1:{metrics_port}"
    ) as (grpc_address, http_address):
        yield Traced(grpc_address, http_address, receiver, f"http://127.0.0.1:{metrics_port}/metrics")


def _metadata(parent: str) -> tuple[tuple[str, str], ...]:
    return (("x-inbox-principal", "agent-1"), ("traceparent", parent), ("tracestate", "vendor=opaque"))


def _by_id(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    return {span.span_id: span for span in spans}


def assert_cycle_trace(spans: list[ReceivedSpan], trace_id: str, parent_id: str, face: str) -> list[ReceivedSpan]:
    """ClaimReply, BeginSend, ConfirmSent: each a SERVER span, child of the caller's span, with its store spans
    beneath it (an etcd transaction, and the etcd request that carried it)."""
    mine = [span for span in spans if span.trace_id == trace_id]
    servers = {span.name.rpartition("/")[2]: span for span in mine if span.kind == "SERVER"}
    assert set(servers) == {"ClaimReply", "BeginSend", "ConfirmSent"}, sorted(servers)
    for method, span in servers.items():
        assert span.service == COORDINATOR_SERVICE
        assert span.parent_span_id == parent_id, f"{method} is not the caller's child"
        assert span.trace_state == "vendor=opaque"
        assert span.attributes["rpc.system"] == face
        assert span.attributes["rpc.method"] == method
        assert span.attributes["inbox.mailbox"] == "traces@shop.example"
        assert span.attributes["inbox.subject.kind"] == "message"
        assert span.attributes["inbox.principal"] == "agent-1"
        assert_store_beneath(spans, span)
    assert servers["ClaimReply"].attributes["inbox.result"] == "granted"
    assert servers["BeginSend"].attributes["inbox.result"] == "ok"
    assert servers["ConfirmSent"].attributes["inbox.result"] == "ok"
    # The claim's first lease is granted under the ClaimReply that needed it.
    return mine


async def test_a_reply_cycle_over_grpc_continues_the_callers_trace_down_to_etcd(traced: Traced) -> None:
    trace_id, parent_id = new_ids()
    subject = message("traces@shop.example", f"grpc-{new_request_id()}")
    async with grpc.aio.insecure_channel(traced.grpc_address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        metadata = _metadata(traceparent(trace_id, parent_id))
        claimed = await stub.ClaimReply(
            pb.ClaimReplyRequest(
                request_id=new_request_id(), subject=subject, ttl_seconds=30, summary=SUMMARY, notification_id="n-1"
            ),
            metadata=metadata,
        )
        assert claimed.result == pb.ClaimReplyResponse.GRANTED
        token = claimed.status.fencing_token
        begun = await stub.BeginSend(
            pb.BeginSendRequest(request_id=new_request_id(), subject=subject, fencing_token=token), metadata=metadata
        )
        assert begun.result == pb.FENCE_RESULT_OK
        confirmed = await stub.ConfirmSent(
            pb.ConfirmSentRequest(
                request_id=new_request_id(), subject=subject, fencing_token=token, sent_message_id="sent-1"
            ),
            metadata=metadata,
        )
        assert confirmed.result == pb.FENCE_RESULT_OK
    spans = await asyncio.to_thread(traced.receiver.wait_for, calls_traced(trace_id, 3))
    mine = assert_cycle_trace(spans, trace_id, parent_id, "grpc")
    claim = next(span for span in mine if span.name.endswith("/ClaimReply"))
    assert claim.attributes["inbox.subject.id"] == subject.id
    assert claim.attributes["inbox.notification_id"] == "n-1"
    assert traced.receiver.requests["http"] > 0
    # The call metrics carry exemplars naming a sampled call's trace, in the OpenMetrics exposition; the metric
    # names are the Prometheus ones.
    request = urllib.request.Request(traced.metrics_url, headers={"Accept": "application/openmetrics-text"})
    exposition = (await asyncio.to_thread(lambda: urllib.request.urlopen(request, timeout=10).read())).decode()
    lines = [line for line in exposition.splitlines() if f'trace_id="{trace_id}"' in line]
    names = {line.partition("{")[0] for line in lines}
    assert "inbox_coordinator_rpc_duration_seconds_bucket" in names
    assert "inbox_coordinator_rpcs_total" in names


def _post(address: str, method: str, body: dict[str, object], headers: dict[str, str]) -> dict[str, object]:
    request = urllib.request.Request(
        f"http://{address}/{SERVICE}/{method}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        result: dict[str, object] = json.loads(answer.read())
        return result


async def test_a_reply_cycle_over_http_json_continues_the_callers_trace_down_to_etcd(traced: Traced) -> None:
    trace_id, parent_id = new_ids()
    subject = {"mailbox": "traces@shop.example", "kind": "SUBJECT_KIND_MESSAGE", "id": f"http-{new_request_id()}"}
    headers = {"x-inbox-principal": "agent-1", "traceparent": traceparent(trace_id, parent_id)}
    headers["tracestate"] = "vendor=opaque"

    def cycle() -> None:
        claimed = _post(
            traced.http_address,
            "ClaimReply",
            {"requestId": new_request_id(), "subject": subject, "ttlSeconds": 30},
            headers,
        )
        assert claimed["result"] == "GRANTED", claimed
        status = claimed["status"]
        assert isinstance(status, dict)
        token = status["fencingToken"]
        for method, extra in (("BeginSend", {}), ("ConfirmSent", {"sentMessageId": "sent-1"})):
            answer = _post(
                traced.http_address,
                method,
                {"requestId": new_request_id(), "subject": subject, "fencingToken": token, **extra},
                headers,
            )
            assert answer["result"] == "FENCE_RESULT_OK", answer

    await asyncio.to_thread(cycle)
    spans = await asyncio.to_thread(traced.receiver.wait_for, calls_traced(trace_id, 3))
    assert_cycle_trace(spans, trace_id, parent_id, "connect_rpc")


async def test_a_group_commit_span_is_linked_to_every_call_it_carried(traced: Traced) -> None:
    """A Batch of calls, each of its own trace: each call's span continues the context its BatchCall carries,
    and the one etcd request that committed their transactions together is linked to each transaction."""
    calls = 8
    contexts = [new_ids() for _ in range(calls)]
    batch = pb.BatchRequest()
    for index, (trace_id, span_id) in enumerate(contexts):
        call = batch.calls.add(traceparent=traceparent(trace_id, span_id))
        call.claim_reply.CopyFrom(
            pb.ClaimReplyRequest(
                request_id=new_request_id(),
                subject=message("traces@shop.example", f"batch-{index}-{new_request_id()}"),
                ttl_seconds=30,
            )
        )
    async with grpc.aio.insecure_channel(traced.grpc_address) as channel:
        answer = await pb_grpc.CoordinatorStub(channel).Batch(batch, metadata=(("x-inbox-principal", "agent-1"),))
    assert [result.claim_reply.result for result in answer.results] == [pb.ClaimReplyResponse.GRANTED] * calls
    trace_ids = {trace_id for trace_id, _ in contexts}

    def enough(spans: list[ReceivedSpan]) -> bool:
        carried = [span for span in spans if span.trace_id in trace_ids and span.name == "etcd transaction"]
        return len(carried) >= calls and any(span.name == "etcd group commit" for span in spans)

    spans = await asyncio.to_thread(traced.receiver.wait_for, enough)
    by_id = _by_id(spans)
    transactions = {}
    for trace_id, parent_id in contexts:
        mine = [span for span in spans if span.trace_id == trace_id]
        (server,) = [span for span in mine if span.name == f"{SERVICE}/ClaimReply"]
        assert server.parent_span_id == parent_id
        assert server.attributes["inbox.batched"] is True
        (batch_span,) = [by_id[span_id] for _, span_id in server.links if span_id in by_id]
        assert batch_span.name == f"{SERVICE}/Batch"
        assert batch_span.attributes["inbox.batch.calls"] == calls
        (transaction,) = [span for span in mine if span.name == "etcd transaction"]
        assert transaction.parent_span_id == server.span_id
        assert [name for name, _ in transaction.events] == ["sent"]
        transactions[transaction.span_id] = transaction
    # The shared request: one span (or more, had etcd's answer split the batch) linked to the transactions it
    # carried, each carried transaction linked back to it, and an etcd Txn beneath it.
    shared = [
        span
        for span in spans
        if span.name == "etcd group commit" and {span_id for _, span_id in span.links} & set(transactions)
    ]
    assert shared
    carried = {span_id for span in shared for _, span_id in span.links}
    assert carried == set(transactions)
    for span in shared:
        size = span.attributes["inbox.group_commit.transactions"]
        assert size == len(span.links)
        assert size > 1
        assert span.parent_span_id in transactions  # the child of the first transaction it carried
        assert any(child.name == "etcd Txn" for child in under(spans, span))
        for _, span_id in span.links:
            transaction = transactions[span_id]
            assert transaction.events[0][1]["inbox.group_commit.transactions"] == size
            if span_id != span.parent_span_id:
                assert (span.trace_id, span.span_id) in transaction.links


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [text for item in value for text in _strings(item)]
    if isinstance(value, dict):
        return [text for key, item in value.items() for text in (key, *_strings(item))]
    return [str(value)]


async def test_no_summary_token_or_secret_reaches_any_attribute(traced: Traced) -> None:
    """Every attribute, event attribute and resource attribute of every span this module's calls produced is
    read: none holds a message's subject line or sender, a fencing token, or the caller's bearer token."""
    trace_id, parent_id = new_ids()
    subject = message("traces@shop.example", f"secret-{new_request_id()}")
    metadata = (*_metadata(traceparent(trace_id, parent_id)), ("authorization", f"Bearer {BEARER}"))
    async with grpc.aio.insecure_channel(traced.grpc_address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        claimed = await stub.ClaimReply(
            pb.ClaimReplyRequest(request_id=new_request_id(), subject=subject, ttl_seconds=30, summary=SUMMARY),
            metadata=metadata,
        )
        held = await stub.ClaimReply(
            pb.ClaimReplyRequest(request_id=new_request_id(), subject=subject, ttl_seconds=30, summary=SUMMARY),
            metadata=(("x-inbox-principal", "agent-2"), ("traceparent", traceparent(trace_id, parent_id))),
        )
        assert held.result == pb.ClaimReplyResponse.HELD
        token = claimed.status.fencing_token
        await stub.RenewClaim(
            pb.RenewClaimRequest(request_id=new_request_id(), subject=subject, fencing_token=token), metadata=metadata
        )
    spans = await asyncio.to_thread(traced.receiver.wait_for, calls_traced(trace_id, 3))
    (held_span,) = [
        span for span in spans if span.trace_id == trace_id and span.attributes.get("inbox.result") == "held"
    ]
    assert held_span.attributes["inbox.holder"] == "agent-1"  # who stands in the way: a name, not a secret
    forbidden = {SUMMARY.subject_line, SUMMARY.sender, BEARER, "ana@shop.example", "Refund"}
    tokens = {str(token)}
    for span in spans:
        texts = [
            *_strings(span.attributes),
            *(text for _, attributes in span.events for text in _strings(attributes)),
            *_strings(span.resource),
        ]
        for text in texts:
            assert not any(secret in text for secret in forbidden), f"{span.name} carries {text!r}"
            assert text not in tokens, f"{span.name} carries the fencing token"
        assert not any(key.startswith(("rpc.request.metadata", "http.request.header")) for key in span.attributes)


async def test_a_receiver_that_stops_or_hangs_never_slows_or_fails_a_claim(shared_etcd: EtcdServer) -> None:
    """Spans flow to the receiver; then it stops (nothing listens), then its port hangs (connections accepted,
    never answered): every claim is granted meanwhile, each far sooner than the exporter's own timeout."""
    receiver = OtlpReceiver().start()
    port = receiver.grpc_port
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.grpc_endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "20",  # seconds: an export waiting on the hung port waits this long
        "OTEL_BSP_MAX_QUEUE_SIZE": "64",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "64",
    }
    with serve_traced(shared_etcd, f"test/traces-{new_request_id()}/", env) as (address, _http):
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            await _claims(stub, 5)
            await asyncio.to_thread(receiver.wait_for, lambda spans: len(spans) >= 5)
            assert receiver.requests["grpc"] > 0
            receiver.stop()
            assert await _claims(stub, 200) < 5.0  # many times the queue: spans are dropped, never waited for
            with black_hole(port):
                assert await _claims(stub, 200) < 5.0


async def _claims(stub: Any, count: int) -> float:
    """The slowest of ``count`` claims, each with a sampled trace of its own."""
    slowest = 0.0
    for _ in range(count):
        trace_id, span_id = new_ids()
        started = time.monotonic()
        answer = await stub.ClaimReply(
            pb.ClaimReplyRequest(
                request_id=new_request_id(),
                subject=message("traces@shop.example", new_request_id()),
                ttl_seconds=30,
            ),
            metadata=_metadata(traceparent(trace_id, span_id)),
            timeout=10,
        )
        assert answer.result == pb.ClaimReplyResponse.GRANTED
        slowest = max(slowest, time.monotonic() - started)
    return slowest


async def test_the_rate_limiters_refusal_and_the_wait_it_asks_for_are_on_the_calls_span(
    shared_etcd: EtcdServer, receiver: OtlpReceiver
) -> None:
    """A principal over its rate is refused RATE_LIMITED with a retry delay: the span says both, so a slow claim
    shows it waited for the rate limiter (the clients' spans show the wait itself, as a retry event)."""
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.http_endpoint}
    with serve_traced(shared_etcd, f"test/traces-{new_request_id()}/", env, "--rate-limit=1", "--rate-burst=1") as (
        address,
        _http,
    ):
        trace_id, parent_id = new_ids()
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            codes = []
            for _ in range(2):
                try:
                    await stub.GetStatus(
                        pb.GetStatusRequest(subject=message("traces@shop.example", "limited")),
                        metadata=_metadata(traceparent(trace_id, parent_id)),
                    )
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as error:
                    codes.append(error.code())
        assert codes == [grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED]

        def refused(spans: list[ReceivedSpan]) -> bool:
            return any(span.trace_id == trace_id and "inbox.reason" in span.attributes for span in spans)

        spans = await asyncio.to_thread(receiver.wait_for, refused)
        (span,) = [span for span in spans if span.trace_id == trace_id and "inbox.reason" in span.attributes]
        assert span.attributes["inbox.reason"] == "RATE_LIMITED"
        assert span.attributes["inbox.result"] == "resource_exhausted"
        assert 0 < span.attributes["inbox.retry_after_ms"] <= 1000
        assert span.status == 0  # the caller's refusal, not the server's fault
