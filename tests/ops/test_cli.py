"""`inbox-coordinator serve`: the README's first command, run as a user would."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from coordinator.store.etcd.process import free_port
from inbox_wire.v1 import coordinator_pb2 as pb
from tests.helpers import Actor, message


def _start(data_dir: Path, port: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "coordinator",
            "serve",
            "--listen",
            f"127.0.0.1:{port}",
            "--data-dir",
            str(data_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _wait_for_line(process: subprocess.Popen[str], needle: str, timeout: float = 60) -> list[str]:
    assert process.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return lines
    process.kill()
    # Reaped and its pipes closed here: left to the garbage collector, they warn inside whichever test runs next.
    process.communicate()
    raise AssertionError(f"{needle!r} never printed; output:\n{''.join(lines)}")


def _stop(process: subprocess.Popen[str]) -> tuple[int, str]:
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=30)
    return process.returncode, out


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


async def _claim(port: int, subject_id: str) -> pb.ClaimReplyResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        return await Actor(channel, "cli-test").claim(message("mb", subject_id), ttl=600)


@pytest.mark.etcd
async def test_serve_runs_on_an_embedded_etcd_and_keeps_its_data(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    port = free_port()
    process = _start(data_dir, port)
    lines = _wait_for_line(process, "serving gRPC on")
    banner = "".join(lines)
    assert "DEVELOPMENT MODE" in banner
    assert f"127.0.0.1:{port}" in banner
    assert "Ctrl-C" in banner
    first = await _claim(port, "persisted")
    assert first.result == pb.ClaimReplyResponse.GRANTED
    code, out = _stop(process)
    assert code == 0, out
    assert "stopping" in out

    # The embedded etcd stopped with the coordinator, and its data stays for the next start.
    ports = json.loads((data_dir / "ports.json").read_text())
    assert not _port_open(ports["client"]), "the embedded etcd outlived the coordinator"
    assert "embedded" in (data_dir / "etcd.log").read_text()
    process = _start(data_dir, port)
    _wait_for_line(process, "serving gRPC on")
    again = await _claim(port, "persisted")
    assert again.result == pb.ClaimReplyResponse.HELD
    assert again.status.fencing_token == first.status.fencing_token
    code, _ = _stop(process)
    assert code == 0
    assert json.loads((data_dir / "ports.json").read_text()) == ports


def test_serve_refuses_a_bad_endpoint_list(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "coordinator", "serve", "--etcd-endpoints", "etcd-a:2379,etcd_b:2379"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "'etcd_b' is neither an IP address nor a DNS name" in result.stderr
