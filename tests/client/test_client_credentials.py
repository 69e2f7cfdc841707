"""The client's credential options against a real coordinator that authenticates: bearer tokens, TLS, mutual
TLS, ready-made channel credentials, and the call-rate quota's retry hint."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import trustme

from coordinator.api.auth import TlsSettings, TokenAuthenticator, hash_token, new_token, server_credentials
from coordinator.api.quotas import QuotaSettings
from coordinator.api.service import CoordinatorServicer
from coordinator.core.domain import Rules
from coordinator.core.engine import Engine
from coordinator.ops.server import wall_clock_ms
from coordinator.store.etcd.process import EtcdServer
from coordinator.store.etcd.settings import EtcdSettings
from coordinator.store.etcd.store import EtcdStore
from inbox_claims import AsyncCoordinator, Coordinator, CoordinatorUnavailable, RetryPolicy, Subject, SubjectState
from inbox_claims.errors import PermissionDenied, QuotaExceeded, Unauthenticated
from inbox_claims.types import ClaimOutcome
from inbox_wire.v1 import coordinator_pb2_grpc as pb_grpc
from tests.client.support import SendLog
from tests.conftest import TEST_LIMITS

AGENT_TOKEN = new_token()[0]
CERTIFICATE_NAME = "agent-a.acme.test"


def token_file(path: Path) -> Path:
    path.write_text(
        '[[principals]]\nid = "agent-a"\nkind = "agent"\nmailboxes = ["acme-*"]\nroles = []\n'
        f'token_sha256 = ["{hash_token(AGENT_TOKEN)}"]\ncertificate_names = ["{CERTIFICATE_NAME}"]\n'
    )
    return path


@contextlib.asynccontextmanager
async def secured_coordinator(
    etcd: EtcdServer,
    prefix: str,
    tmp_path: Path,
    *,
    tls: TlsSettings | None = None,
    quotas: QuotaSettings | None = None,
) -> AsyncIterator[str]:
    """A coordinator that authenticates with a token file (and serves TLS when given); yields its address."""
    store = EtcdStore(EtcdSettings([etcd.endpoint], prefix=prefix), wall_clock_ms)
    engine = Engine(store, Rules(TEST_LIMITS), wall_clock_ms)
    server = grpc.aio.server()
    servicer = CoordinatorServicer(engine, TokenAuthenticator(token_file(tmp_path / "tokens.toml")), quotas)
    pb_grpc.add_CoordinatorServicer_to_server(servicer, server)
    listen = "127.0.0.1:0"
    port = server.add_secure_port(listen, server_credentials(tls)) if tls else server.add_insecure_port(listen)
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)
        await store.close()


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def tls_settings(tmp_path: Path, ca: trustme.CA, *, require_client_cert: bool) -> TlsSettings:
    issued = ca.issue_cert("localhost", "127.0.0.1")
    cert, key, client_ca = tmp_path / "server.pem", tmp_path / "server.key", tmp_path / "ca.pem"
    cert.write_bytes(b"".join(blob.bytes() for blob in issued.cert_chain_pems))
    key.write_bytes(issued.private_key_pem.bytes())
    client_ca.write_bytes(ca.cert_pem.bytes())
    # A client CA goes with requiring client certificates (grpcio cannot ask for an optional one).
    return TlsSettings(cert, key, client_ca if require_client_cert else None, require_client_cert)


async def test_a_bearer_token_says_who_the_caller_is(etcd: EtcdServer, prefix: str, tmp_path: Path) -> None:
    subject = Subject.message("acme-1", "msg-1")
    async with secured_coordinator(etcd, prefix, tmp_path) as address:
        async with AsyncCoordinator(address, token=AGENT_TOKEN) as agent:
            granted = await agent.claim(subject, ttl=30)
            assert granted.status is not None
            assert granted.status.holder == "agent-a"
            with pytest.raises(PermissionDenied):
                await agent.claim(Subject.message("globex", "msg-1"))  # not one of its mailboxes
        async with AsyncCoordinator(address, principal="agent-a", token=AGENT_TOKEN) as agent:
            assert (await agent.status(subject)).holder == "agent-a"  # naming itself is fine
        async with AsyncCoordinator(address, principal="agent-b", token=AGENT_TOKEN) as impostor:
            with pytest.raises(PermissionDenied, match="acts only as itself"):
                await impostor.status(subject)
        async with AsyncCoordinator(address, principal="agent-a") as no_token:
            with pytest.raises(Unauthenticated):
                await no_token.status(subject)
        with Coordinator(address, token=AGENT_TOKEN) as blocking:
            status = await asyncio.to_thread(blocking.status, subject)
            assert (status.state, status.holder) == (SubjectState.CLAIMED, "agent-a")


async def test_tls_with_root_certificates_or_ready_credentials(
    etcd: EtcdServer, prefix: str, tmp_path: Path, ca: trustme.CA
) -> None:
    root = ca.cert_pem.bytes()
    tls = tls_settings(tmp_path, ca, require_client_cert=False)
    async with secured_coordinator(etcd, prefix, tmp_path, tls=tls) as address:
        async with AsyncCoordinator(address, token=AGENT_TOKEN, root_certificates=root) as agent:
            sends = SendLog()
            async with agent.reply_to(mailbox="acme-1", message_id="over-tls") as claim:
                await claim.send(sends.send_async)
            assert (await agent.status(claim.subject)).state is SubjectState.REPLIED
        ready = grpc.ssl_channel_credentials(root_certificates=root)
        with Coordinator(address, token=AGENT_TOKEN, credentials=ready) as blocking:
            status = await asyncio.to_thread(blocking.status, claim.subject)
            assert status.sent_message_id == "sent-1"
        untrusted = trustme.CA().cert_pem.bytes()
        async with AsyncCoordinator(
            address, token=AGENT_TOKEN, root_certificates=untrusted, retry=RetryPolicy.none()
        ) as stranger:
            with pytest.raises(CoordinatorUnavailable):
                await stranger.status(claim.subject)


async def test_mutual_tls_client_certificate_is_the_identity(
    etcd: EtcdServer, prefix: str, tmp_path: Path, ca: trustme.CA
) -> None:
    tls = tls_settings(tmp_path, ca, require_client_cert=True)
    client_cert = ca.issue_cert(CERTIFICATE_NAME)
    async with secured_coordinator(etcd, prefix, tmp_path, tls=tls) as address:
        async with AsyncCoordinator(
            address,
            root_certificates=ca.cert_pem.bytes(),
            client_certificate=client_cert.cert_chain_pems[0].bytes(),
            client_key=client_cert.private_key_pem.bytes(),
        ) as agent:
            result = await agent.claim(Subject.message("acme-1", "msg-1"), ttl=30)
        assert result.outcome is ClaimOutcome.GRANTED
        assert result.status is not None
        assert result.status.holder == "agent-a"


async def test_the_rate_limit_is_retried_after_the_coordinators_hint(
    etcd: EtcdServer, prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="inbox_claims")
    subject = Subject.message("acme-1", "msg-1")
    quotas = QuotaSettings(calls_per_second=10, burst=3)
    async with secured_coordinator(etcd, prefix, tmp_path, quotas=quotas) as address:
        async with AsyncCoordinator(address, token=AGENT_TOKEN, retry=RetryPolicy(attempts=10)) as agent:
            statuses = [await agent.status(subject) for _ in range(8)]  # 3 at once, then 10 a second
        assert all(status.state is SubjectState.FREE for status in statuses)
        assert any("RESOURCE_EXHAUSTED" in record.getMessage() for record in caplog.records)
        async with AsyncCoordinator(address, token=AGENT_TOKEN, retry=RetryPolicy.none()) as hasty:

            async def too_fast() -> None:
                for _ in range(5):
                    await hasty.status(subject)

            with pytest.raises(QuotaExceeded) as exceeded:
                await too_fast()
        assert exceeded.value.retry_after is not None
        assert 0 < exceeded.value.retry_after <= 0.2
