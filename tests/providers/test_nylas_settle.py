"""A Nylas send left IN_DOUBT settles itself (docs/providers.md, "Sends that settle themselves"): the send carries the
claim's stamp as a Nylas custom header (X-Inbox-Claim), and when the copy of the reply arrives in the grant's sent
folder the provider reads it with its headers (``fields=include_headers``) and reports it with the stamp's token;
through real coordinators on real etcd and the Nylas double over HTTP (examples/agent/fake_nylas.py). Without an API
key the provider reads nothing, and the send stays IN_DOUBT for a person."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from examples.agent.fake_nylas import FakeNylas
from inbox_claims import AsyncClaim, AsyncCoordinator, Subject, SubjectState
from inbox_claims.asgi import WebhookApp, webhook_app
from inbox_claims.nylas import AsyncNylas, NylasReply
from inbox_claims.providers import MessageFacts
from inbox_claims.providers._httpx import AsyncHttp
from inbox_claims.providers.nylas import NylasProvider
from inbox_claims.testing import sign_nylas
from tests.providers.support import eventually, post, settle, settled_by_its_copy, state_is

pytestmark = pytest.mark.etcd
API_KEY = "nyk_v0_settle"
SECRET = "nylas-webhook-secret"
SHOP = "support@shop.example"


@pytest.fixture
def fake() -> Iterator[FakeNylas]:
    with FakeNylas(API_KEY) as nylas:
        yield nylas


@pytest.fixture
async def opened() -> AsyncIterator[list[httpx.AsyncClient]]:
    """The HTTP clients a test's agents open, closed after it."""
    clients: list[httpx.AsyncClient] = []
    yield clients
    for client in clients:
        await client.aclose()


def notification(grant: str, message: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    body = json.dumps(
        {
            "specversion": "1.0",
            "type": "message.created",
            "id": f"notification-{message['id']}",
            "time": int(time.time()),
            "data": {"application_id": "app-1", "object": {"grant_id": grant, "object": "message", **message}},
        }
    ).encode()
    return body, {"content-type": "application/json", "x-nylas-signature": sign_nylas(body, SECRET)}


def apps(
    fake: FakeNylas, clients: list[AsyncCoordinator], opened: list[httpx.AsyncClient], *, reads: bool = True
) -> list[WebhookApp]:
    made = []
    for client in clients:
        reader = httpx.AsyncClient(timeout=5)
        key = API_KEY if reads else ""
        provider = NylasProvider(SECRET, api_key=key, api_base=fake.api_base, transport=AsyncHttp(reader))
        nylas = AsyncNylas(API_KEY, api_base=fake.api_base, timeout=5)
        opened += [reader, nylas._http]

        async def answer(message: MessageFacts, claim: AsyncClaim, nylas: AsyncNylas = nylas) -> None:
            reply = NylasReply.answering(message.source, body="Your order ships today.")
            await claim.send(nylas.send, message.mailbox, reply, idempotency_key=claim.idempotency_key)

        made.append(webhook_app(provider, answer, coordinator=client))
    return made


async def in_doubt(
    fake: FakeNylas, clients: dict[str, AsyncCoordinator], opened: list[httpx.AsyncClient], grant: str
) -> tuple[Subject, str]:
    """A customer's message answered by agent-a, Nylas sending the reply and losing its answer: IN_DOUBT."""
    message: dict[str, Any] = {
        "id": f"msg-{uuid.uuid4().hex[:8]}",
        "thread_id": "thread-1",
        "subject": "Where is my order?",
    }
    message |= {"from": [{"email": "bea@example.org"}], "folders": ["INBOX"], "date": int(time.time())}
    fake.behaviour = "lost_answer"
    agent = apps(fake, [clients["a1"]], opened)
    assert (await post(agent[0], *notification(grant, message))).status_code == 200
    subject = Subject.message(grant, message["id"])
    await eventually(lambda: state_is(clients["a1"], subject, SubjectState.IN_DOUBT))
    await settle(agent)
    (sent,) = fake.sends_for(message["id"])
    return subject, sent.id


def sent_copy(sent_id: str) -> dict[str, Any]:
    """The copy of the agent's reply in the grant's sent folder, as Nylas notifies it (no headers)."""
    return {
        "id": sent_id,
        "thread_id": "thread-1",
        "subject": "Re: Where is my order?",
        "from": [{"email": SHOP}],
        "folders": ["SENT"],
        "date": int(time.time()),
    }


async def test_a_send_left_in_doubt_settles_itself_when_its_stamped_copy_is_read(
    fake: FakeNylas, clients: dict[str, AsyncCoordinator], opened: list[httpx.AsyncClient]
) -> None:
    grant = f"grant-{uuid.uuid4().hex[:8]}"
    subject, sent_id = await in_doubt(fake, clients, opened, grant)
    other = apps(fake, [clients["b"]], opened)
    assert (await post(other[0], *notification(grant, sent_copy(sent_id)))).status_code == 200
    await settle(other)
    await settled_by_its_copy(clients["a1"], subject, sent_id, "agent-b")
    # The copy was read once, with its headers (each incoming message is read too: the automated-mail rules).
    reads = [r for r in fake.requests if r.method == "GET" and sent_id in r.path]
    assert [r.path for r in reads] == [f"/v3/grants/{grant}/messages/{sent_id}?fields=include_headers"]


async def test_without_reading_the_copy_the_send_stays_in_doubt_for_a_person(
    fake: FakeNylas, clients: dict[str, AsyncCoordinator], opened: list[httpx.AsyncClient]
) -> None:
    grant = f"grant-{uuid.uuid4().hex[:8]}"
    subject, sent_id = await in_doubt(fake, clients, opened, grant)
    other = apps(fake, [clients["b"]], opened, reads=False)  # no API key: the copy's headers are never read
    assert (await post(other[0], *notification(grant, sent_copy(sent_id)))).status_code == 200
    await settle(other)
    status = await clients["a1"].status(subject)
    assert (status.state, status.settled_by) == (SubjectState.IN_DOUBT, "")
