"""Our MCP server's tools against a real coordinator and etcd, through the SDK's own client in memory, with a fake
Nylas send endpoint that counts sends: at most one reply per message, whatever the agent sessions do."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from coordinator.ops.server import CoordinatorServer
from examples.agent.fake_nylas import FakeNylas
from inbox_claims import AsyncCoordinator, ClaimLost, Subject, SubjectState
from inbox_claims.mcp import _answers as answers
from inbox_claims.types import LossReason
from tests.conftest import StartCoordinator
from tests.mcp.support import agent_session, reply_arguments, text


@pytest.fixture
async def server(start_coordinator: StartCoordinator) -> CoordinatorServer:
    return await start_coordinator(send_timeout_ms=500, sweep_interval_s=0.1)


async def status_of(address: str, subject: Subject) -> SubjectState:
    async with AsyncCoordinator(address, principal="observer") as coord:
        return (await coord.status(subject)).state


def answer(result: Any) -> dict[str, Any]:
    assert result.structured_content is not None, result
    return dict(result.structured_content)


async def test_the_tools_are_listed_with_schemas_annotations_and_output_schemas(
    server: CoordinatorServer, fake: FakeNylas
) -> None:
    async with agent_session(server.address, "agent-a", api_base=fake.api_base) as (client, _):
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}

    assert set(tools) == {"claim_message", "send_reply", "mark_replied", "release_message", "who_is_answering"}
    send = tools["send_reply"]
    assert set(send.input_schema["required"]) == {"mailbox", "message_id", "to", "subject", "body"}
    assert send.output_schema is not None
    assert "outcome" in send.output_schema["properties"]
    assert send.annotations is not None
    assert (send.annotations.read_only_hint, send.annotations.destructive_hint) == (False, False)
    assert (send.annotations.idempotent_hint, send.annotations.open_world_hint) == (True, True)
    who = tools["who_is_answering"].annotations
    assert who is not None
    assert who.read_only_hint is True
    claim = tools["claim_message"].annotations
    assert claim is not None
    assert (claim.idempotent_hint, claim.open_world_hint) == (True, False)


async def test_without_a_mail_service_send_reply_is_not_offered(server: CoordinatorServer) -> None:
    async with agent_session(server.address, "agent-a") as (client, _):
        names = {tool.name for tool in (await client.list_tools()).tools}
        refused = await client.call_tool("send_reply", reply_arguments("grant-x", "m-1"))

    assert "send_reply" not in names
    assert refused.is_error
    assert "Unknown tool 'send_reply'" in text(refused)


@pytest.mark.parametrize("same_principal", [False, True], ids=["two-agents", "one-agent-two-sessions"])
async def test_two_sessions_racing_send_reply_send_one_reply_per_message(
    server: CoordinatorServer, fake: FakeNylas, mailbox: str, same_principal: bool
) -> None:
    messages = [f"msg-{n}" for n in range(8)]
    second = "agent-a" if same_principal else "agent-b"
    async with (
        agent_session(server.address, "agent-a", api_base=fake.api_base) as (first_client, _),
        agent_session(server.address, second, api_base=fake.api_base) as (second_client, _),
    ):
        results = await asyncio.gather(
            *(
                client.call_tool("send_reply", reply_arguments(mailbox, message, body=f"from {name}"))
                for message in messages
                for client, name in ((first_client, "first"), (second_client, "second"))
            )
        )

    for message in messages:
        assert len(fake.sends_for(message)) == 1, message
    by_message: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        by_message.setdefault(answer(result)["subject_id"], []).append(answer(result))
    for message, pair in by_message.items():
        outcomes = sorted(a["outcome"] for a in pair)
        assert outcomes in (["held", "sent"], ["already_replied", "sent"]), (message, pair)
        refused = next(a for a in pair if a["outcome"] != "sent")
        assert refused["may_reply"] is False
        assert "do not reply" in refused["message"]
        if same_principal:
            assert "another session of agent-a (this agent)" in refused["message"]
        assert await status_of(server.address, Subject.message(mailbox, message)) is SubjectState.REPLIED
    assert fake.problems == []


async def test_a_repeated_send_reply_answers_the_first_result_and_sends_nothing(
    server: CoordinatorServer, fake: FakeNylas, mailbox: str
) -> None:
    arguments = reply_arguments(mailbox, "msg-retry")
    async with agent_session(server.address, "agent-a", api_base=fake.api_base) as (client, _):
        first = await client.call_tool("send_reply", arguments)
        again = await client.call_tool("send_reply", arguments)
        other = await client.call_tool("send_reply", {**arguments, "body": "A second thought."})
    # A restarted server (a new session, nothing in memory of the first) answers from the coordinator's state.
    async with agent_session(server.address, "agent-a", api_base=fake.api_base) as (client, _):
        after_restart = await client.call_tool("send_reply", arguments)

    assert len(fake.sends) == 1
    assert answer(first)["outcome"] == "sent"
    assert answer(first)["sent_message_id"] == "sent-1"
    assert not first.is_error
    assert answer(again) == answer(first)
    assert answer(after_restart) == answer(first)
    assert other.is_error
    assert answer(other)["outcome"] == "already_replied"
    assert "this other reply was not sent" in answer(other)["message"]


async def test_a_persons_takeover_while_the_model_drafts_refuses_the_send_with_the_reason(
    server: CoordinatorServer, fake: FakeNylas, mailbox: str
) -> None:
    subject = Subject.message(mailbox, "msg-vip")
    async with (
        agent_session(server.address, "agent-a", api_base=fake.api_base) as (client, _),
        AsyncCoordinator(server.address, principal="ana@example.com", kind="human") as person,
    ):
        claimed = await client.call_tool("claim_message", {"mailbox": mailbox, "message_id": subject.id})
        assert answer(claimed)["outcome"] == "granted"
        assert answer(claimed)["may_reply"] is True
        taken = await person.takeover(subject, note="VIP, I will answer")
        assert taken.holds
        refused = await client.call_tool("send_reply", reply_arguments(mailbox, subject.id))
        then = await client.call_tool("claim_message", {"mailbox": mailbox, "message_id": subject.id})

    assert refused.is_error
    assert answer(refused)["outcome"] == "lost"
    assert answer(refused)["holder"] == "ana@example.com"
    assert answer(refused)["holder_kind"] == "person"
    assert "ana@example.com (a person) took this message over" in answer(refused)["message"]
    assert "do not reply" in answer(refused)["message"]
    assert answer(then)["outcome"] == "held"
    assert "ana@example.com (a person)" in answer(then)["message"]
    assert fake.sends == []


async def test_a_person_answering_from_the_mailbox_while_the_model_drafts_stops_its_send(
    server: CoordinatorServer, fake: FakeNylas, mailbox: str
) -> None:
    """Replies written outside our tools reach MCP agents too: a claim made with the email's thread and arrival
    time is ended by a person's reply from Gmail in that thread, and the model is told not to reply."""
    asked = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=5)
    where = {"mailbox": mailbox, "message_id": "msg-late", "thread_id": "thr-7", "received_at": asked.isoformat()}
    async with (
        agent_session(server.address, "agent-a", api_base=fake.api_base) as (client, _),
        AsyncCoordinator(server.address, principal="helpdesk-relay") as relay,
    ):
        claimed = await client.call_tool("claim_message", where)
        assert answer(claimed)["outcome"] == "granted"
        answered_at = asked + timedelta(minutes=3)
        await relay.record_outgoing(mailbox, "gmail-9", "thr-7", answered_at, sender="ana@shop.example")
        refused = await client.call_tool("send_reply", {**reply_arguments(mailbox, "msg-late"), **where})
        then = await client.call_tool("claim_message", where)

    assert refused.is_error
    assert answer(refused)["outcome"] == "lost"
    assert answer(refused)["message"].startswith("Not sent: ana@shop.example already answered this email from the")
    assert answer(refused)["message"].endswith("do not reply.")
    assert answer(then)["outcome"] == "already_replied"
    assert answer(then)["message"].startswith("Already answered from the mailbox by ana@shop.example at ")
    # The sender is only what the message says: the principal that reported it is named beside it.
    assert "its From line says, recorded by helpdesk-relay" in answer(refused)["message"]
    assert "its From line says, recorded by helpdesk-relay" in answer(then)["message"]
    assert fake.sends == []


def test_every_way_to_lose_a_claim_is_told_in_its_own_words() -> None:
    subject = Subject.message("grant-1", "m-1")
    said = {answers.lost(ClaimLost(subject, 7, reason, None), "agent-a").message for reason in LossReason}
    assert len(said) == len(LossReason)
    assert not [message for message in said if "(it ended)" in message]


async def test_claim_message_answers_in_words_a_model_acts_on(
    server: CoordinatorServer, fake: FakeNylas, mailbox: str
) -> None:
    held_by_person = Subject.message(mailbox, "msg-person")
    async with (
        agent_session(server.address, "agent-a", api_base=fake.api_base) as (client, _),
        agent_session(server.address, "agent-b", api_base=fake.api_base) as (other, _),
        AsyncCoordinator(server.address, principal="ana@example.com", kind="human") as person,
    ):
        granted = await client.call_tool(
            "claim_message",
            {"mailbox": mailbox, "message_id": "msg-1", "summary": {"subject_line": "Order 42", "sender": "Bea"}},
        )
        again = await client.call_tool("claim_message", {"mailbox": mailbox, "message_id": "msg-1"})
        held = await other.call_tool("claim_message", {"mailbox": mailbox, "message_id": "msg-1"})
        assert (await person.claim(held_by_person, ttl=60)).granted
        by_person = await client.call_tool("claim_message", {"mailbox": mailbox, "message_id": held_by_person.id})
        await other.call_tool("send_reply", reply_arguments(mailbox, "msg-2"))
        answered = await client.call_tool("claim_message", {"mailbox": mailbox, "message_id": "msg-2"})
        who = await other.call_tool("who_is_answering", {"mailbox": mailbox})

    assert text(granted).startswith("Granted until ")
    assert answer(granted)["until"]
    assert answer(granted)["may_reply"] is True
    assert answer(again)["outcome"] == "granted"
    assert answer(again)["message"].startswith("You already hold")
    assert answer(held)["outcome"] == "held"
    assert not held.is_error
    assert answer(held)["message"].startswith("Being answered by agent-a (an agent) until ")
    assert answer(held)["message"].endswith("do not reply.")
    assert answer(by_person)["message"].startswith("Being answered by ana@example.com (a person) until ")
    assert answer(answered)["outcome"] == "already_replied"
    assert answer(answered)["message"].startswith("Already answered by agent-b (an agent) at ")
    assert answer(answered)["message"].endswith("do not reply.")
    live = {claim["subject_id"]: claim for claim in answer(who)["claims"]}
    assert set(live) == {"msg-1", held_by_person.id}
    assert live["msg-1"]["subject_line"] == "Order 42"
    assert live["msg-1"]["holder"] == "agent-a"
    assert live[held_by_person.id]["holder_kind"] == "person"


async def test_bad_arguments_are_a_tool_error_that_names_the_field_and_nothing_is_sent(
    server: CoordinatorServer, fake: FakeNylas, mailbox: str
) -> None:
    good = reply_arguments(mailbox, "msg-bad")
    async with agent_session(server.address, "agent-a", api_base=fake.api_base) as (client, _):
        no_body = await client.call_tool("send_reply", {key: v for key, v in good.items() if key != "body"})
        bad_address = await client.call_tool("send_reply", {**good, "to": [{"email": "not an address"}]})
        unknown = await client.call_tool("send_reply", {**good, "attachments": []})
        too_long = await client.call_tool("claim_message", {"mailbox": "m" * 321, "message_id": "x"})

    for result, field in ((no_body, "body"), (bad_address, "to.0.email"), (unknown, "attachments")):
        assert result.is_error
        assert f"{field}: " in text(result), result
    assert too_long.is_error
    assert "mailbox: " in text(too_long)
    assert fake.requests == []
    assert await status_of(server.address, Subject.message(mailbox, "msg-bad")) is SubjectState.FREE


async def test_a_refused_send_frees_the_message_and_an_unknown_outcome_is_in_doubt(
    server: CoordinatorServer, fake: FakeNylas, mailbox: str
) -> None:
    async with agent_session(server.address, "agent-a", api_base=fake.api_base) as (client, _):
        fake.behaviour = "reject"
        rejected = await client.call_tool("send_reply", reply_arguments(mailbox, "msg-422"))
        fake.behaviour = "unavailable"
        unknown = await client.call_tool("send_reply", reply_arguments(mailbox, "msg-503"))
        fake.behaviour = "send"
        repeat = await client.call_tool("send_reply", reply_arguments(mailbox, "msg-503"))

    assert rejected.is_error
    assert answer(rejected)["outcome"] == "not_sent"
    assert "HTTP 422" in answer(rejected)["detail"]
    assert await status_of(server.address, Subject.message(mailbox, "msg-422")) is SubjectState.FREE
    assert unknown.is_error
    assert answer(unknown)["outcome"] == "in_doubt"
    assert "may have gone out. Do not send it again" in answer(unknown)["message"]
    assert answer(repeat) == answer(unknown)
    assert fake.sends == []
    assert await status_of(server.address, Subject.message(mailbox, "msg-503")) in (
        SubjectState.SENDING,
        SubjectState.IN_DOUBT,
    )


async def test_mark_replied_and_release_message(server: CoordinatorServer, fake: FakeNylas, mailbox: str) -> None:
    async with (
        agent_session(server.address, "agent-a", api_base=fake.api_base) as (client, _),
        agent_session(server.address, "agent-b", api_base=fake.api_base) as (other, _),
    ):
        marked = await client.call_tool(
            "mark_replied", {"mailbox": mailbox, "message_id": "msg-phone", "note": "called the customer"}
        )
        blocked = await other.call_tool("send_reply", reply_arguments(mailbox, "msg-phone"))
        await client.call_tool("claim_message", {"mailbox": mailbox, "message_id": "msg-skip"})
        released = await client.call_tool("release_message", {"mailbox": mailbox, "message_id": "msg-skip"})
        nothing = await client.call_tool("release_message", {"mailbox": mailbox, "message_id": "msg-skip"})
        free_again = await other.call_tool("claim_message", {"mailbox": mailbox, "message_id": "msg-skip"})

    assert answer(marked)["outcome"] == "marked_replied"
    assert not marked.is_error
    assert blocked.is_error
    assert answer(blocked)["message"].startswith("Already answered by hand by agent-a")
    assert answer(released)["outcome"] == "released"
    assert answer(nothing)["outcome"] == "not_held"
    assert answer(free_again)["outcome"] == "granted"
    assert fake.sends == []


async def test_a_session_that_ends_releases_its_claims(server: CoordinatorServer, mailbox: str) -> None:
    subject = Subject.message(mailbox, "msg-left")
    async with agent_session(server.address, "agent-a") as (client, session):
        await client.call_tool("claim_message", {"mailbox": mailbox, "message_id": subject.id})
        assert session.held == (subject,)
        assert await status_of(server.address, subject) is SubjectState.CLAIMED

    assert await status_of(server.address, subject) is SubjectState.FREE


async def test_claim_message_and_send_reply_claim_a_message_id_however_it_is_written(
    server: CoordinatorServer, fake: FakeNylas, mailbox: str
) -> None:
    async with (
        agent_session(server.address, "agent-a", api_base=fake.api_base) as (client, _),
        agent_session(server.address, "agent-b", api_base=fake.api_base) as (other, _),
    ):
        claimed = await client.call_tool("claim_message", {"mailbox": mailbox, "message_id": "<CAF=1@mail.gmail.com>"})
        held = await other.call_tool("claim_message", {"mailbox": mailbox, "message_id": " CAF=1@mail.gmail.com"})
        sent = await client.call_tool("send_reply", reply_arguments(mailbox, "CAF=1@mail.gmail.com\n"))
        answered = await other.call_tool("send_reply", reply_arguments(mailbox, "<CAF=1@mail.gmail.com>"))

    assert answer(claimed)["subject_id"] == "CAF=1@mail.gmail.com"
    assert answer(held)["outcome"] == "held"
    assert answer(sent)["outcome"] == "sent"
    assert answer(answered)["outcome"] == "already_replied"
    assert len(fake.sends) == 1
    assert fake.sends[0].payload["reply_to_message_id"] == "CAF=1@mail.gmail.com"  # the id as claimed


async def test_send_reply_marks_the_reply_automatic_and_answers_a_spent_budget_in_words(
    server: CoordinatorServer, fake: FakeNylas, mailbox: str
) -> None:
    """Each send_reply carries Auto-Submitted: auto-replied (RFC 3834); the thread's fourth agent reply within the
    hour is refused at the commit point, and the model is told, in words, to stop and leave it to a person."""
    asked = datetime(2026, 12, 2, 14, 3, tzinfo=UTC)

    def in_thread(n: int) -> dict[str, Any]:
        at = (asked + timedelta(minutes=n)).isoformat()
        return {**reply_arguments(mailbox, f"msg-{n}"), "thread_id": "thread-1", "received_at": at}

    async with agent_session(server.address, "agent-a", api_base=fake.api_base) as (client, _):
        results = [await client.call_tool("send_reply", in_thread(n)) for n in range(4)]

    assert [answer(result)["outcome"] for result in results] == ["sent", "sent", "sent", "not_sent"]
    assert len(fake.sends) == 3
    for sent in fake.sends:
        assert sent.payload["custom_headers"] == [{"name": "Auto-Submitted", "value": "auto-replied"}]
    refused = answer(results[3])
    assert results[3].is_error
    assert refused["message"].startswith(
        "Not sent: agents stopped: 3 agent replies to this conversation in the last hour"
    )
    assert "it is left for a person" in refused["message"]
    assert await status_of(server.address, Subject.message(mailbox, "msg-3")) is SubjectState.FREE


async def test_send_reply_to_a_conversation_that_moved_on_says_to_answer_the_newest_message(
    server: CoordinatorServer, fake: FakeNylas, mailbox: str
) -> None:
    asked = datetime(2026, 12, 2, 14, 3, tzinfo=UTC)
    first = {**reply_arguments(mailbox, "msg-old"), "thread_id": "thread-2", "received_at": asked.isoformat()}
    newer = {
        "mailbox": mailbox,
        "message_id": "msg-new",
        "thread_id": "thread-2",
        "received_at": (asked + timedelta(seconds=30)).isoformat(),
    }
    async with (
        agent_session(server.address, "agent-a", api_base=fake.api_base) as (drafting, _),
        agent_session(server.address, "agent-b", api_base=fake.api_base) as (other, _),
    ):
        claimed = await drafting.call_tool("claim_message", {k: first[k] for k in newer})
        assert answer(claimed)["outcome"] == "granted"
        assert answer(await other.call_tool("claim_message", newer))["outcome"] == "granted"
        result = await drafting.call_tool("send_reply", first)

    assert fake.sends == []
    assert result.is_error
    assert answer(result)["outcome"] == "not_sent"
    assert answer(result)["message"].startswith(
        "Not sent: the customer wrote again; draft again with the new message (message msg-new)."
    )


async def test_send_reply_counts_the_correspondent_from_the_summarys_sender(
    server: CoordinatorServer, fake: FakeNylas, mailbox: str
) -> None:
    """The sender of the summary the model gives is the correspondent of the reply budget: the eleventh reply to one
    customer in a day, over eleven conversations, is refused."""
    asked = datetime(2026, 12, 2, 14, 3, tzinfo=UTC).isoformat()

    def to_bea(n: int) -> dict[str, Any]:
        summary = {"subject_line": f"Order {n}", "sender": "Bea Costa <Bea@Example.org>"}
        return {**reply_arguments(mailbox, f"m-{n}"), "thread_id": f"t-{n}", "received_at": asked, "summary": summary}

    async with agent_session(server.address, "agent-a", api_base=fake.api_base) as (client, _):
        results = [await client.call_tool("send_reply", to_bea(n)) for n in range(11)]

    assert [answer(result)["outcome"] for result in results] == ["sent"] * 10 + ["not_sent"]
    assert "agent replies to bea@example.org in the last day" in answer(results[10])["message"].lower()
    assert len(fake.sends) == 10
