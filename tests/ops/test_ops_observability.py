"""Health, reflection, Prometheus metrics and per-call logs of a real coordinator on a real etcd."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import urllib.request
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from coordinator.ops import logs
from coordinator.ops.server import LIVENESS_SERVICE, SERVICE_NAME, CoordinatorServer, ServerSettings
from coordinator.store.etcd.process import EtcdServer
from coordinator.store.etcd.settings import EtcdSettings
from inbox_wire.v1 import coordinator_pb2 as pb
from tests.conftest import test_rules
from tests.helpers import Actor, eventually, message, rpc_error

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@contextlib.asynccontextmanager
async def _coordinator(endpoint: str, prefix: str, **overrides: Any) -> AsyncIterator[CoordinatorServer]:
    settings = ServerSettings(
        EtcdSettings([endpoint], prefix=prefix, call_timeout_s=2.0),
        listen="127.0.0.1:0",
        rules=test_rules(),
        health_interval_s=0.2,
        shutdown_grace_s=1.0,
        gauge_interval_s=0.1,
        key_count_interval_s=0.2,
        **overrides,
    )
    server = CoordinatorServer(settings)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace=0.5)


async def _scrape(address: str) -> Samples:
    def get() -> str:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
            return str(response.read().decode())

    samples: Samples = {}
    for family in text_string_to_metric_families(await asyncio.to_thread(get)):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def _rpcs(samples: Samples, method: str, result: str) -> float:
    key = frozenset({("service", SERVICE_NAME), ("method", method), ("result", result)})
    return samples.get(("inbox_coordinator_rpcs_total", key), 0.0)


async def _health(channel: grpc.aio.Channel, service: str) -> int:
    response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
    return int(response.status)


async def test_reflection_lists_the_coordinator_and_health_services(
    etcd: EtcdServer, prefix: str, mailbox: str
) -> None:
    async with _coordinator(etcd.endpoint, prefix) as server, grpc.aio.insecure_channel(server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        listed = [service.name async for response in responses for service in response.list_services_response.service]
        assert SERVICE_NAME in listed
        assert "grpc.health.v1.Health" in listed
        # The descriptor is there too, so grpcurl and friends can call it without the .proto file.
        responses = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME)])
        )
        files = [response async for response in responses]
        assert files[0].file_descriptor_response.file_descriptor_proto
        for service in ("", SERVICE_NAME, LIVENESS_SERVICE):
            assert await _health(channel, service) == SERVING
        error = await rpc_error(_health(channel, "no.such.Service"))
        assert error.code() == grpc.StatusCode.NOT_FOUND


async def test_metrics_count_results_time_calls_and_follow_the_gauges(
    etcd: EtcdServer, prefix: str, mailbox: str
) -> None:
    async with (
        _coordinator(etcd.endpoint, prefix, metrics_listen="127.0.0.1:0") as server,
        grpc.aio.insecure_channel(server.address) as channel,
    ):
        assert server.metrics_server is not None
        agent, other, human = Actor(channel, "agent-a"), Actor(channel, "agent-b"), Actor(channel, "ana", "human")
        subject = message(mailbox, "m-1")
        granted = await agent.claim(subject, ttl=60)
        assert granted.result == pb.ClaimReplyResponse.GRANTED
        assert (await other.claim(subject)).result == pb.ClaimReplyResponse.HELD
        token = granted.status.fencing_token
        assert (await agent.begin(subject, token)).result == pb.FENCE_RESULT_OK
        assert (await agent.confirm(subject, token)).result == pb.FENCE_RESULT_OK
        assert (await other.claim(subject)).result == pb.ClaimReplyResponse.ALREADY_REPLIED
        assert (await other.begin(subject, token + 1)).result == pb.FENCE_RESULT_STALE_TOKEN
        dedup = message(mailbox, "m-2")
        assert (await agent.claim(dedup, notification_id="n-1")).result == pb.ClaimReplyResponse.GRANTED
        assert (await other.claim(dedup, notification_id="n-1")).result == pb.ClaimReplyResponse.DUPLICATE_DELIVERY
        invalid = await rpc_error(agent.claim(message(mailbox, "m-3"), ttl=999_999))
        assert invalid.code() == grpc.StatusCode.INVALID_ARGUMENT
        await agent.status(subject)
        watch = human.stub.Watch(pb.WatchRequest(mailbox=mailbox), metadata=human.metadata)
        await watch.read()

        async def gauges() -> Samples | None:
            samples = await _scrape(server.metrics_server.address)  # type: ignore[union-attr]
            watching = samples.get(("inbox_coordinator_watch_subscribers", frozenset()), 0)
            subjects = samples.get(("inbox_coordinator_etcd_keys", frozenset({("family", "subjects")})), 0)
            # A refusal is sent before the observer counts it (grpc's abort answers at once): wait for the count too.
            refused = _rpcs(samples, "ClaimReply", "invalid_argument")
            return samples if watching == 1 and subjects >= 2 and refused == 1 else None

        samples = await eventually(gauges, within=10)
        assert _rpcs(samples, "ClaimReply", "granted") == 2
        assert _rpcs(samples, "ClaimReply", "held") == 1
        assert _rpcs(samples, "ClaimReply", "already_replied") == 1
        assert _rpcs(samples, "ClaimReply", "duplicate_delivery") == 1
        assert _rpcs(samples, "ClaimReply", "invalid_argument") == 1
        assert _rpcs(samples, "BeginSend", "ok") == 1
        assert _rpcs(samples, "BeginSend", "stale_token") == 1
        assert _rpcs(samples, "ConfirmSent", "ok") == 1
        assert _rpcs(samples, "GetStatus", "ok") == 1
        latency = frozenset({("service", SERVICE_NAME), ("method", "ClaimReply")})
        assert samples[("inbox_coordinator_rpc_duration_seconds_count", latency)] == 6
        assert samples[("inbox_coordinator_rpc_duration_seconds_sum", latency)] > 0
        watching = frozenset({("service", SERVICE_NAME), ("method", "Watch")})
        assert samples[("inbox_coordinator_rpcs_in_flight", watching)] == 1
        txn = frozenset({("method", "Txn")})
        assert samples[("inbox_coordinator_etcd_request_duration_seconds_count", txn)] >= 6
        assert samples[("inbox_coordinator_watched_mailboxes", frozenset())] == 1
        assert samples[("inbox_coordinator_lease_buckets", frozenset())] >= 1
        assert samples[("inbox_coordinator_etcd_keys", frozenset({("family", "deliveries")}))] == 1
        assert samples[("inbox_coordinator_etcd_keys", frozenset({("family", "sending")}))] == 0
        assert samples[("inbox_coordinator_serving", frozenset())] == 1

        watch.cancel()

        async def watch_counted() -> bool:
            samples = await _scrape(server.metrics_server.address)  # type: ignore[union-attr]
            return (
                _rpcs(samples, "Watch", "cancelled") == 1
                and samples[("inbox_coordinator_watch_subscribers", frozenset())] == 0
            )

        await eventually(watch_counted, within=10)


@contextlib.contextmanager
def _rpc_log_lines(level: int) -> Iterator[io.StringIO]:
    """The coordinator's per-call log (inbox_coordinator.rpc) as JSON lines, from ``level`` up, for one test."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter())
    rpc_log = logging.getLogger("inbox_coordinator.rpc")
    rpc_log.addHandler(handler)
    rpc_log.setLevel(level)
    try:
        yield stream
    finally:
        rpc_log.removeHandler(handler)
        rpc_log.setLevel(logging.NOTSET)


async def test_etcd_down_is_not_serving_counted_and_logged(private_etcd: EtcdServer, prefix: str, mailbox: str) -> None:
    with _rpc_log_lines(logging.INFO) as stream:
        async with (
            _coordinator(private_etcd.endpoint, prefix, access_log=True) as server,
            grpc.aio.insecure_channel(server.address) as channel,
        ):
            agent = Actor(channel, "agent-a")
            await agent.claim(message(mailbox, "before"), request_id="req-before")
            private_etcd.stop()
            error = await rpc_error(agent.claim(message(mailbox, "during"), request_id="req-during"))
            assert error.code() == grpc.StatusCode.UNAVAILABLE

            async def not_serving() -> bool:
                statuses = [await _health(channel, service) for service in ("", SERVICE_NAME, LIVENESS_SERVICE)]
                return statuses == [NOT_SERVING, NOT_SERVING, SERVING]

            await eventually(not_serving, within=10)
            metrics = server.metrics
            assert metrics.value("inbox_coordinator_serving") == 0
            assert (
                metrics.value("inbox_coordinator_etcd_errors_total", {"method": "Txn", "code": "UNAVAILABLE"}) or 0
            ) >= 1
            labels = {"service": SERVICE_NAME, "method": "ClaimReply", "result": "unavailable"}
            assert metrics.value("inbox_coordinator_rpcs_total", labels) == 1

            private_etcd.start()

            async def serving() -> bool:
                return bool(await _health(channel, "") == SERVING)

            await eventually(serving, within=20)
            assert metrics.value("inbox_coordinator_serving") == 1

    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    by_request = {line.get("request_id"): line for line in lines if line.get("event") == "rpc"}
    ok = by_request["req-before"]
    assert ok["level"] == "info"
    assert ok["method"] == "ClaimReply"
    assert ok["code"] == "OK"
    assert ok["result"] == "granted"
    assert ok["principal"] == "agent-a"
    assert ok["mailbox"] == mailbox
    assert ok["subject_id"] == "before"
    assert ok["duration_ms"] > 0
    failed = by_request["req-during"]
    assert failed["level"] == "warning"
    assert failed["code"] == "UNAVAILABLE"
    assert "retry" in failed["details"]
    # Health probes are not logged at INFO: they would drown the calls.
    assert not any(line.get("method") == "Check" for line in lines)


async def test_without_the_access_log_answers_are_debug_lines_and_refusals_info(etcd: EtcdServer, prefix: str) -> None:
    """The default: a line per answered call only at debug (it costs the coordinator ~50 µs of CPU a call), a
    refusal still at info, and the metrics count both."""
    with _rpc_log_lines(logging.DEBUG) as stream:
        async with (
            _coordinator(etcd.endpoint, prefix) as server,
            grpc.aio.insecure_channel(server.address) as channel,
        ):
            agent = Actor(channel, "agent-a")
            assert (await agent.claim(message("grant-a", "m-1"), request_id="req-answered")).result == (
                pb.ClaimReplyResponse.GRANTED
            )
            error = await rpc_error(agent.claim(message("grant-a", ""), request_id="req-refused"))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            metrics = server.metrics

            async def counted() -> bool:
                # The refusal reaches the client as the server sends it, a moment before the observer counts it.
                return all(
                    metrics.value(
                        "inbox_coordinator_rpcs_total",
                        {"service": SERVICE_NAME, "method": "ClaimReply", "result": result},
                    )
                    == 1
                    for result in ("granted", "invalid_argument")
                )

            await eventually(counted, within=5)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    levels = {line.get("request_id"): line["level"] for line in lines if line.get("event") == "rpc"}
    assert levels == {"req-answered": "debug", "req-refused": "info"}
