"""The guard an existing handler wraps its answer in (``guard``), the send without a wrapper function
(``inbox_claims.nylas.send``), ``from_env()``, the per-call ``timeout=``, and the curated top level. Against a
real coordinator on a real etcd and the fake Nylas endpoint."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import inbox_claims
import inbox_claims._default
import inbox_claims.asgi
import inbox_claims.webhooks
from coordinator.ops.server import CoordinatorServer
from examples.agent.fake_nylas import Behaviour, FakeNylas
from inbox_claims import (
    AlreadyReplied,
    AsyncCoordinator,
    ClaimLost,
    Coordinator,
    CoordinatorUnavailable,
    DuplicateDelivery,
    Notification,
    ReplyHeld,
    RetryPolicy,
    SendOutcomeUnknown,
    Subject,
    SubjectState,
    current_claim,
    nylas,
)
from inbox_claims.nylas import NylasDuplicateSend, NylasSendOutcomeUnknown, NylasSendRejected
from inbox_claims.types import HolderKind
from tests.client.support import HUMAN
from tests.conftest import StartCoordinator

API_KEY = "nyk_guard_test"
MAILBOX = "grant-guard"


def event(message_id: str, *, kind: str = "message.created", notification_id: str | None = None) -> dict[str, Any]:
    """A Nylas v3 notification, as the handler's ``json.loads(body)`` gives it."""
    return {
        "specversion": "1.0",
        "type": kind,
        "id": notification_id or f"notif-{uuid.uuid4().hex[:12]}",
        "data": {
            "application_id": "app-1",
            "object": {
                "id": message_id,
                "grant_id": MAILBOX,
                "object": "message",
                "subject": "Where is my order?",
                "from": [{"email": "customer@example.com"}],
            },
        },
    }


def draft(message_id: str) -> dict[str, Any]:
    return {"reply_to_message_id": message_id, "to": [{"email": "customer@example.com"}], "subject": "Re", "body": "x"}


def new_id() -> str:
    return f"msg-{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def server(start_coordinator: StartCoordinator) -> CoordinatorServer:
    return await start_coordinator(send_timeout_ms=300, sweep_interval_s=0.1)


@pytest.fixture
def fake() -> Iterator[FakeNylas]:
    with FakeNylas(API_KEY) as endpoint:
        yield endpoint


@pytest.fixture
async def agent(server: CoordinatorServer) -> AsyncIterator[AsyncCoordinator]:
    async with AsyncCoordinator(server.address, principal="agent-a") as client:
        yield client


@pytest.fixture
async def human(server: CoordinatorServer) -> AsyncIterator[AsyncCoordinator]:
    async with AsyncCoordinator(server.address, principal=HUMAN, kind="human") as client:
        yield client


@pytest.fixture
async def http(fake: FakeNylas) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=fake.api_base, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        yield client


# ------------------------------------------------------------------------------------------------- guard


async def test_guard_takes_the_body_the_event_or_a_notification_and_passes_it_on_unchanged(
    agent: AsyncCoordinator,
) -> None:
    seen: list[object] = []

    @agent.guard
    async def answer(received: bytes | dict[str, Any] | Notification, extra: int) -> int:
        seen.append(received)
        assert current_claim() is not None
        return extra

    as_dict = event(new_id())
    as_bytes = json.dumps(event(new_id())).encode()
    as_notification = inbox_claims.webhooks.parse_notification(event(new_id()))
    assert await answer(as_dict, 1) == 1
    assert await answer(as_bytes, 2) == 2
    assert await answer(as_notification, 3) == 3
    assert seen == [as_dict, as_bytes, as_notification]
    assert current_claim() is None  # only inside the guarded call


async def test_guard_answers_created_and_updated_and_skips_the_rest(agent: AsyncCoordinator) -> None:
    calls: list[str] = []

    @agent.guard
    async def answer(received: dict[str, Any]) -> None:
        calls.append(received["type"])

    for kind in ("message.created", "message.updated.truncated", "message.opened", "thread.replied"):
        await answer(event(new_id(), kind=kind))
    assert calls == ["message.created", "message.updated.truncated"]
    assert {"message.created", "message.updated"} == inbox_claims.ANSWERED_EVENTS
    assert inbox_claims.asgi.DEFAULT_EVENTS == inbox_claims.ANSWERED_EVENTS

    @agent.guard(events={"message.created"})
    async def created_only(received: dict[str, Any]) -> None:
        calls.append("created only")

    await created_only(event(new_id(), kind="message.updated"))
    assert calls == ["message.created", "message.updated.truncated"]


async def test_guard_logs_each_expected_refusal_once_and_raise_refusals_raises_it(
    agent: AsyncCoordinator,
    human: AsyncCoordinator,
    fake: FakeNylas,
    http: httpx.AsyncClient,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ran: list[str] = []

    @agent.guard
    async def answer(received: dict[str, Any]) -> str | None:
        message_id = received["data"]["object"]["id"]
        ran.append(message_id)
        return await nylas.send(http, MAILBOX, draft(message_id))

    @agent.guard(raise_refusals=True)
    async def strict(received: dict[str, Any]) -> None:
        ran.append("strict")

    replied = new_id()
    created = event(replied)
    assert (await answer(created)) is not None
    caplog.set_level(logging.INFO, logger="inbox_claims")
    caplog.clear()
    assert await answer(created) is None  # the same notification again: a duplicate
    assert await answer(event(replied, kind="message.updated")) is None  # another notification: answered already
    held = new_id()
    taken = await human.claim(Subject.message(MAILBOX, held), ttl=60)
    assert taken.status is not None
    assert await answer(event(held)) is None  # a human holds it
    lines = [record for record in caplog.records if record.name == "inbox_claims"]
    assert [type(record.args[2]) for record in lines if isinstance(record.args, tuple)] == [
        DuplicateDelivery,
        AlreadyReplied,
        ReplyHeld,
    ]
    assert all(record.levelno == logging.INFO for record in lines)
    assert ran == [replied]
    assert len(fake.sends) == 1

    with pytest.raises(DuplicateDelivery):
        await strict(created)
    with pytest.raises(AlreadyReplied):
        await strict(event(replied, kind="message.updated"))
    with pytest.raises(ReplyHeld):
        await strict(event(held))
    assert ran == [replied]


async def test_guard_absorbs_a_claim_taken_over_while_drafting_and_nothing_is_sent(
    agent: AsyncCoordinator, human: AsyncCoordinator, fake: FakeNylas, http: httpx.AsyncClient
) -> None:
    message_id = new_id()

    @agent.guard
    async def answer(received: dict[str, Any]) -> str | None:
        await human.takeover(Subject.message(MAILBOX, message_id))  # "I'm answering this" while the LLM drafts
        return await nylas.send(http, MAILBOX, draft(message_id))

    @agent.guard(raise_refusals=True)
    async def strict(received: dict[str, Any]) -> str | None:
        await human.takeover(Subject.message(MAILBOX, strict_id))
        return await nylas.send(http, MAILBOX, draft(strict_id))

    assert await answer(event(message_id)) is None
    strict_id = new_id()
    with pytest.raises(ClaimLost):
        await strict(event(strict_id))
    assert fake.sends == []
    status = await human.status(Subject.message(MAILBOX, message_id))
    assert (status.state, status.holder_kind) == (SubjectState.CLAIMED, HolderKind.HUMAN)


async def test_the_blocking_guard_and_nylas_send_with_an_httpx_client(
    server: CoordinatorServer, fake: FakeNylas, caplog: pytest.LogCaptureFixture
) -> None:
    message_id = new_id()

    def run() -> list[str | None]:
        with (
            Coordinator(server.address, principal="agent-sync") as coord,
            httpx.Client(base_url=fake.api_base, headers={"Authorization": f"Bearer {API_KEY}"}) as client,
        ):

            @coord.guard
            def answer(received: bytes | str) -> str | None:
                return nylas.send(client, MAILBOX, draft(message_id))

            body = json.dumps(event(message_id)).encode()
            return [answer(body), answer(body), answer(json.dumps(event(message_id, kind="message.updated")))]

    caplog.set_level(logging.INFO, logger="inbox_claims")
    first, duplicate, updated = await asyncio.to_thread(run)
    assert first is not None
    assert (duplicate, updated) == (None, None)
    assert [sent.reply_to_message_id for sent in fake.sends] == [message_id]
    assert fake.sends[0].idempotency_key == Subject.message(MAILBOX, message_id).idempotency_key
    assert sum("not replying" in record.getMessage() for record in caplog.records) == 2


async def test_many_concurrent_guarded_calls_on_three_clients_send_once_per_message(
    server: CoordinatorServer, fake: FakeNylas, http: httpx.AsyncClient
) -> None:
    messages = [new_id() for _ in range(10)]
    async with (
        AsyncCoordinator(server.address, principal="agent-1") as one,
        AsyncCoordinator(server.address, principal="agent-2") as two,
        AsyncCoordinator(server.address, principal="agent-3") as three,
    ):
        answers = []
        for client in (one, two, three):

            @client.guard
            async def answer(received: dict[str, Any]) -> str | None:
                message_id = received["data"]["object"]["id"]
                await asyncio.sleep(0.05)  # the draft: long enough for the others to arrive meanwhile
                return await nylas.send(http, MAILBOX, draft(message_id))

            answers.append(answer)
        # Per message: one created notification delivered to every client twice, and an updated one to each.
        calls = []
        for message_id in messages:
            created = event(message_id)
            for answer in answers:
                calls += [answer(created), answer(created), answer(event(message_id, kind="message.updated"))]
        results = await asyncio.gather(*calls)
    assert sum(result is not None for result in results) == len(messages)
    assert sorted(sent.reply_to_message_id for sent in fake.sends) == sorted(messages)


# ---------------------------------------------------------------------------------------------- nylas.send


async def test_nylas_send_inside_a_claim_is_fenced_and_carries_the_claims_idempotency_key(
    agent: AsyncCoordinator, fake: FakeNylas, http: httpx.AsyncClient
) -> None:
    implicit, explicit = new_id(), new_id()
    async with agent.reply_to(event(implicit)) as claim:
        sent = await nylas.send(http, MAILBOX, draft(implicit))  # passes the commit point by itself
        assert claim.replied
        assert claim.sent_message_id == sent
    async with agent.reply_to(event(explicit)) as claim:
        assert await claim.send(nylas.send(http, MAILBOX, draft(explicit))) is not None  # the same, spelled out
    keys = [sent.idempotency_key for sent in fake.sends]
    assert keys == [Subject.message(MAILBOX, m).idempotency_key for m in (implicit, explicit)]
    for message_id in (implicit, explicit):
        assert (await agent.status(Subject.message(MAILBOX, message_id))).state is SubjectState.REPLIED


@pytest.mark.parametrize(
    ("behaviour", "raised", "cause", "state"),
    [
        ("reject", NylasSendRejected, None, SubjectState.FREE),  # 4xx: nothing went out
        ("conflict", SendOutcomeUnknown, NylasDuplicateSend, SubjectState.SENDING),  # 409: never "not sent"
        ("unavailable", SendOutcomeUnknown, NylasSendOutcomeUnknown, SubjectState.SENDING),  # 5xx: unknown
    ],
)
async def test_nylas_send_applies_the_status_rules(
    agent: AsyncCoordinator,
    fake: FakeNylas,
    http: httpx.AsyncClient,
    behaviour: Behaviour,
    raised: type[Exception],
    cause: type[Exception] | None,
    state: SubjectState,
) -> None:
    fake.behaviour = behaviour
    message_id = new_id()
    with pytest.raises(raised) as caught:
        async with agent.reply_to(event(message_id)):
            await nylas.send(http, MAILBOX, draft(message_id))
    if cause is not None:
        assert isinstance(caught.value.__cause__, cause)
    status = await agent.status(Subject.message(MAILBOX, message_id))
    assert status.state in ({state, SubjectState.IN_DOUBT} if state is SubjectState.SENDING else {state})


async def test_nylas_send_that_times_out_is_an_unknown_outcome(agent: AsyncCoordinator, fake: FakeNylas) -> None:
    fake.behaviour = "hang"
    message_id = new_id()
    async with httpx.AsyncClient(base_url=fake.api_base, timeout=0.3) as slow:
        with pytest.raises(SendOutcomeUnknown) as caught:
            async with agent.reply_to(event(message_id)):
                await nylas.send(slow, MAILBOX, draft(message_id), api_key=API_KEY)
    fake.release()
    assert isinstance(caught.value.__cause__, NylasSendOutcomeUnknown)
    assert "timed out" in str(caught.value.__cause__)


async def test_nylas_send_outside_a_claim_needs_an_explicit_key_and_the_client_needs_credentials(
    fake: FakeNylas, http: httpx.AsyncClient
) -> None:
    with pytest.raises(RuntimeError, match="outside a guarded claim"):
        nylas.send(http, MAILBOX, draft("m-1"))
    assert await nylas.send(http, MAILBOX, draft("m-1"), idempotency_key="my-key") is not None
    assert fake.sends[0].idempotency_key == "my-key"
    async with httpx.AsyncClient(base_url=fake.api_base) as anonymous:
        with pytest.raises(ValueError, match="api_key="):
            nylas.send(anonymous, MAILBOX, draft("m-2"), idempotency_key="k")
        assert await nylas.send(anonymous, MAILBOX, draft("m-2"), idempotency_key="k2", api_key=API_KEY) is not None
    assert fake.problems == []


async def test_a_send_refused_at_the_commit_point_never_starts_the_awaitable(
    agent: AsyncCoordinator, human: AsyncCoordinator, fake: FakeNylas, http: httpx.AsyncClient
) -> None:
    message_id = new_id()
    started: list[bool] = []

    async def post() -> str:
        started.append(True)
        return "never"

    async with agent.reply_to(event(message_id)) as claim:
        await human.takeover(claim.subject)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a coroutine left unawaited would warn
            with pytest.raises(ClaimLost):
                await claim.send(post())
    assert started == []
    with pytest.raises(TypeError, match="awaitable"):
        await agent.reply_to(event(new_id())).send(42)  # type: ignore[call-overload]


# --------------------------------------------------------------------------------- from_env and timeout=


def test_from_env_reads_the_variables_inboxctl_reads(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_bytes(b"-----BEGIN CERTIFICATE-----\n")
    coord = Coordinator.from_env({"INBOX_COORDINATOR_TARGET": "10.1.2.3:6000", "INBOX_PRINCIPAL": "agent-7"})
    assert (coord.target, coord.principal, coord.kind) == ("10.1.2.3:6000", "agent-7", HolderKind.AGENT)
    human = AsyncCoordinator.from_env(
        {"INBOX_PRINCIPAL": "ana", "INBOX_PRINCIPAL_KIND": "human", "INBOX_CALL_TIMEOUT": "2.5"}, max_batch=4
    )
    assert (human.target, human.kind, human._core.options.timeout) == ("127.0.0.1:50051", HolderKind.HUMAN, 2.5)
    assert human._core.options.max_batch == 4
    secured = Coordinator.from_env({"INBOX_TOKEN": "tok", "INBOX_TLS": "true", "INBOX_CA_FILE": str(ca)})
    assert secured.principal is None
    assert ("authorization", "Bearer tok") in secured._core.options.metadata
    assert secured._core.options.credentials is not None
    with pytest.raises(ValueError, match=r"INBOX_TOKEN .* INBOX_PRINCIPAL"):
        Coordinator.from_env({})
    with pytest.raises(ValueError, match="kind must be"):
        Coordinator.from_env({"INBOX_PRINCIPAL": "a", "INBOX_PRINCIPAL_KIND": "robot"})
    with pytest.raises(ValueError, match="call_timeout"):
        Coordinator.from_env({"INBOX_PRINCIPAL": "a", "INBOX_CALL_TIMEOUT": "soon"})
    with pytest.raises(ValueError, match="cannot read the CA file"):
        Coordinator.from_env({"INBOX_PRINCIPAL": "a", "INBOX_CA_FILE": str(tmp_path / "missing.pem")})


async def test_the_module_level_guard_uses_the_from_env_client(
    server: CoordinatorServer, fake: FakeNylas, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INBOX_COORDINATOR_TARGET", server.address)
    monkeypatch.setenv("INBOX_PRINCIPAL", "agent-from-env")
    message_id = new_id()

    @inbox_claims.guard
    async def answer(received: dict[str, Any]) -> str | None:
        return await nylas.send(http, MAILBOX, draft(message_id))

    created = event(message_id)
    assert await answer(created) is not None
    assert await answer(created) is None
    client = inbox_claims._default.default_async_coordinator()
    assert client.principal == "agent-from-env"
    assert (await client.status(Subject.message(MAILBOX, message_id))).holder == "agent-from-env"
    await client.close()


async def test_a_per_call_timeout_bounds_the_call_with_its_retries() -> None:
    patient = RetryPolicy(attempts=100, initial_backoff=0.2, max_backoff=0.5)
    async with AsyncCoordinator("127.0.0.1:1", principal="a", retry=patient, timeout=0.2) as nowhere:
        started = time.monotonic()
        with pytest.raises(CoordinatorUnavailable):
            await nowhere.status(Subject.message(MAILBOX, "m"), timeout=1.0)
        # Without timeout= the 100 attempts would take over 30 s.
        assert time.monotonic() - started < 5
        with pytest.raises(ValueError, match="timeout must be a positive"):
            await nowhere.status(Subject.message(MAILBOX, "m"), timeout=0)


# ---------------------------------------------------------------------------------------------- exports


def test_the_top_level_is_what_a_guarded_agent_needs() -> None:
    assert 20 <= len(inbox_claims.__all__) <= 25
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in inbox_claims.__all__:
            getattr(inbox_claims, name)
    for module in ("types", "errors", "webhooks", "testing", "nylas", "asgi", "wsgi"):
        public = __import__(f"inbox_claims.{module}", fromlist=["__all__"])
        for name in public.__all__:
            getattr(public, name)
