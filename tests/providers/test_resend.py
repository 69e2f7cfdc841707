"""Resend inbound through the provider seam, against a Resend double that follows Resend's documented behaviour
(tests/providers/fake_resend.py), through real coordinators on real etcd: one email.received delivered three times
to two workers, two agents of different principals, the agent's own reply coming back as email.sent, a person
answering from their mail client (Bcc to the receiving address) while the agent drafts, a lost acknowledgement, a
send left IN_DOUBT settled by its email.sent (the stamp in its tags), a refused send freeing the message, and a wrong
signature. Each guarded scenario sends one reply per customer message, counted at the double; the same deliveries
unguarded send at least two."""

from __future__ import annotations

import asyncio

import pytest

from inbox_claims import AsyncClaim, AsyncCoordinator, Subject, SubjectState
from inbox_claims.asgi import WebhookApp, webhook_app
from inbox_claims.providers import MessageFacts
from inbox_claims.providers.resend import ResendProvider
from tests.providers.fake_resend import BASE, FakeResend
from tests.providers.support import KeyedUnguarded, delivered, eventually, post, settle, settled_by_its_copy, state_is

pytestmark = pytest.mark.etcd
BODY = "Your order ships today."


def provider(fake: FakeResend) -> ResendProvider:
    return ResendProvider(
        fake.secret, fake.mailbox, api_key=fake.api_key, sender=f"Shop <{fake.mailbox}>", api_base=BASE, transport=fake
    )


def apps(fake: FakeResend, clients: list[AsyncCoordinator], drafting: asyncio.Event | None = None) -> list[WebhookApp]:
    made = []
    for client in clients:
        mail = provider(fake)

        async def answer(message: MessageFacts, claim: AsyncClaim, mail: ResendProvider = mail) -> None:
            if drafting is not None:
                await drafting.wait()
            await claim.send(mail.reply, message, body=BODY)

        made.append(webhook_app(mail, answer, coordinator=client))
    return made


async def unguarded_replies(deliveries: list[int]) -> int:
    """The replies the agent without the coordinator sends to one email whose event goes to ``deliveries``."""
    fake = FakeResend()
    agents = [KeyedUnguarded(provider(fake)) for _ in range(max(deliveries) + 1)]
    email = fake.receive("bea@example.org", "Where is my order?")
    for index in deliveries:
        await agents[index].deliver(*fake.received(email))
    return fake.replies_to(email["id"])


async def test_one_event_delivered_three_times_to_two_workers_gets_one_reply(
    clients: dict[str, AsyncCoordinator],
) -> None:
    fake = FakeResend()
    email = fake.receive("bea@example.org", "Where is my order?")
    workers = apps(fake, [clients["a1"], clients["a2"]])
    event = fake.received(email)
    answers = await asyncio.gather(*(delivered(workers[i], event) for i in (0, 1, 0)))
    assert list(answers) == [200, 200, 200]
    await settle(workers)
    assert fake.replies_to(email["id"]) == 1
    # The agent's own reply comes back as email.sent: reported, never answered.
    copy = fake.sent_copy(email["id"])
    again = apps(fake, [clients["a2"]])
    assert await delivered(again[0], fake.sent(copy)) == 200
    await settle(again)
    assert fake.replies_to(copy["id"]) == 0
    subject = Subject.message(fake.mailbox, email["id"])
    status = await clients["a1"].status(subject)
    assert (status.state, status.sent_message_id) == (SubjectState.REPLIED, copy["id"])
    # In the thread, with the claim's key, its stamp and RFC 3834's Auto-Submitted.
    assert copy["headers"]["In-Reply-To"] == email["message_id"]
    assert copy["headers"]["Auto-Submitted"] == "auto-replied"
    assert copy["headers"]["X-Inbox-Claim"].startswith(subject.idempotency_key + ".")
    assert list(fake.keys) == [subject.idempotency_key]

    assert await unguarded_replies([0, 1, 0]) >= 2


async def test_two_agents_of_different_principals_send_one_reply(clients: dict[str, AsyncCoordinator]) -> None:
    fake = FakeResend()
    email = fake.receive("carl@example.net", "Refund for order 1042")
    agents = apps(fake, [clients["a1"], clients["b"]])
    event = fake.received(email)
    assert list(await asyncio.gather(delivered(agents[0], event), delivered(agents[1], event))) == [200, 200]
    await settle(agents)
    assert fake.replies_to(email["id"]) == 1
    status = await clients["b"].status(Subject.message(fake.mailbox, email["id"]))
    assert status.state is SubjectState.REPLIED

    assert await unguarded_replies([0, 1]) >= 2


async def test_a_person_answering_from_their_mail_client_while_the_agent_drafts_stops_its_send(
    clients: dict[str, AsyncCoordinator],
) -> None:
    fake = FakeResend()
    email = fake.receive("bea@example.org", "Where is my order?")
    drafting = asyncio.Event()
    workers = apps(fake, [clients["a1"], clients["a2"]], drafting)
    assert await delivered(workers[0], fake.received(email)) == 200
    subject = Subject.message(fake.mailbox, email["id"])
    assert (await clients["a1"].status(subject)).state is SubjectState.CLAIMED  # the agent drafts
    person = fake.person_replies(email)  # From the mailbox, Bcc the receiving address: in the thread
    assert await delivered(workers[1], fake.received(person)) == 200
    status = await clients["a1"].status(subject)
    assert (status.state, status.replied_outside) == (SubjectState.REPLIED, True)
    drafting.set()
    await settle(workers)
    assert [send.by for send in fake.sends] == ["person"]
    assert fake.replies_to(person["id"]) == 0  # the person's own mail is not answered either


async def test_an_event_delivered_again_after_its_acknowledgement_was_lost_is_not_answered_twice(
    clients: dict[str, AsyncCoordinator],
) -> None:
    fake = FakeResend()
    email = fake.receive("dan@example.com", "Invoice please")
    first = apps(fake, [clients["a1"]])
    assert await delivered(first[0], fake.received(email)) == 200  # answered; the 200 never reached Resend
    await settle(first)
    retry = apps(fake, [clients["a2"]])
    assert await delivered(retry[0], fake.received(email)) == 200
    await settle(retry)
    assert fake.replies_to(email["id"]) == 1

    assert await unguarded_replies([0, 0]) >= 2


async def test_a_send_left_in_doubt_settles_itself_when_its_email_sent_is_seen(
    clients: dict[str, AsyncCoordinator],
) -> None:
    fake = FakeResend()
    email = fake.receive("bea@example.org", "Where is my order?")
    agent = apps(fake, [clients["a1"]])
    fake.send_failure = "lost_answer"  # Resend sends it, and its answer is lost
    assert await delivered(agent[0], fake.received(email)) == 200
    subject = Subject.message(fake.mailbox, email["id"])
    await eventually(lambda: state_is(clients["a1"], subject, SubjectState.IN_DOUBT))
    copy = fake.sent_copy(email["id"])
    other = apps(fake, [clients["b"]])  # email.sent carries the claim stamp in its tags
    assert await delivered(other[0], fake.sent(copy)) == 200
    await settle(agent + other)
    await settled_by_its_copy(clients["a1"], subject, copy["id"], "agent-b")
    assert fake.replies_to(email["id"]) == 1


async def test_a_refused_send_frees_the_message_instead_of_leaving_it_in_doubt(
    clients: dict[str, AsyncCoordinator],
) -> None:
    fake = FakeResend()
    email = fake.receive("eve@example.org", "Is the shop open on Sunday?")
    agent = apps(fake, [clients["a1"]])
    fake.send_failure = "reject"  # 422: nothing went out
    assert await delivered(agent[0], fake.received(email)) == 200
    subject = Subject.message(fake.mailbox, email["id"])
    await eventually(lambda: state_is(clients["a1"], subject, SubjectState.FREE))
    await settle(agent)
    assert fake.replies_to(email["id"]) == 0


async def test_a_wrong_signature_is_refused_and_nothing_is_recorded(clients: dict[str, AsyncCoordinator]) -> None:
    fake = FakeResend()
    email = fake.receive("eve@example.org", "Hello")
    agent = apps(fake, [clients["a1"]])
    body, headers = fake.received(email)
    answer = await post(agent[0], body.replace(b"Hello", b"Hullo"), headers)
    await settle(agent)
    assert answer.status_code == 401
    assert (await clients["a1"].status(Subject.message(fake.mailbox, email["id"]))).state is SubjectState.FREE
    assert sum(fake.calls.values()) == 0
    assert fake.sends == []


async def test_many_emails_each_delivered_three_times_at_once_to_three_workers_get_one_reply_each(
    clients: dict[str, AsyncCoordinator],
) -> None:
    fake = FakeResend()
    workers = apps(fake, [clients["a1"], clients["a2"], clients["b"]])
    emails = [fake.receive(f"c{i}@example.org", f"Order {i}") for i in range(12)]
    posts = [delivered(workers[(i + k) % 3], fake.received(email)) for i, email in enumerate(emails) for k in range(3)]
    assert set(await asyncio.gather(*posts)) == {200}
    await settle(workers)
    assert [fake.replies_to(e["id"]) for e in emails] == [1] * len(emails)
