"""A coordinator process given etcd members by distinct DNS names: it resolves each, serves, and fails over
when the member in use dies.

The names (etcd-0.inbox.test, ...) exist only for the coordinator: it runs in a private mount namespace
(``unshare``) where /etc/hosts is a file of this test's, so the machine's own /etc/hosts is never touched.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from coordinator.ops.config import ConfigError, load
from coordinator.store.etcd.cluster import EtcdCluster
from coordinator.store.etcd.process import free_port
from inbox_wire.v1 import coordinator_pb2 as pb
from tests.helpers import Actor, message, missing_on_this_machine
from tests.ops.test_cli import _wait_for_line

pytestmark = pytest.mark.etcd  # starts etcd (or a coordinator with its own) itself

GRANTED = pb.ClaimReplyResponse.GRANTED
# Bind-mount our hosts file over /etc/hosts in a namespace of the command's own, then run the command.
_PRIVATE_HOSTS = [
    "unshare",
    "--user",
    "--map-root-user",
    "--mount",
    "sh",
    "-c",
    'mount --bind "$0" /etc/hosts && exec "$@"',
]


def _private_hosts_usable(hosts: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run([*_PRIVATE_HOSTS, str(hosts), "true"], capture_output=True, timeout=30, check=False)
    return probe.returncode == 0


def _serve_seeing(hosts: Path, port: int, endpoints: str) -> subprocess.Popen[str]:
    """`inbox-coordinator serve` with ``hosts`` as its /etc/hosts."""
    return subprocess.Popen(
        [
            *_PRIVATE_HOSTS,
            str(hosts),
            sys.executable,
            "-m",
            "coordinator",
            "serve",
            f"--listen=127.0.0.1:{port}",
            "--metrics-listen=",
            f"--etcd-endpoints={endpoints}",
            "--etcd-call-timeout=2s",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    etcd = EtcdCluster(tmp_path / "cluster")
    etcd.start()
    yield etcd
    etcd.stop()


async def test_members_by_distinct_dns_names(tmp_path: Path, cluster: EtcdCluster, mailbox: str) -> None:
    names = [f"etcd-{i}.inbox.test" for i in range(len(cluster.members))]
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n" + "".join(f"127.0.0.1 {name}\n" for name in names))
    if not _private_hosts_usable(hosts):
        missing_on_this_machine("unshare cannot make a private mount namespace (test_ops_cluster covers DNS endpoints)")
    port = free_port()
    endpoints = ",".join(f"{name}:{m.spec.client_port}" for name, m in zip(names, cluster.members, strict=True))
    process = _serve_seeing(hosts, port, endpoints)
    try:
        _wait_for_line(process, "serving gRPC on")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            agent = Actor(channel, "agent-a")
            assert (await agent.claim(message(mailbox, "before"))).result == GRANTED
            cluster.members[0].kill()
            killed_at = time.monotonic()
            while True:
                try:
                    answer = await agent.claim(message(mailbox, "after"), request_id="after-1")
                    break
                except grpc.aio.AioRpcError as error:
                    if error.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() - killed_at > 10:
                        raise
            assert answer.result == GRANTED
            assert (await agent.claim(message(mailbox, "before"))).result == pb.ClaimReplyResponse.HELD
    finally:
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=30)
    assert process.returncode == 0, out


def test_endpoints_may_be_dns_names_ip_addresses_or_both() -> None:
    endpoints = "etcd-0.etcd-headless.etcd.svc:2379,https://etcd-1.example.com:2379,10.0.0.7:2379,[::1]:2379"
    assert len(load({"etcd_endpoints": endpoints}, environ={}).etcd_endpoints) == 4
    for bad, problem in (
        ("etcd_0:2379,etcd-1:2379", "'etcd_0' is neither an IP address nor a DNS name"),
        ("etcd-0:2379,::1:2379", "an IPv6 address needs brackets"),
        ("etcd-0:2379,etcd-0:2379", "'etcd-0:2379' is given twice"),
        ("etcd-0:0", "not HOST:PORT"),
    ):
        with pytest.raises(ConfigError, match=re.escape(problem)):
            load({"etcd_endpoints": bad}, environ={})
