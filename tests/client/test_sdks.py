"""The SDKs people send with, as published on PyPI (nylas 6.x, resend, agentmail), under the guard
(inbox_claims.sdks), each against a local double of its API over real HTTP and a real coordinator on etcd:

* through ``claim.send``: the claim's key reaches the API as ``Idempotency-Key`` through the SDK's own per-request
  options, the stamp and ``Auto-Submitted`` go with it, and the sent id is recorded (REPLIED);
* the API's 4xx through the SDK frees the message (FREE), as our own adapters do; a 5xx leaves it IN_DOUBT;
* a send straight through the SDK inside a guarded claim, or its result handed to ``claim.send``, is refused before
  any request: nothing reaches the API."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import resend
from agentmail import AgentMail, AsyncAgentMail
from agentmail.environment import AgentMailEnvironment
from nylas import Client as NylasClient  # type: ignore[import-untyped]

from coordinator.ops.server import CoordinatorServer
from examples.agent.fake_nylas import FakeNylas
from inbox_claims import AsyncCoordinator, Coordinator, SendOutcomeUnknown, SendRejected, Subject, SubjectState
from inbox_claims.sdks import UnguardedSend, agentmail_reply, nylas_send, resend_send
from tests.conftest import StartCoordinator
from tests.providers.fake_agentmail import FakeAgentMail
from tests.providers.fake_resend import FakeResend
from tests.providers.serving import served

pytestmark = pytest.mark.etcd
NYLAS_KEY = "nyk_v0_sdk_test"


@pytest.fixture
async def server(start_coordinator: StartCoordinator) -> CoordinatorServer:
    return await start_coordinator(send_timeout_ms=300, sweep_interval_s=0.1)


@pytest.fixture
async def coord(server: CoordinatorServer) -> Any:
    async with AsyncCoordinator(server.address, principal="agent-a") as client:
        yield client


def subject() -> Subject:
    return Subject.message("support@shop.example", f"msg-{uuid.uuid4().hex[:10]}")


async def state_after(coord: AsyncCoordinator, what: Subject) -> SubjectState:
    for _ in range(100):
        status = await coord.status(what)
        if status.state is not SubjectState.SENDING:
            return status.state
        await asyncio.sleep(0.05)
    return status.state


# -- Nylas ------------------------------------------------------------------------------------------------------


@pytest.fixture
def nylas() -> Iterator[tuple[FakeNylas, Any]]:
    with FakeNylas(NYLAS_KEY) as fake:
        yield fake, NylasClient(api_key=NYLAS_KEY, api_uri=fake.api_base)


def nylas_body(message_id: str) -> dict[str, Any]:
    return {
        "reply_to_message_id": message_id,
        "to": [{"email": "bea@example.org"}],
        "subject": "Re: Where is my order?",
        "body": "It ships today.",
    }


async def test_nylas_sdk_through_claim_send_carries_the_key_and_records_the_sent_id(
    coord: AsyncCoordinator, nylas: tuple[FakeNylas, Any]
) -> None:
    fake, client = nylas
    what = subject()
    async with coord.reply_to(mailbox=what.mailbox, message_id=what.id) as claim:
        sent_id = await claim.send(nylas_send, client, "grant-1", nylas_body(what.id))
        key = claim.idempotency_key
    (sent,) = fake.sends
    assert sent_id == sent.id
    assert sent.idempotency_key == key
    headers = {h["name"]: h["value"] for h in sent.payload["custom_headers"]}
    assert headers["Auto-Submitted"] == "auto-replied"
    assert headers["X-Inbox-Claim"].startswith(key + ".")
    status = await coord.status(what)
    assert (status.state, status.sent_message_id) == (SubjectState.REPLIED, sent.id)


async def test_nylas_sdk_4xx_frees_the_message_and_5xx_leaves_it_in_doubt(
    coord: AsyncCoordinator, nylas: tuple[FakeNylas, Any]
) -> None:
    fake, client = nylas
    refused, unknown = subject(), subject()
    fake.behaviour = "reject"  # 422
    with pytest.raises(SendRejected, match="422"):
        async with coord.reply_to(mailbox=refused.mailbox, message_id=refused.id) as claim:
            await claim.send(nylas_send, client, "grant-1", nylas_body(refused.id))
    assert await state_after(coord, refused) is SubjectState.FREE
    fake.behaviour = "unavailable"  # 503
    with pytest.raises(SendOutcomeUnknown):
        async with coord.reply_to(mailbox=unknown.mailbox, message_id=unknown.id) as claim:
            await claim.send(nylas_send, client, "grant-1", nylas_body(unknown.id))
    assert await state_after(coord, unknown) is SubjectState.IN_DOUBT


async def test_nylas_sdk_send_inside_a_guarded_claim_but_not_through_claim_send_is_refused(
    coord: AsyncCoordinator, nylas: tuple[FakeNylas, Any]
) -> None:
    fake, client = nylas
    what = subject()
    with pytest.raises(UnguardedSend, match=r"claim\.send\(sdks\.nylas_send"):
        async with coord.reply_to(mailbox=what.mailbox, message_id=what.id):
            client.messages.send(identifier="grant-1", request_body=nylas_body(what.id))
    with pytest.raises(UnguardedSend):  # the SDK's call handed to claim.send runs first, outside the commit point
        async with coord.reply_to(mailbox=what.mailbox, message_id=what.id) as claim:
            await claim.send(client.messages.send(identifier="grant-1", request_body=nylas_body(what.id)))
    assert fake.requests == []  # nothing reached Nylas
    assert (await coord.status(what)).state is SubjectState.FREE
    # Outside any claim the SDK works as it always does.
    outside = {"headers": {"Idempotency-Key": "sent-outside-any-claim"}}
    sent = client.messages.send(identifier="grant-1", request_body=nylas_body(what.id), overrides=outside)
    assert sent.data.id == "sent-1"


async def test_a_new_users_nylas_sdk_send_in_a_guard_decorated_handler_is_refused_before_nylas_hears_of_it(
    coord: AsyncCoordinator, nylas: tuple[FakeNylas, Any]
) -> None:
    fake, client = nylas

    @coord.guard
    async def answer(event: dict[str, Any]) -> None:  # as the issue found it: the SDK's send, no claim.send
        message = event["data"]["object"]
        client.messages.send(identifier=message["grant_id"], request_body=nylas_body(message["id"]))

    message: dict[str, Any] = {"id": "msg-guard-1", "grant_id": "grant-1", "thread_id": "t-1", "object": "message"}
    message |= {"subject": "Hi", "from": [{"email": "bea@example.org"}], "folders": ["INBOX"], "date": int(time.time())}
    event = {"specversion": "1.0", "type": "message.created", "id": "n-guard-1", "time": int(time.time())}
    with pytest.raises(UnguardedSend, match=r"not through claim\.send"):
        await answer({**event, "data": {"application_id": "app-1", "object": message}})
    assert fake.requests == []
    assert (await coord.status(Subject.message("grant-1", "msg-guard-1"))).state is SubjectState.FREE


# -- Resend ------------------------------------------------------------------------------------------------------


@pytest.fixture
def resend_api() -> Iterator[FakeResend]:
    fake = FakeResend()
    before = resend.api_key, resend.api_url
    with served(fake.answer) as url:
        resend.api_key, resend.api_url = fake.api_key, url
        try:
            yield fake
        finally:
            resend.api_key, resend.api_url = before


def resend_params(to: dict[str, Any]) -> dict[str, Any]:
    return {
        "from": "Shop <support@shop.example>",
        "to": ["bea@example.org"],
        "subject": "Re: Where is my order?",
        "text": "It ships today.",
        "headers": {"In-Reply-To": to["message_id"]},
    }


async def test_resend_sdk_through_claim_send_carries_the_key_and_records_the_sent_id(
    coord: AsyncCoordinator, resend_api: FakeResend
) -> None:
    email = resend_api.receive("bea@example.org", "Where is my order?")
    what = Subject.message(resend_api.mailbox, email["id"])
    async with coord.reply_to(mailbox=what.mailbox, message_id=what.id) as claim:
        sent_id = await claim.send(resend_send, resend_params(email))
        key = claim.idempotency_key
    assert list(resend_api.keys) == [key]
    copy = resend_api.sent_copy(email["id"])
    assert sent_id == copy["id"]
    assert copy["headers"]["X-Inbox-Claim"].startswith(key + ".")
    assert copy["headers"]["Auto-Submitted"] == "auto-replied"
    status = await coord.status(what)
    assert (status.state, status.sent_message_id) == (SubjectState.REPLIED, copy["id"])


async def test_resend_sdk_4xx_frees_the_message_and_a_send_outside_claim_send_is_refused(
    coord: AsyncCoordinator, resend_api: FakeResend
) -> None:
    email = resend_api.receive("bea@example.org", "Where is my order?")
    what = Subject.message(resend_api.mailbox, email["id"])
    resend_api.send_failure = "reject"  # 422
    with pytest.raises(SendRejected, match="422"):
        async with coord.reply_to(mailbox=what.mailbox, message_id=what.id) as claim:
            await claim.send(resend_send, resend_params(email))
    assert await state_after(coord, what) is SubjectState.FREE
    with pytest.raises(UnguardedSend, match=r"resend\.Emails\.send"):
        async with coord.reply_to(mailbox=what.mailbox, message_id=what.id):
            resend.Emails.send(resend_params(email))  # type: ignore[arg-type]
    assert resend_api.calls["emails.send"] == 1  # only the refused 422: the unguarded one never left
    assert resend_api.sends == []


async def test_resend_sdk_in_a_blocking_claim_sends_at_once_with_the_key(
    server: CoordinatorServer, coord: AsyncCoordinator, resend_api: FakeResend
) -> None:
    email = resend_api.receive("bea@example.org", "Where is my order?")
    what = Subject.message(resend_api.mailbox, email["id"])

    def blocking() -> str | None:
        with (
            Coordinator(server.address, principal="agent-a") as client,
            client.reply_to(mailbox=what.mailbox, message_id=what.id) as claim,
        ):
            return claim.send(resend_send, resend_params(email))

    sent_id = await asyncio.to_thread(blocking)
    assert sent_id == resend_api.sent_copy(email["id"])["id"]
    assert list(resend_api.keys) == [what.idempotency_key]
    assert (await coord.status(what)).state is SubjectState.REPLIED


# -- AgentMail ---------------------------------------------------------------------------------------------------


@pytest.fixture
def agentmail_api() -> Iterator[tuple[FakeAgentMail, str]]:
    fake = FakeAgentMail()
    with served(fake.answer) as url:
        yield fake, url


@pytest.fixture
def blocking_http() -> Iterator[httpx.Client]:
    with httpx.Client() as client:
        yield client


def environment(url: str) -> AgentMailEnvironment:
    return AgentMailEnvironment(http=url, websockets="ws://127.0.0.1:9")


@pytest.mark.parametrize("flavour", ["blocking", "asyncio"])
async def test_agentmail_sdk_through_claim_send_carries_the_key_and_records_the_sent_id(
    coord: AsyncCoordinator, agentmail_api: tuple[FakeAgentMail, str], flavour: str
) -> None:
    fake, url = agentmail_api
    http: Any = httpx.Client() if flavour == "blocking" else httpx.AsyncClient()
    client: Any = (AgentMail if flavour == "blocking" else AsyncAgentMail)(
        api_key=fake.api_key, environment=environment(url), httpx_client=http
    )
    message = fake.receive("bea@example.org", "Where is my order?", "thd-sdk")
    what = Subject.message(fake.inbox, message["message_id"])
    async with coord.reply_to(mailbox=what.mailbox, message_id=what.id) as claim:
        sent_id = await claim.send(agentmail_reply, client, fake.inbox, message["message_id"], text="It ships today.")
        key = claim.idempotency_key
    await http.aclose() if flavour == "asyncio" else http.close()
    copy = fake.sent_copy(message["message_id"])
    assert sent_id == copy["message_id"]
    assert list(fake.keys) == [key]
    assert copy["headers"]["X-Inbox-Claim"].startswith(key + ".")
    status = await coord.status(what)
    assert (status.state, status.sent_message_id) == (SubjectState.REPLIED, copy["message_id"])


async def test_agentmail_sdk_4xx_frees_the_message_and_a_reply_outside_claim_send_is_refused(
    coord: AsyncCoordinator, agentmail_api: tuple[FakeAgentMail, str], blocking_http: httpx.Client
) -> None:
    fake, url = agentmail_api
    client = AgentMail(api_key=fake.api_key, environment=environment(url), httpx_client=blocking_http)
    message = fake.receive("bea@example.org", "Where is my order?", "thd-sdk2")
    what = Subject.message(fake.inbox, message["message_id"])
    fake.send_failure = "reject"  # 400
    with pytest.raises(SendRejected, match="400"):
        async with coord.reply_to(mailbox=what.mailbox, message_id=what.id) as claim:
            await claim.send(agentmail_reply, client, fake.inbox, message["message_id"], text="It ships today.")
    assert await state_after(coord, what) is SubjectState.FREE
    with pytest.raises(UnguardedSend, match=r"agentmail inboxes\.messages\.reply"):
        async with coord.reply_to(mailbox=what.mailbox, message_id=what.id):
            client.inboxes.messages.reply(fake.inbox, message["message_id"], text="It ships today.")
    assert fake.calls["messages.reply"] == 1  # only the refused 400
    assert fake.sends == []
