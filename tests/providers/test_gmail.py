"""Gmail through the provider seam, against a Gmail API and Pub/Sub push double that follows their documented
behaviour (tests/providers/fake_gmail.py), through real coordinators on real etcd: one push delivered three times
to two workers, two agents of different principals, a person answering from the Gmail UI while the agent drafts,
the agent's own reply coming back in the history, a dropped push found by the periodic history check (ASGI and
WSGI), a mailbox's first push and a history id too old (bounded resyncs), the Gmail API failing mid-range (503, the
range given back at once), a send left IN_DOUBT settled by its stamped copy (and, with no copy, left for a
person), and bad pushes (forged, expired, another audience, another mailbox, a mailbox the principal is not
granted) refused with nothing recorded. Each guarded scenario sends one reply per customer message, counted at the
double; the same deliveries to the agent without the coordinator send at least two."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from coordinator.api.auth import TokenAuthenticator
from coordinator.ops.server import CoordinatorServer
from inbox_claims import AsyncClaim, AsyncCoordinator, Claim, Coordinator, Subject, SubjectState
from inbox_claims.asgi import WebhookApp, webhook_app
from inbox_claims.providers import MessageFacts
from inbox_claims.providers.gmail import CURSOR, GmailProvider
from inbox_claims.wsgi import webhook_wsgi
from tests.conftest import StartCoordinator
from tests.providers.fake_gmail import FakeGmail
from tests.providers.support import (
    Unguarded,
    eventually,
    gmail_provider,
    post,
    settle,
    settled_by_its_copy,
    state_is,
    token_file,
)

pytestmark = pytest.mark.etcd
BODY = "Your order ships today."


def provider(fake: FakeGmail, *, check_every: float = 0) -> GmailProvider:
    return gmail_provider(fake, check_every=check_every)


def apps(
    fake: FakeGmail,
    clients: list[AsyncCoordinator],
    *,
    drafting: asyncio.Event | None = None,
    check_every: float = 0,
) -> list[WebhookApp]:
    made = []
    for client in clients:
        mail = provider(fake, check_every=check_every)

        async def answer(message: MessageFacts, claim: AsyncClaim, mail: GmailProvider = mail) -> None:
            if drafting is not None:
                await drafting.wait()
            await claim.send(mail.reply, message, body=BODY)

        made.append(webhook_app(mail, answer, coordinator=client))
    return made


async def push(app: WebhookApp, fake: FakeGmail, history_id: int | None = None, **token: Any) -> int:
    headers, body = fake.push(history_id, **token)
    return (await post(app, body, headers)).status_code


async def unguarded_push(agent: Unguarded, fake: FakeGmail) -> None:
    headers, body = fake.push()
    await agent.deliver(body, headers)


async def unguarded_replies(deliveries: tuple[int, ...]) -> int:
    """The replies the agent without the coordinator sends to one message whose push goes to ``deliveries`` (the
    index of the worker, or of the agent, that gets each delivery)."""
    fake = FakeGmail()
    agents = [Unguarded(provider(fake)) for _ in range(max(deliveries) + 1)]
    for agent in agents:
        await unguarded_push(agent, fake)  # each starts from the mailbox as it is
    message = fake.receive("bea@example.org", "Where is my order?")
    headers, body = fake.push()
    for index in deliveries:
        await agents[index].deliver(body, headers)
    return fake.replies_to(message["id"])


async def primed(fake: FakeGmail, app: WebhookApp) -> None:
    """The mailbox's first push: the cursor starts at its current history id (a resync of an empty mailbox)."""
    assert await push(app, fake) == 200


async def cursor(client: AsyncCoordinator, fake: FakeGmail) -> tuple[str, int]:
    return await client.get_cursor(fake.address, CURSOR)


async def test_one_push_delivered_three_times_to_two_workers_gets_one_reply(
    clients: dict[str, AsyncCoordinator],
) -> None:
    fake = FakeGmail()
    workers = apps(fake, [clients["a1"], clients["a2"]])
    await primed(fake, workers[0])
    message = fake.receive("Bea Costa <bea@example.org>", "Where is my order?")
    headers, body = fake.push()
    answers = await asyncio.gather(*(post(app, body, headers) for app in (workers[0], workers[1], workers[0])))
    assert [a.status_code for a in answers] == [200, 200, 200]
    await settle(workers)
    assert fake.replies_to(message["id"]) == 1
    copy = fake.sent_copy(message["id"])
    reply = fake.parsed(copy["id"])
    assert copy["threadId"] == message["threadId"]  # in the customer's thread, as Gmail documents threading
    assert reply["In-Reply-To"] == fake.parsed(message["id"])["Message-ID"]
    assert reply["Auto-Submitted"] == "auto-replied"  # an agent's reply says it is automatic (RFC 3834)
    status = await clients["a1"].status(Subject.message(fake.address, message["id"]))
    assert (status.state, status.sent_message_id) == (SubjectState.REPLIED, copy["id"])

    # The copy of the agent's reply comes back in the history (SENT): never answered.
    again = apps(fake, [clients["a2"]])
    assert await push(again[0], fake) == 200
    await settle(again)
    assert fake.replies_to(copy["id"]) == 0
    assert [sent.in_reply_to for sent in fake.sends] == [message["id"]]
    assert (await cursor(clients["a1"], fake))[1] == fake.history_id  # everything recorded, the cursor at the end

    assert await unguarded_replies(deliveries=(0, 1, 0)) >= 2


async def test_two_agents_of_different_principals_send_one_reply(clients: dict[str, AsyncCoordinator]) -> None:
    fake = FakeGmail()
    agents = apps(fake, [clients["a1"], clients["b"]])
    await primed(fake, agents[0])
    message = fake.receive("carl@example.net", "Refund for order 1042")
    headers, body = fake.push()
    answers = await asyncio.gather(post(agents[0], body, headers), post(agents[1], body, headers))
    assert [a.status_code for a in answers] == [200, 200]
    await settle(agents)
    assert fake.replies_to(message["id"]) == 1
    status = await clients["b"].status(Subject.message(fake.address, message["id"]))
    assert status.state is SubjectState.REPLIED
    assert status.holder in ("agent-a", "agent-b")

    assert await unguarded_replies(deliveries=(0, 1)) >= 2


async def test_a_person_answering_from_the_gmail_ui_while_the_agent_drafts_stops_its_send(
    clients: dict[str, AsyncCoordinator],
) -> None:
    fake = FakeGmail()
    drafting = asyncio.Event()
    workers = apps(fake, [clients["a1"], clients["a2"]], drafting=drafting)
    await primed(fake, workers[0])
    message = fake.receive("bea@example.org", "Where is my order?")
    assert await push(workers[0], fake) == 200
    subject = Subject.message(fake.address, message["id"])
    assert (await clients["a1"].status(subject)).state is SubjectState.CLAIMED  # the agent drafts
    fake.person_replies(message)
    assert await push(workers[1], fake) == 200  # the person's reply, in SENT, reported: the claim ends
    status = await clients["a1"].status(subject)
    assert (status.state, status.replied_outside) == (SubjectState.REPLIED, True)
    drafting.set()
    await settle(workers)
    assert [sent.by for sent in fake.sends] == ["person"]  # the agent's send was refused: nothing went out

    baseline = FakeGmail()
    naive = Unguarded(provider(baseline))
    await unguarded_push(naive, baseline)
    again = baseline.receive("bea@example.org", "Where is my order?")
    baseline.person_replies(again)
    await unguarded_push(naive, baseline)
    assert baseline.replies_to(again["id"]) + baseline.replies_to(again["id"], by="person") >= 2


async def test_a_dropped_push_is_found_by_the_periodic_history_check_and_answered_once(
    clients: dict[str, AsyncCoordinator],
) -> None:
    fake = FakeGmail()
    workers = apps(fake, [clients["a1"], clients["a2"]], check_every=0.2)
    assert all(not app.periodic_running for app in workers)
    await primed(fake, workers[0])
    await primed(fake, workers[1])  # each worker's check runs from its first request (no lifespan here)
    assert all(app.periodic_running for app in workers)
    first = fake.receive("bea@example.org", "Where is my order?")
    assert await push(workers[0], fake) == 200
    dropped = fake.receive("dan@example.com", "Invoice please")
    late_push = fake.push()  # Pub/Sub drops it: no worker hears of this message from a push
    await eventually(lambda: fake.replies_to(dropped["id"]) == 1)
    assert (await post(workers[1], late_push[1], late_push[0])).status_code == 200  # arrives late: covered
    checks = fake.calls["history.list"]
    await eventually(lambda: fake.calls["history.list"] >= checks + 4)  # the checks go on, finding nothing new
    await settle(workers)
    assert all(not app.periodic_running for app in workers)
    assert (fake.replies_to(first["id"]), fake.replies_to(dropped["id"])) == (1, 1)
    assert len(fake.sends) == 2


async def test_a_history_id_too_old_resyncs_the_last_day_only_and_answers_nothing_twice(
    clients: dict[str, AsyncCoordinator],
) -> None:
    now = [time.time()]
    fake = FakeGmail(clock=lambda: now[0])
    workers = apps(fake, [clients["a1"], clients["a2"]])
    await primed(fake, workers[0])
    answered = fake.receive("bea@example.org", "Where is my order?")
    assert await push(workers[0], fake) == 200
    await eventually(lambda: fake.replies_to(answered["id"]) == 1)
    now[0] -= 3 * 86400
    ancient = fake.receive("old@example.org", "An old question, dropped long ago")  # dated three days back
    now[0] += 3 * 86400
    fake.expire_history()  # the cursor's history id is gone: history.list answers 404
    fresh = fake.receive("eve@example.org", "Is the shop open on Sunday?")
    assert await push(workers[1], fake) == 200
    await settle(workers)
    assert fake.calls["messages.list"] == 2  # the resync: the first push's, and this one
    assert (fake.replies_to(answered["id"]), fake.replies_to(fresh["id"])) == (1, 1)
    assert fake.replies_to(ancient["id"]) == 0  # older than the resync's day
    value, position = await cursor(clients["a1"], fake)
    assert position >= int(fresh["historyId"])
    assert value == str(position)

    # The cursor is good again: the next message comes through the history, with no resync.
    later = fake.receive("fay@example.org", "Thanks!")
    more = apps(fake, [clients["a1"]])
    assert await push(more[0], fake) == 200
    await settle(more)
    assert fake.calls["messages.list"] == 2
    assert fake.replies_to(later["id"]) == 1


async def test_the_gmail_api_failing_mid_range_is_answered_503_and_the_range_given_back(
    clients: dict[str, AsyncCoordinator],
) -> None:
    fake = FakeGmail()
    workers = apps(fake, [clients["a1"], clients["a2"]])
    await primed(fake, workers[0])
    before = await cursor(clients["a1"], fake)
    asked = [fake.receive("bea@example.org", "Where is my order?"), fake.receive("carl@example.net", "Refund")]
    fake.failing["messages.get"] = 1  # Gmail answers 503 to one read of the range
    headers, body = fake.push()
    pushed = fake.history_id
    assert (await post(workers[0], body, headers)).status_code == 503  # Pub/Sub delivers it again
    assert await cursor(clients["a1"], fake) == before  # nothing recorded, the cursor unmoved
    # The redelivery reaches the other worker: the range was given back (it is not left to its 60 s lease).
    assert (await post(workers[1], body, headers)).status_code == 200
    await settle(workers)
    assert [fake.replies_to(message["id"]) for message in asked] == [1, 1]
    assert (await cursor(clients["a1"], fake))[1] >= pushed


async def test_a_mailboxs_first_push_answers_the_last_days_unanswered_messages_only(
    clients: dict[str, AsyncCoordinator],
) -> None:
    fake = FakeGmail()
    answered_by_ana = fake.receive("bea@example.org", "Where is my order?")
    fake.person_replies(answered_by_ana)  # answered from the Gmail UI before the agent was there
    waiting = fake.receive("carl@example.net", "Refund for order 1042")
    agent = apps(fake, [clients["a1"]])
    assert await push(agent[0], fake) == 200  # no cursor yet: the first push is a resync of the last day
    await settle(agent)
    assert fake.calls["messages.list"] == 1
    assert (fake.replies_to(answered_by_ana["id"]), fake.replies_to(waiting["id"])) == (0, 1)
    status = await clients["a1"].status(Subject.message(fake.address, answered_by_ana["id"]))
    assert (status.state, status.replied_outside) == (SubjectState.REPLIED, True)


async def test_a_send_left_in_doubt_settles_itself_when_its_stamped_copy_is_seen(
    clients: dict[str, AsyncCoordinator],
) -> None:
    fake = FakeGmail()
    agent = apps(fake, [clients["a1"]])
    await primed(fake, agent[0])
    message = fake.receive("bea@example.org", "Where is my order?")
    fake.send_failure = "lost_answer"  # Gmail sends it, and its answer is lost: the agent cannot know
    assert await push(agent[0], fake) == 200
    subject = Subject.message(fake.address, message["id"])
    await eventually(lambda: state_is(clients["a1"], subject, SubjectState.IN_DOUBT))
    copy = fake.sent_copy(message["id"])
    # Another agent's push reads the history: the SENT copy carries the claim's stamp. No person needed.
    other = apps(fake, [clients["b"]])
    assert await push(other[0], fake) == 200
    await settle(agent + other)
    await settled_by_its_copy(clients["a1"], subject, copy["id"], "agent-b")
    assert fake.replies_to(message["id"]) == 1


async def test_a_send_left_in_doubt_with_no_copy_stays_for_a_person(clients: dict[str, AsyncCoordinator]) -> None:
    fake = FakeGmail()
    agent = apps(fake, [clients["a1"]])
    await primed(fake, agent[0])
    message = fake.receive("bea@example.org", "Where is my order?")
    fake.send_failure = "unavailable"  # 503: nothing went out, and the agent cannot know that either
    assert await push(agent[0], fake) == 200
    subject = Subject.message(fake.address, message["id"])
    await eventually(lambda: state_is(clients["a1"], subject, SubjectState.IN_DOUBT))
    fake.receive("carl@example.net", "Another question")  # the history moves on, with no copy of the send
    other = apps(fake, [clients["b"]])
    assert await push(other[0], fake) == 200
    await settle(agent + other)
    status = await clients["a1"].status(subject)
    assert (status.state, status.settled_by) == (SubjectState.IN_DOUBT, "")
    assert fake.replies_to(message["id"]) == 0


@pytest.mark.parametrize(
    ("token", "why"),
    [
        ({"signer": "forger"}, "Signature verification failed"),
        ({"expires_in": -1}, "expired"),
        ({"audience": "https://someone-else.example/push"}, "audience"),
        ({"issuer": "https://evil.example"}, "issuer"),
    ],
    ids=["forged", "expired", "foreign-audience", "foreign-issuer"],
)
async def test_a_bad_token_is_refused_401_and_nothing_is_recorded(
    clients: dict[str, AsyncCoordinator], token: Mapping[str, Any], why: str
) -> None:
    fake = FakeGmail()
    agent = apps(fake, [clients["a1"]])
    message = fake.receive("eve@example.org", "Hello")
    headers, body = fake.push(**token)
    answer = await post(agent[0], body, headers)
    await settle(agent)
    assert answer.status_code == 401
    assert why.lower() in answer.text.lower()
    assert await cursor(clients["a1"], fake) == ("", 0)  # nothing taken, nothing moved
    assert (await clients["a1"].status(Subject.message(fake.address, message["id"]))).state is SubjectState.FREE
    assert fake.calls["history.list"] + fake.calls["messages.get"] + fake.calls["messages.list"] == 0
    assert fake.sends == []


async def test_a_push_for_another_mailbox_is_refused_403(clients: dict[str, AsyncCoordinator]) -> None:
    fake = FakeGmail()
    agent = apps(fake, [clients["a1"]])
    fake.receive("eve@example.org", "Hello")
    headers, body = fake.push(email_address="sales@shop.example")
    answer = await post(agent[0], body, headers)
    await settle(agent)
    assert answer.status_code == 403
    assert "sales@shop.example" in answer.text
    assert await cursor(clients["a1"], fake) == ("", 0)
    assert fake.calls["history.list"] + fake.calls["messages.list"] == 0


async def test_a_push_for_a_mailbox_the_principal_is_not_granted_is_refused_403_nothing_recorded(
    start_coordinator: StartCoordinator, tmp_path: Path
) -> None:
    fake = FakeGmail()
    path = tmp_path / "tokens.toml"
    tokens = token_file(path, {"agent-a": ("agent", ["sales@shop.example"], []), "ana": ("human", ["*"], [])})
    secured = await start_coordinator(authenticator=TokenAuthenticator(path))
    async with (
        AsyncCoordinator(secured.address, token=tokens["agent-a"]) as agent,
        AsyncCoordinator(secured.address, token=tokens["ana"]) as person,
    ):
        app = apps(fake, [agent])
        message = fake.receive("eve@example.org", "Hello")
        headers, body = fake.push()
        answer = await post(app[0], body, headers)
        await settle(app)
        assert answer.status_code == 403
        assert f"not granted mailbox '{fake.address}'" in answer.text
        assert await person.get_cursor(fake.address, CURSOR) == ("", 0)
        assert (await person.status(Subject.message(fake.address, message["id"]))).state is SubjectState.FREE
        assert fake.calls["history.list"] + fake.calls["messages.list"] == 0
        assert fake.sends == []


async def test_the_wsgi_adapter_runs_the_periodic_history_check_too(server: CoordinatorServer) -> None:
    fake = FakeGmail()

    def blocking_agent() -> tuple[int, int, bool]:
        with Coordinator(server.address, principal="agent-w") as coordinator:
            mail = gmail_provider(fake, check_every=0.2, transport=fake.blocking())

            def answer(message: MessageFacts, claim: Claim) -> None:
                claim.send(mail.reply, message, body=BODY)

            app = webhook_wsgi(mail, answer, coordinator=coordinator)
            headers, body = fake.push()
            with httpx.Client(transport=httpx.WSGITransport(app=app), base_url="http://agent") as http:
                first = http.post("/webhook", content=body, headers=headers).status_code  # starts the check
            dropped = fake.receive("dan@example.com", "Invoice please")  # no push for it, ever
            deadline = time.monotonic() + 15
            while fake.replies_to(dropped["id"]) == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            app.close(grace=10)
            return first, fake.replies_to(dropped["id"]), app.running == 0

    assert await asyncio.to_thread(blocking_agent) == (200, 1, True)
