"""inboxctl, run as a person at a terminal (or a script) would run it, against a real coordinator.

Each command runs as a subprocess (``python -m inbox_claims.cli``, and the installed ``inboxctl`` script once),
with a clean environment and a home of its own, so that no setting of the machine leaks in.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from coordinator.store.etcd.process import EtcdServer
from inbox_claims import Coordinator, Subject, SubjectState
from inbox_claims.cli import clock, main, table
from inbox_claims.testing import RunningCoordinator, running_coordinator
from inbox_claims.types import FenceResult, MessageSummary, OutsideReply, SubjectStatus
from tests.server.test_auth import TOKENS, _serve, _token_file

ANA = "ana@example.com"

Ctl = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def running(shared_etcd: EtcdServer) -> Iterator[RunningCoordinator]:
    with running_coordinator(etcd_endpoint=shared_etcd.endpoint, send_timeout=0.5, min_ttl=2) as coordinator:
        yield coordinator


def clean_env(home: Path, **settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("INBOX_", "INBOXCTL_"))}
    return {**env, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "PYTHONUNBUFFERED": "1", **settings}


@pytest.fixture
def home(tmp_path: Path) -> Path:
    (tmp_path / ".config").mkdir()
    return tmp_path


@pytest.fixture(scope="module")
def patient(shared_etcd: EtcdServer) -> Iterator[RunningCoordinator]:
    """A coordinator whose sends stay SENDING for minutes: for a test that reads a send begun and not confirmed
    (``running``'s half-second send timeout turned one IN_DOUBT on a loaded machine)."""
    with running_coordinator(etcd_endpoint=shared_etcd.endpoint, send_timeout=300, min_ttl=2) as coordinator:
        yield coordinator


@pytest.fixture
def ctl(running: RunningCoordinator, home: Path) -> Ctl:
    return _ctl_for(running.target, home)


def _ctl_for(target: str, home: Path) -> Ctl:
    """``ctl(*args, env={...})``: runs inboxctl against the coordinator, as ANA (a human) unless told otherwise."""

    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        settings = {"INBOX_COORDINATOR_TARGET": target, "INBOX_PRINCIPAL": ANA, **(env or {})}
        return subprocess.run(
            [sys.executable, "-m", "inbox_claims.cli", *args],
            env=clean_env(home, **settings),
            capture_output=True,
            text=True,
            timeout=30,
        )

    return run


@pytest.fixture
def agent(running: RunningCoordinator) -> Iterator[Coordinator]:
    with running.client("agent-a") as client:
        yield client


def test_help_shows_every_command_with_examples_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    installed = Path(sys.executable).with_name("inboxctl")
    top = subprocess.run([str(installed), "--help"], capture_output=True, text=True, timeout=30)
    assert top.returncode == 0, top.stderr
    for command in (
        "status",
        "ls",
        "watch",
        "claim",
        "release",
        "takeover",
        "replied",
        "in-doubt",
        "resolve",
        "undo-outside",
    ):
        assert f"inboxctl {command} grant-7f3a" in top.stdout
        with pytest.raises(SystemExit) as done:
            main([command, "--help"])
        assert done.value.code == 0
        text = capsys.readouterr().out
        assert "examples:" in text
        assert f"  inboxctl {command} " in text
        assert "4  not authenticated, or not permitted" in text
    assert "--target" in top.stdout
    assert "[$INBOX_COORDINATOR_TARGET]" in top.stdout


def test_usage_errors_exit_2(ctl: Ctl, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = ctl("status", "grant-1")
    assert missing.returncode == 2
    assert "required: id" in missing.stderr
    assert ctl("frobnicate").returncode == 2
    assert ctl("resolve", "grant-1", "m-1").returncode == 2  # --sent or --not-sent is required
    bad_value = ctl("claim", "grant-1", "m" * 600)
    assert bad_value.returncode == 2  # the coordinator rejects the id: INVALID_ARGUMENT
    assert "id" in bad_value.stderr

    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    (home / ".config" / "inboxctl.toml").write_text('target = "127.0.0.1:1"\ncolour = "blue"\n')
    with pytest.raises(SystemExit) as unknown_key:
        main(["ls", "grant-1"])
    (home / "broken.toml").write_text("target = \n")
    with pytest.raises(SystemExit) as broken:
        main(["--config", str(home / "broken.toml"), "ls", "grant-1"])
    with pytest.raises(SystemExit) as absent:
        main(["ls", "grant-1", "--config", str(home / "absent.toml")])
    assert unknown_key.value.code == broken.value.code == absent.value.code == 2


def test_an_unreachable_coordinator_exits_3(ctl: Ctl) -> None:
    started = time.monotonic()
    result = ctl("--target", "127.0.0.1:1", "status", "grant-1", "m-1")
    assert result.returncode == 3
    assert "cannot reach the coordinator at 127.0.0.1:1" in result.stderr
    assert time.monotonic() - started < 10


def test_a_support_session_claim_status_ls_release(ctl: Ctl, mailbox: str) -> None:
    claimed = ctl("claim", mailbox, "msg-1", "--note", "calling the customer back", "--ttl", "600")
    assert claimed.returncode == 0, claimed.stderr
    assert f"claimed message msg-1 in {mailbox}" in claimed.stdout
    assert f"release it with: inboxctl release {mailbox} msg-1" in claimed.stdout

    refused = ctl("claim", mailbox, "msg-1", env={"INBOX_PRINCIPAL": "bo@example.com"})
    assert refused.returncode == 1
    assert "not claimed: held by someone else" in refused.stdout
    assert f"held by   {ANA} (human) since" in refused.stdout

    status = ctl("status", mailbox, "msg-1")
    assert status.returncode == 0
    assert f"message msg-1 in {mailbox}: CLAIMED" in status.stdout
    assert "expires   in 9m5" in status.stdout or "expires   in 10m00s" in status.stdout
    assert "note      calling the customer back" in status.stdout
    document = json.loads(ctl("status", mailbox, "msg-1", "--json").stdout)
    assert (document["state"], document["holder"], document["holder_kind"]) == ("CLAIMED", ANA, "HUMAN")
    assert document["ttl_seconds"] == 600

    listing = ctl("ls", mailbox)
    assert listing.returncode == 0
    header, row = listing.stdout.splitlines()
    assert header.split() == ["KIND", "ID", "STATE", "HOLDER", "SINCE", "EXPIRES", "NOTE"]
    assert row.split()[:5] == ["message", "msg-1", "CLAIMED", ANA, "(human)"]
    assert [s["subject"]["id"] for s in json.loads(ctl("--json", "ls", mailbox).stdout)] == ["msg-1"]

    not_yours = ctl("release", mailbox, "msg-1", env={"INBOX_PRINCIPAL": "bo@example.com"})
    assert (not_yours.returncode, not_yours.stdout.splitlines()[0]) == (1, "not released: you do not hold it")
    released = ctl("release", mailbox, "msg-1")
    assert released.returncode == 0
    assert "it is FREE now" in released.stdout
    assert "nothing held" in ctl("ls", mailbox).stdout


def test_takeover_fences_the_agent(ctl: Ctl, agent: Coordinator, mailbox: str) -> None:
    subject = Subject.message(mailbox, "msg-vip")
    agent_token = agent.claim(subject, ttl=60).token

    by_agent = ctl("takeover", mailbox, "msg-vip", "--kind", "agent", env={"INBOX_PRINCIPAL": "agent-b"})
    assert by_agent.returncode == 4
    assert "not permitted" in by_agent.stderr
    taken = ctl("takeover", mailbox, "msg-vip", "--note", "VIP, I will answer")
    assert taken.returncode == 0, taken.stderr
    assert f"took message msg-vip in {mailbox} over from agent-a (its token {agent_token} is stale" in taken.stdout
    assert agent.begin_send(subject, agent_token) == FenceResult(ok=False, status=agent.status(subject))
    again = ctl("takeover", mailbox, "msg-vip", env={"INBOX_PRINCIPAL": "bo@example.com"})
    assert (again.returncode, "not taken over: a human holds it" in again.stdout) == (1, True)
    assert f"to take it from {ANA} (a colleague), say so: add --from {ANA}" in again.stdout
    # From a colleague, by naming them: Ana's claim ends (her token is stale), Bo holds it.
    from_ana = ctl("takeover", mailbox, "msg-vip", "--from", ANA, env={"INBOX_PRINCIPAL": "bo@example.com"})
    assert from_ana.returncode == 0, from_ana.stdout + from_ana.stderr
    assert f"took message msg-vip in {mailbox} over from {ANA}" in from_ana.stdout
    assert agent.status(subject).holder == "bo@example.com"


def test_replied_records_a_reply_by_hand_and_the_agent_then_leaves_it(
    ctl: Ctl, agent: Coordinator, mailbox: str
) -> None:
    subject = Subject.message(mailbox, "msg-vip")
    agent.claim(subject, ttl=60)
    held_by_agent = ctl("replied", mailbox, "msg-vip")
    assert held_by_agent.returncode == 1
    assert f"take it over first: inboxctl takeover {mailbox} msg-vip" in held_by_agent.stdout
    assert ctl("takeover", mailbox, "msg-vip").returncode == 0
    not_yours = ctl("replied", mailbox, "msg-vip", env={"INBOX_PRINCIPAL": "bo@example.com"})
    assert not_yours.returncode == 1
    marked = ctl("replied", mailbox, "msg-vip", "--sent-id", "gmail-1", "--note", "replied from Gmail")
    assert marked.returncode == 0, marked.stderr
    assert f"recorded: message msg-vip in {mailbox} was answered by hand" in marked.stdout
    assert f"replied   by hand by {ANA} (human)" in marked.stdout
    assert "sent id   gmail-1" in marked.stdout
    later = agent.claim(subject, notification_id="message.updated-1")
    assert later.outcome.name == "ALREADY_REPLIED"
    assert later.status is not None
    assert later.status.replied_by_hand

    # Answered without claiming first: `replied` claims and marks in one go.
    unclaimed = ctl("replied", mailbox, "msg-phone", "--note", "called them", "--json")
    assert unclaimed.returncode == 0, unclaimed.stderr
    document = json.loads(unclaimed.stdout)
    assert (document["ok"], document["status"]["state"], document["status"]["replied_by_hand"]) == (
        True,
        "REPLIED",
        True,
    )
    assert agent.claim(Subject.message(mailbox, "msg-phone")).outcome.name == "ALREADY_REPLIED"
    twice = ctl("replied", mailbox, "msg-phone")
    assert (twice.returncode, "it is not held: nothing to record" in twice.stdout) == (1, True)


def test_in_doubt_and_resolve(ctl: Ctl, agent: Coordinator, mailbox: str) -> None:
    for message_id in ("msg-a", "msg-b"):
        subject = Subject.message(mailbox, message_id)
        assert agent.begin_send(subject, agent.claim(subject).token).ok  # and then the agent vanished
    deadline = time.monotonic() + 10
    while len(agent.list_claims(mailbox, states=[SubjectState.IN_DOUBT]).subjects) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)

    listing = ctl("in-doubt", mailbox)
    assert listing.returncode == 0
    assert [line.split()[1] for line in listing.stdout.splitlines()[1:3]] == ["msg-a", "msg-b"]
    assert "2 send(s) began and were never confirmed" in listing.stdout
    assert {s["state"] for s in json.loads(ctl("in-doubt", mailbox, "--json").stdout)} == {"IN_DOUBT"}

    sent = ctl("resolve", mailbox, "msg-a", "--sent", "--sent-message-id", "nylas-77", "--note", "in Sent")
    assert sent.returncode == 0, sent.stderr
    assert f"message msg-a in {mailbox}: REPLIED" in sent.stdout
    assert "sent id   nylas-77" in sent.stdout
    not_sent = ctl("resolve", mailbox, "msg-b", "--not-sent")
    assert not_sent.returncode == 0
    assert agent.status(Subject.message(mailbox, "msg-b")).state is SubjectState.FREE
    twice = ctl("resolve", mailbox, "msg-a", "--not-sent")
    assert twice.returncode == 1
    assert "refused:" in twice.stderr
    assert "no send in doubt" in ctl("in-doubt", mailbox).stdout


def test_watch_prints_a_line_per_event_and_stops_by_itself(
    running: RunningCoordinator, home: Path, agent: Coordinator, mailbox: str
) -> None:
    subject = Subject.message(mailbox, "msg-w")
    agent.claim(Subject.message(mailbox, "msg-held"))
    env = clean_env(home, INBOX_COORDINATOR_TARGET=running.target, INBOX_PRINCIPAL=ANA)
    command = [sys.executable, "-m", "inbox_claims.cli", "watch", mailbox, "--count", "3"]
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as watch:
        assert watch.stdout is not None
        assert f"watching {mailbox}: 1 subject(s) not free" in watch.stdout.readline()
        assert "CLAIMED message msg-held" in watch.stdout.readline()
        token = agent.claim(subject, ttl=30).token
        agent.release(subject, token)
        agent.claim(subject, ttl=30)
        out, err = watch.communicate(timeout=20)
    assert watch.returncode == 0, err
    lines = out.splitlines()
    assert [line.split()[1] for line in lines] == ["CLAIMED", "RELEASED", "CLAIMED"]
    assert f"message msg-w in {mailbox} by agent-a (agent) expires in" in lines[0]

    started = time.monotonic()
    timed = subprocess.run(
        [sys.executable, "-m", "inbox_claims.cli", "watch", mailbox, "--timeout", "0.5", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert timed.returncode == 0, timed.stderr
    assert time.monotonic() - started < 10
    snapshot = json.loads(timed.stdout.splitlines()[0])["snapshot"]
    assert sorted(s["subject"]["id"] for s in snapshot["subjects"]) == ["msg-held", "msg-w"]


def test_watch_on_a_terminal_redraws_a_table_in_place(
    running: RunningCoordinator, home: Path, agent: Coordinator, mailbox: str
) -> None:
    env = clean_env(home, INBOX_COORDINATOR_TARGET=running.target, INBOX_PRINCIPAL=ANA)
    controller, terminal = pty.openpty()
    command = [sys.executable, "-m", "inbox_claims.cli", "watch", mailbox, "--count", "1"]
    with subprocess.Popen(command, env=env, stdout=terminal, stderr=subprocess.PIPE) as watch:
        os.close(terminal)
        screen = read_until(controller, b"(nothing held)")
        agent.claim(Subject.message(mailbox, "msg-live"), ttl=30, note="drafting")
        screen += read_until(controller, b"last event: ")
        watch.wait(timeout=20)
    os.close(controller)
    assert watch.returncode == 0
    text = screen.decode()
    assert text.count("\x1b[H\x1b[J") >= 2  # drawn, then redrawn in place
    assert f"inboxctl watch {mailbox}" in text
    last = text.rsplit("\x1b[H\x1b[J", 1)[1]
    assert "KIND     ID        STATE    HOLDER" in last
    assert "msg-live  CLAIMED  agent-a (agent)" in last
    assert "drafting" in last


def read_until(fd: int, marker: bytes, within: float = 15.0) -> bytes:
    seen = b""
    deadline = time.monotonic() + within
    while marker not in seen:
        assert time.monotonic() < deadline, f"{marker!r} never shown; got {seen!r}"
        if select.select([fd], [], [], 0.1)[0]:
            try:
                seen += os.read(fd, 65536)
            except OSError:  # the terminal closed
                break
    return seen


def test_settings_precedence_flags_over_env_over_file(ctl: Ctl, running: RunningCoordinator, home: Path) -> None:
    mailbox = f"grant-{uuid.uuid4().hex[:8]}"
    config = home / ".config" / "inboxctl.toml"
    config.write_text(f'target = "{running.target}"\nprincipal = "from-file"\nkind = "human"\ncall_timeout = 3\n')
    no_target = {"INBOX_COORDINATOR_TARGET": "", "INBOX_PRINCIPAL": ""}

    def holder(*args: str, env: dict[str, str]) -> str:
        result = ctl(*args, "--json", env=env)
        assert result.returncode == 0, result.stderr
        status = json.loads(result.stdout)["status"]
        return str(status["holder"])

    assert holder("claim", mailbox, "m-1", env=no_target) == "from-file"
    assert holder("claim", mailbox, "m-2", env={**no_target, "INBOX_PRINCIPAL": "from-env"}) == "from-env"
    from_flag = holder("--principal", "from-flag", "claim", mailbox, "m-3", env={"INBOX_PRINCIPAL": "from-env"})
    assert from_flag == "from-flag"
    other = home / "other.toml"
    other.write_text('target = "127.0.0.1:1"\n')
    assert ctl("ls", mailbox, "--config", str(other), env=no_target).returncode == 3  # --config replaces the file
    assert ctl("ls", mailbox, "--config", str(other), "--target", running.target, env=no_target).returncode == 0


@contextlib.contextmanager
def token_coordinator(etcd: EtcdServer, token_file: Path) -> Iterator[str]:
    """A coordinator that authenticates bearer tokens (tests/server/test_auth.py's principals), in a thread
    of its own."""
    from coordinator.api.auth import TokenAuthenticator

    address: list[str] = []
    ready, stop = threading.Event(), threading.Event()

    async def serve() -> None:
        async with _serve(etcd, f"test/{uuid.uuid4().hex}/", TokenAuthenticator(token_file)) as served:
            address.append(served)
            ready.set()
            await asyncio.to_thread(stop.wait)

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    try:
        assert ready.wait(30), "the coordinator did not start"
        yield address[0]
    finally:
        stop.set()
        thread.join(30)


def test_tokens_are_sent_and_refusals_exit_4(ctl: Ctl, shared_etcd: EtcdServer, home: Path) -> None:
    with token_coordinator(shared_etcd, _token_file(home / "tokens.toml")) as target:
        as_ana = {"INBOX_COORDINATOR_TARGET": target, "INBOX_PRINCIPAL": "", "INBOX_TOKEN": TOKENS["ana"]}
        claimed = ctl("claim", "acme-1", "m-1", "--json", env=as_ana)
        assert claimed.returncode == 0, claimed.stderr
        assert json.loads(claimed.stdout)["status"]["holder"] == "ana"  # the identity came from the token
        assert ctl("ls", "acme-1", env=as_ana).returncode == 0

        wrong = ctl("ls", "acme-1", env={**as_ana, "INBOX_TOKEN": "not-a-token"})
        assert wrong.returncode == 4
        assert "not authenticated" in wrong.stderr
        other_tenant = ctl("ls", "globex", env=as_ana)
        assert (other_tenant.returncode, "not permitted" in other_tenant.stderr) == (4, True)
        no_role = ctl("--token", TOKENS["bo"], "takeover", "acme-1", "m-2", env=as_ana)  # the flag wins over env
        assert no_role.returncode == 4


def test_ls_status_and_watch_show_which_email_and_watch_fits_the_terminal(
    running: RunningCoordinator, home: Path, ctl: Ctl, agent: Coordinator, mailbox: str
) -> None:
    refund = MessageSummary("Refund for order 1182?", "Bea Costa <bea@example.org>", datetime.now(UTC))
    agent.claim(Subject.message(mailbox, "msg-00"), ttl=600, summary=refund)
    for number in range(1, 30):
        agent.claim(Subject.message(mailbox, f"msg-{number:02d}"), ttl=600)
    replied = Subject.message(mailbox, "msg-done")
    agent.mark_replied(replied, agent.claim(replied, summary=MessageSummary("Invoice 77", "carl@example.net")).token)

    status = ctl("status", mailbox, "msg-00")
    assert "  subject   Refund for order 1182?" in status.stdout
    assert "  from      Bea Costa <bea@example.org> (received " in status.stdout
    header, *rows = ctl("ls", mailbox, "--limit", "2").stdout.splitlines()
    assert header.split()[:4] == ["KIND", "ID", "SUBJECT", "FROM"]
    assert "Refund for order 1182?  Bea Costa <bea@example.org>  CLAIMED" in rows[0]

    env = clean_env(home, INBOX_COORDINATOR_TARGET=running.target, INBOX_PRINCIPAL=ANA)
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 16, 120, 0, 0))
    command = [sys.executable, "-m", "inbox_claims.cli", "watch", mailbox, "--state", "replied", "--state", "claimed"]
    with subprocess.Popen([*command, "--count", "1"], env=env, stdout=terminal, stderr=subprocess.PIPE) as watch:
        os.close(terminal)
        screen = read_until(controller, b"Ctrl-C to stop")
        agent.release(
            Subject.message(mailbox, "msg-01"), agent.status(Subject.message(mailbox, "msg-01")).fencing_token
        )
        screen += read_until(controller, b"last event: ")
        watch.wait(timeout=20)
    os.close(controller)
    assert watch.returncode == 0
    last = screen.decode().rsplit("\x1b[H\x1b[J", 1)[1]
    lines = last.rstrip("\r\n").splitlines()
    assert len(lines) <= 16  # the terminal's height
    assert "30 subject(s) CLAIMED or REPLIED" in lines[0]
    assert "… and " in last
    assert "more (narrow it with --state" in last
    assert "RELEASED message msg-01" in last
    assert "msg-00" in last  # claims sort before replies, so the live ones are the ones shown

    # Line mode with a filter: the snapshot and the events of REPLIED subjects only.
    only_replied = subprocess.run(
        [*command[:-2], "--timeout", "1"], env=env, capture_output=True, text=True, timeout=30
    )
    assert only_replied.returncode == 0, only_replied.stderr
    out = only_replied.stdout.splitlines()
    assert f"watching {mailbox}: 1 subject(s) REPLIED" in out[0]
    assert out[1].split()[1:3] == ["REPLIED", "message"]


def test_whoami_says_who_the_coordinator_takes_you_to_be_and_what_you_may_do(
    ctl: Ctl, shared_etcd: EtcdServer, home: Path
) -> None:
    development = ctl("whoami")
    assert development.returncode == 0, development.stderr
    assert development.stdout.splitlines()[0] == f"{ANA} (a person)"
    assert "take a message over from an agent" in development.stdout
    assert "development mode" in development.stdout
    with token_coordinator(shared_etcd, _token_file(home / "tokens.toml")) as target:
        as_bo = {"INBOX_COORDINATOR_TARGET": target, "INBOX_PRINCIPAL": "", "INBOX_TOKEN": TOKENS["bo"]}
        bo = ctl("whoami", env=as_bo)
        assert bo.returncode == 0, bo.stderr
        assert bo.stdout.splitlines() == [
            "bo (a person)",
            "mailboxes: acme-*",
            "may: only claim, give back and answer messages in those mailboxes (no roles)",
        ]
        ana = json.loads(ctl("whoami", "--json", env={**as_bo, "INBOX_TOKEN": TOKENS["ana"]}).stdout)
        assert ana == {
            "principal": "ana",
            "kind": "HUMAN",
            "roles": ["resolve", "takeover"],
            "mailboxes": ["acme-*"],
            "development_mode": False,
        }
        refused = ctl("whoami", env={**as_bo, "INBOX_TOKEN": "not-a-token"})
        assert refused.returncode == 4


def test_a_reply_from_the_mailbox_is_said_in_peoples_words(
    patient: RunningCoordinator, home: Path, mailbox: str
) -> None:
    """What a support person sees when someone answered from Gmail: who and when, on the row of the agent that
    stopped because of it, in status, ls and watch; and beside a send that went out anyway."""
    ctl = _ctl_for(patient.target, home)
    with patient.client("agent-a") as agent:
        at = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=2)
        drafting, sending = Subject.message(mailbox, "msg-drafting"), Subject.message(mailbox, "msg-sending")
        asked = at - timedelta(minutes=5)
        agent.claim(drafting, ttl=30, thread_id="t-1", received_at=asked)
        other = agent.claim(sending, ttl=30, thread_id="t-2", received_at=asked)
        agent.begin_send(sending, other.token)
        agent.record_outgoing(
            mailbox, "copy-1", "t-2", at, sender="Shop"
        )  # the send's own copy, before its confirmation
        env = clean_env(home, INBOX_COORDINATOR_TARGET=patient.target, INBOX_PRINCIPAL=ANA)
        command = [sys.executable, "-m", "inbox_claims.cli", "watch", mailbox, "--count", "2"]
        with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as watch:
            assert watch.stdout is not None
            assert "watching" in watch.stdout.readline()
            watch.stdout.readline(), watch.stdout.readline()  # the two subjects of the snapshot
            agent.record_outgoing(mailbox, "gmail-1", "t-1", at, sender="ana@shop.example")
            agent.record_outgoing(mailbox, "gmail-2", "t-2", at, sender="ana@shop.example")
            out, err = watch.communicate(timeout=20)
        assert watch.returncode == 0, err
        local = clock(at)  # the person's local time, as inboxctl prints times
        lines = out.splitlines()
        assert lines[0].split()[1:] == [
            "ANSWERED_OUTSIDE",
            "message",
            "msg-drafting",
            "in",
            f"{mailbox}:",
            *(
                f"answered from the mailbox by ana@shop.example (its From line; recorded by agent-a) at {local}; "
                "agent-a stopped, a person answered"
            ).split(),
        ]
        assert lines[1].endswith(
            f"answered from the mailbox by ana@shop.example (its From line; recorded by agent-a) at {local}; "
            "agent-a is sending a reply too: both go out"
        )
        status = ctl("status", mailbox, "msg-drafting")
        assert status.returncode == 0, status.stderr
        assert f"{mailbox}: REPLIED" in status.stdout
        assert (
            "replied   answered from the mailbox by ana@shop.example (its From line; recorded by agent-a) "
            f"at {local}; agent-a stopped"
        ) in status.stdout
        both = ctl("status", mailbox, "msg-sending")
        assert f"message msg-sending in {mailbox}: SENDING" in both.stdout
        assert "also      answered from the mailbox by ana@shop.example" in both.stdout
        listing = ctl("ls", mailbox)
        row = next(line for line in listing.stdout.splitlines() if "msg-drafting" in line)
        assert "REPLIED" in row
        assert "ana@shop.example (human)" in row
        assert f"answered from the mailbox (recorded by agent-a) at {local}; agent-a stopped, a person answered" in row

    def test_text_that_would_show_as_something_else_is_written_out(ctl: Ctl, agent: Coordinator, mailbox: str) -> None:
        # Summaries are cleaned by the coordinator; an id or a note may still carry a right-to-left override.
        disguised = "invoice-\u202egnp.exe"
        agent.claim(Subject.message(mailbox, disguised), note="see \u2067attached\u2069")
        status = ctl("status", mailbox, disguised)
        assert status.returncode == 0, status.stderr
        assert "invoice-<U+202E>gnp.exe" in status.stdout
        assert "note      see <U+2067>attached<U+2069>" in status.stdout
        assert "\u202e" not in status.stdout
        listing = ctl("ls", mailbox)
        assert "invoice-<U+202E>gnp.exe" in listing.stdout
        assert "\u202e" not in listing.stdout
        document = ctl("status", mailbox, disguised, "--json").stdout
        assert "\\u202e" in document
        assert "\u202e" not in document
        assert json.loads(document)["subject"]["id"] == disguised


def test_a_table_row_says_a_reply_from_the_mailbox_whole_on_another_day_and_with_long_names() -> None:
    """The row's words are never cut: only the names in them are. A reply from yesterday prints its date, which
    made the sentence 83 characters, and a fixed cut at 80 left "a person answer…" (seen in CI past midnight)."""
    now = datetime.now(UTC)
    yesterday = now - timedelta(days=1, minutes=2)
    holder = "support-agent-with-a-very-long-principal-name-" + "x" * 40
    status = SubjectStatus(
        subject=Subject.message("grant-1", "msg-1"),
        state=SubjectState.REPLIED,
        holder="ana@shop.example",
        replied_outside=True,
        outside_reply=OutsideReply("ana@shop.example", yesterday, "gmail-1", "agent-a", stopped_holder=holder),
    )
    row = table([status], now)[1]
    day = yesterday.astimezone().strftime("%Y-%m-%d")
    assert f"answered from the mailbox (recorded by agent-a) at {day} " in row
    assert row.endswith("… stopped, a person answered")
    assert holder[:35] + "…" in row
    assert holder not in row


def test_claiming_a_message_you_already_hold_says_so_with_its_expiry(
    ctl: Ctl, shared_etcd: EtcdServer, home: Path, mailbox: str
) -> None:
    """The finding: the holder herself was told "held by someone else"."""
    first = ctl("claim", mailbox, "msg-1", "--ttl", "600")
    assert first.returncode == 0, first.stderr
    again = ctl("claim", mailbox, "msg-1")
    assert again.returncode == 0, again.stdout
    assert again.stdout.startswith(f"you already hold message msg-1 in {mailbox} (token ")
    assert "it frees in 9m5" in again.stdout or "it frees in 10m00s" in again.stdout
    assert "held by someone else" not in again.stdout
    assert "held by someone else" in ctl("claim", mailbox, "msg-1", env={"INBOX_PRINCIPAL": "bo@example.com"}).stdout
    # With a token, inboxctl asks the coordinator who it is.
    with token_coordinator(shared_etcd, _token_file(home / "tokens.toml")) as target:
        as_ana = {"INBOX_COORDINATOR_TARGET": target, "INBOX_PRINCIPAL": "", "INBOX_TOKEN": TOKENS["ana"]}
        assert ctl("claim", "acme-1", "m-1", env=as_ana).returncode == 0
        held = ctl("claim", "acme-1", "m-1", env=as_ana)
        assert (held.returncode, held.stdout.startswith("you already hold message m-1 in acme-1")) == (0, True)


def test_undo_outside_makes_a_message_answerable_again_and_watch_says_who_undid_it(
    ctl: Ctl, agent: Coordinator, home: Path, running: RunningCoordinator, mailbox: str
) -> None:
    at = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=2)
    subject = Subject.message(mailbox, "msg-1")
    agent.claim(subject, ttl=60, thread_id="t-1", received_at=at - timedelta(minutes=5))
    agent.record_outgoing(mailbox, "gmail-1", "t-1", at, sender="Ana Lima <ana@shop.example>")
    env = clean_env(home, INBOX_COORDINATOR_TARGET=running.target, INBOX_PRINCIPAL=ANA)
    command = [sys.executable, "-m", "inbox_claims.cli", "watch", mailbox, "--count", "1"]
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as watch:
        assert watch.stdout is not None
        assert "watching" in watch.stdout.readline()
        watch.stdout.readline()  # the subject of the snapshot
        undone = ctl("undo-outside", mailbox, "msg-1", "--note", "Ana answered another customer")
        out, err = watch.communicate(timeout=20)
    assert undone.returncode == 0, undone.stderr
    said = undone.stdout.splitlines()
    assert said[0] == (
        'undone: "answered from the mailbox by Ana Lima <ana@shop.example> (its From line; recorded by agent-a) '
        f'at {clock(at)}" no longer counts as the answer to message msg-1 in {mailbox}'
    )
    assert said[1].startswith(f"recorded as undone by {ANA} at ")
    assert said[1].endswith("; it can be answered again")
    assert f"message msg-1 in {mailbox}: FREE" in said[2]
    assert watch.returncode == 0, err
    event = out.splitlines()[-1]
    assert f"OUTSIDE_REPLY_UNDONE message msg-1 in {mailbox}: {ANA} undid " in event
    assert "(Ana answered another customer): it can be answered again" in event
    assert agent.claim(subject, ttl=30, thread_id="t-1", received_at=at - timedelta(minutes=5)).granted
    again = ctl("undo-outside", mailbox, "msg-1")
    assert (again.returncode, "only a message recorded as answered outside" in again.stderr) == (1, True)


def test_waiting_lists_stopped_conversations_after_the_agent_let_go_and_automated_mail(
    ctl: Ctl, agent: Coordinator, mailbox: str
) -> None:
    """docs/design.md#reply-storms: what agents leave to people, with how to answer it."""
    asked = datetime.now(UTC) - timedelta(minutes=10)
    assert "nothing waits for a person" in ctl("waiting", mailbox).stdout
    agent.record_incoming(
        mailbox,
        "ooo-1",
        "t-ooo",
        asked,
        automated="Auto-Submitted: auto-replied",
        summary=MessageSummary("Automatic reply: away", "Cy <cy@example.org>"),
        notification_id="n-ooo",
    )
    for n in range(4):
        subject = Subject.message(mailbox, f"m-{n}")
        claimed = agent.claim(
            subject, thread_id="t-1", received_at=asked + timedelta(seconds=n), summary=MessageSummary("Refund?", "Ana")
        )
        begun = agent.begin_send(subject, claimed.token)
        if begun.ok:
            agent.confirm_sent(subject, claimed.token)
    assert not begun.ok
    agent.release(subject, claimed.token)  # as the guard does at once
    shown = ctl("waiting", mailbox)
    assert shown.returncode == 0, shown.stderr
    stopped, automated = shown.stdout.split("\n\n")
    assert stopped.startswith("agents stopped: 3 agent replies to this conversation in the last hour")
    assert f"message m-3 in {mailbox}" in stopped
    assert "stopped   agent-a at" in stopped
    assert "agents    may answer again from" in stopped
    assert f"answer it inboxctl claim {mailbox} m-3" in stopped
    assert automated.startswith("automated message (Auto-Submitted: auto-replied): agents leave it")
    assert "“Automatic reply: away” from Cy <cy@example.org>" in automated
    listed = json.loads(ctl("waiting", mailbox, "--json").stdout)
    assert [item["subject"]["id"] for item in listed] == ["m-3", "ooo-1"]
    assert listed[0]["agents_stopped"]["scope"] == "thread"
