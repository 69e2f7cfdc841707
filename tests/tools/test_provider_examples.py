"""The provider examples (examples/providers/<name>/) as a user runs them: ``./run`` (the guarded agent) and ``./run
--unguarded`` (the same agent without the coordinator), two processes of each, configured only by the environment
their README names, against each provider's double over real HTTP (tests/providers: Graph's, Gmail's, AgentMail's
and Resend's, and the fake Nylas send endpoint) and a real coordinator on a real etcd. The same deliveries go to
both pairs: one notification delivered three times over the two processes, the copy of the agent's own reply, and a
customer's message that a person answers from the provider's own app while the agent drafts. Replies are counted at
the double: the guarded pair sends one to the first message, none to its own reply's copy, none to the message the
person answered; the unguarded pair sends at least two to the first, and answers the person's message too.

And docs/providers.md's "guarded handler in the fewest lines" is each example's handler, line for line, with the
count it states."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from coordinator.store.etcd.process import EtcdServer, free_port
from examples.agent.fake_nylas import FakeNylas
from inbox_claims.testing import RunningCoordinator, running_coordinator, sign_nylas
from tests.client.test_guard_handlers import Worker, _wait_until_serving
from tests.providers.fake_agentmail import FakeAgentMail
from tests.providers.fake_gmail import AUDIENCE, JWKS_PATH, FakeGmail
from tests.providers.fake_graph import FakeGraph
from tests.providers.fake_resend import FakeResend
from tests.providers.serving import served

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "providers"
PROVIDERS = ("nylas", "graph", "gmail", "agentmail", "resend")
HANDLERS = (*PROVIDERS, "imap")
"""The examples whose handler docs/providers.md shows (IMAP's runs against Dovecot: tests/providers/test_imap.py)."""
LLM_DELAY = "1.5"  # long enough for the person's reply to arrive while the agent drafts
SHOP = "support@shop.example"

Delivery = tuple[dict[str, str], bytes]


@dataclass
class Mail:
    """One provider's double, as the scenario drives it."""

    env: dict[str, str]
    customer: Callable[[str], str]
    """A customer's message arrives: its id."""
    delivery: Callable[[str], Delivery]
    """The notification (or push) that tells of that message (or, for Gmail, of everything up to now)."""
    person_replies: Callable[[str], str]
    """A person answers the message from the provider's own app: the id of their reply."""
    copy_of_reply: Callable[[str], str]
    """The id of the copy of the agent's reply to the message, in the mailbox's sent mail."""
    replies_to: Callable[[str], int]
    """The agent's replies to the message, counted at the double."""
    prime: bool = False
    """Deliver once before any message (Gmail: the first push sets the mailbox's history cursor)."""
    closing: list[Callable[[], None]] = field(default_factory=list)


@contextlib.contextmanager
def nylas_double() -> Iterator[Mail]:
    fake = FakeNylas("nylas-key", require_idempotency_key=False)  # the unguarded agent sends no key, as Nylas allows
    secret = "nylas-webhook-secret"
    grant = f"grant-{uuid.uuid4().hex[:8]}"
    messages: dict[str, dict[str, Any]] = {}

    def message(sender: str, subject: str, thread: str, folders: list[str]) -> str:
        message_id = f"msg-{uuid.uuid4().hex[:10]}"
        messages[message_id] = {
            "id": message_id,
            "grant_id": grant,
            "thread_id": thread,
            "object": "message",
            "subject": subject,
            "from": [{"email": sender}],
            "folders": folders,
            "date": int(time.time()),
        }
        return message_id

    def delivery(message_id: str) -> Delivery:
        body = json.dumps(
            {
                "specversion": "1.0",
                "type": "message.created",
                "id": f"notification-{message_id}",
                "time": int(time.time()),
                "data": {"application_id": "app-1", "object": messages[message_id]},
            }
        ).encode()
        return {"content-type": "application/json", "x-nylas-signature": sign_nylas(body, secret)}, body

    def copy_of_reply(message_id: str) -> str:
        sent = fake.sends_for(message_id)[0]
        messages[sent.id] = {**messages[message_id], "id": sent.id, "folders": ["SENT"], "from": [{"email": SHOP}]}
        return sent.id

    with fake:
        yield Mail(
            env={
                "NYLAS_WEBHOOK_SECRET": secret,
                "NYLAS_API_KEY": "nylas-key",
                "NYLAS_API_BASE": fake.api_base,
                "INBOX_MAILBOX_ADDRESSES": SHOP,
            },
            customer=lambda subject: message("bea@example.org", subject, f"thread-{uuid.uuid4().hex[:8]}", ["INBOX"]),
            delivery=delivery,
            person_replies=lambda to: message(SHOP, "Re: it", messages[to]["thread_id"], ["SENT"]),
            copy_of_reply=copy_of_reply,
            replies_to=lambda message_id: len(fake.sends_for(message_id)),
        )


@contextlib.contextmanager
def graph_double() -> Iterator[Mail]:
    fake = FakeGraph()
    with served(fake.answer) as url:
        yield Mail(
            env={
                "GRAPH_CLIENT_STATE": fake.client_state,
                "GRAPH_USER": fake.user,
                "GRAPH_TOKEN": fake.token,
                "GRAPH_API_BASE": f"{url}/v1.0",
            },
            customer=lambda subject: fake.receive("bea@example.org", subject, f"conv-{uuid.uuid4().hex[:8]}")["id"],
            delivery=lambda message_id: (
                {"content-type": "application/json"},
                fake.notification(fake.messages[message_id]),
            ),
            person_replies=lambda to: fake.person_replies(fake.messages[to])["id"],
            copy_of_reply=lambda message_id: fake.sent_copy(message_id)["id"],
            replies_to=fake.replies_to,
        )


@contextlib.contextmanager
def gmail_double() -> Iterator[Mail]:
    fake = FakeGmail()
    with served(fake.answer) as url:
        yield Mail(
            env={
                "GMAIL_PUSH_AUDIENCE": AUDIENCE,
                "GMAIL_USER": fake.address,
                "GMAIL_TOKEN": fake.token,
                "GMAIL_API_BASE": url,
                "GMAIL_JWKS_URL": f"{url}{JWKS_PATH}",
            },
            customer=lambda subject: fake.receive("bea@example.org", subject)["id"],
            delivery=lambda _message_id: fake.push(),  # a push says only "the mailbox changed up to now"
            person_replies=lambda to: fake.person_replies(fake.messages[to])["id"],
            copy_of_reply=lambda message_id: fake.sent_copy(message_id)["id"],
            replies_to=fake.replies_to,
            prime=True,
        )


@contextlib.contextmanager
def agentmail_double() -> Iterator[Mail]:
    fake = FakeAgentMail(SHOP)

    def delivery(message_id: str) -> Delivery:
        message = fake.messages[message_id]
        body, headers = fake.sent(message) if "sent" in message["labels"] else fake.received(message)
        return headers, body

    with served(fake.answer) as url:
        yield Mail(
            env={
                "AGENTMAIL_WEBHOOK_SECRET": fake.secret,
                "AGENTMAIL_API_KEY": fake.api_key,
                "AGENTMAIL_API_BASE": url,
                "INBOX_MAILBOX_ADDRESSES": SHOP,
            },
            customer=lambda subject: fake.receive("bea@example.org", subject, f"thd-{uuid.uuid4().hex[:8]}")[
                "message_id"
            ],
            delivery=delivery,
            person_replies=lambda to: fake.person_replies(fake.messages[to])["message_id"],
            copy_of_reply=lambda message_id: fake.sent_copy(message_id)["message_id"],
            replies_to=fake.replies_to,
        )


@contextlib.contextmanager
def resend_double() -> Iterator[Mail]:
    fake = FakeResend(SHOP)

    def delivery(email_id: str) -> Delivery:
        email = fake.messages[email_id]
        body, headers = fake.sent(email) if email["_kind"] == "sent" else fake.received(email)
        return headers, body

    with served(fake.answer) as url:
        yield Mail(
            env={
                "RESEND_WEBHOOK_SECRET": fake.secret,
                "RESEND_MAILBOX": SHOP,
                "RESEND_API_KEY": fake.api_key,
                "RESEND_FROM": f"Shop <{SHOP}>",
                "RESEND_API_BASE": url,
                "INBOX_MAILBOX_ADDRESSES": SHOP,
            },
            customer=lambda subject: fake.receive("bea@example.org", subject)["id"],
            delivery=delivery,
            person_replies=lambda to: fake.person_replies(fake.messages[to])["id"],
            copy_of_reply=lambda email_id: fake.sent_copy(email_id)["id"],
            replies_to=fake.replies_to,
        )


DOUBLES = {
    "nylas": nylas_double,
    "graph": graph_double,
    "gmail": gmail_double,
    "agentmail": agentmail_double,
    "resend": resend_double,
}


@contextlib.contextmanager
def agents(
    provider: str, variant: str, mail: Mail, coordinator: RunningCoordinator, logs: Path
) -> Iterator[list[Worker]]:
    """Two processes of ``./run`` (``variant`` "guarded") or ``./run --unguarded``, each from the environment."""
    started: list[Worker] = []
    try:
        for index in range(2):
            port = free_port()
            env = {
                **os.environ,
                **mail.env,
                "PORT": str(port),
                "INBOX_COORDINATOR_TARGET": coordinator.target,
                "INBOX_PRINCIPAL": f"{provider}-agent-{index + 1}",
                "LLM_DELAY": LLM_DELAY,
                "PYTHON": sys.executable,
            }
            log = logs / f"{provider}-{variant}-{index}.log"
            command = [str(EXAMPLES / provider / "run"), *(["--unguarded"] if variant == "unguarded" else [])]
            with log.open("wb") as output:
                process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
            started.append(Worker(f"http://127.0.0.1:{port}", process, log))  # GET / answers 404: it listens
        for agent in started:
            _wait_until_serving(agent)
        yield started
    finally:
        stop(started)


def stop(started: list[Worker]) -> None:
    """SIGTERM, as an orchestrator stops a replica: each lets the replies it is drafting finish."""
    for agent in started:
        if agent.process.poll() is None:
            agent.process.send_signal(signal.SIGTERM)
    for agent in started:
        try:
            agent.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            agent.process.kill()
            agent.process.wait()


def post(agent: Worker, delivery: Delivery) -> int:
    headers, body = delivery
    return httpx.post(f"{agent.url}/webhook", content=body, headers=headers, timeout=30.0).status_code


def post_all(deliveries: list[tuple[Worker, Delivery]]) -> None:
    with ThreadPoolExecutor(max_workers=len(deliveries)) as pool:
        statuses = list(pool.map(lambda pair: post(*pair), deliveries))
    assert all(200 <= status < 300 for status in statuses), statuses


def eventually(check: Callable[[], bool], within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, f"not within {within} s"
        time.sleep(0.05)


@dataclass
class Replies:
    redelivered: int
    own_copy: int
    answered_by_a_person: int


def run_the_deliveries(mail: Mail, pair: list[Worker]) -> Replies:
    first, second = pair
    if mail.prime:
        post_all([(first, mail.delivery(""))])
    asked = mail.customer("Where is my order?")
    post_all([(first, mail.delivery(asked)), (second, mail.delivery(asked)), (first, mail.delivery(asked))])
    drafting = mail.customer("Refund for order 1042")
    post_all([(first, mail.delivery(drafting))])  # the agent drafts for LLM_DELAY seconds...
    person = mail.person_replies(drafting)
    post_all([(second, mail.delivery(person))])  # ...while a person answers it from the provider's app
    eventually(lambda: mail.replies_to(asked) >= 1)
    copy = mail.copy_of_reply(asked)
    post_all([(second, mail.delivery(copy))])  # the copy of the agent's own reply comes back
    stop(pair)
    for agent in pair:  # uvicorn shuts down gracefully, then raises the SIGTERM it caught again
        assert agent.process.returncode in (0, -signal.SIGTERM), agent.log.read_text()
    return Replies(mail.replies_to(asked), mail.replies_to(copy), mail.replies_to(drafting))


@pytest.fixture(scope="module")
def coordinator(shared_etcd: EtcdServer) -> Iterator[RunningCoordinator]:
    with running_coordinator(etcd_endpoint=shared_etcd.endpoint) as running:
        yield running


@pytest.mark.etcd
@pytest.mark.timeout(240)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_the_guarded_example_replies_once_and_the_unguarded_one_at_least_twice(
    provider: str, coordinator: RunningCoordinator, tmp_path: Path
) -> None:
    with (
        DOUBLES[provider]() as guarded_mail,
        DOUBLES[provider]() as unguarded_mail,
        agents(provider, "guarded", guarded_mail, coordinator, tmp_path) as guarded,
        agents(provider, "unguarded", unguarded_mail, coordinator, tmp_path) as unguarded,
        ThreadPoolExecutor(max_workers=2) as pool,
    ):
        after_future = pool.submit(run_the_deliveries, guarded_mail, guarded)
        before = run_the_deliveries(unguarded_mail, unguarded)
        after = after_future.result()
    logs = "".join(path.read_text() for path in sorted(tmp_path.glob(f"{provider}-guarded-*.log")))
    assert after == Replies(redelivered=1, own_copy=0, answered_by_a_person=0), logs
    assert before.redelivered >= 2, before
    assert before.answered_by_a_person >= 1, before  # with the person's own: the customer got two answers
    # Why, one line each: the draft stopped because the person answered; the copy known as the agent's own reply.
    assert "was lost: someone answered it from the mailbox" in logs, logs
    assert "the coordinator knows it as the mailbox's own reply" in logs, logs


# ----------------------------------------------------------------------- the handler in the fewest lines

_REGION = re.compile(r"# --- the guarded handler.*?\n(.*?)# --- end of the guarded handler", re.S)
_DOC_BLOCK = re.compile(r"^### (\w[^\n]*?): (\d+) lines\n.*?```python\n(.*?)```", re.S | re.M)


def handler_of(provider: str) -> str:
    found = _REGION.search((EXAMPLES / provider / "agent.py").read_text())
    assert found, f"examples/providers/{provider}/agent.py marks no guarded handler"
    return found.group(1)


def counted(code: str) -> int:
    """The lines that do something: not blank, not only a comment."""
    return sum(1 for line in code.splitlines() if line.strip() and not line.strip().startswith("#"))


def test_docs_show_each_examples_guarded_handler_line_for_line_with_its_count() -> None:
    document = (ROOT / "docs" / "providers.md").read_text()
    blocks = {name.split()[0].lower(): (int(lines), code) for name, lines, code in _DOC_BLOCK.findall(document)}
    assert set(blocks) == set(HANDLERS), blocks.keys()
    for provider in HANDLERS:
        stated, code = blocks[provider]
        assert code == handler_of(provider), f"docs/providers.md's {provider} handler is not the example's"
        assert counted(code) == stated, (provider, counted(code))


def test_the_nylas_example_reads_nylas_api_uri_with_a_line_saying_it_is_deprecated() -> None:
    code = "from examples.providers.common import nylas_api_base; print(nylas_api_base())"
    environment = {k: v for k, v in os.environ.items() if not k.startswith("NYLAS_API_")}
    old = subprocess.run(
        [sys.executable, "-c", code],
        env={**environment, "NYLAS_API_URI": "https://api.eu.nylas.com"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert (old.stdout, old.stderr) == (
        "https://api.eu.nylas.com\n",
        "NYLAS_API_URI is deprecated: set NYLAS_API_BASE instead\n",
    )
    both = {**environment, "NYLAS_API_URI": "https://old.example", "NYLAS_API_BASE": "https://new.example"}
    new = subprocess.run([sys.executable, "-c", code], env=both, cwd=ROOT, capture_output=True, text=True, check=True)
    assert (new.stdout, new.stderr) == ("https://new.example\n", "")
