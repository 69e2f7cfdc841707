"""Microsoft 365 through the provider seam, against a Graph double that follows Graph's documented behaviour
(tests/providers/fake_graph.py), through real coordinators on real etcd: one notification delivered three times,
two workers, the agent's own reply coming back from Sent Items, a person answering from Outlook while the agent
drafts, a wrong clientState; each guarded scenario sends one reply per customer message, and the same deliveries
unguarded send at least two (counted at the double)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from coordinator.ops.server import CoordinatorServer
from inbox_claims import AsyncClaim, AsyncCoordinator
from inbox_claims.asgi import webhook_app
from inbox_claims.providers import ClaimStamp, MessageFacts
from inbox_claims.providers._httpx import drive
from inbox_claims.providers.graph import GraphProvider
from tests.conftest import StartCoordinator
from tests.providers.fake_graph import BASE, FakeGraph

pytestmark = pytest.mark.etcd
SHOP = "support@shop.example"


class NoCursors:
    def take(self, *args: Any) -> Any:
        raise AssertionError("no cursor in this scenario")

    def advance(self, *args: Any) -> Any:
        raise AssertionError("no cursor in this scenario")


def provider(fake: FakeGraph) -> GraphProvider:
    return GraphProvider(fake.client_state, fake.user, token="t", api_base=BASE, transport=fake)  # type: ignore[arg-type]


@pytest.fixture
async def server(start_coordinator: StartCoordinator) -> CoordinatorServer:
    return await start_coordinator()


@pytest.fixture
async def workers(server: CoordinatorServer) -> AsyncIterator[list[AsyncCoordinator]]:
    clients = [AsyncCoordinator(server.address, principal="agent-a", mailbox_addresses=[SHOP]) for _ in range(2)]
    yield clients
    for client in clients:
        await client.close()


def guarded_apps(fake: FakeGraph, clients: list[AsyncCoordinator], drafting: asyncio.Event | None = None) -> list[Any]:
    apps = []
    for client in clients:
        mail = provider(fake)

        async def answer(message: MessageFacts, claim: AsyncClaim, mail: GraphProvider = mail) -> None:
            if drafting is not None:
                await drafting.wait()
            await claim.send(mail.reply, message, body="Your order ships today.")

        apps.append(webhook_app(mail, answer, coordinator=client))
    return apps


async def post(app: Any, body: bytes) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://agent") as http:
        return await http.post("/webhook", content=body, headers={"content-type": "application/json"})


async def settle(apps: list[Any]) -> None:
    for app in apps:
        await app.aclose(grace=10)


async def unguarded(fake: FakeGraph, body: bytes) -> None:
    """The same agent without the coordinator: every delivery that reads an incoming message replies to it."""
    mail = provider(fake)
    accepted = mail.verify(_request(body))
    batch = await drive(mail.open(accepted, NoCursors()), fake)  # type: ignore[arg-type,misc]
    for facts in batch.facts:
        if "SENT" not in facts.folders:
            await drive(mail._reply(facts, "Your order ships today.", ClaimStamp("ic1-" + "0" * 64, 1)), fake)  # type: ignore[arg-type,misc]


def _request(body: bytes) -> Any:
    from inbox_claims.providers import WebhookRequest

    return WebhookRequest("POST", "", {"content-type": "application/json"}, body)


async def test_one_notification_delivered_three_times_to_two_workers_gets_one_reply(
    workers: list[AsyncCoordinator],
) -> None:
    fake = FakeGraph()
    message = fake.receive("bea@example.org", "Where is my order?", "conv-1")
    apps = guarded_apps(fake, workers)
    body = fake.notification(message)
    answers = await asyncio.gather(post(apps[0], body), post(apps[1], body), post(apps[0], body))
    assert [a.status_code for a in answers] == [202, 202, 202]
    await settle(apps)
    assert fake.replies_to(message["id"]) == 1
    # The agent's own reply comes back from Sent Items (its subscription): never answered.
    sent = next(m for m in fake.messages.values() if m.get("_reply_to") == message["id"])
    copy = await post(guarded_apps(fake, workers)[0], fake.notification(sent))
    assert copy.status_code == 202
    assert fake.replies_to(sent["id"]) == 0
    assert fake.replies_to(message["id"]) == 1

    baseline = FakeGraph()
    again = baseline.receive("bea@example.org", "Where is my order?", "conv-1")
    for _ in range(3):
        await unguarded(baseline, baseline.notification(again))
    assert baseline.replies_to(again["id"]) >= 2


async def test_a_new_mail_arriving_as_updated_and_then_created_gets_one_reply(workers: list[AsyncCoordinator]) -> None:
    fake = FakeGraph()
    message = fake.receive("carl@example.net", "Refund", "conv-2")
    apps = guarded_apps(fake, workers)
    updated = fake.notification(message, change="updated")
    assert (await post(apps[0], updated)).status_code == 202
    assert (await post(apps[1], fake.notification(message))).status_code == 202
    await settle(apps)
    assert fake.replies_to(message["id"]) == 1


async def test_a_person_answering_from_outlook_while_the_agent_drafts_stops_its_send(
    workers: list[AsyncCoordinator],
) -> None:
    fake = FakeGraph()
    message = fake.receive("bea@example.org", "Where is my order?", "conv-3")
    drafting = asyncio.Event()
    apps = guarded_apps(fake, workers, drafting)
    assert (await post(apps[0], fake.notification(message))).status_code == 202
    person = fake.person_replies(message)
    assert (await post(apps[1], fake.notification(person))).status_code == 202
    await asyncio.sleep(0.5)  # the agent's next renewal finds its claim answered outside (TTL 60 s: at once on send)
    drafting.set()
    await settle(apps)
    assert [send["by"] for send in fake.sends] == ["person"]  # the agent's send was refused: nothing went out


async def test_a_wrong_client_state_is_refused_and_nothing_is_recorded(
    workers: list[AsyncCoordinator], server: CoordinatorServer
) -> None:
    fake = FakeGraph()
    message = fake.receive("eve@example.org", "Hello", "conv-4")
    apps = guarded_apps(fake, workers)
    answer = await post(apps[0], fake.notification(message, state="guessed"))
    assert answer.status_code == 401
    status = await workers[0].status(__import__("inbox_claims").Subject.message(fake.user, message["id"]))
    assert status.state.name == "FREE"
    assert fake.sends == []
