"""Calls that never send their request, streams per connection and keepalive: what one client connection can
hold open on a coordinator, and for how long."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from coordinator.api.interceptor import REQUEST_TIMEOUT_REASON
from coordinator.api.service import SERVICE_NAME
from coordinator.ops.server import CoordinatorServer, ServerSettings
from coordinator.store.etcd.process import EtcdServer, free_port
from coordinator.store.etcd.settings import EtcdSettings
from inbox_wire.v1 import coordinator_pb2 as pb
from tests.conftest import test_rules
from tests.helpers import Actor, error_reason, eventually, message, rpc_error, spawn, wait_for_line

CLAIM_REPLY = f"/{SERVICE_NAME}/ClaimReply"


def _raw(data: bytes) -> bytes:
    return data


def _stalled_call(channel: grpc.aio.Channel) -> grpc.aio.StreamUnaryCall[bytes, bytes]:
    """A ClaimReply whose request message is never sent: the stream opens (HEADERS) and nothing follows.
    The wire is the same as a unary call's; only the client API differs."""
    return channel.stream_unary(CLAIM_REPLY, request_serializer=_raw, response_deserializer=_raw)()


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


@pytest.mark.timeout(180)
async def test_a_request_that_never_arrives_is_cut_off_and_memory_stays_flat(etcd: EtcdServer, prefix: str) -> None:
    port = free_port()
    serve = ["serve", "--listen", f"127.0.0.1:{port}", "--etcd-endpoints", etcd.endpoint, "--prefix", prefix]
    process = spawn([sys.executable, "-m", "coordinator", *serve, "--request-timeout", "1s", "--metrics-listen", ""])
    # Each cut-off call logs a line: read them, or the pipe fills and the coordinator's logging blocks.
    assert process.stdout is not None
    reader = threading.Thread(target=process.stdout.read, daemon=True)
    try:
        wait_for_line(process, "serving gRPC on")
        reader.start()
        rss: list[float] = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await channel.channel_ready()
            rss.append(_rss_mib(process.pid))
            # 10,000 stalled calls in 10 waves of 1,000 at once (the default streams per connection): each is
            # cut off a second after it opened, and what it held is freed for the next wave.
            codes: Counter[grpc.StatusCode] = Counter()
            for _ in range(10):
                began = time.monotonic()
                calls = [_stalled_call(channel) for _ in range(1000)]
                errors = await asyncio.gather(*(rpc_error(call) for call in calls))
                waited = time.monotonic() - began
                assert waited < 10, f"a wave of stalled calls took {waited:.1f} s to be cut off"
                codes.update(error.code() for error in errors)
                rss.append(_rss_mib(process.pid))
                # A stream counts against the limit until the client's reset of it arrives: without this pause
                # the next wave's first streams are refused (UNAVAILABLE, REFUSED_STREAM), costing nothing.
                await asyncio.sleep(0.2)
            print(f"stalled calls: {dict(codes)}; RSS MiB idle, then after each wave: {rss}")
            assert set(codes) <= {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE}, codes
            assert codes[grpc.StatusCode.DEADLINE_EXCEEDED] >= 9000, codes
            cut_off = next(error for error in errors if error.code() is grpc.StatusCode.DEADLINE_EXCEEDED)
            assert error_reason(cut_off)[0] == REQUEST_TIMEOUT_REASON
            assert "did not arrive within 1 s" in (cut_off.details() or "")
        # Without the cut-off every stalled call stays (about 11 KiB each: 10,000 grew a coordinator by 113 MiB,
        # and the waves here would never end). With it, the first wave sets the level and the next nine, 9,000
        # more calls, only move around it (by up to 20 MiB here, as the allocator keeps and reuses memory).
        growth = max(rss[2:]) - rss[1]
        assert growth < 40, f"RSS grew {growth:.1f} MiB over nine more waves of 1,000 stalled calls: {rss}"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        if reader.is_alive():
            reader.join(timeout=10)
        process.stdout.close()


@pytest.fixture
async def tight_coordinator(etcd: EtcdServer, prefix: str) -> AsyncIterator[CoordinatorServer]:
    """A coordinator allowing 8 streams per connection and waiting 30 s for a request message."""
    settings = ServerSettings(
        EtcdSettings([etcd.endpoint], prefix=prefix),
        listen="127.0.0.1:0",
        rules=test_rules(),
        shutdown_grace_s=0.5,
    )
    server = CoordinatorServer(dataclasses.replace(settings, max_streams_per_connection=8, request_timeout_s=30.0))
    await server.start()
    yield server
    await server.stop(grace=0)


def _in_flight(server: CoordinatorServer, method: str) -> float:
    value = server.metrics.registry.get_sample_value(
        "inbox_coordinator_rpcs_in_flight", {"service": SERVICE_NAME, "method": method}
    )
    return value or 0.0


async def test_one_connection_holds_at_most_its_streams_limit(tight_coordinator: CoordinatorServer) -> None:
    async with grpc.aio.insecure_channel(tight_coordinator.address) as channel:
        calls = [_stalled_call(channel) for _ in range(20)]

        async def eight_open() -> bool:
            return _in_flight(tight_coordinator, "ClaimReply") == 8

        await eventually(eight_open, within=10)
        await asyncio.sleep(0.5)  # the other 12 wait in the client, not on the server
        assert _in_flight(tight_coordinator, "ClaimReply") == 8
        # Another connection is not held up by the first one's stalled calls.
        # (A local subchannel pool: by default, grpc would share the first channel's connection.)
        own_connection = [("grpc.use_local_subchannel_pool", 1)]
        async with grpc.aio.insecure_channel(tight_coordinator.address, options=own_connection) as other:
            status = await Actor(other, "agent-a").status(message("grant-x", "m1"))
            assert status.state == pb.SUBJECT_STATE_FREE
        for call in calls:
            call.cancel()

    async def none_open() -> bool:
        return _in_flight(tight_coordinator, "ClaimReply") == 0

    await eventually(none_open, within=10)


async def test_a_client_that_pings_too_often_is_sent_away(coordinator: CoordinatorServer, mailbox: str) -> None:
    # The server accepts a ping every 10 s at most; this client pings every 200 ms, also without data.
    pushy = [
        ("grpc.keepalive_time_ms", 200),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    async with grpc.aio.insecure_channel(coordinator.address, options=pushy) as channel:
        watch = Actor(channel, "agent-a").watch(mailbox)
        first = await watch.__anext__()
        assert first.HasField("snapshot")

        async def drain() -> None:
            async for _ in watch:
                pass

        error = await asyncio.wait_for(rpc_error(drain()), timeout=30)
        assert error.code() is grpc.StatusCode.UNAVAILABLE, error
        assert "Too many pings" in (error.details() or ""), error
