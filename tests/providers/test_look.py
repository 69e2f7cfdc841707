"""Look before you send (docs/design.md#reply-storms), through the Gmail, Graph and Nylas providers and their doubles,
against a real coordinator on a real etcd: right before the commit point, ``claim.send(provider.reply, message,
...)`` asks the provider for the thread's messages received since the claimed one, and records what it finds as its
notification would have been. A person's reply from the mail client that no notification has brought yet stops the
agent (answered outside); a customer's newer message refuses the send (the conversation moved on); with nothing
new, the reply goes out, at the cost of one API call."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import pytest

from coordinator.ops.server import CoordinatorServer
from inbox_claims import AsyncCoordinator, ClaimLost, Subject, SubjectState
from inbox_claims.errors import ConversationMovedOn
from inbox_claims.providers import MessageFacts
from inbox_claims.providers._httpx import HttpTransport, drive
from inbox_claims.providers._seam import Flow
from inbox_claims.providers.gmail import GmailProvider
from inbox_claims.providers.graph import GraphProvider
from inbox_claims.providers.nylas import NylasProvider
from inbox_claims.providers.nylas import facts_of as nylas_facts
from inbox_claims.types import LossReason
from inbox_claims.webhooks import parse_notification
from tests.conftest import StartCoordinator
from tests.providers.fake_gmail import FakeGmail
from tests.providers.fake_graph import BASE, FakeGraph
from tests.providers.fake_nylas_api import BASE as NYLAS_BASE
from tests.providers.fake_nylas_api import FakeNylasApi
from tests.providers.support import gmail_provider

pytestmark = pytest.mark.etcd
BODY = "Your order ships today."
SHOP = "support@shop.example"
T = TypeVar("T")


@pytest.fixture
async def agent(start_coordinator: StartCoordinator) -> AsyncIterator[AsyncCoordinator]:
    server: CoordinatorServer = await start_coordinator()
    async with AsyncCoordinator(server.address, principal="agent-a", mailbox_addresses=[SHOP]) as client:
        yield client


class Gmail:
    """The Gmail double on a clock the test moves (a minute per message), and its provider."""

    def __init__(self) -> None:
        minutes = itertools.count()
        self.fake = FakeGmail(SHOP, clock=lambda: 1_796_220_000 + 60 * next(minutes))
        self.provider: GmailProvider = gmail_provider(self.fake)

    async def facts(self, document: dict[str, Any]) -> MessageFacts:
        read = await ran(self.provider._message(document["id"]), self.fake)
        assert read is not None
        return self.provider.facts(read)

    def customer(self) -> dict[str, Any]:
        return self.fake.receive("Bea Costa <bea@example.org>", "Where is my order?")


class Graph:
    def __init__(self) -> None:
        self.fake = FakeGraph()
        self.provider = GraphProvider(
            self.fake.client_state,
            self.fake.user,
            token=self.fake.token,
            api_base=BASE,
            notification_url="https://agent.example/webhook",
            transport=self.fake,
        )

    async def facts(self, document: dict[str, Any]) -> MessageFacts:
        return await ran(self.provider.facts(document, "message.created"), self.fake)

    def customer(self) -> dict[str, Any]:
        # Received a minute ago: what arrives during the test is newer, to the second Graph gives.
        return self.fake.receive("bea@example.org", "Where is my order?", "conv-look", at="2020-01-01T00:00:00Z")


class Nylas:
    """The Nylas API double on a clock the test moves, and the Nylas provider given an API key."""

    def __init__(self) -> None:
        minutes = itertools.count()
        self.fake = FakeNylasApi(clock=lambda: 1_796_220_000 + 60 * next(minutes))
        self.provider = NylasProvider(
            "nylas-secret",
            api_key=self.fake.api_key,
            api_base=NYLAS_BASE,
            transport=self.fake,
            mailbox_addresses=[SHOP],
        )

    async def facts(self, document: dict[str, Any]) -> MessageFacts:
        facts = nylas_facts(parse_notification(self.fake.notification(document)))
        assert facts is not None
        return facts

    def customer(self) -> dict[str, Any]:
        return self.fake.receive("bea@example.org", "Where is my order?")


Mail = Gmail | Graph | Nylas
MAILS: dict[str, Callable[[], Mail]] = {"gmail": Gmail, "graph": Graph, "nylas": Nylas}


async def ran(flow: Flow[T], transport: HttpTransport) -> T:
    """A provider's flow on the double (an asyncio transport): awaited."""
    result = drive(flow, transport)
    assert inspect.iscoroutine(result)
    answer: T = await result
    return answer


def person_replies(mail: Mail, to: dict[str, Any]) -> None:
    mail.fake.person_replies(to)


def customer_writes_again(mail: Mail, to: dict[str, Any]) -> dict[str, Any]:
    if isinstance(mail, Gmail | Nylas):
        return mail.fake.customer_writes_again(to)
    return mail.fake.receive("bea@example.org", "RE: Where is my order?", to["conversationId"])


def looks(mail: Mail) -> int:
    return mail.fake.calls["threads.get" if isinstance(mail, Gmail) else "messages.list"]


def sent_headers(mail: Mail, to: dict[str, Any]) -> dict[str, str]:
    """The headers of the agent's reply to ``to``, as the provider keeps its sent copy."""
    copy = mail.fake.sent_copy(to["id"])
    if isinstance(mail, Gmail):
        return {name: str(value) for name, value in mail.fake.parsed(copy["id"]).items()}
    listed = copy["internetMessageHeaders"] if isinstance(mail, Graph) else copy["headers"]
    return {h["name"]: h["value"] for h in listed}


@pytest.mark.parametrize("name", sorted(MAILS))
async def test_a_persons_reply_from_the_mail_client_found_by_the_look_stops_the_agent(
    name: str, agent: AsyncCoordinator
) -> None:
    mail = MAILS[name]()
    document = mail.customer()
    message = await mail.facts(document)

    async def draft_while_a_person_answers() -> None:
        async with agent.reply_to(message) as claim:
            person_replies(mail, document)  # from Gmail or Outlook: no notification of it has come
            await claim.send(mail.provider.reply, message, body=BODY)

    with pytest.raises(ClaimLost) as lost:
        await draft_while_a_person_answers()

    assert lost.value.reason is LossReason.ANSWERED_OUTSIDE
    assert mail.fake.replies_to(document["id"]) == 0  # the agent sent nothing
    assert mail.fake.replies_to(document["id"], by="person") == 1
    status = await agent.status(Subject.message(message.mailbox, message.message_id))
    assert status.state is SubjectState.REPLIED
    assert status.replied_outside
    assert looks(mail) == 1


@pytest.mark.parametrize("name", sorted(MAILS))
async def test_a_customers_newer_message_found_by_the_look_refuses_the_send(name: str, agent: AsyncCoordinator) -> None:
    mail = MAILS[name]()
    document = mail.customer()
    message = await mail.facts(document)

    async def draft_while_the_customer_writes_again() -> str:
        async with agent.reply_to(message) as claim:
            newer = customer_writes_again(mail, document)
            await claim.send(mail.provider.reply, message, body=BODY)
        return str(newer["id"])

    with pytest.raises(ConversationMovedOn) as refused:
        await draft_while_the_customer_writes_again()

    assert mail.fake.replies_to(document["id"]) == 0
    assert refused.value.newer_message_id != message.message_id
    assert refused.value.reason == "the customer wrote again; draft again with the new message"


@pytest.mark.parametrize("name", sorted(MAILS))
async def test_with_nothing_new_the_reply_goes_out_after_one_look(name: str, agent: AsyncCoordinator) -> None:
    mail = MAILS[name]()
    document = mail.customer()
    message = await mail.facts(document)
    async with agent.reply_to(message) as claim:
        await claim.send(mail.provider.reply, message, body=BODY)
    assert mail.fake.replies_to(document["id"]) == 1
    assert looks(mail) == 1
    assert sent_headers(mail, document)["Auto-Submitted"] == "auto-replied"


async def test_an_auto_reply_in_the_thread_found_by_the_look_does_not_stop_the_answer(agent: AsyncCoordinator) -> None:
    """An out-of-office arriving in the thread after the customer's message is no new question: the reply goes out."""
    mail = Nylas()
    document = mail.customer()
    message = await mail.facts(document)
    async with agent.reply_to(message) as claim:
        mail.fake.receive(
            "bea@example.org", "Out of office", document["thread_id"], headers={"Auto-Submitted": "auto-replied"}
        )
        await claim.send(mail.provider.reply, message, body=BODY)
    assert mail.fake.replies_to(document["id"]) == 1
    assert looks(mail) == 1
