"""Slow watchers against a real coordinator process: Watch streams that stop reading are ended with ABORTED
once a write has waited the drain timeout, while a watcher that reads gets every event and other callers
keep working; the coordinator's memory stays bounded."""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from coordinator.api.quotas import QuotaSettings
from coordinator.store.etcd.process import EtcdServer, free_ports
from inbox_wire.v1 import coordinator_pb2 as pb
from inbox_wire.v1 import coordinator_pb2_grpc as pb_grpc
from tests.conftest import StartCoordinator
from tests.helpers import Actor, eventually, message, serve_process

HANGING = 200
STREAMS_PER_CONNECTION = 100
NOTE = "x" * 1000  # big events fill a stuck stream's HTTP/2 window sooner
DRAIN_TIMEOUT_S = 3.0
SUBSCRIBERS_GAUGE = "inbox_coordinator_watch_subscribers "


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


@pytest.fixture
def coordinator_process(etcd: EtcdServer, prefix: str) -> Iterator[tuple[str, int, str]]:
    port, metrics_port = free_ports(2)
    with serve_process(
        f"--listen=127.0.0.1:{port}",
        f"--etcd-endpoints={etcd.endpoint}",
        f"--etcd-prefix={prefix}",
        "--max-watches=256",
        f"--watch-drain-timeout={DRAIN_TIMEOUT_S}s",
        "--rate-limit=0",
        f"--metrics-listen=127.0.0.1:{metrics_port}",
        "--log-level=warning",
    ) as process:
        yield f"127.0.0.1:{port}", process.pid, f"http://127.0.0.1:{metrics_port}/metrics"


async def _read_snapshot(call: grpc.aio.UnaryStreamCall[pb.WatchRequest, pb.WatchResponse]) -> None:
    first = await call.read()
    assert isinstance(first, pb.WatchResponse)
    assert first.HasField("snapshot"), first


async def _true(condition: bool) -> bool:
    return condition


async def _final_status(call: grpc.aio.UnaryStreamCall[pb.WatchRequest, pb.WatchResponse]) -> grpc.aio.AioRpcError:
    """Reads what the stream buffered until its status, which must be an error."""
    try:
        async with asyncio.timeout(30):
            while await call.read() is not grpc.aio.EOF:
                pass
    except grpc.aio.AioRpcError as error:
        return error
    raise AssertionError("a slow watcher's stream ended with OK")


@pytest.mark.parametrize("window", ["fixed", "default"])
async def test_slow_watchers_are_ended_with_aborted_while_a_reading_watcher_and_other_callers_carry_on(
    coordinator_process: tuple[str, int, str], mailbox: str, window: str
) -> None:
    """``fixed``: 64 KiB windows (no BDP probing), which a client that stops reading fills within seconds: the
    drain timeout ends it. ``default``: gRPC's own windows, which BDP probing grows to megabytes: flow control
    holds nothing back for minutes, and what ends the streams is their principal's write budget."""
    address, pid, metrics_url = coordinator_process
    options = [("grpc.use_local_subchannel_pool", 1)] + ([("grpc.http2.bdp_probe", 0)] if window == "fixed" else [])
    async with contextlib.AsyncExitStack() as stack:
        channels = [
            await stack.enter_async_context(grpc.aio.insecure_channel(address, options=options))
            for _ in range(HANGING // STREAMS_PER_CONNECTION + 1)
        ]
        slow = [pb_grpc.CoordinatorStub(ch) for ch in channels[1:]]
        agent, human = Actor(channels[0], "agent-a"), Actor(channels[0], "ana", kind="human")

        healthy = human.stub.Watch(pb.WatchRequest(mailbox=mailbox), metadata=human.metadata)
        await _read_snapshot(healthy)
        hanging = []
        for index in range(HANGING):
            call = slow[index % len(slow)].Watch(
                pb.WatchRequest(mailbox=mailbox), metadata=(("x-inbox-principal", "slow-watcher"),)
            )
            await _read_snapshot(call)
            hanging.append(call)
        rss_start = _rss_bytes(pid)

        received: list[pb.WatchEvent] = []

        async def read_healthy() -> None:
            while (response := await healthy.read()) is not grpc.aio.EOF:
                assert isinstance(response, pb.WatchResponse)
                received.append(response.event)

        reader = asyncio.create_task(read_healthy())
        made = 0
        rss_peak = rss_start
        ended = asyncio.create_task(_slow_streams_ended(metrics_url, watching=HANGING + 1, still_watching=1))
        # Claims flow until every slow stream is ended; each claim and release is an event for every watcher.
        async with asyncio.timeout(120):
            while not ended.done():
                batch = [message(mailbox, f"m-{made + i}") for i in range(8)]
                claims = await asyncio.gather(*(agent.claim(s, note=NOTE) for s in batch))
                assert all(c.result == pb.ClaimReplyResponse.GRANTED for c in claims)
                releases = await asyncio.gather(
                    *(agent.release(s, c.status.fencing_token) for s, c in zip(batch, claims, strict=True))
                )
                assert all(r.result == pb.FENCE_RESULT_OK for r in releases)
                made += len(batch)
                rss_peak = max(rss_peak, _rss_bytes(pid))
        await ended
        # Each stuck client learns why once it reads again: what was buffered, then ABORTED.
        errors = [await _final_status(call) for call in hanging]
        assert {e.code() for e in errors} == {grpc.StatusCode.ABORTED}
        assert all("watch again" in (e.details() or "") and "fresh snapshot" in (e.details() or "") for e in errors)

        # The reading watcher got every event, in order, and is still open.
        await eventually(lambda: _true(len(received) >= 2 * made), within=30)
        assert len(received) == 2 * made
        assert [e.type for e in received[:2]] == [pb.EVENT_TYPE_CLAIMED, pb.EVENT_TYPE_CLAIMED]
        assert sum(e.type == pb.EVENT_TYPE_RELEASED for e in received) == made
        assert not reader.done()
        reader.cancel()

        # Memory: the hanging streams cost a bounded amount, not one that grows with the events they missed.
        assert rss_peak - rss_start < 64 << 20, f"RSS grew from {rss_start >> 20} to {rss_peak >> 20} MiB"
        # The slow principal's watch slots came back: it may watch again, and gets a fresh snapshot.
        again = slow[0].Watch(pb.WatchRequest(mailbox=mailbox), metadata=(("x-inbox-principal", "slow-watcher"),))
        await _read_snapshot(again)
        again.cancel()


async def _watch_subscribers(metrics_url: str) -> float:
    """The coordinator's watch_subscribers gauge (refreshed every second)."""
    page = await asyncio.to_thread(lambda: urllib.request.urlopen(metrics_url, timeout=5).read().decode())
    return next(float(line.split()[1]) for line in page.splitlines() if line.startswith(SUBSCRIBERS_GAUGE))


async def _slow_streams_ended(metrics_url: str, watching: int, still_watching: int) -> None:
    """Once the gauge has seen all ``watching`` subscribers: until the coordinator has cut the slow streams off
    its mailbox feeds, leaving ``still_watching``. The clients cannot tell without reading: the ABORTED status
    waits behind the messages their windows hold back."""

    async def all_seen() -> bool:
        return await _watch_subscribers(metrics_url) >= watching

    async def cut_off() -> bool:
        return await _watch_subscribers(metrics_url) <= still_watching

    await eventually(all_seen, within=30, interval=0.2)
    await eventually(cut_off, within=120, interval=0.2)


async def test_a_principal_over_its_watch_budget_is_cut_off_while_another_principal_gets_every_event(
    start_coordinator: StartCoordinator, mailbox: str
) -> None:
    """gRPC's default windows (BDP probing on): the crowd's streams are never held back by flow control, so
    what ends them is their principal's write budget, whether they read or not."""
    budget, cycles_per_second = 100, 30  # the crowd wants 20 x 60 messages/s; the board 60/s, inside its own
    server = await start_coordinator(
        quotas=QuotaSettings(watch_events_per_second=budget, watch_drain_timeout_s=1.0, calls_per_second=0)
    )
    async with grpc.aio.insecure_channel(server.address) as channel:
        agent, board = Actor(channel, "agent-a"), Actor(channel, "ana", kind="human")
        crowd_stub = pb_grpc.CoordinatorStub(channel)
        board_stream = board.stub.Watch(pb.WatchRequest(mailbox=mailbox), metadata=board.metadata)
        await _read_snapshot(board_stream)
        crowd = [
            crowd_stub.Watch(pb.WatchRequest(mailbox=mailbox), metadata=(("x-inbox-principal", "crowd"),))
            for _ in range(20)
        ]
        for call in crowd:
            await _read_snapshot(call)

        made = 0
        # Stopped between cycles, never cancelled: a cycle cut between its claim and its release would leave an
        # event the count does not know about.
        stop = asyncio.Event()

        async def claims_flow() -> None:
            nonlocal made
            loop = asyncio.get_running_loop()
            started = loop.time()
            while not stop.is_set():
                subject = message(mailbox, f"m-{made}")
                claim = await agent.claim(subject)
                await agent.release(subject, claim.status.fencing_token)
                made += 1
                await asyncio.sleep(max(0.0, started + made / cycles_per_second - loop.time()))

        received: list[pb.WatchEvent] = []

        async def read_board() -> None:
            while (response := await board_stream.read()) is not grpc.aio.EOF:
                assert isinstance(response, pb.WatchResponse)
                received.append(response.event)

        flow, reader = asyncio.create_task(claims_flow()), asyncio.create_task(read_board())
        try:
            errors = await asyncio.gather(*(_final_status(call) for call in crowd))
        finally:
            stop.set()
            async with asyncio.timeout(10):
                await flow
        assert {e.code() for e in errors} == {grpc.StatusCode.ABORTED}
        assert all("--watch-events-per-second" in (e.details() or "") for e in errors), errors[0].details()
        assert all("fresh snapshot" in (e.details() or "") for e in errors)

        # The board, a principal of its own under its budget, got every event and is still open.
        await eventually(lambda: _true(len(received) >= 2 * made), within=15)
        assert len(received) == 2 * made
        assert sum(e.type == pb.EVENT_TYPE_RELEASED for e in received) == made
        assert not reader.done()
        reader.cancel()
