"""inbox_claims.nylas through claim.send, against a real coordinator and a fake Nylas endpoint on loopback.

The fake (examples/agent/fake_nylas.py) checks every request: the path, the bearer key, an Idempotency-Key of
1 to 256 characters, and the JSON fields. Each outcome of the send API must leave the subject in the state that
tells the truth: REPLIED when sent, FREE when Nylas certainly refused, SENDING and then IN_DOUBT when nobody
can know.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
from collections.abc import Iterator
from typing import Literal

import httpx
import pytest

from coordinator.ops.server import CoordinatorServer
from examples.agent.fake_nylas import Behaviour, FakeNylas
from inbox_claims import (
    AsyncCoordinator,
    Coordinator,
    SendOutcomeUnknown,
    SendRejected,
    Subject,
    SubjectState,
    SubjectStatus,
)
from inbox_claims.nylas import (
    AsyncNylas,
    Nylas,
    NylasDuplicateSend,
    NylasReply,
    NylasSendOutcomeUnknown,
    NylasSendRejected,
    build_send_request,
    interpret_send_response,
)
from inbox_claims.types import ClaimOutcome, EventType
from tests.client.support import wait_for_event, watching
from tests.conftest import StartCoordinator

API_KEY = "nyk_v0_test_key"
SEND_TIMEOUT_MS = 300
Variant = Literal["sync", "async"]
VARIANTS: tuple[Variant, ...] = ("sync", "async")


@pytest.fixture
def fake() -> Iterator[FakeNylas]:
    with FakeNylas(API_KEY) as nylas:
        yield nylas


@pytest.fixture
async def server(start_coordinator: StartCoordinator) -> CoordinatorServer:
    return await start_coordinator(send_timeout_ms=SEND_TIMEOUT_MS, sweep_interval_s=0.1)


def a_reply(message_id: str) -> NylasReply:
    return NylasReply(
        reply_to_message_id=message_id,
        to=["customer@example.com", {"email": "boss@example.com", "name": "The Boss"}],
        subject="Re: Where is my order?",
        body="<p>It ships today.</p>",
        cc=["cc@example.com"],
    )


async def send_through_claim(
    variant: Variant, address: str, subject: Subject, api_base: str, *, api_key: str = API_KEY, wait: float = 5
) -> str | None:
    """reply_to + claim.send(nylas.send, ...) with the blocking or the asyncio client; raises what send raises.
    ``wait``: the Nylas client's timeout."""
    reply = a_reply(subject.id)
    mailbox, message_id = subject.mailbox, subject.id
    if variant == "async":
        async with (
            AsyncCoordinator(address, principal="agent-a") as coord,
            AsyncNylas(api_key, api_base=api_base, timeout=wait) as nylas,
            coord.reply_to(mailbox=mailbox, message_id=message_id) as claim,
        ):
            return await claim.send(nylas.send, mailbox, reply, idempotency_key=claim.idempotency_key)

    def blocking() -> str | None:
        with (
            Coordinator(address, principal="agent-a") as coord,
            Nylas(api_key, api_base=api_base, timeout=wait) as nylas,
            coord.reply_to(mailbox=mailbox, message_id=message_id) as claim,
        ):
            return claim.send(nylas.send, mailbox, reply, idempotency_key=claim.idempotency_key)

    return await asyncio.to_thread(blocking)


async def status_of(address: str, subject: Subject) -> SubjectStatus:
    async with AsyncCoordinator(address, principal="observer") as coord:
        return await coord.status(subject)


@pytest.mark.parametrize("variant", VARIANTS)
async def test_a_sent_reply_is_recorded_with_the_nylas_message_id(
    variant: Variant, server: CoordinatorServer, fake: FakeNylas, mailbox: str
) -> None:
    subject = Subject.message(mailbox, "msg/1 ü")

    sent_id = await send_through_claim(variant, server.address, subject, fake.api_base)

    assert sent_id == "sent-1"
    status = await status_of(server.address, subject)
    assert (status.state, status.sent_message_id, status.holder) == (SubjectState.REPLIED, "sent-1", "agent-a")
    assert fake.problems == []
    [request] = fake.requests
    assert request.method == "POST"
    assert request.path == f"/v3/grants/{mailbox}/messages/send"
    assert request.headers["authorization"] == f"Bearer {API_KEY}"
    key = request.headers["idempotency-key"]
    assert key == subject.idempotency_key
    assert 1 <= len(key) <= 256
    assert request.json() == {
        "reply_to_message_id": "msg/1 ü",
        "to": [{"email": "customer@example.com"}, {"email": "boss@example.com", "name": "The Boss"}],
        "cc": [{"email": "cc@example.com"}],
        "subject": "Re: Where is my order?",
        "body": "<p>It ships today.</p>",
        # An agent's reply says it is automatic (RFC 3834), so that auto-responders do not answer it.
        "custom_headers": [{"name": "Auto-Submitted", "value": "auto-replied"}],
    }


@pytest.mark.parametrize("variant", VARIANTS)
async def test_a_refused_send_is_aborted_and_frees_the_message(
    variant: Variant, server: CoordinatorServer, fake: FakeNylas, mailbox: str
) -> None:
    subject = Subject.message(mailbox, "msg-422")
    fake.behaviour = "reject"

    with pytest.raises(NylasSendRejected) as refused:
        await send_through_claim(variant, server.address, subject, fake.api_base)

    assert isinstance(refused.value, SendRejected)
    assert refused.value.status_code == 422
    assert "unprocessable recipient" in str(refused.value)
    assert (await status_of(server.address, subject)).state is SubjectState.FREE
    async with AsyncCoordinator(server.address, principal="agent-b") as other:
        assert (await other.claim(subject)).outcome is ClaimOutcome.GRANTED  # it can be answered again
    assert fake.sends == []


@pytest.mark.parametrize("variant", VARIANTS)
async def test_a_wrong_api_key_is_a_refusal(
    variant: Variant, server: CoordinatorServer, fake: FakeNylas, mailbox: str
) -> None:
    subject = Subject.message(mailbox, "msg-401")

    with pytest.raises(NylasSendRejected) as refused:
        await send_through_claim(variant, server.address, subject, fake.api_base, api_key="not-the-key")

    assert refused.value.status_code == 401
    assert fake.problems == ["authorization: expected 'Bearer <the API key>'"]
    assert (await status_of(server.address, subject)).state is SubjectState.FREE


async def unknown_outcome(
    variant: Variant, address: str, subject: Subject, api_base: str, *, wait: float = 5
) -> BaseException | None:
    """Sends through the claim while watching the mailbox; asserts that the send's outcome was unknown and that
    the subject went SENDING and then IN_DOUBT, never FREE; answers the send function's exception."""
    async with (
        AsyncCoordinator(address, principal="observer") as observer,
        watching(observer, subject.mailbox) as events,
    ):
        with pytest.raises(SendOutcomeUnknown) as unknown:
            await send_through_claim(variant, address, subject, api_base, wait=wait)
        await wait_for_event(events, EventType.IN_DOUBT)
        assert (await observer.status(subject)).state is SubjectState.IN_DOUBT
    assert [event.type for event in events] == [EventType.CLAIMED, EventType.SENDING, EventType.IN_DOUBT]
    return unknown.value.__cause__


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    ("behaviour", "cause"),
    [("conflict", NylasDuplicateSend), ("unavailable", NylasSendOutcomeUnknown), ("hang", NylasSendOutcomeUnknown)],
)
async def test_an_unknown_outcome_stays_sending_then_is_in_doubt(
    variant: Variant,
    behaviour: Behaviour,
    cause: type[Exception],
    server: CoordinatorServer,
    fake: FakeNylas,
    mailbox: str,
) -> None:
    subject = Subject.message(mailbox, f"msg-{behaviour}")
    fake.behaviour = behaviour

    error = await unknown_outcome(variant, server.address, subject, fake.api_base, wait=0.3)

    assert type(error) is cause  # never a SendRejected: nobody may answer the message meanwhile
    assert fake.problems == []
    assert len(fake.requests) == 1  # never retried


@pytest.mark.parametrize("variant", VARIANTS)
async def test_a_connection_error_is_an_unknown_outcome(
    variant: Variant, server: CoordinatorServer, mailbox: str
) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        api_base = f"http://127.0.0.1:{closed.getsockname()[1]}"  # bound, not listening: refused
        error = await unknown_outcome(variant, server.address, Subject.message(mailbox, "msg-refused"), api_base)
    assert isinstance(error, NylasSendOutcomeUnknown)
    assert error.status_code is None


async def test_the_idempotency_key_stops_a_second_reply_at_nylas(fake: FakeNylas, mailbox: str) -> None:
    """The backstop: even outside the coordinator, one key sends once (a repeat of the same payload gets the
    first answer, another payload 409)."""
    key = Subject.message(mailbox, "msg-1").idempotency_key
    async with AsyncNylas(API_KEY, api_base=fake.api_base) as nylas:
        first = await nylas.send(mailbox, a_reply("msg-1"), idempotency_key=key)
        again = await nylas.send(mailbox, a_reply("msg-1"), idempotency_key=key)
        other_draft = NylasReply("msg-1", ["customer@example.com"], "Re: Where is my order?", "<p>Another draft</p>")
        with pytest.raises(NylasDuplicateSend) as conflict:
            await nylas.send(mailbox, other_draft, idempotency_key=key)
    assert first == again == "sent-1"
    assert conflict.value.status_code == 409
    assert len(fake.sends) == 1
    assert fake.replays == 1


def test_requests_and_answers_are_built_and_read_in_one_place() -> None:
    request = build_send_request(
        "https://api.eu.nylas.com/", "key", "grant/1", a_reply("m-1"), idempotency_key="ic1-" + "0" * 64
    )
    assert request.url == "https://api.eu.nylas.com/v3/grants/grant%2F1/messages/send"
    assert request.headers["Idempotency-Key"] == "ic1-" + "0" * 64
    assert json.loads(request.content)["reply_to_message_id"] == "m-1"
    with pytest.raises(ValueError, match="1 to 256"):
        build_send_request("https://x", "key", "g", a_reply("m"), idempotency_key="k" * 257)
    with pytest.raises(ValueError, match="recipient"):
        NylasReply("m", [], "s", "b").payload()

    assert interpret_send_response(200, b'{"data": {"id": "abc"}}') == "abc"
    assert interpret_send_response(202, b"not json") is None  # it went out; the id is unknown
    with pytest.raises(NylasSendRejected):
        interpret_send_response(429, b'{"error": {"type": "rate_limit", "message": "slow down"}}')
    with pytest.raises(NylasDuplicateSend):
        interpret_send_response(409, b"")
    for status in (500, 502, 504, 302):
        with pytest.raises(NylasSendOutcomeUnknown) as unknown:
            interpret_send_response(status, b"")
        assert not isinstance(unknown.value, SendRejected)


async def test_the_sent_folders_of_a_grant_are_found_by_their_attribute_across_pages(fake: FakeNylas) -> None:
    """What the guard's sent_folders setting takes for a Microsoft or IMAP grant: the ids of the folders whose
    attributes hold \\Sent (Nylas's common attribute), on every page of the folder list."""
    grant = "grant-outlook"
    fake.folders[grant] = [
        {"id": "AAMkInbox", "name": "Inbox", "attributes": ["\\Inbox"]},
        {"id": "AAMkDrafts", "name": "Drafts", "attributes": ["\\Drafts"]},
        {"id": "AAMkSent", "name": "Sent Items", "attributes": ["\\Sent"]},
        {"id": "AAMkArchive", "name": "Archive"},
        {"id": "INBOX.Sent", "name": "Sent", "attributes": ["\\HasNoChildren", "\\Sent"]},
    ]
    fake.folder_page_size = 2
    async with AsyncNylas(API_KEY, api_base=fake.api_base) as nylas:
        assert await nylas.sent_folder_ids(grant) == ["AAMkSent", "INBOX.Sent"]
        assert await nylas.sent_folder_ids("grant-without-folders") == []
    with Nylas(API_KEY, api_base=fake.api_base) as blocking:
        assert blocking.sent_folder_ids(grant) == ["AAMkSent", "INBOX.Sent"]
    with Nylas("wrong-key", api_base=fake.api_base) as refused, pytest.raises(httpx.HTTPStatusError, match="401"):
        refused.sent_folder_ids(grant)


async def test_a_persons_reply_is_never_marked_automatic_and_an_agents_keeps_its_threading(
    server: CoordinatorServer, fake: FakeNylas, mailbox: str
) -> None:
    """RFC 3834 marks only automatic replies: a person's claim (kind human) sends without Auto-Submitted; an agent's
    keeps the reply's threading (reply_to_message_id, from which Nylas sets In-Reply-To and References) and the
    draft's own custom headers."""
    person_subject, agent_subject = Subject.message(mailbox, "m-person"), Subject.message(mailbox, "m-agent")
    async with (
        AsyncCoordinator(server.address, principal="ana", kind="human") as person,
        AsyncNylas(API_KEY, api_base=fake.api_base) as nylas,
        person.reply_to(mailbox=mailbox, message_id=person_subject.id) as claim,
    ):
        await claim.send(nylas.send, mailbox, a_reply(person_subject.id), idempotency_key=claim.idempotency_key)
    own = dataclasses.replace(
        a_reply(agent_subject.id), fields={"custom_headers": [{"name": "X-Ticket", "value": "T-7"}]}
    )
    async with (
        AsyncCoordinator(server.address, principal="agent-a") as agent,
        AsyncNylas(API_KEY, api_base=fake.api_base) as nylas,
        agent.reply_to(mailbox=mailbox, message_id=agent_subject.id) as claim,
    ):
        await claim.send(nylas.send, mailbox, own, idempotency_key=claim.idempotency_key)

    assert fake.problems == []
    by_person, by_agent = (request.json() for request in fake.requests)
    assert by_person["reply_to_message_id"] == "m-person"
    assert "custom_headers" not in by_person
    assert by_agent["reply_to_message_id"] == "m-agent"
    assert by_agent["custom_headers"] == [
        {"name": "X-Ticket", "value": "T-7"},
        {"name": "Auto-Submitted", "value": "auto-replied"},
    ]
