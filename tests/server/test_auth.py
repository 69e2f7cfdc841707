"""Authentication, authorization and tenant isolation (docs/design.md#invariants, invariant 6), on a real etcd."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import trustme

from coordinator.api.auth import (
    Authenticator,
    TlsSettings,
    TokenAuthenticator,
    TokenFileError,
    hash_token,
    load_token_file,
    new_token,
    server_credentials,
)
from coordinator.api.quotas import QuotaSettings
from coordinator.api.service import CoordinatorServicer
from coordinator.core.domain import Rules
from coordinator.core.engine import Engine
from coordinator.ops.server import wall_clock_ms
from coordinator.store.etcd.process import EtcdServer
from coordinator.store.etcd.settings import EtcdSettings
from coordinator.store.etcd.store import EtcdStore
from inbox_wire.v1 import coordinator_pb2 as pb
from inbox_wire.v1 import coordinator_pb2_grpc as pb_grpc
from tests.conftest import TEST_LIMITS
from tests.helpers import Actor, error_reason, error_retry_delay_ms, message, new_request_id, rpc_error

TOKENS = {name: new_token()[0] for name in ("agent-a", "agent-b", "ana", "bo", "root")}


def _token_file(path: Path, *, revoked: tuple[str, ...] = (), extra: str = "") -> Path:
    def entry(name: str, kind: str, mailboxes: list[str], roles: list[str], certs: list[str] | None = None) -> str:
        hashes = [] if name in revoked else [hash_token(TOKENS[name])]
        return (
            f'[[principals]]\nid = "{name}"\nkind = "{kind}"\nmailboxes = {mailboxes!r}\nroles = {roles!r}\n'
            f"token_sha256 = {hashes!r}\ncertificate_names = {certs or []!r}\n"
        ).replace("'", '"')

    path.write_text(
        entry("agent-a", "agent", ["acme-*"], [], ["agent-a.acme.test"])
        + entry("agent-b", "agent", ["globex"], [])
        + entry("ana", "human", ["acme-*"], ["takeover", "resolve"])
        + entry("bo", "human", ["acme-*"], [])
        + entry("root", "human", [], ["admin"])
        + extra
    )
    return path


@dataclass
class Secured:
    address: str
    authenticator: TokenAuthenticator
    token_file: Path

    def actor(self, channel: grpc.aio.Channel, name: str) -> Actor:
        return Actor(channel, name, token=TOKENS[name])


@contextlib.asynccontextmanager
async def _serve(
    etcd: EtcdServer,
    prefix: str,
    authenticator: Authenticator,
    *,
    quotas: QuotaSettings | None = None,
    tls: TlsSettings | None = None,
    send_timeout_ms: int = 120_000,
) -> AsyncIterator[str]:
    store = EtcdStore(EtcdSettings([etcd.endpoint], prefix=prefix), wall_clock_ms)
    engine = Engine(store, Rules(TEST_LIMITS, send_timeout_ms=send_timeout_ms), wall_clock_ms)
    server = grpc.aio.server()
    pb_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(engine, authenticator, quotas), server)
    address = "127.0.0.1:0"
    port = server.add_secure_port(address, server_credentials(tls)) if tls else server.add_insecure_port(address)
    await server.start()
    sweeper = asyncio.create_task(engine.run_sweeper(0.1))
    try:
        yield f"127.0.0.1:{port}"
    finally:
        sweeper.cancel()
        await server.stop(0)
        await store.close()


@pytest.fixture
async def secured(etcd: EtcdServer, prefix: str, tmp_path: Path) -> AsyncIterator[Secured]:
    token_file = _token_file(tmp_path / "tokens.toml")
    authenticator = TokenAuthenticator(token_file)
    async with _serve(etcd, prefix, authenticator, send_timeout_ms=300) as address:
        yield Secured(address, authenticator, token_file)


# Every RPC, as one principal acting on one subject: used to show that each one is guarded.
Call = Callable[[Actor, pb.Subject], Awaitable[Any]]
EVERY_RPC: dict[str, Call] = {
    "RecordDelivery": lambda a, s: a.record_delivery(s.mailbox, "n-1"),
    "ClaimReply": lambda a, s: a.claim(s),
    "RenewClaim": lambda a, s: a.renew(s, 1),
    "ReleaseClaim": lambda a, s: a.release(s, 1),
    "BeginSend": lambda a, s: a.begin(s, 1),
    "ConfirmSent": lambda a, s: a.confirm(s, 1),
    "AbortSend": lambda a, s: a.abort(s, 1),
    "GetStatus": lambda a, s: a.status(s),
    "ListClaims": lambda a, s: a.list(s.mailbox),
    "Watch": lambda a, s: anext(a.watch(s.mailbox)),
    "Takeover": lambda a, s: a.takeover(s),
    "ResolveInDoubt": lambda a, s: a.resolve(s, pb.ResolveInDoubtRequest.OUTCOME_NOT_SENT),
}


@pytest.mark.parametrize("rpc", sorted(EVERY_RPC))
async def test_another_tenants_mailbox_is_refused(secured: Secured, rpc: str) -> None:
    async with grpc.aio.insecure_channel(secured.address) as channel:
        owner = secured.actor(channel, "agent-b")
        token = (await owner.claim(message("globex", "m-1"), note="secret plans")).status.fencing_token
        assert token > 0
        # ana is a human with every role, but only for acme-* mailboxes.
        intruder = secured.actor(channel, "ana" if rpc in ("Takeover", "ResolveInDoubt") else "agent-a")
        error = await rpc_error(EVERY_RPC[rpc](intruder, message("globex", "m-1")))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED, error.details()
        details = error.details() or ""
        assert "not granted mailbox 'globex'" in details
        # Nothing about the other tenant leaks: not its holder, its note, or its token.
        assert "agent-b" not in details
        assert "secret" not in details
        assert str(token) not in details
        assert (await owner.status(message("globex", "m-1"))).holder == "agent-b"


@pytest.mark.parametrize("rpc", sorted(EVERY_RPC))
async def test_calls_without_valid_credentials_are_unauthenticated(secured: Secured, rpc: str) -> None:
    async with grpc.aio.insecure_channel(secured.address) as channel:
        for actor in (
            Actor(channel, "agent-a"),  # development-mode metadata only: no longer enough
            Actor(channel, "agent-a", token="ict_not-a-real-token"),
        ):
            error = await rpc_error(EVERY_RPC[rpc](actor, message("acme-1", "m")))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "Bearer" in (error.details() or "")


async def test_holder_comes_from_the_credentials_and_cannot_be_forged(secured: Secured) -> None:
    async with grpc.aio.insecure_channel(secured.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        subject = message("acme-1", "m")
        forged = (("authorization", f"Bearer {TOKENS['agent-a']}"), ("x-inbox-principal", "ana"))
        error = await rpc_error(stub.ClaimReply(pb.ClaimReplyRequest(request_id="r", subject=subject), metadata=forged))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "acts only as itself" in (error.details() or "")
        # Naming itself is fine; the kind always comes from the token file, not from metadata.
        honest = (
            ("authorization", f"Bearer {TOKENS['agent-a']}"),
            ("x-inbox-principal", "agent-a"),
            ("x-inbox-principal-kind", "human"),
        )
        granted = await stub.ClaimReply(pb.ClaimReplyRequest(request_id="r", subject=subject), metadata=honest)
        assert granted.status.holder == "agent-a"
        assert granted.status.holder_kind == pb.HOLDER_KIND_AGENT


async def test_a_revoked_token_stops_working_after_reload(secured: Secured) -> None:
    async with grpc.aio.insecure_channel(secured.address) as channel:
        agent = secured.actor(channel, "agent-a")
        assert (await agent.claim(message("acme-1", "m"))).result == pb.ClaimReplyResponse.GRANTED
        _token_file(secured.token_file, revoked=("agent-a",))
        assert secured.authenticator.reload() == 5
        error = await rpc_error(agent.claim(message("acme-1", "m2")))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        # The other principals are unaffected, on the same connection.
        assert (await secured.actor(channel, "bo").status(message("acme-1", "m"))).holder == "agent-a"


async def test_a_broken_token_file_keeps_the_old_principals(secured: Secured) -> None:
    secured.token_file.write_text('[[principals]]\nid = "x"\nkind = "robot"\ntoken_sha256 = []\n')
    with pytest.raises(TokenFileError, match=r"principals\[0\]\.kind"):
        secured.authenticator.reload()
    async with grpc.aio.insecure_channel(secured.address) as channel:
        assert (await secured.actor(channel, "agent-a").claim(message("acme-1", "m"))).result == 1


async def test_roles_are_enforced(secured: Secured) -> None:
    async with grpc.aio.insecure_channel(secured.address) as channel:
        agent, ana, bo, root = (secured.actor(channel, n) for n in ("agent-a", "ana", "bo", "root"))
        subject = message("acme-1", "m")
        token = (await agent.claim(subject)).status.fencing_token
        error = await rpc_error(bo.takeover(subject))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "role 'takeover'" in (error.details() or "")
        assert (await ana.takeover(subject)).result == pb.TakeoverResponse.TAKEN_OVER
        assert (await agent.begin(subject, token)).result == pb.FENCE_RESULT_STALE_TOKEN

        doubt = message("acme-1", "doubt")
        t = (await agent.claim(doubt)).status.fencing_token
        await agent.begin(doubt, t)
        deadline = time.monotonic() + 10
        while (await agent.status(doubt)).state != pb.SUBJECT_STATE_IN_DOUBT:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        error = await rpc_error(bo.resolve(doubt, pb.ResolveInDoubtRequest.OUTCOME_NOT_SENT))
        assert "role 'resolve'" in (error.details() or "")
        resolved = await ana.resolve(doubt, pb.ResolveInDoubtRequest.OUTCOME_SENT)
        assert resolved.status.state == pb.SUBJECT_STATE_REPLIED
        # admin reaches every mailbox.
        assert (await root.status(message("globex", "anything"))).state == pb.SUBJECT_STATE_FREE


async def test_list_and_watch_cover_only_granted_mailboxes(secured: Secured) -> None:
    async with grpc.aio.insecure_channel(secured.address) as channel:
        a, b = secured.actor(channel, "agent-a"), secured.actor(channel, "agent-b")
        await a.claim(message("acme-1", "mine"))
        await b.claim(message("globex", "theirs"))
        assert [s.subject.id for s in (await a.list("acme-1")).subjects] == ["mine"]
        stream = a.watch("acme-1")
        snapshot = await anext(stream)
        assert [s.subject.id for s in snapshot.snapshot.subjects] == ["mine"]
        assert (await rpc_error(a.list("globex"))).code() == grpc.StatusCode.PERMISSION_DENIED


async def test_rate_limit_answers_resource_exhausted_with_a_retry_hint(
    etcd: EtcdServer, prefix: str, tmp_path: Path
) -> None:
    authenticator = TokenAuthenticator(_token_file(tmp_path / "tokens.toml"))
    quotas = QuotaSettings(calls_per_second=5, burst=5, max_watches=2)
    async with (
        _serve(etcd, prefix, authenticator, quotas=quotas) as address,
        grpc.aio.insecure_channel(address) as channel,
    ):
        agent = Actor(channel, "agent-a", token=TOKENS["agent-a"])
        subject = message("acme-1", "m")
        for _ in range(5):
            await agent.status(subject)
        call = agent.stub.GetStatus(pb.GetStatusRequest(subject=subject), metadata=agent.metadata)
        error = await rpc_error(call)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "5 calls/s" in (error.details() or "")
        hint = dict(error.trailing_metadata() or ())["retry-after-ms"]
        assert 0 < int(str(hint)) <= 200
        # The same, machine-readable: google.rpc ErrorInfo and RetryInfo.
        assert error_reason(error)[0] == "RATE_LIMITED"
        assert error_retry_delay_ms(error) == int(str(hint))
        # Another principal has its own budget.
        assert (await Actor(channel, "bo", token=TOKENS["bo"]).status(subject)).state == pb.SUBJECT_STATE_FREE
        await asyncio.sleep(int(str(hint)) / 1000 + 0.05)
        assert (await agent.status(subject)).state == pb.SUBJECT_STATE_FREE


async def test_a_batch_is_authorized_call_by_call(secured: Secured) -> None:
    async with grpc.aio.insecure_channel(secured.address) as channel:
        owner = secured.actor(channel, "agent-b")
        await owner.claim(message("globex", "m-1"), note="secret plans")
        agent = secured.actor(channel, "agent-a")  # acme-* only

        def claim(subject: pb.Subject) -> pb.BatchCall:
            return pb.BatchCall(claim_reply=pb.ClaimReplyRequest(request_id=new_request_id(), subject=subject))

        status = pb.BatchCall(get_status=pb.GetStatusRequest(subject=message("globex", "m-1")))
        mine, theirs, peek = await agent.batch(claim(message("acme-1", "m-1")), claim(message("globex", "m-1")), status)
        assert mine.claim_reply.result == pb.ClaimReplyResponse.GRANTED
        assert mine.claim_reply.status.holder == "agent-a"
        for refused in (theirs, peek):
            assert refused.error.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
            assert "globex" in refused.error.message
            assert "agent-b" not in refused.error.message
            assert "secret" not in refused.error.message
        # Without credentials the whole batch is refused, before any call runs.
        anonymous = Actor(channel, "nobody")
        anonymous.metadata = ()
        error = await rpc_error(anonymous.batch(claim(message("acme-1", "m-2"))))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert (await agent.status(message("acme-1", "m-2"))).state == pb.SUBJECT_STATE_FREE


async def test_every_call_of_a_batch_counts_against_the_rate_limit(
    etcd: EtcdServer, prefix: str, tmp_path: Path
) -> None:
    authenticator = TokenAuthenticator(_token_file(tmp_path / "tokens.toml"))
    quotas = QuotaSettings(calls_per_second=5, burst=5)
    async with (
        _serve(etcd, prefix, authenticator, quotas=quotas) as address,
        grpc.aio.insecure_channel(address) as channel,
    ):
        agent = Actor(channel, "agent-a", token=TOKENS["agent-a"])
        four = [pb.BatchCall(get_status=pb.GetStatusRequest(subject=message("acme-1", f"m-{n}"))) for n in range(4)]
        assert len(await agent.batch(*four)) == 4
        error = await rpc_error(agent.batch(*four))  # 1 call's worth left in the bucket, 4 asked
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        hint = int(str(dict(error.trailing_metadata() or ())["retry-after-ms"]))
        assert 400 <= hint <= 700  # 3 more calls at 5/s
        await asyncio.sleep(1.1)  # the bucket is full again (5)
        # A batch larger than the burst is admitted once the bucket is full, and leaves it in debt.
        ten = four + four + four[:2]
        assert len(await agent.batch(*ten)) == 10
        error = await rpc_error(agent.status(message("acme-1", "m-0")))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_watches_per_principal_are_limited(etcd: EtcdServer, prefix: str, tmp_path: Path) -> None:
    authenticator = TokenAuthenticator(_token_file(tmp_path / "tokens.toml"))
    quotas = QuotaSettings(max_watches=2)
    async with (
        _serve(etcd, prefix, authenticator, quotas=quotas) as address,
        grpc.aio.insecure_channel(address) as channel,
    ):
        agent = Actor(channel, "agent-a", token=TOKENS["agent-a"])
        first, second = agent.watch("acme-1"), agent.watch("acme-2")
        await anext(first)
        await anext(second)
        error = await rpc_error(anext(agent.watch("acme-3")))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "2 watches" in (error.details() or "")


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def _tls_files(tmp_path: Path, ca: trustme.CA, *, require_client_cert: bool) -> TlsSettings:
    server_cert = ca.issue_cert("localhost", "127.0.0.1")
    cert, key, client_ca = tmp_path / "server.pem", tmp_path / "server.key", tmp_path / "ca.pem"
    cert.write_bytes(b"".join(blob.bytes() for blob in server_cert.cert_chain_pems))
    key.write_bytes(server_cert.private_key_pem.bytes())
    client_ca.write_bytes(ca.cert_pem.bytes())
    # A client CA goes with requiring client certificates (grpcio cannot ask for an optional one).
    return TlsSettings(cert, key, client_ca if require_client_cert else None, require_client_cert)


async def test_tls_refuses_a_client_that_does_not_trust_the_server(
    etcd: EtcdServer, prefix: str, tmp_path: Path, ca: trustme.CA
) -> None:
    tls = _tls_files(tmp_path, ca, require_client_cert=False)
    authenticator = TokenAuthenticator(_token_file(tmp_path / "tokens.toml"))
    async with _serve(etcd, prefix, authenticator, tls=tls) as address:
        good = grpc.ssl_channel_credentials(root_certificates=ca.cert_pem.bytes())
        async with grpc.aio.secure_channel(address, good) as channel:
            agent = Actor(channel, "agent-a", token=TOKENS["agent-a"])
            assert (await agent.claim(message("acme-1", "m"))).result == pb.ClaimReplyResponse.GRANTED
        wrong = grpc.ssl_channel_credentials(root_certificates=trustme.CA().cert_pem.bytes())
        async with grpc.aio.secure_channel(address, wrong) as channel:
            agent = Actor(channel, "agent-a", token=TOKENS["agent-a"])
            error = await rpc_error(agent.claim(message("acme-1", "m2")))
            assert error.code() == grpc.StatusCode.UNAVAILABLE
        async with grpc.aio.insecure_channel(address) as channel:
            error = await rpc_error(Actor(channel, "agent-a", token=TOKENS["agent-a"]).claim(message("acme-1", "m3")))
            assert error.code() == grpc.StatusCode.UNAVAILABLE


async def test_mtls_requires_a_client_certificate_and_maps_it_to_a_principal(
    etcd: EtcdServer, prefix: str, tmp_path: Path, ca: trustme.CA
) -> None:
    tls = _tls_files(tmp_path, ca, require_client_cert=True)
    authenticator = TokenAuthenticator(_token_file(tmp_path / "tokens.toml"))
    root = ca.cert_pem.bytes()
    async with _serve(etcd, prefix, authenticator, tls=tls) as address:
        async with grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=root)) as channel:
            error = await rpc_error(Actor(channel, "agent-a", token=TOKENS["agent-a"]).claim(message("acme-1", "m")))
            assert error.code() == grpc.StatusCode.UNAVAILABLE
        client = ca.issue_cert("agent-a.acme.test")
        credentials = grpc.ssl_channel_credentials(
            root_certificates=root,
            private_key=client.private_key_pem.bytes(),
            certificate_chain=client.cert_chain_pems[0].bytes(),
        )
        async with grpc.aio.secure_channel(address, credentials) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            # No token at all: the certificate alone says who this is.
            response = await stub.ClaimReply(
                pb.ClaimReplyRequest(request_id=new_request_id(), subject=message("acme-1", "m"))
            )
            assert response.status.holder == "agent-a"
        stranger = ca.issue_cert("stranger.acme.test")
        credentials = grpc.ssl_channel_credentials(
            root_certificates=root,
            private_key=stranger.private_key_pem.bytes(),
            certificate_chain=stranger.cert_chain_pems[0].bytes(),
        )
        async with grpc.aio.secure_channel(address, credentials) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            error = await rpc_error(
                stub.ClaimReply(pb.ClaimReplyRequest(request_id="r", subject=message("acme-1", "x")))
            )
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "not mapped" in (error.details() or "")


def test_token_file_errors_name_the_entry_and_field(tmp_path: Path) -> None:
    cases = {
        "principals = 3\n": "array of tables",
        '[[principals]]\nkind = "agent"\ntoken_sha256 = []\n': "principals[0].id",
        '[[principals]]\nid = "a"\nroles = ["god"]\ntoken_sha256 = []\n': "principals[0].roles",
        '[[principals]]\nid = "a"\ntoken_sha256 = ["abc"]\n': "64 lowercase hex",
        '[[principals]]\nid = "a"\n': "can never authenticate",
        '[[principals]]\nid = "a"\nmailbox = ["x"]\ntoken_sha256 = []\n': "unknown keys ['mailbox']",
        "not toml = = \n": "not valid TOML",
    }
    for text, words in cases.items():
        path = tmp_path / "t.toml"
        path.write_text(text)
        with pytest.raises(TokenFileError) as caught:
            load_token_file(path)
        assert words in str(caught.value), (text, str(caught.value))
    same = hash_token("t")
    path.write_text(
        f'[[principals]]\nid = "a"\ntoken_sha256 = ["{same}"]\n[[principals]]\nid = "b"\ntoken_sha256 = ["{same}"]\n'
    )
    with pytest.raises(TokenFileError, match="also given to 'a'"):
        load_token_file(path)


def test_a_certificate_name_under_two_principals_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text(
        '[[principals]]\nid = "agent-1"\ncertificate_names = ["agent-1.acme.test"]\n'
        '[[principals]]\nid = "root"\nroles = ["admin"]\ncertificate_names = ["root.acme.test", "agent-1.acme.test"]\n'
    )
    with pytest.raises(TokenFileError) as caught:
        load_token_file(path)
    assert "principals[1].certificate_names: certificate name 'agent-1.acme.test' is also given to 'agent-1'" in str(
        caught.value
    )


async def test_a_duplicate_certificate_name_on_reload_keeps_the_old_principals(
    etcd: EtcdServer, prefix: str, tmp_path: Path, ca: trustme.CA
) -> None:
    tls = _tls_files(tmp_path, ca, require_client_cert=True)
    token_file = _token_file(tmp_path / "tokens.toml")
    authenticator = TokenAuthenticator(token_file)
    # The typo the rule exists for: the agent's certificate name given to the admin as well.
    _token_file(
        token_file, extra='[[principals]]\nid = "typo"\nroles = ["admin"]\ncertificate_names = ["agent-a.acme.test"]\n'
    )
    with pytest.raises(TokenFileError, match=r"'agent-a\.acme\.test' is also given to 'agent-a'"):
        authenticator.reload()
    credentials = _client_credentials(ca, "agent-a.acme.test")
    async with (
        _serve(etcd, prefix, authenticator, tls=tls) as address,
        grpc.aio.secure_channel(address, credentials) as channel,
    ):
        response = await pb_grpc.CoordinatorStub(channel).ClaimReply(
            pb.ClaimReplyRequest(request_id=new_request_id(), subject=message("acme-1", "m"))
        )
        assert response.status.holder == "agent-a"
        # Still only acme-*: the admin's rights did not reach the agent's certificate.
        error = await rpc_error(
            pb_grpc.CoordinatorStub(channel).GetStatus(pb.GetStatusRequest(subject=message("globex", "m")))
        )
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_a_certificate_whose_names_map_to_two_principals_is_refused(
    etcd: EtcdServer, prefix: str, tmp_path: Path, ca: trustme.CA
) -> None:
    tls = _tls_files(tmp_path, ca, require_client_cert=True)
    authenticator = TokenAuthenticator(
        _token_file(tmp_path / "tokens.toml", extra='[[principals]]\nid = "x"\ncertificate_names = ["x.acme.test"]\n')
    )
    async with _serve(etcd, prefix, authenticator, tls=tls) as address:
        credentials = _client_credentials(ca, "agent-a.acme.test", "x.acme.test")
        async with grpc.aio.secure_channel(address, credentials) as channel:
            error = await rpc_error(
                pb_grpc.CoordinatorStub(channel).GetStatus(pb.GetStatusRequest(subject=message("acme-1", "m")))
            )
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "map to several principals (agent-a, x)" in (error.details() or "")


def _client_credentials(ca: trustme.CA, *names: str) -> grpc.ChannelCredentials:
    client = ca.issue_cert(*names)
    return grpc.ssl_channel_credentials(
        root_certificates=ca.cert_pem.bytes(),
        private_key=client.private_key_pem.bytes(),
        certificate_chain=client.cert_chain_pems[0].bytes(),
    )
