"""`inbox-coordinator serve` with a token file and TLS, as an operator runs it: tokens made by `token new`,
revoked by editing the file and sending SIGHUP, plaintext refused off loopback."""

from __future__ import annotations

import datetime
import re
import signal
import ssl
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
import trustme

from coordinator.store.etcd.process import EtcdServer, free_port
from inbox_wire.v1 import coordinator_pb2 as pb
from inbox_wire.v1 import coordinator_pb2_grpc as pb_grpc
from tests.helpers import Actor, eventually, message, rpc_error, spawn, wait_for_line

CLI = [sys.executable, "-m", "coordinator"]


def _token_new(principal: str, *extra: str) -> tuple[str, str]:
    out = subprocess.run(
        [*CLI, "token", "new", "--id", principal, *extra], capture_output=True, text=True, check=True
    ).stdout
    token = re.search(r"^# (ict_\S+)$", out, re.MULTILINE)
    assert token is not None, out
    entry = out[out.index("[[principals]]") :]
    return token.group(1), entry


async def test_token_file_and_tls_through_the_cli(tmp_path: Path, etcd: EtcdServer, prefix: str) -> None:
    agent_token, agent_entry = _token_new("agent-1", "--mailbox", "acme-*")
    human_token, human_entry = _token_new("ana", "--kind", "human", "--mailbox", "acme-*", "--role", "takeover")
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(agent_entry + human_entry)
    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1")
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    cert.write_bytes(b"".join(blob.bytes() for blob in server_cert.cert_chain_pems))
    key.write_bytes(server_cert.private_key_pem.bytes())
    port = free_port()
    process = spawn(
        [
            *CLI,
            "serve",
            "--listen",
            f"127.0.0.1:{port}",
            "--etcd-endpoints",
            etcd.endpoint,
            "--prefix",
            prefix,
            "--token-file",
            str(tokens),
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
            "--metrics-listen",
            "",
        ],
    )
    try:
        banner = wait_for_line(process, "serving gRPC on")
        assert "no token file" not in banner
        credentials = grpc.ssl_channel_credentials(root_certificates=ca.cert_pem.bytes())
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
            agent = Actor(channel, "agent-1", token=agent_token)
            granted = await agent.claim(message("acme-1", "m"))
            assert granted.status.holder == "agent-1"
            human = Actor(channel, "ana", kind="human", token=human_token)
            assert (await human.takeover(message("acme-1", "m"))).result == pb.TakeoverResponse.TAKEN_OVER
            denied = await rpc_error(agent.claim(message("globex", "m")))
            assert denied.code() == grpc.StatusCode.PERMISSION_DENIED

            # Revoke the agent: edit the file, SIGHUP; the human's token goes on working on the same connection.
            tokens.write_text(human_entry)
            process.send_signal(signal.SIGHUP)
            wait_for_line(process, "token file reloaded: 1 principal")

            async def refused() -> bool:
                error = await rpc_error(agent.status(message("acme-1", "m")))
                return error.code() == grpc.StatusCode.UNAUTHENTICATED

            assert await eventually(refused, within=5)
            assert (await human.status(message("acme-1", "m"))).holder == "ana"

            # A broken file is refused and the previous principals stay.
            tokens.write_text("[[principals]]\nid = 3\n")
            process.send_signal(signal.SIGHUP)
            wait_for_line(process, "NOT reloaded")
            assert (await human.status(message("acme-1", "m"))).holder == "ana"

            # So is a file that gives one certificate name to two principals.
            names = 'certificate_names = ["ana.acme.test"]\n'
            tokens.write_text(human_entry + names + '[[principals]]\nid = "root"\nroles = ["admin"]\n' + names)
            process.send_signal(signal.SIGHUP)
            refusal = wait_for_line(process, "NOT reloaded")
            assert "certificate name 'ana.acme.test' is also given to 'ana'" in refusal
            assert (await human.status(message("acme-1", "m"))).holder == "ana"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()


def test_plaintext_off_loopback_is_refused_at_start() -> None:
    result = subprocess.run(
        [*CLI, "serve", "--listen", "0.0.0.0:0", "--etcd-endpoints", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "without TLS on a non-loopback address" in result.stderr
    assert "allow_plaintext" in result.stderr


_NAMES = 'certificate_names = ["agent-1.acme.test"]\n'


@pytest.mark.parametrize(
    ("text", "refusal"),
    [
        ('[[principals]]\nid = "x"\nkind = "robot"\ntoken_sha256 = []\n', "principals[0].kind"),
        (
            '[[principals]]\nid = "agent-1"\n' + _NAMES + '[[principals]]\nid = "root"\n' + _NAMES,
            "principals[1].certificate_names: certificate name 'agent-1.acme.test' is also given to 'agent-1'",
        ),
    ],
    ids=["bad kind", "certificate name under two principals"],
)
def test_a_bad_token_file_is_a_configuration_error(tmp_path: Path, text: str, refusal: str) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(text)
    result = subprocess.run(
        [*CLI, "serve", "--etcd-endpoints", "127.0.0.1:1", "--token-file", str(tokens), "--metrics-listen", ""],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert refusal in result.stderr


def _stop(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()


def _mtls_serve(tmp_path: Path, etcd: EtcdServer, prefix: str) -> tuple[trustme.CA, int, list[str]]:
    """A CA, a port, and the command serving it with TLS and required client certificates from that CA."""
    ca = trustme.CA()
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem.bytes())
    server_cert = ca.issue_cert("127.0.0.1")
    (tmp_path / "server.pem").write_bytes(b"".join(b.bytes() for b in server_cert.cert_chain_pems))
    (tmp_path / "server.key").write_bytes(server_cert.private_key_pem.bytes())
    port = free_port()
    tls = ["--tls-cert", str(tmp_path / "server.pem"), "--tls-key", str(tmp_path / "server.key")]
    mtls = ["--tls-client-ca", str(tmp_path / "ca.pem"), "--require-client-cert"]
    serve = ["serve", "--listen", f"127.0.0.1:{port}", "--etcd-endpoints", etcd.endpoint, "--prefix", prefix]
    return ca, port, [*CLI, *serve, *tls, *mtls, "--metrics-listen", ""]


def test_health_checks_a_coordinator_that_requires_client_certificates(
    tmp_path: Path, etcd: EtcdServer, prefix: str
) -> None:
    ca, port, command = _mtls_serve(tmp_path, etcd, prefix)
    client_cert = ca.issue_cert("probe.ops.test")
    (tmp_path / "probe.pem").write_bytes(b"".join(b.bytes() for b in client_cert.cert_chain_pems))
    (tmp_path / "probe.key").write_bytes(client_cert.private_key_pem.bytes())
    process = spawn(command)

    def health(*extra: str) -> subprocess.CompletedProcess[str]:
        probe = ["health", "--address", f"127.0.0.1:{port}", "--ca-file", str(tmp_path / "ca.pem"), *extra]
        return subprocess.run([*CLI, *probe], capture_output=True, text=True, timeout=30)

    try:
        wait_for_line(process, "serving gRPC on")
        refused = health()
        assert refused.returncode == 1, refused
        assert "UNAVAILABLE" in refused.stdout
        client = ["--cert-file", str(tmp_path / "probe.pem"), "--key-file", str(tmp_path / "probe.key")]
        answered = health(*client)
        assert answered.returncode == 0, answered
        assert answered.stdout.strip().endswith("SERVING")
        half = health("--cert-file", str(tmp_path / "probe.pem"))
        assert half.returncode == 2
        assert "--cert-file and --key-file go together" in half.stderr
    finally:
        _stop(process)


async def test_a_refused_client_certificate_is_logged_with_its_reason(
    tmp_path: Path, etcd: EtcdServer, prefix: str
) -> None:
    ca, port, command = _mtls_serve(tmp_path, etcd, prefix)
    process = spawn([*command, "--log-format", "json"])

    async def attempt(client: trustme.LeafCert | None) -> grpc.aio.AioRpcError:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=ca.cert_pem.bytes(),
            private_key=client.private_key_pem.bytes() if client is not None else None,
            certificate_chain=client.cert_chain_pems[0].bytes() if client is not None else None,
        )
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
            return await rpc_error(Actor(channel, "agent-1").status(message("acme-1", "m")))

    expired = ca.issue_cert("agent-1.acme.test", not_after=datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC))
    cases = [
        (None, "client_certificate_missing", "the client sent no certificate"),
        (trustme.CA().issue_cert("agent-1.acme.test"), "client_certificate_untrusted", "not signed by --tls-client-ca"),
        (expired, "client_certificate_expired", "has expired"),
    ]
    try:
        wait_for_line(process, "serving gRPC on")
        for client, reason, advice in cases:
            error = await attempt(client)
            assert error.code() is grpc.StatusCode.UNAVAILABLE  # all the client ever learns: "Socket closed"
            line = wait_for_line(process, '"event": "tls_handshake_refused"').splitlines()[-1]
            assert f'"reason": "{reason}"' in line, line
            assert advice in line, line
    finally:
        _stop(process)


def test_a_client_ca_without_requiring_certificates_is_refused_at_start(tmp_path: Path, etcd: EtcdServer) -> None:
    # grpcio asks for a client certificate only when it requires one: such a CA would never see a certificate.
    ca = trustme.CA()
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem.bytes())
    server_cert = ca.issue_cert("127.0.0.1")
    (tmp_path / "server.pem").write_bytes(b"".join(b.bytes() for b in server_cert.cert_chain_pems))
    (tmp_path / "server.key").write_bytes(server_cert.private_key_pem.bytes())
    tls = ["--tls-cert", str(tmp_path / "server.pem"), "--tls-key", str(tmp_path / "server.key")]
    result = subprocess.run(
        [
            *CLI,
            "serve",
            "--etcd-endpoints",
            etcd.endpoint,
            *tls,
            "--tls-client-ca",
            str(tmp_path / "ca.pem"),
            "--metrics-listen",
            "",
            "--listen",
            f"127.0.0.1:{free_port()}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert "tls_client_ca" in result.stderr
    assert "require_client_cert" in result.stderr
    assert "optionally" in result.stderr


async def test_a_mapped_client_certificate_is_the_caller_over_grpc_and_http(
    tmp_path: Path, etcd: EtcdServer, prefix: str
) -> None:
    ca, port, command = _mtls_serve(tmp_path, etcd, prefix)
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        '[[principals]]\nid = "agent-1"\nmailboxes = ["acme-*"]\ncertificate_names = ["agent-1.acme.test"]\n'
    )
    http = f"127.0.0.1:{free_port()}"
    process = spawn([*command, "--token-file", str(tokens), "--http-listen", http])
    client = ca.issue_cert("agent-1.acme.test")
    client.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "client.pem"))
    try:
        wait_for_line(process, "claims board on")
        credentials = grpc.ssl_channel_credentials(
            root_certificates=ca.cert_pem.bytes(),
            private_key=client.private_key_pem.bytes(),
            certificate_chain=client.cert_chain_pems[0].bytes(),
        )
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
            caller = await pb_grpc.CoordinatorStub(channel).GetCaller(pb.GetCallerRequest())
        assert caller.principal == "agent-1"
        # The HTTP face asks for the certificate too, and maps it the same way.
        url = f"https://{http}/inbox.coordinator.v1.Coordinator/GetCaller"
        context = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        context.load_cert_chain(str(tmp_path / "client.pem"))
        async with httpx.AsyncClient(verify=context) as https:
            answer = await https.post(url, json={})
        assert answer.status_code == 200, answer.text
        assert answer.json()["principal"] == "agent-1"
        # Without a certificate, no HTTP request gets through either.
        async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))) as bare:
            with pytest.raises(httpx.TransportError):
                await bare.post(url, json={})
    finally:
        _stop(process)
