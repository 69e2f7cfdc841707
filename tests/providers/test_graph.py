"""Microsoft 365 through the provider seam, against a Graph double that follows Graph's documented behaviour
(tests/providers/fake_graph.py), through real coordinators on real etcd: one notification delivered three times to
two workers, two agents of different principals, the agent's own reply coming back from Sent Items, a new mail
arriving as updated, a person answering from Outlook while the agent drafts, the ``missed`` lifecycle event (a
bounded delta resync, run once however many workers hear it), the other lifecycle events, a send left IN_DOUBT
settled by its stamped copy (and, with no copy, left for a person), a customer's mail carrying a forged stamp
(settling nothing, answered), and a wrong clientState. Each guarded scenario
sends one reply per customer message, counted at the double; the same deliveries unguarded send at least two."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from inbox_claims import AsyncClaim, AsyncCoordinator, Subject, SubjectState
from inbox_claims.asgi import WebhookApp, webhook_app
from inbox_claims.providers import MessageFacts
from inbox_claims.providers.graph import GraphProvider
from tests.providers.fake_graph import BASE, FakeGraph
from tests.providers.support import Unguarded, eventually, post, settle, settled_by_its_copy, state_is

pytestmark = pytest.mark.etcd
BODY = "Your order ships today."


def provider(fake: FakeGraph) -> GraphProvider:
    return GraphProvider(
        fake.client_state,
        fake.user,
        token=fake.token,
        api_base=BASE,
        notification_url="https://agent.example/webhook",
        transport=fake,
    )


def apps(fake: FakeGraph, clients: list[AsyncCoordinator], drafting: asyncio.Event | None = None) -> list[WebhookApp]:
    made = []
    for client in clients:
        mail = provider(fake)

        async def answer(message: MessageFacts, claim: AsyncClaim, mail: GraphProvider = mail) -> None:
            if drafting is not None:
                await drafting.wait()
            await claim.send(mail.reply, message, body=BODY)

        made.append(webhook_app(mail, answer, coordinator=client))
    return made


async def unguarded_replies(deliveries: tuple[int, ...], change: str = "created") -> int:
    """The replies the agent without the coordinator sends to one message whose notification goes to ``deliveries``
    (the index of the worker, or of the agent, that gets each delivery)."""
    fake = FakeGraph()
    agents = [Unguarded(provider(fake)) for _ in range(max(deliveries) + 1)]
    message = fake.receive("bea@example.org", "Where is my order?", "conv-u")
    for index in deliveries:
        await agents[index].deliver(fake.notification(message, change))
    return fake.replies_to(message["id"])


async def test_one_notification_delivered_three_times_to_two_workers_gets_one_reply(
    clients: dict[str, AsyncCoordinator],
) -> None:
    fake = FakeGraph()
    message = fake.receive("bea@example.org", "Where is my order?", "conv-1")
    workers = apps(fake, [clients["a1"], clients["a2"]])
    body = fake.notification(message)
    answers = await asyncio.gather(post(workers[0], body), post(workers[1], body), post(workers[0], body))
    assert [a.status_code for a in answers] == [202, 202, 202]
    await settle(workers)
    assert fake.replies_to(message["id"]) == 1
    # The agent's own reply comes back from Sent Items (its subscription): never answered.
    copy = fake.sent_copy(message["id"])
    again = apps(fake, [clients["a2"]])
    assert (await post(again[0], fake.notification(copy))).status_code == 202
    await settle(again)
    assert fake.replies_to(copy["id"]) == 0
    assert fake.replies_to(message["id"]) == 1
    status = await clients["a1"].status(Subject.message(fake.user, message["id"]))
    assert (status.state, status.sent_message_id) == (SubjectState.REPLIED, copy["id"])
    # The reply, made in MIME, says it is automatic (RFC 3834) and keeps the thread's headers and the stamp.
    headers = {h["name"]: h["value"] for h in copy["internetMessageHeaders"]}
    assert headers["Auto-Submitted"] == "auto-replied"
    original = message["internetMessageId"]
    assert (headers["In-Reply-To"], headers["References"]) == (original, original)
    assert (
        headers["X-Inbox-Claim"]
        == f"{Subject.message(fake.user, message['id']).idempotency_key}.{status.fencing_token}"
    )

    assert await unguarded_replies((0, 1, 0)) >= 2


async def test_two_agents_of_different_principals_send_one_reply(clients: dict[str, AsyncCoordinator]) -> None:
    fake = FakeGraph()
    message = fake.receive("carl@example.net", "Refund for order 1042", "conv-2")
    agents = apps(fake, [clients["a1"], clients["b"]])
    body = fake.notification(message)
    answers = await asyncio.gather(post(agents[0], body), post(agents[1], body))
    assert [a.status_code for a in answers] == [202, 202]
    await settle(agents)
    assert fake.replies_to(message["id"]) == 1
    status = await clients["b"].status(Subject.message(fake.user, message["id"]))
    assert status.state is SubjectState.REPLIED
    assert status.holder in ("agent-a", "agent-b")

    assert await unguarded_replies((0, 1)) >= 2


async def test_a_new_mail_arriving_as_updated_and_then_created_gets_one_reply(
    clients: dict[str, AsyncCoordinator],
) -> None:
    fake = FakeGraph()
    message = fake.receive("carl@example.net", "Refund", "conv-3")
    workers = apps(fake, [clients["a1"], clients["a2"]])
    assert (await post(workers[0], fake.notification(message, change="updated"))).status_code == 202
    assert (await post(workers[1], fake.notification(message))).status_code == 202
    await settle(workers)
    assert fake.replies_to(message["id"]) == 1


async def test_a_person_answering_from_outlook_while_the_agent_drafts_stops_its_send(
    clients: dict[str, AsyncCoordinator],
) -> None:
    fake = FakeGraph()
    message = fake.receive("bea@example.org", "Where is my order?", "conv-4")
    drafting = asyncio.Event()
    workers = apps(fake, [clients["a1"], clients["a2"]], drafting)
    assert (await post(workers[0], fake.notification(message))).status_code == 202
    subject = Subject.message(fake.user, message["id"])
    assert (await clients["a1"].status(subject)).state is SubjectState.CLAIMED  # the agent drafts
    person = fake.person_replies(message)
    assert (await post(workers[1], fake.notification(person))).status_code == 202
    status = await clients["a1"].status(subject)
    assert (status.state, status.replied_outside) == (SubjectState.REPLIED, True)
    drafting.set()
    await settle(workers)
    assert [send.by for send in fake.sends] == ["person"]  # the agent's send was refused: nothing went out


async def test_a_missed_lifecycle_event_resyncs_the_last_day_once_and_answers_nothing_twice(
    clients: dict[str, AsyncCoordinator],
) -> None:
    fake = FakeGraph()
    workers = apps(fake, [clients["a1"], clients["a2"]])
    three_days_ago = (datetime.now(UTC) - timedelta(days=3)).strftime("%Y-%m-%dT%H:%M:%SZ")
    ancient = fake.receive("old@example.org", "An old question", "conv-5a", at=three_days_ago)
    answered = fake.receive("bea@example.org", "Where is my order?", "conv-5b")
    assert (await post(workers[0], fake.notification(answered))).status_code == 202
    await eventually(lambda: fake.replies_to(answered["id"]) == 1)
    dropped = fake.receive("dan@example.com", "Invoice please", "conv-5c")  # its notification never comes
    # Graph says it dropped notifications, to both workers at once: one reads the folders, the other leaves it.
    missed = fake.lifecycle("missed")
    answers = await asyncio.gather(post(workers[0], missed), post(workers[1], missed))
    assert [a.status_code for a in answers] == [202, 202]
    await eventually(lambda: fake.replies_to(dropped["id"]) == 1)
    assert fake.calls["delta"] == 2  # one first round per folder (Inbox, Sent Items), by one worker
    inbox = await clients["a1"].get_cursor(fake.user, "graph-delta:inbox")
    assert "deltatoken" in inbox[0]
    assert inbox[1] == 1
    # Missed again later: the delta links read what changed since (the reply's copy, own), nothing twice.
    assert (await post(workers[1], missed)).status_code == 202
    await settle(workers)
    assert fake.calls["delta"] == 4
    assert (await clients["a1"].get_cursor(fake.user, "graph-delta:inbox"))[1] == 2
    replies = (fake.replies_to(answered["id"]), fake.replies_to(dropped["id"]), fake.replies_to(ancient["id"]))
    assert replies == (1, 1, 0)  # the three-day-old message is outside the resync's day


async def test_an_expired_delta_link_starts_a_first_round_again(clients: dict[str, AsyncCoordinator]) -> None:
    fake = FakeGraph()
    agent = apps(fake, [clients["a1"]])
    assert (await post(agent[0], fake.lifecycle("missed"))).status_code == 202  # the links are made
    message = fake.receive("eve@example.org", "Is the shop open on Sunday?", "conv-6")
    fake.forget_delta_tokens()  # Graph answers the links 410 from now
    assert (await post(agent[0], fake.lifecycle("missed"))).status_code == 202
    await settle(agent)
    assert fake.replies_to(message["id"]) == 1


async def test_reauthorization_renews_a_removed_subscription_is_made_again_and_a_mailbox_subscribes(
    clients: dict[str, AsyncCoordinator],
) -> None:
    fake = FakeGraph()
    agent = apps(fake, [clients["a1"]])
    assert (await post(agent[0], fake.lifecycle("reauthorizationRequired", "sub-inbox"))).status_code == 202
    assert fake.calls["subscriptions.update"] == 1
    assert "expirationDateTime" in fake.subscriptions["sub-inbox"]
    assert (await post(agent[0], fake.lifecycle("subscriptionRemoved", "sub-inbox"))).status_code == 202
    await settle(agent)
    (made,) = [s for name, s in fake.subscriptions.items() if name != "sub-inbox"]
    assert (made["clientState"], made["changeType"]) == (fake.client_state, "created,updated")
    assert made["resource"] == f"users/{fake.user}/mailFolders('inbox')/messages"
    ids = await provider(fake).create_subscriptions()  # a new mailbox's two: its Inbox and its Sent Items
    assert [fake.subscriptions[i]["resource"].rsplit("'", 2)[1] for i in ids] == ["inbox", "sentitems"]
    assert all(fake.subscriptions[i]["lifecycleNotificationUrl"] == "https://agent.example/webhook" for i in ids)


async def test_a_send_left_in_doubt_settles_itself_when_its_stamped_copy_is_seen(
    clients: dict[str, AsyncCoordinator],
) -> None:
    fake = FakeGraph()
    message = fake.receive("bea@example.org", "Where is my order?", "conv-7")
    agent = apps(fake, [clients["a1"]])
    fake.send_failure = "lost_answer"  # Graph sends it, and its answer is lost: the agent cannot know
    assert (await post(agent[0], fake.notification(message))).status_code == 202
    subject = Subject.message(fake.user, message["id"])
    await eventually(lambda: state_is(clients["a1"], subject, SubjectState.IN_DOUBT))
    copy = fake.sent_copy(message["id"])
    other = apps(fake, [clients["b"]])  # another agent hears of the copy in Sent Items: it carries the stamp
    assert (await post(other[0], fake.notification(copy))).status_code == 202
    await settle(agent + other)
    await settled_by_its_copy(clients["a1"], subject, copy["id"], "agent-b")
    assert fake.replies_to(message["id"]) == 1


async def test_a_send_left_in_doubt_with_no_copy_stays_for_a_person(clients: dict[str, AsyncCoordinator]) -> None:
    fake = FakeGraph()
    message = fake.receive("bea@example.org", "Where is my order?", "conv-8")
    agent = apps(fake, [clients["a1"]])
    fake.send_failure = "unavailable"  # 503: the draft was not sent, and the agent cannot know that either
    assert (await post(agent[0], fake.notification(message))).status_code == 202
    subject = Subject.message(fake.user, message["id"])
    await eventually(lambda: state_is(clients["a1"], subject, SubjectState.IN_DOUBT))
    other = apps(fake, [clients["b"]])
    assert (await post(other[0], fake.lifecycle("missed"))).status_code == 202  # Sent Items read: no copy there
    await settle(agent + other)
    status = await clients["a1"].status(subject)
    assert (status.state, status.settled_by) == (SubjectState.IN_DOUBT, "")
    assert fake.replies_to(message["id"]) == 0


async def test_a_customers_mail_carrying_a_forged_stamp_settles_nothing_and_is_answered(
    clients: dict[str, AsyncCoordinator],
) -> None:
    fake = FakeGraph()
    message = fake.receive("bea@example.org", "Where is my order?", "conv-10")
    agent = apps(fake, [clients["a1"]])
    fake.send_failure = "unavailable"  # nothing went out: the send is left IN_DOUBT
    assert (await post(agent[0], fake.notification(message))).status_code == 202
    subject = Subject.message(fake.user, message["id"])
    await eventually(lambda: state_is(clients["a1"], subject, SubjectState.IN_DOUBT))
    in_doubt = await clients["a1"].status(subject)
    # The customer writes again in the thread, with the in-doubt send's stamp in a header of their own making.
    forged = fake.receive("bea@example.org", "RE: Where is my order?", "conv-10")
    stamp = f"{subject.idempotency_key}.{in_doubt.fencing_token}"
    forged["internetMessageHeaders"].append({"name": "X-Inbox-Claim", "value": stamp})
    other = apps(fake, [clients["b"]])
    assert (await post(other[0], fake.notification(forged))).status_code == 202
    await settle(agent + other)
    assert (await clients["a1"].status(subject)).state is SubjectState.IN_DOUBT  # still for a person to check
    assert fake.replies_to(forged["id"]) == 1  # an incoming message like any other: answered


async def test_a_wrong_client_state_is_refused_and_nothing_is_recorded(clients: dict[str, AsyncCoordinator]) -> None:
    fake = FakeGraph()
    message = fake.receive("eve@example.org", "Hello", "conv-9")
    agent = apps(fake, [clients["a1"]])
    answer = await post(agent[0], fake.notification(message, state="guessed"))
    await settle(agent)
    assert answer.status_code == 401
    assert "clientState" in answer.text
    status = await clients["a1"].status(Subject.message(fake.user, message["id"]))
    assert status.state is SubjectState.FREE
    assert sum(fake.calls.values()) == 0  # nothing read
    assert fake.sends == []
