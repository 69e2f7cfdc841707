"""Automated mail through the Nylas webhook app, against a real coordinator on a real etcd and the Nylas API double:
a Nylas notification carries no headers, so the provider given an API key reads the message again with them (one
``messages.get`` with ``fields=include_headers`` per message) and the guard never hands an auto-reply to the
handler; a person's message is handled as before, after the same one read."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from coordinator.ops.server import CoordinatorServer
from inbox_claims import AsyncClaim, AsyncCoordinator
from inbox_claims.asgi import webhook_app
from inbox_claims.providers import MessageFacts
from inbox_claims.providers.nylas import NylasProvider
from inbox_claims.testing import sign_nylas
from tests.conftest import StartCoordinator
from tests.providers.fake_nylas_api import BASE, FakeNylasApi
from tests.providers.support import post, settle

pytestmark = pytest.mark.etcd
SECRET = "nylas-webhook-secret"


@pytest.fixture
async def agent(start_coordinator: StartCoordinator) -> AsyncIterator[AsyncCoordinator]:
    server: CoordinatorServer = await start_coordinator()
    async with AsyncCoordinator(server.address, principal="agent-a") as client:
        yield client


async def deliver(
    agent: AsyncCoordinator, fake: FakeNylasApi, message: dict[str, Any], *, api_key: str | None, status: int = 200
) -> list[str]:
    """One signed notification of ``message`` through the webhook app, answered ``status``; the messages the handler
    was given."""
    handled: list[str] = []

    async def handle(facts: MessageFacts, claim: AsyncClaim) -> None:
        handled.append(facts.message_id)

    provider = NylasProvider(SECRET, api_key=api_key, api_base=BASE, transport=fake)
    app = webhook_app(provider, handle, coordinator=agent)
    body = json.dumps(fake.notification(message)).encode()
    answer = await post(app, body, {"content-type": "application/json", "x-nylas-signature": sign_nylas(body, SECRET)})
    await settle([app])
    assert answer.status_code == status, answer.text
    return handled


async def test_an_auto_reply_is_recognised_from_the_headers_read_and_never_handled(agent: AsyncCoordinator) -> None:
    fake = FakeNylasApi()
    auto = fake.receive("bea@example.org", "Out of office", headers={"Auto-Submitted": "auto-replied"})
    person = fake.receive("carl@example.net", "Where is my order?", headers={"Auto-Submitted": "no"})

    assert await deliver(agent, fake, auto, api_key=fake.api_key) == []
    assert await deliver(agent, fake, person, api_key=fake.api_key) == [person["id"]]
    assert fake.calls["messages.get"] == 2  # the cost: one read per message notification


async def test_without_an_api_key_only_the_senders_rules_apply_and_nothing_is_read(agent: AsyncCoordinator) -> None:
    fake = FakeNylasApi()
    auto = fake.receive("bea@example.org", "Out of office", headers={"Auto-Submitted": "auto-replied"})
    bounce = fake.receive("MAILER-DAEMON@mx.example", "Undeliverable")

    assert await deliver(agent, fake, auto, api_key=None) == [auto["id"]]  # its headers were never seen
    assert await deliver(agent, fake, bounce, api_key=None) == []
    assert sum(fake.calls.values()) == 0


async def test_a_failed_header_read_is_not_acknowledged_and_its_redelivery_is_judged(agent: AsyncCoordinator) -> None:
    """Answering automated mail is what the read prevents: when Nylas cannot answer it, the notification is answered
    503 (Nylas delivers it again), nothing is claimed, and the redelivery reads the headers and leaves the
    auto-reply."""
    fake = FakeNylasApi()
    auto = fake.receive("bea@example.org", "Out of office", headers={"X-Autoreply": "yes"})
    fake.failing["messages.get"] = 1

    assert await deliver(agent, fake, auto, api_key=fake.api_key, status=503) == []
    assert await deliver(agent, fake, auto, api_key=fake.api_key) == []
    assert fake.calls["messages.get"] == 2
