"""An existing Nylas webhook agent, as a user writes it, guarded in at most five changed lines.

tests/data/handlers holds each handler twice: ``*_unguarded.py`` (signature check, an in-process set of seen
notification ids, an LLM draft, a send with httpx) and ``*_guarded.py``, the same file after the change
docs/client.md section 2 shows. Both run as real servers: two worker processes of each (two separate uvicorn
processes for FastAPI, two ``flask run`` werkzeug processes for Flask, each on its own port; this test is the
dispatcher that spreads the deliveries over them, as a load balancer would) against a real coordinator on a
real etcd and a fake Nylas that records every send. The unguarded pair replies twice; the guarded pair once.

And the mailbox's own messages (docs/design.md#replies-written-outside): the fake Nylas delivers the copy of every
reply the agents send (in SENT, as Nylas notifies every message the mailbox sends, here before the send is even
answered), and a person answers a message from Gmail while an agent drafts its answer. The unguarded pair replies
to its own replies and to the person's, and sends its draft anyway; the guarded pair replies once per customer
message, never to an outgoing message, and the agent drafting sends nothing.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from coordinator.store.etcd.process import EtcdServer, free_port
from examples.agent.fake_nylas import FakeNylas, Sent
from inbox_claims import Subject, SubjectState
from inbox_claims.testing import RunningCoordinator, running_coordinator, sign_nylas

HANDLERS = Path(__file__).resolve().parents[1] / "data" / "handlers"
ROOT = Path(__file__).resolve().parents[2]
API_KEY = "nyk_handler_test"
SECRET = "webhook-secret-for-the-handler-test"
GRANT = "grant-handlers"
MAX_CHANGED_LINES = 5
# A send is done within the draft time plus a few round trips; the sends have settled once none came for this
# long (the unguarded handlers have no other way to say they are done).
QUIET_S = 1.5


def changed_lines(before: str, after: str) -> list[str]:
    """The + and - lines of the unified diff (without its --- and +++ headers)."""
    diff = difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
    return [line for line in diff if line[:1] in "+-" and not line.startswith(("---", "+++"))]


@pytest.mark.parametrize("framework", ["fastapi", "flask"])
def test_guarding_the_handler_changes_at_most_five_lines(framework: str) -> None:
    before = (HANDLERS / f"{framework}_unguarded.py").read_text()
    after = (HANDLERS / f"{framework}_guarded.py").read_text()
    changes = changed_lines(before, after)
    assert 0 < len(changes) <= MAX_CHANGED_LINES, "\n".join(changes)


def test_the_handlers_type_check_with_mypy_strict(tmp_path: Path) -> None:
    for source in HANDLERS.glob("*.py"):
        shutil.copy(source, tmp_path / source.name)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--cache-dir", os.devnull, "."],
        cwd=tmp_path,
        env={**os.environ, "MYPYPATH": str(ROOT / "clients" / "python")},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _refusal_output(setup: str) -> str:
    """What a process that configured its logging with ``setup`` prints for one absorbed refusal."""
    refusal = "from inbox_claims._guard import log_refusal\nlog_refusal('not replying to %s', 'm-1')"
    code = f"import logging\n{setup}\n{refusal}"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True)
    return result.stdout + result.stderr


def test_a_refusal_line_shows_where_the_app_configured_no_logging_and_follows_it_where_it_did() -> None:
    # uvicorn and gunicorn configure their own loggers only: the line must still show.
    assert _refusal_output("") == "INFO:inbox_claims: not replying to m-1\n"
    # An app that configures logging decides: shown at INFO in its format, not at WARNING, not twice.
    assert _refusal_output("logging.basicConfig(level=logging.INFO, format='%(name)s %(message)s')") == (
        "inbox_claims not replying to m-1\n"
    )
    assert _refusal_output("logging.basicConfig(level=logging.WARNING)") == ""
    assert _refusal_output("logging.getLogger('inbox_claims').setLevel(logging.WARNING)") == ""


# ---------------------------------------------------------------------------------------- the servers


@dataclass
class Worker:
    url: str
    process: subprocess.Popen[bytes]
    log: Path


def _command(framework: str, module: str, port: int) -> list[str]:
    if framework == "fastapi":
        return [sys.executable, "-m", "uvicorn", "--app-dir", str(HANDLERS), f"{module}:app", "--port", str(port)]
    return [sys.executable, "-m", "flask", "--app", str(HANDLERS / f"{module}.py"), "run", "--port", str(port)]


def _wait_until_serving(worker: Worker, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if worker.process.poll() is not None:
            raise AssertionError(f"the worker exited ({worker.process.returncode}):\n{worker.log.read_text()}")
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(worker.url, timeout=1.0)  # any answer (404, 405) means it listens
            return
        time.sleep(0.1)
    raise AssertionError(f"the worker at {worker.url} did not start:\n{worker.log.read_text()}")


@contextlib.contextmanager
def workers(
    framework: str,
    module: str,
    coordinator: RunningCoordinator,
    nylas: FakeNylas,
    logs: Path,
    extra_env: dict[str, str] | None = None,
) -> Iterator[list[Worker]]:
    started: list[Worker] = []
    try:
        for index in range(2):
            port = free_port()
            log = logs / f"{module}-{index}.log"
            env = {
                **os.environ,
                "NYLAS_API_BASE": nylas.api_base,
                "NYLAS_API_KEY": API_KEY,
                "NYLAS_WEBHOOK_SECRET": SECRET,
                "INBOX_COORDINATOR_TARGET": coordinator.target,
                "INBOX_PRINCIPAL": f"{module}-worker-{index}",
                **(extra_env or {}),
            }
            with log.open("wb") as output:
                process = subprocess.Popen(
                    _command(framework, module, port), cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT
                )
            started.append(Worker(f"http://127.0.0.1:{port}/webhooks/nylas", process, log))
        for worker in started:
            _wait_until_serving(worker)
        yield started
    finally:
        for worker in started:
            worker.process.terminate()
        for worker in started:
            try:
                worker.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()


# ---------------------------------------------------------------------------------------- deliveries


def notification(
    message_id: str,
    *,
    kind: str = "message.created",
    notification_id: str | None = None,
    thread_id: str | None = None,
    sent_by: str | None = None,
) -> bytes:
    """A message notification: a customer's, in INBOX; or, with ``sent_by``, one the mailbox sent (Google's SENT)."""
    message = {
        "id": message_id,
        "grant_id": GRANT,
        "thread_id": thread_id or f"thread-{message_id}",
        "object": "message",
        "subject": f"Order {message_id}",
        # Each message from a customer of its own: twenty from one address would spend that correspondent's reply
        # budget (10 a day by default, docs/design.md#reply-storms) and the guarded run would rightly stop at ten.
        "from": [
            {"email": sent_by or f"customer-{message_id}@example.com", "name": "Ana Lima" if sent_by else "A Customer"}
        ],
        "folders": ["SENT"] if sent_by else ["INBOX", "UNREAD"],
        "date": int(time.time()),
    }
    document = {
        "specversion": "1.0",
        "type": kind,
        "id": notification_id or f"notification-{uuid.uuid4().hex}",
        "time": int(time.time()),
        "data": {"application_id": "app-1", "object": message},
    }
    return json.dumps(document).encode()


def post(delivery: tuple[Worker, bytes]) -> int:
    worker, body = delivery
    headers = {"X-Nylas-Signature": sign_nylas(body, SECRET), "Content-Type": "application/json"}
    return httpx.post(worker.url, content=body, headers=headers, timeout=30.0).status_code


def deliver_all(deliveries: list[tuple[Worker, bytes]]) -> None:
    """POSTs every delivery at once (each to its worker), signed as Nylas signs; each must be accepted."""
    with ThreadPoolExecutor(max_workers=len(deliveries)) as pool:
        statuses = list(pool.map(post, deliveries))
    assert statuses == [200] * len(deliveries)


def settled_sends(nylas: FakeNylas, message_ids: list[str], *, at_least: int, within: float = 30.0) -> Counter[str]:
    """Sends per message, once at least ``at_least`` were made and none came for QUIET_S."""
    deadline = time.monotonic() + within
    last_count, last_change = -1, time.monotonic()
    while time.monotonic() < deadline:
        count = len(nylas.sends)
        if count != last_count:
            last_count, last_change = count, time.monotonic()
        elif count >= at_least and time.monotonic() - last_change >= QUIET_S:
            break
        time.sleep(0.05)
    wanted = set(message_ids)
    return Counter(sent.reply_to_message_id for sent in nylas.sends if sent.reply_to_message_id in wanted)


@dataclass
class Outcome:
    redelivered: Counter[str]
    created_and_updated: Counter[str]
    twenty_twice: Counter[str]
    message_ids: list[str]


def run_the_deliveries(pair: list[Worker], nylas: FakeNylas) -> Outcome:
    first, second = pair
    tag = uuid.uuid4().hex[:8]

    # 1. One message.created delivered three times (the same notification id), across both workers.
    redelivered_id = f"msg-{tag}-redelivered"
    body = notification(redelivered_id)
    deliver_all([(first, body), (second, body), (first, body)])
    redelivered = settled_sends(nylas, [redelivered_id], at_least=1)

    # 2. Two notifications about one message: message.created, and a message.updated (its own id).
    updated_id = f"msg-{tag}-updated"
    deliver_all([(first, notification(updated_id)), (second, notification(updated_id, kind="message.updated"))])
    created_and_updated = settled_sends(nylas, [updated_id], at_least=1)

    # 3. Twenty messages, each delivered twice at the same time, once to each worker.
    many = [f"msg-{tag}-{index:02d}" for index in range(20)]
    bodies = [notification(message_id) for message_id in many]
    deliver_all([(worker, body) for body in bodies for worker in (first, second)])
    twenty_twice = settled_sends(nylas, many, at_least=20)

    for worker in pair:
        assert worker.process.poll() is None, worker.log.read_text()
    return Outcome(redelivered, created_and_updated, twenty_twice, [redelivered_id, updated_id, *many])


@pytest.fixture
def coordinator(shared_etcd: EtcdServer) -> Iterator[RunningCoordinator]:
    with running_coordinator(etcd_endpoint=shared_etcd.endpoint) as running:
        yield running


@pytest.fixture
def nylas() -> Iterator[FakeNylas]:
    with FakeNylas(API_KEY, require_idempotency_key=False) as fake:
        yield fake


@pytest.mark.timeout(240)
@pytest.mark.parametrize("framework", ["fastapi", "flask"])
def test_the_unguarded_handler_replies_twice_and_the_guarded_one_once(
    framework: str, coordinator: RunningCoordinator, nylas: FakeNylas, tmp_path: Path
) -> None:
    with workers(framework, f"{framework}_unguarded", coordinator, nylas, tmp_path) as pair:
        before = run_the_deliveries(pair, nylas)
    # Each worker has its own set of seen notification ids, and a created and an updated are two ids.
    assert before.redelivered.most_common(1)[0][1] >= 2, before.redelivered
    assert before.created_and_updated.most_common(1)[0][1] == 2, before.created_and_updated
    assert sum(before.twenty_twice.values()) > 20, before.twenty_twice
    assert nylas.problems == []

    with workers(framework, f"{framework}_guarded", coordinator, nylas, tmp_path) as pair:
        after = run_the_deliveries(pair, nylas)
    # The redeliveries were dropped, each with its line in the worker's output, though the handler configures
    # no logging and uvicorn (or werkzeug) only its own.
    output = "".join(worker.log.read_text() for worker in pair)
    assert "INFO:inbox_claims: not replying to message" in output, output
    assert after.redelivered == Counter({after.message_ids[0]: 1})
    assert after.created_and_updated == Counter({after.message_ids[1]: 1})
    assert after.twenty_twice == Counter(dict.fromkeys(after.message_ids[2:], 1))
    assert nylas.problems == []
    guarded = [sent for sent in nylas.sends if sent.reply_to_message_id in set(after.message_ids)]
    # The guarded sends carry the claim's idempotency key: Nylas itself would refuse a second reply.
    assert all(sent.idempotency_key.startswith("ic1-") for sent in guarded)
    with coordinator.client("checker") as checker:
        for message_id in after.message_ids:
            assert checker.status(Subject.message(GRANT, message_id)).state is SubjectState.REPLIED


# ------------------------------------------------------------------------ the mailbox's own messages

SHOP = "support@shop.example"
DRAFT_WHILE_ANSWERED_S = 2.0


@dataclass
class Conversation:
    customer_replies: Counter[str]
    replies_to_outgoing: list[str]
    copies: list[int]
    answered_while_drafting: str


def run_the_conversation(pair: list[Worker], nylas: FakeNylas, coordinator: RunningCoordinator) -> Conversation:
    first, second = pair
    tag = uuid.uuid4().hex[:8]
    asked, drafting = f"msg-{tag}-asked", f"msg-{tag}-answered-from-gmail"
    customers = {asked, drafting}
    copies: list[int] = []
    earlier = len(nylas.sends)

    def deliver_copy(sent: Sent) -> None:
        # The copy of a reply to a customer, in SENT, delivered before the send is answered (so before the agent
        # can confirm it); copies of replies to anything else are not sent, which bounds the unguarded agents.
        if sent.reply_to_message_id in customers:
            thread = f"thread-{sent.reply_to_message_id}"
            copies.append(post((second, notification(sent.id, thread_id=thread, sent_by=SHOP))))

    nylas.on_send = deliver_copy
    # 1. A customer writes: answered once; the answer's copy comes back.
    assert post((first, notification(asked))) == 200
    settled_sends(nylas, [asked], at_least=1)
    # 2. Another customer writes; while the agent drafts its answer, Ana answers from Gmail. (Delivered from a
    # thread of its own: the Flask handler drafts and sends before it answers the webhook.)
    pending = ThreadPoolExecutor(max_workers=1)
    answered = pending.submit(post, (first, notification(drafting)))
    with coordinator.client("observer") as observer:
        deadline = time.monotonic() + DRAFT_WHILE_ANSWERED_S / 2
        while time.monotonic() < deadline and observer.status(Subject.message(GRANT, drafting)).state is not (
            SubjectState.CLAIMED
        ):
            time.sleep(0.02)
    gmail = f"gmail-{tag}"
    assert post((second, notification(gmail, thread_id=f"thread-{drafting}", sent_by="ana@shop.example"))) == 200
    assert answered.result(timeout=30) == 200
    pending.shutdown()
    time.sleep(DRAFT_WHILE_ANSWERED_S + 0.5)  # the draft is done: its send went out, or was refused
    settled_sends(nylas, [], at_least=0)
    nylas.on_send = None
    for worker in pair:
        assert worker.process.poll() is None, worker.log.read_text()
    sends = nylas.sends[earlier:]
    outgoing = {sent.id for sent in sends} | {gmail}
    return Conversation(
        Counter(sent.reply_to_message_id for sent in sends if sent.reply_to_message_id in customers),
        [sent.reply_to_message_id for sent in sends if sent.reply_to_message_id in outgoing],
        copies,
        drafting,
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("framework", ["fastapi", "flask"])
def test_no_reply_to_the_mailboxs_own_messages_and_none_after_a_person_answered_from_gmail(
    framework: str, coordinator: RunningCoordinator, nylas: FakeNylas, tmp_path: Path
) -> None:
    env = {"LLM_DRAFT_SECONDS": str(DRAFT_WHILE_ANSWERED_S), "INBOX_MAILBOX_ADDRESSES": SHOP}
    with workers(framework, f"{framework}_unguarded", coordinator, nylas, tmp_path, env) as pair:
        before = run_the_conversation(pair, nylas, coordinator)
    # Without the guard: a reply to its own reply, one to the person's, and the draft sent after the person answered.
    assert len(before.replies_to_outgoing) >= 2, before
    assert before.customer_replies[before.answered_while_drafting] == 1, before

    with workers(framework, f"{framework}_guarded", coordinator, nylas, tmp_path, env) as pair:
        after = run_the_conversation(pair, nylas, coordinator)
    asked = next(message for message in after.customer_replies if message != after.answered_while_drafting)
    assert after.customer_replies == Counter({asked: 1}), after
    assert after.replies_to_outgoing == [], after
    assert after.copies == [200], after
    assert nylas.problems == []
    with coordinator.client("checker") as checker:
        answered = checker.status(Subject.message(GRANT, after.answered_while_drafting))
        assert (answered.state, answered.replied_outside) == (SubjectState.REPLIED, True)
        assert answered.holder == "Ana Lima <ana@shop.example>"
        assert checker.status(Subject.message(GRANT, asked)).state is SubjectState.REPLIED
