"""The coordinator on an etcd that demands TLS, client certificates, and a user and password."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import pytest
import trustme
from aetcd import rpc

from coordinator.core.domain import Subject, SubjectKind
from coordinator.core.errors import StoreUnavailable
from coordinator.ops.server import wall_clock_ms
from coordinator.store.etcd.channels import open_channel
from coordinator.store.etcd.process import EtcdClientTls, EtcdMemberSpec, EtcdServer, free_port
from coordinator.store.etcd.settings import EtcdSettings
from coordinator.store.etcd.store import EtcdStore
from tests.conftest import StartCoordinator
from tests.helpers import Actor, message

pytestmark = pytest.mark.etcd  # starts etcd (or a coordinator with its own) itself


def _write(path: Path, blob: trustme.Blob) -> Path:
    path.write_bytes(blob.bytes())
    return path


@pytest.fixture
def tls_etcd(tmp_path: Path) -> Iterator[tuple[EtcdServer, Path, Path, Path]]:
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("inbox-coordinator")
    files = {
        "ca": _write(tmp_path / "ca.pem", ca.cert_pem),
        "server": tmp_path / "server.pem",
        "server_key": _write(tmp_path / "server.key", server.private_key_pem),
        "client": _write(tmp_path / "client.pem", client.cert_chain_pems[0]),
        "client_key": _write(tmp_path / "client.key", client.private_key_pem),
    }
    files["server"].write_bytes(b"".join(b.bytes() for b in server.cert_chain_pems))
    tls = EtcdClientTls(
        cert_file=files["server"],
        key_file=files["server_key"],
        ca_file=files["ca"],
        client_ca_file=files["ca"],
        probe_cert_file=files["client"],
        probe_key_file=files["client_key"],
    )
    etcd = EtcdServer(tmp_path / "etcd", client_tls=tls)
    etcd.start()
    yield etcd, files["ca"], files["client"], files["client_key"]
    etcd.stop()


async def test_claims_over_tls_with_a_client_certificate(
    tls_etcd: tuple[EtcdServer, Path, Path, Path], start_coordinator: StartCoordinator, mailbox: str
) -> None:
    etcd, ca, cert, key = tls_etcd
    assert etcd.client_url.startswith("https://")
    server = await start_coordinator(
        endpoint=etcd.endpoint, etcd_options={"ca_file": ca, "cert_file": cert, "key_file": key}
    )
    async with grpc.aio.insecure_channel(server.address) as channel:
        agent = Actor(channel, "agent-a")
        granted = await agent.claim(message(mailbox, "m"))
        assert granted.status.fencing_token > 0
        stream = agent.watch(mailbox)
        assert [s.subject.id for s in (await anext(stream)).snapshot.subjects] == ["m"]


async def test_without_the_client_certificate_etcd_refuses(tls_etcd: tuple[EtcdServer, Path, Path, Path]) -> None:
    etcd, ca, _cert, _key = tls_etcd
    store = EtcdStore(EtcdSettings([etcd.endpoint], ca_file=ca, call_timeout_s=2.0), wall_clock_ms)
    try:
        with pytest.raises(StoreUnavailable, match="etcd"):
            await store.ping()
    finally:
        await store.close()


async def _enable_auth(etcd: EtcdServer, password: str) -> None:
    channel = open_channel(EtcdSettings([etcd.endpoint]))
    try:
        auth = rpc.AuthStub(channel)
        await auth.UserAdd(rpc.AuthUserAddRequest(name="root", password=password))
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"))
        await auth.AuthEnable(rpc.AuthEnableRequest())
    finally:
        await channel.close()


async def test_claims_with_an_etcd_user_and_password(
    private_etcd: EtcdServer, start_coordinator: StartCoordinator, mailbox: str
) -> None:
    await _enable_auth(private_etcd, "s3cret")
    anonymous = EtcdStore(EtcdSettings([private_etcd.endpoint], call_timeout_s=2.0), wall_clock_ms)
    try:
        with pytest.raises(StoreUnavailable, match=r"credentials|user"):
            await anonymous.status(Subject(mailbox, SubjectKind.MESSAGE, "m"))
    finally:
        await anonymous.close()
    wrong = EtcdStore(
        EtcdSettings([private_etcd.endpoint], username="root", password="nope", call_timeout_s=2.0), wall_clock_ms
    )
    try:
        with pytest.raises(StoreUnavailable, match="credentials"):
            await wrong.ping()
    finally:
        await wrong.close()
    server = await start_coordinator(
        endpoint=private_etcd.endpoint, etcd_options={"username": "root", "password": "s3cret"}
    )
    async with grpc.aio.insecure_channel(server.address) as channel:
        agent = Actor(channel, "agent-a")
        token = (await agent.claim(message(mailbox, "m"), ttl=30)).status.fencing_token
        assert (await agent.renew(message(mailbox, "m"), token, ttl=30)).result == 1
        stream = agent.watch(mailbox)
        await anext(stream)


def _tls_member_cluster(tmp_path: Path, ca: trustme.CA, hosts: Sequence[str]) -> list[EtcdServer]:
    """A cluster whose member i is reached at ``hosts[i]`` and whose certificate carries that name only."""
    ports: set[int] = set()
    while len(ports) < 2 * len(hosts):
        ports.add(free_port())
    pairs = list(ports)
    specs = [EtcdMemberSpec(f"etcd{i}", pairs[2 * i], pairs[2 * i + 1], host=host) for i, host in enumerate(hosts)]
    initial_cluster = ",".join(f"{spec.name}={spec.peer_url}" for spec in specs)
    token = f"tls-{uuid.uuid4().hex[:8]}"
    members = []
    for spec in specs:
        cert = ca.issue_cert(spec.host)
        tls = EtcdClientTls(
            cert_file=_write(tmp_path / f"{spec.name}.pem", cert.cert_chain_pems[0]),
            key_file=_write(tmp_path / f"{spec.name}.key", cert.private_key_pem),
            ca_file=_write(tmp_path / "ca.pem", ca.cert_pem),
        )
        members.append(
            EtcdServer(
                tmp_path / spec.name,
                spec=spec,
                initial_cluster=initial_cluster,
                cluster_token=token,
                client_tls=tls,
            )
        )
    return members


async def test_each_etcd_endpoint_is_checked_against_its_own_certificate_name(tmp_path: Path) -> None:
    ca = trustme.CA()
    # etcd binds "localhost" as well as IP addresses; each member's certificate names only its own endpoint.
    members = _tls_member_cluster(tmp_path, ca, ["localhost", "127.0.0.1", "localhost"])
    for member in members:
        member.start(wait=False)
    try:
        for member in members:
            member.wait_healthy(60)
        ca_file = tmp_path / "ca.pem"
        endpoints = [member.client_url for member in members]
        assert endpoints[0].startswith("https://localhost:")
        assert endpoints[1].startswith("https://127.0.0.1:")

        # Member 0 by an address its certificate does not name: refused, whatever the other members hold.
        wrong = EtcdStore(
            EtcdSettings([f"https://127.0.0.1:{members[0].spec.client_port}"], ca_file=ca_file, call_timeout_s=2.0),
            wall_clock_ms,
        )
        try:
            with pytest.raises(StoreUnavailable):
                await wrong.ping()
        finally:
            await wrong.close()

        store = EtcdStore(EtcdSettings(endpoints, ca_file=ca_file, call_timeout_s=2.0), wall_clock_ms)
        try:
            before = await store.current_revision()
            # Each endpoint's channel completes its TLS handshake, verified against that endpoint's own host.
            channels = {endpoint.endpoint: endpoint.channel for endpoint in store.etcd.channels.endpoints}
            assert set(channels) == set(endpoints)
            for endpoint, channel in channels.items():
                async with asyncio.timeout(10):
                    while (state := channel.get_state(try_to_connect=True)) != grpc.ChannelConnectivity.READY:
                        await channel.wait_for_state_change(state)
                assert channel.get_state() == grpc.ChannelConnectivity.READY, endpoint
            members[0].kill()
            answered = None
            for _ in range(50):
                try:
                    answered = await store.current_revision()
                    break
                except StoreUnavailable:
                    await asyncio.sleep(0.1)
            # Another member, over its own verified connection, answered the linearizable read.
            assert answered is not None
            assert answered >= before
            assert store.etcd.channels.current.endpoint != endpoints[0]
        finally:
            await store.close()
    finally:
        for member in members:
            member.stop()
