"""AgentMail through the provider seam, against an AgentMail double that follows AgentMail's documented behaviour
(tests/providers/fake_agentmail.py), through real coordinators on real etcd: one event delivered three times to two
workers (twice through two webhooks: two svix-ids, one event_id), two agents of different principals, the agent's
own reply coming back as message.sent, a person answering from AgentMail's console while the agent drafts, a lost
acknowledgement (the event delivered again after it was answered), a send left IN_DOUBT settled by its stamped copy,
a refused send freeing the message, and a wrong signature. Each guarded scenario sends one reply per customer
message, counted at the double; the same deliveries unguarded send at least two."""

from __future__ import annotations

import asyncio

import pytest

from inbox_claims import AsyncClaim, AsyncCoordinator, Subject, SubjectState
from inbox_claims.asgi import WebhookApp, webhook_app
from inbox_claims.providers import MessageFacts
from inbox_claims.providers.agentmail import AgentMailProvider
from tests.providers.fake_agentmail import BASE, FakeAgentMail
from tests.providers.support import KeyedUnguarded, delivered, eventually, post, settle, settled_by_its_copy, state_is

pytestmark = pytest.mark.etcd
BODY = "Your order ships today."


def provider(fake: FakeAgentMail) -> AgentMailProvider:
    return AgentMailProvider(fake.secret, api_key=fake.api_key, api_base=BASE, transport=fake)


def apps(
    fake: FakeAgentMail, clients: list[AsyncCoordinator], drafting: asyncio.Event | None = None
) -> list[WebhookApp]:
    made = []
    for client in clients:
        mail = provider(fake)

        async def answer(message: MessageFacts, claim: AsyncClaim, mail: AgentMailProvider = mail) -> None:
            if drafting is not None:
                await drafting.wait()
            await claim.send(mail.reply, message, body=BODY)

        made.append(webhook_app(mail, answer, coordinator=client))
    return made


async def unguarded_replies(deliveries: list[tuple[int, str]]) -> int:
    """The replies the agent without the coordinator sends to one message whose event goes to ``deliveries``: (the
    index of the worker or agent, the webhook it comes through)."""
    fake = FakeAgentMail()
    agents = [KeyedUnguarded(provider(fake)) for _ in range(max(i for i, _ in deliveries) + 1)]
    message = fake.receive("bea@example.org", "Where is my order?", "thd-u")
    for index, webhook in deliveries:
        await agents[index].deliver(*fake.received(message, webhook=webhook))
    return fake.replies_to(message["message_id"])


async def test_one_event_delivered_three_times_to_two_workers_through_two_webhooks_gets_one_reply(
    clients: dict[str, AsyncCoordinator],
) -> None:
    fake = FakeAgentMail()
    message = fake.receive("bea@example.org", "Where is my order?", "thd-1")
    workers = apps(fake, [clients["a1"], clients["a2"]])
    inbox_hook, pod_hook = fake.received(message), fake.received(message, webhook="pod")
    assert inbox_hook[1]["svix-id"] != pod_hook[1]["svix-id"]  # what a dedup on svix-id would take for two events
    answers = await asyncio.gather(
        delivered(workers[0], inbox_hook), delivered(workers[1], pod_hook), delivered(workers[0], inbox_hook)
    )
    assert list(answers) == [200, 200, 200]
    await settle(workers)
    assert fake.replies_to(message["message_id"]) == 1
    # The agent's own reply comes back as message.sent: reported, never answered.
    copy = fake.sent_copy(message["message_id"])
    again = apps(fake, [clients["a2"]])
    assert await delivered(again[0], fake.sent(copy)) == 200
    await settle(again)
    assert fake.replies_to(copy["message_id"]) == 0
    assert fake.replies_to(message["message_id"]) == 1
    subject = Subject.message(fake.inbox, message["message_id"])
    status = await clients["a1"].status(subject)
    assert (status.state, status.sent_message_id) == (SubjectState.REPLIED, copy["message_id"])
    # The reply carried the claim's key, its stamp and RFC 3834's Auto-Submitted.
    assert copy["headers"]["Auto-Submitted"] == "auto-replied"
    assert copy["headers"]["X-Inbox-Claim"].startswith(subject.idempotency_key + ".")
    assert list(fake.keys) == [subject.idempotency_key]

    assert await unguarded_replies([(0, "inbox"), (1, "pod"), (0, "inbox")]) >= 2


async def test_two_agents_of_different_principals_send_one_reply(clients: dict[str, AsyncCoordinator]) -> None:
    fake = FakeAgentMail()
    message = fake.receive("carl@example.net", "Refund for order 1042", "thd-2")
    agents = apps(fake, [clients["a1"], clients["b"]])
    delivery = fake.received(message)
    assert list(await asyncio.gather(delivered(agents[0], delivery), delivered(agents[1], delivery))) == [200, 200]
    await settle(agents)
    assert fake.replies_to(message["message_id"]) == 1
    status = await clients["b"].status(Subject.message(fake.inbox, message["message_id"]))
    assert status.state is SubjectState.REPLIED
    assert status.holder in ("agent-a", "agent-b")

    assert await unguarded_replies([(0, "inbox"), (1, "inbox")]) >= 2


async def test_a_person_answering_from_the_console_while_the_agent_drafts_stops_its_send(
    clients: dict[str, AsyncCoordinator],
) -> None:
    fake = FakeAgentMail()
    message = fake.receive("bea@example.org", "Where is my order?", "thd-3")
    drafting = asyncio.Event()
    workers = apps(fake, [clients["a1"], clients["a2"]], drafting)
    assert await delivered(workers[0], fake.received(message)) == 200
    subject = Subject.message(fake.inbox, message["message_id"])
    assert (await clients["a1"].status(subject)).state is SubjectState.CLAIMED  # the agent drafts
    person = fake.person_replies(message)
    assert await delivered(workers[1], fake.sent(person)) == 200
    status = await clients["a1"].status(subject)
    assert (status.state, status.replied_outside) == (SubjectState.REPLIED, True)
    drafting.set()
    await settle(workers)
    assert [send.by for send in fake.sends] == ["person"]  # the agent's send was refused: nothing went out

    assert await unguarded_replies([(0, "inbox")]) == 1  # unguarded, the agent's reply goes out besides the person's


async def test_an_event_delivered_again_after_its_acknowledgement_was_lost_is_not_answered_twice(
    clients: dict[str, AsyncCoordinator],
) -> None:
    fake = FakeAgentMail()
    message = fake.receive("dan@example.com", "Invoice please", "thd-4")
    first = apps(fake, [clients["a1"]])
    assert await delivered(first[0], fake.received(message)) == 200  # answered; the 200 never reached AgentMail
    await settle(first)
    assert fake.replies_to(message["message_id"]) == 1
    retry = apps(fake, [clients["a2"]])  # Svix retries later, to whichever worker
    assert await delivered(retry[0], fake.received(message)) == 200
    await settle(retry)
    assert fake.replies_to(message["message_id"]) == 1

    assert await unguarded_replies([(0, "inbox"), (0, "inbox")]) >= 2


async def test_a_send_left_in_doubt_settles_itself_when_its_stamped_copy_is_seen(
    clients: dict[str, AsyncCoordinator],
) -> None:
    fake = FakeAgentMail()
    message = fake.receive("bea@example.org", "Where is my order?", "thd-5")
    agent = apps(fake, [clients["a1"]])
    fake.send_failure = "lost_answer"  # AgentMail sends it, and its answer is lost: the agent cannot know
    assert await delivered(agent[0], fake.received(message)) == 200
    subject = Subject.message(fake.inbox, message["message_id"])
    await eventually(lambda: state_is(clients["a1"], subject, SubjectState.IN_DOUBT))
    copy = fake.sent_copy(message["message_id"])
    other = apps(fake, [clients["b"]])  # another agent hears message.sent: the copy carries the stamp
    assert await delivered(other[0], fake.sent(copy)) == 200
    await settle(agent + other)
    await settled_by_its_copy(clients["a1"], subject, copy["message_id"], "agent-b")
    assert fake.replies_to(message["message_id"]) == 1


async def test_a_refused_reply_frees_the_message_for_a_person_instead_of_leaving_it_in_doubt(
    clients: dict[str, AsyncCoordinator],
) -> None:
    fake = FakeAgentMail()
    message = fake.receive("eve@example.org", "Is the shop open on Sunday?", "thd-6")
    agent = apps(fake, [clients["a1"]])
    fake.send_failure = "reject"  # 400: nothing went out
    assert await delivered(agent[0], fake.received(message)) == 200
    subject = Subject.message(fake.inbox, message["message_id"])
    await eventually(lambda: state_is(clients["a1"], subject, SubjectState.FREE))
    await settle(agent)
    assert fake.replies_to(message["message_id"]) == 0
    status = await clients["a1"].status(subject)
    assert (status.state, status.sent_message_id) == (SubjectState.FREE, "")


async def test_a_wrong_signature_is_refused_and_nothing_is_recorded(clients: dict[str, AsyncCoordinator]) -> None:
    fake = FakeAgentMail()
    message = fake.receive("eve@example.org", "Hello", "thd-7")
    agent = apps(fake, [clients["a1"]])
    body, headers = fake.received(message)
    answer = await post(agent[0], body.replace(b"Hello", b"Hullo"), headers)
    await settle(agent)
    assert answer.status_code == 401
    assert "signature" in answer.text
    status = await clients["a1"].status(Subject.message(fake.inbox, message["message_id"]))
    assert status.state is SubjectState.FREE
    assert sum(fake.calls.values()) == 0
    assert fake.sends == []


async def test_many_messages_each_delivered_three_times_at_once_to_three_workers_get_one_reply_each(
    clients: dict[str, AsyncCoordinator],
) -> None:
    fake = FakeAgentMail()
    workers = apps(fake, [clients["a1"], clients["a2"], clients["b"]])
    messages = [fake.receive(f"c{i}@example.org", f"Order {i}", f"thd-m{i}") for i in range(12)]
    posts = [
        delivered(workers[(i + k) % 3], fake.received(message, webhook=("inbox", "pod", "inbox")[k]))
        for i, message in enumerate(messages)
        for k in range(3)
    ]
    assert set(await asyncio.gather(*posts)) == {200}
    await settle(workers)
    assert [fake.replies_to(m["message_id"]) for m in messages] == [1] * len(messages)
