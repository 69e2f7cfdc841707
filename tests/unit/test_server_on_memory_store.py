"""A whole coordinator on the memory store: the server reads health, alarms and statistics through the Store
protocol, so health, metrics and the calls work on any store, not only on etcd."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.core.storage import StoreStatistics
from coordinator.ops.server import SERVICE_NAME, CoordinatorServer, ServerSettings, wall_clock_ms
from coordinator.store.memory import MemoryStore
from inbox_claims import AsyncCoordinator, Subject
from tests.conftest import test_rules
from tests.helpers import eventually


async def test_health_metrics_and_claims_on_the_memory_store() -> None:
    store = MemoryStore(wall_clock_ms)
    settings = ServerSettings(
        None,
        listen="127.0.0.1:0",
        rules=test_rules(),
        health_interval_s=0.05,
        gauge_interval_s=0.05,
        key_count_interval_s=0.05,
    )
    server = CoordinatorServer(settings, store=store)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            answer = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        async with AsyncCoordinator(server.address, principal="agent-a") as coord:
            subject = Subject.message("grant-1", "msg-1")
            claim = await coord.claim(subject, ttl=30)
            assert claim.token > 0
            watch = coord.watch("grant-1")
            await anext(watch)  # the snapshot: the stream is subscribed

            async def gauges_show_it() -> bool:
                return (
                    server.metrics.value("inbox_coordinator_etcd_keys", {"family": "subjects"}) == 1
                    and server.metrics.value("inbox_coordinator_watch_subscribers") == 1
                )

            await eventually(gauges_show_it, within=5, interval=0.02)
            assert store.statistics() == StoreStatistics(watched_mailboxes=1, watch_subscribers=1)
            assert server.metrics.value("inbox_coordinator_serving") == 1
            await watch.aclose()
    finally:
        await server.stop(grace=0.5)


def test_a_server_needs_etcd_settings_or_a_store() -> None:
    with pytest.raises(ValueError, match="etcd is required unless the server is given its store"):
        CoordinatorServer(ServerSettings(None))
