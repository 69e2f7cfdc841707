"""SIGTERM on a real coordinator process: NOT_SERVING, new calls refused, watches ended with UNAVAILABLE, the
call in flight finished, exit 0; and its JSON log lines."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.store.etcd.process import EtcdServer, free_port
from inbox_wire.v1 import coordinator_pb2 as pb
from tests.conftest import StartCoordinator
from tests.helpers import Actor, message, rpc_error


def _start(*flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "coordinator", "serve", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _wait_for_line(process: subprocess.Popen[str], needle: str, timeout: float = 30) -> None:
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return
    process.kill()
    raise AssertionError(f"{needle!r} never printed; output:\n{''.join(seen)}")


async def test_sigterm_drains_the_call_in_flight_refuses_new_ones_and_ends_watches(
    private_etcd: EtcdServer, prefix: str, mailbox: str, start_coordinator: StartCoordinator
) -> None:
    port = free_port()
    process = _start(
        f"--listen=127.0.0.1:{port}",
        f"--etcd-endpoints={private_etcd.endpoint}",
        f"--etcd-prefix={prefix}",
        "--etcd-call-timeout=30s",
        "--shutdown-grace=20s",
        "--metrics-listen=",
        "--log-format=json",
        "--access-log",
    )
    try:
        _wait_for_line(process, "serving gRPC on")
        address = f"127.0.0.1:{port}"
        async with grpc.aio.insecure_channel(address) as channel:
            agent, human = Actor(channel, "agent-a"), Actor(channel, "ana", kind="human")
            assert (await agent.claim(message(mailbox, "warm-up"))).result == pb.ClaimReplyResponse.GRANTED
            health = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await health.read()).status == health_pb2.HealthCheckResponse.SERVING
            watch = human.stub.Watch(pb.WatchRequest(mailbox=mailbox), metadata=human.metadata)
            first = await watch.read()
            assert isinstance(first, pb.WatchResponse)
            assert first.HasField("snapshot")

            # A call that cannot finish while etcd is frozen: it is in flight when SIGTERM comes.
            private_etcd.pause()
            in_flight = asyncio.ensure_future(agent.claim(message(mailbox, "in-flight"), request_id="in-flight-1"))
            await asyncio.sleep(0.5)
            assert not in_flight.done()
            process.send_signal(signal.SIGTERM)

            async with asyncio.timeout(10):
                assert (await health.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
                error = await rpc_error(watch.read())
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert "watch again" in (error.details() or "")

            # New calls are refused, on this connection and on a new one, while the old call drains.
            refused = await rpc_error(agent.claim(message(mailbox, "refused"), request_id="refused-1"))
            assert refused.code() == grpc.StatusCode.UNAVAILABLE
            async with grpc.aio.insecure_channel(address) as fresh:
                again = await rpc_error(Actor(fresh, "agent-b").claim(message(mailbox, "refused")))
            assert again.code() == grpc.StatusCode.UNAVAILABLE
            assert not in_flight.done()

            private_etcd.resume()
            async with asyncio.timeout(15):
                answer = await in_flight
            assert answer.result == pb.ClaimReplyResponse.GRANTED
        code = await asyncio.to_thread(process.wait, 20)
        out, err = process.communicate()
        assert code == 0, err
        assert "stopping" in out
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
        if private_etcd.is_paused:
            private_etcd.resume()

    # The drained call's claim stands; the refused call changed nothing.
    server = await start_coordinator(endpoint=private_etcd.endpoint)
    async with grpc.aio.insecure_channel(server.address) as channel:
        other = Actor(channel, "agent-b")
        status = await other.status(message(mailbox, "in-flight"))
        assert status.state == pb.SUBJECT_STATE_CLAIMED
        assert status.holder == "agent-a"
        assert status.fencing_token == answer.status.fencing_token
        assert (await other.status(message(mailbox, "refused"))).state == pb.SUBJECT_STATE_FREE

    # One JSON object per line on stderr, with the call's request id, principal and mailbox.
    records = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert records, err
    calls = {r["request_id"]: r for r in records if r.get("event") == "rpc" and "request_id" in r}
    drained = calls["in-flight-1"]
    assert (drained["method"], drained["code"], drained["result"]) == ("ClaimReply", "OK", "granted")
    assert (drained["principal"], drained["mailbox"], drained["subject_id"]) == ("agent-a", mailbox, "in-flight")
    assert drained["duration_ms"] >= 500
    assert "refused-1" not in calls
    assert any(r.get("event") == "start" for r in records)
    assert any(r.get("event") == "stop" for r in records)
