"""python -m bench providers: what one customer message costs on each provider's path, Nylas's beside Graph's,
Gmail's, AgentMail's and Resend's (docs/providers.md).

One message's path, through the webhook adapter (``inbox_claims.asgi``) and a real coordinator in a process of its
own on this run's etcd: the message arrives at the provider's double (tests/providers: Graph's and Gmail's; for
Nylas, its send endpoint), its notification is delivered once to the agent (in process, through httpx's ASGI
transport; for Gmail a push of the mailbox's history id), the agent admits it (the provider's check and reads, the
coordinator's calls), answers 2xx, drafts nothing (no LLM: the path is what is measured) and sends the reply through
the provider (Nylas: the send with the claim's Idempotency-Key; Graph: createReply + send; Gmail: messages.send),
then the reply's copy comes back as the provider delivers it and is recorded (RecordOutgoing: the agent's own).

``--lanes`` mailboxes at once, each its own double and webhook app, its messages one after another, all on one
client object (as one agent process with many mailboxes); rounds alternate the providers. Printed per message: the
coordinator calls the client made (by kind), the provider API calls the agent made (by kind, counted at the
double), and CPU seconds per 1,000 messages of the agent (this process, less the doubles' work and the making of
each notification, both timed apart), of the coordinator and of etcd; with the agent's and the coordinator's
ratios to Nylas's. The defaults take about a minute and a half.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from inbox_claims import AsyncClaim, AsyncCoordinator
from inbox_claims import nylas as guarded_nylas
from inbox_claims._effects import Effect, Rpc
from inbox_claims.asgi import WebhookApp, webhook_app
from inbox_claims.providers import HttpRequest, HttpResponse, MessageFacts
from inbox_claims.providers.agentmail import AgentMailProvider
from inbox_claims.providers.graph import GraphProvider
from inbox_claims.providers.nylas import NylasProvider
from inbox_claims.providers.resend import ResendProvider
from inbox_claims.testing import sign_nylas
from tests.providers.fake_agentmail import BASE as AGENTMAIL_BASE
from tests.providers.fake_agentmail import FakeAgentMail
from tests.providers.fake_gmail import FakeGmail
from tests.providers.fake_graph import BASE as GRAPH_BASE
from tests.providers.fake_graph import FakeGraph
from tests.providers.fake_resend import BASE as RESEND_BASE
from tests.providers.fake_resend import FakeResend
from tests.providers.support import gmail_provider

from ._common import CoordinatorProcess, Environment, process_cpu_seconds, run_id

PROVIDERS = ("nylas", "graph", "gmail", "agentmail", "resend")
SHOP = "support@shop.example"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--messages", type=int, default=60, help="messages per lane, provider and round (default 60)")
    parser.add_argument("--lanes", type=int, default=8, help="mailboxes answered at once (default 8)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument(
        "--providers", default=",".join(PROVIDERS), help="which, comma-separated (default %(default)s; nylas first)"
    )


class Aside:
    """Time this process spent on work that is not the agent's: the doubles' answers and the making of each
    notification (the provider's side). Synchronous code on the event loop's thread, so its elapsed time is its CPU
    time but for preemption; timed with perf_counter, since thread_time costs a system call here (~90 us: more than
    a double's answer)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextlib.contextmanager
    def timing(self) -> Any:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - began


class CountingCoordinator(AsyncCoordinator):
    """The asyncio client, counting each coordinator call its flows make (before the client batches them)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: Counter[str] = Counter()

    async def _perform(self, effect: Effect) -> Any:
        if isinstance(effect, Rpc):
            self.calls[effect.method] += 1
        return await super()._perform(effect)


@dataclass
class Lane:
    """One mailbox: its double, its webhook app, and how the provider tells of a message and of the reply's copy."""

    app: WebhookApp
    arrive: Callable[[], str]
    notification: Callable[[str], tuple[dict[str, str], bytes]]
    copy_notification: Callable[[str], tuple[dict[str, str], bytes]]
    api_calls: Callable[[], Counter[str]]
    replied: dict[str, asyncio.Event] = field(default_factory=dict)


def _handler(send: Callable[[MessageFacts, AsyncClaim], Awaitable[object]], replied: dict[str, asyncio.Event]) -> Any:
    async def answer(message: MessageFacts, claim: AsyncClaim) -> None:
        try:
            await send(message, claim)
        finally:  # a failed send is seen below: the reply's copy is not there
            replied.setdefault(message.message_id, asyncio.Event()).set()

    return answer


def nylas_lane(index: int, coordinator: AsyncCoordinator, aside: Aside) -> Lane:
    secret, grant = "bench-secret", f"grant-{index}-{uuid.uuid4().hex[:6]}"
    calls: Counter[str] = Counter()
    messages: dict[str, dict[str, Any]] = {}
    sent: dict[str, str] = {}

    def api(request: httpx.Request) -> httpx.Response:  # Nylas's send endpoint, as the fake Nylas answers it
        with aside.timing():
            calls["messages.send"] += 1
            document = json.loads(request.content)
            sent[document["reply_to_message_id"]] = sent_id = f"sent-{uuid.uuid4().hex[:10]}"
            return httpx.Response(200, json={"request_id": "r", "data": {**document, "id": sent_id}})

    http = httpx.AsyncClient(
        base_url="https://nylas.test", headers={"Authorization": "Bearer key"}, transport=httpx.MockTransport(api)
    )

    async def send(message: MessageFacts, claim: AsyncClaim) -> None:
        draft = {"reply_to_message_id": message.message_id, "to": [{"email": "bea@example.org"}], "body": "ok"}
        await guarded_nylas.send(http, message.mailbox, draft)

    def arrive() -> str:
        message_id = f"msg-{uuid.uuid4().hex[:12]}"
        messages[message_id] = {
            "id": message_id,
            "grant_id": grant,
            "thread_id": f"thread-{message_id}",
            "object": "message",
            "subject": "Where is my order?",
            "from": [{"email": "bea@example.org", "name": "Bea"}],
            "folders": ["INBOX"],
            "date": int(time.time()),
        }
        return message_id

    def envelope(message: dict[str, Any]) -> tuple[dict[str, str], bytes]:
        with aside.timing():
            document = {
                "specversion": "1.0",
                "type": "message.created",
                "id": f"n-{uuid.uuid4().hex}",
                "time": int(time.time()),
                "data": {"application_id": "app", "object": message},
            }
            body = json.dumps(document).encode()
            return {"content-type": "application/json", "x-nylas-signature": sign_nylas(body, secret)}, body

    def copy(message_id: str) -> tuple[dict[str, str], bytes]:
        original = messages[message_id]
        return envelope({**original, "id": sent[message_id], "folders": ["SENT"], "from": [{"email": SHOP}]})

    replied: dict[str, asyncio.Event] = {}
    app = webhook_app(NylasProvider(secret), _handler(send, replied), coordinator=coordinator)
    return Lane(app, arrive, lambda m: envelope(messages[m]), copy, lambda: calls, replied)


class _Timed:
    """A double as the provider's transport, its answers timed apart."""

    is_async = True

    def __init__(self, double: Any, aside: Aside) -> None:
        self.double = double
        self.aside = aside

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        with self.aside.timing():
            response: HttpResponse = self.double.answer(request)
            return response


def graph_lane(index: int, coordinator: AsyncCoordinator, aside: Aside) -> Lane:
    fake = FakeGraph(user=f"u-{index}-{uuid.uuid4().hex[:6]}")
    mail = GraphProvider(
        fake.client_state, fake.user, token=fake.token, api_base=GRAPH_BASE, transport=_Timed(fake, aside)
    )

    async def send(message: MessageFacts, claim: AsyncClaim) -> None:
        await claim.send(mail.reply, message, body="ok")

    def notify(message_id: str) -> tuple[dict[str, str], bytes]:
        with aside.timing():
            return {"content-type": "application/json"}, fake.notification(fake.messages[message_id])

    replied: dict[str, asyncio.Event] = {}
    return Lane(
        webhook_app(mail, _handler(send, replied), coordinator=coordinator),
        lambda: fake.receive("bea@example.org", "Where is my order?", f"conv-{uuid.uuid4().hex[:8]}")["id"],
        notify,
        lambda message_id: notify(fake.sent_copy(message_id)["id"]),
        lambda: fake.calls,
        replied,
    )


def gmail_lane(index: int, coordinator: AsyncCoordinator, aside: Aside) -> Lane:
    fake = FakeGmail(f"support{index}-{uuid.uuid4().hex[:6]}@shop.example")
    mail = gmail_provider(fake, transport=_Timed(fake, aside))  # no periodic check: each message has its push

    async def send(message: MessageFacts, claim: AsyncClaim) -> None:
        await claim.send(mail.reply, message, body="ok")

    def push(_message_id: str) -> tuple[dict[str, str], bytes]:
        with aside.timing():
            return fake.push()

    replied: dict[str, asyncio.Event] = {}
    return Lane(
        webhook_app(mail, _handler(send, replied), coordinator=coordinator),
        lambda: fake.receive("bea@example.org", "Where is my order?")["id"],
        push,
        push,
        lambda: fake.calls,
        replied,
    )


def agentmail_lane(index: int, coordinator: AsyncCoordinator, aside: Aside) -> Lane:
    fake = FakeAgentMail(f"support{index}-{uuid.uuid4().hex[:6]}@shop.agentmail.to")
    mail = AgentMailProvider(fake.secret, api_key=fake.api_key, api_base=AGENTMAIL_BASE, transport=_Timed(fake, aside))

    async def send(message: MessageFacts, claim: AsyncClaim) -> None:
        await claim.send(mail.reply, message, body="ok")

    def event(made: tuple[bytes, dict[str, str]]) -> tuple[dict[str, str], bytes]:
        return made[1], made[0]

    def received(message_id: str) -> tuple[dict[str, str], bytes]:
        with aside.timing():
            return event(fake.received(fake.messages[message_id]))

    def sent(message_id: str) -> tuple[dict[str, str], bytes]:
        with aside.timing():
            return event(fake.sent(fake.sent_copy(message_id)))

    replied: dict[str, asyncio.Event] = {}
    return Lane(
        webhook_app(mail, _handler(send, replied), coordinator=coordinator),
        lambda: fake.receive("bea@example.org", "Where is my order?", f"thd-{uuid.uuid4().hex[:8]}")["message_id"],
        received,
        sent,
        lambda: fake.calls,
        replied,
    )


def resend_lane(index: int, coordinator: AsyncCoordinator, aside: Aside) -> Lane:
    fake = FakeResend(f"support{index}-{uuid.uuid4().hex[:6]}@shop.example")
    mail = ResendProvider(
        fake.secret, fake.mailbox, api_key=fake.api_key, api_base=RESEND_BASE, transport=_Timed(fake, aside)
    )

    async def send(message: MessageFacts, claim: AsyncClaim) -> None:
        await claim.send(mail.reply, message, body="ok")

    def received(email_id: str) -> tuple[dict[str, str], bytes]:
        with aside.timing():
            body, headers = fake.received(fake.messages[email_id])
            return headers, body

    def sent(email_id: str) -> tuple[dict[str, str], bytes]:
        with aside.timing():
            body, headers = fake.sent(fake.sent_copy(email_id))
            return headers, body

    replied: dict[str, asyncio.Event] = {}
    return Lane(
        webhook_app(mail, _handler(send, replied), coordinator=coordinator),
        lambda: fake.receive("bea@example.org", "Where is my order?")["id"],
        received,
        sent,
        lambda: fake.calls,
        replied,
    )


LANES = {
    "nylas": nylas_lane,
    "graph": graph_lane,
    "gmail": gmail_lane,
    "agentmail": agentmail_lane,
    "resend": resend_lane,
}


async def _deliver(lane: Lane, delivery: tuple[dict[str, str], bytes]) -> None:
    headers, body = delivery
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=lane.app), base_url="http://agent") as client:
        answer = await client.post("/webhook", content=body, headers=headers)
    if not 200 <= answer.status_code < 300:
        raise RuntimeError(f"the agent answered {answer.status_code}: {answer.text}")


async def _one_message(lane: Lane) -> None:
    message_id = lane.arrive()
    replied = lane.replied.setdefault(message_id, asyncio.Event())
    await _deliver(lane, lane.notification(message_id))
    await asyncio.wait_for(replied.wait(), 30)
    await _deliver(lane, lane.copy_notification(message_id))


@dataclass
class Measured:
    messages: int = 0
    seconds: float = 0.0
    agent_cpu: float = 0.0
    coordinator_cpu: float = 0.0
    etcd_cpu: float = 0.0
    coordinator_calls: Counter[str] = field(default_factory=Counter)
    api_calls: Counter[str] = field(default_factory=Counter)


def _etcd_cpu(env: Environment) -> float:
    assert env.etcd.pid is not None
    return process_cpu_seconds(env.etcd.pid)


async def measure(
    provider: str, lanes: int, messages: int, server: CoordinatorProcess, env: Environment, into: Measured
) -> None:
    aside = Aside()
    async with CountingCoordinator(server.address, principal=f"bench-{provider}") as coordinator:
        made = [LANES[provider](index, coordinator, aside) for index in range(lanes)]
        await asyncio.gather(*(_one_message(lane) for lane in made))  # warm-up: keys, folders, cursors
        coordinator.calls.clear()
        api_before = [Counter(lane.api_calls()) for lane in made]
        aside.seconds = 0.0
        cpu, server_cpu, etcd_cpu = time.process_time(), server.cpu_seconds(), _etcd_cpu(env)
        began = time.perf_counter()

        async def run_lane(lane: Lane) -> None:
            for _ in range(messages):
                await _one_message(lane)

        await asyncio.gather(*(run_lane(lane) for lane in made))
        into.seconds += time.perf_counter() - began
        into.agent_cpu += time.process_time() - cpu - aside.seconds
        into.coordinator_cpu += server.cpu_seconds() - server_cpu
        into.etcd_cpu += _etcd_cpu(env) - etcd_cpu
        into.messages += lanes * messages
        into.coordinator_calls += coordinator.calls
        for lane, before in zip(made, api_before, strict=True):
            into.api_calls += lane.api_calls() - before
        for lane in made:
            await lane.app.aclose(grace=10)


def _per_message(calls: Counter[str], messages: int) -> str:
    total = sum(calls.values()) / messages
    kinds = ", ".join(f"{name} {count / messages:.2f}" for name, count in sorted(calls.items()) if count)
    return f"{total:.2f} ({kinds})"


async def run(options: argparse.Namespace, env: Environment) -> int:
    print(
        f"== providers: one customer message answered and its copy recorded, per provider "
        f"({options.lanes} mailboxes x {options.messages} messages x {options.rounds} rounds)"
    )
    print(env.describe())
    logging.getLogger("inbox_claims").setLevel(logging.WARNING)  # not a line per own reply's copy
    server = CoordinatorProcess(env.tmp, env.etcd.endpoint, f"bench-providers/{run_id()}/", rate_limit=0)
    chosen = tuple(p for p in PROVIDERS if p in options.providers.split(","))
    results = {provider: Measured() for provider in chosen}
    try:
        for round_number in range(options.rounds):
            order = chosen[round_number % len(chosen) :] + chosen[: round_number % len(chosen)]
            for provider in order:
                await measure(provider, options.lanes, options.messages, server, env, results[provider])
    finally:
        server.stop()
    nylas = results.get("nylas", next(iter(results.values())))
    print(
        f"{'provider':<8} {'msgs/s':>8} {'agent CPU s/1k':>15} {'vs Nylas':>9} {'coord CPU s/1k':>15} "
        f"{'vs Nylas':>9} {'etcd CPU s/1k':>14}"
    )
    for provider, measured in results.items():
        agent, coordinator = (
            measured.agent_cpu * 1000 / measured.messages,
            measured.coordinator_cpu * 1000 / measured.messages,
        )
        print(
            f"{provider:<8} {measured.messages / measured.seconds:>8.0f} {agent:>15.2f} "
            f"{measured.agent_cpu / nylas.agent_cpu:>8.2f}x {coordinator:>15.2f} "
            f"{measured.coordinator_cpu / nylas.coordinator_cpu:>8.2f}x "
            f"{measured.etcd_cpu * 1000 / measured.messages:>14.2f}"
        )
    print("per message: coordinator calls | provider API calls (the agent's)")
    for provider, measured in results.items():
        print(f"{provider:<8} coordinator {_per_message(measured.coordinator_calls, measured.messages)}")
        print(f"{'':<8} API         {_per_message(measured.api_calls, measured.messages)}")
    return 0
