"""Reply storms on real coordinators over a real etcd (docs/design.md#reply-storms): the agents' reply budget per
thread and per correspondent, counted at the commit point across replicas; a conversation that moved on; people
never refused nor counted; AbortSend gives the unit back; RecordIncoming's role, dedup and limits."""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from coordinator.api.auth import TokenAuthenticator
from coordinator.core.storms import Budget, ReplyBudgets
from coordinator.store.etcd.process import EtcdServer
from inbox_wire.v1 import coordinator_pb2 as pb
from tests.conftest import StartCoordinator
from tests.helpers import Actor, error_reason, eventually, message, new_request_id, rpc_error
from tests.server.test_http import Json, serve
from tests.server.test_outside_reporters import TOKENS, _token_file

pytestmark = pytest.mark.etcd

OK, REFUSED = pb.FENCE_RESULT_OK, pb.FENCE_RESULT_REFUSED
SPENT, MOVED_ON = pb.SendRefusal.REPLY_BUDGET_SPENT, pb.SendRefusal.CONVERSATION_MOVED_ON
ASKED = 1_796_220_000  # a provider's received time, in seconds


@dataclass
class Pair:
    """Two replicas on one etcd prefix, an actor maker on either."""

    one: grpc.aio.Channel
    two: grpc.aio.Channel

    def agent(self, name: str, *, second: bool = False) -> Actor:
        return Actor(self.two if second else self.one, name)

    def human(self, name: str, *, second: bool = False) -> Actor:
        return Actor(self.two if second else self.one, name, kind="human")


@pytest.fixture
async def replicas(start_coordinator: StartCoordinator) -> AsyncIterator[Pair]:
    first, second = await start_coordinator(), await start_coordinator()
    async with grpc.aio.insecure_channel(first.address) as one, grpc.aio.insecure_channel(second.address) as two:
        yield Pair(one, two)


async def claim(
    actor: Actor, subject: pb.Subject, thread: str, *, received_s: int = ASKED, correspondent: str = ""
) -> int:
    answer = await actor.stub.ClaimReply(
        pb.ClaimReplyRequest(
            request_id=new_request_id(),
            subject=subject,
            ttl_seconds=120,
            thread_id=thread,
            received_at=Timestamp(seconds=received_s),
            correspondent=correspondent,
        ),
        metadata=actor.metadata,
    )
    assert answer.result == pb.ClaimReplyResponse.GRANTED, answer
    return int(answer.status.fencing_token)


async def reply(
    actor: Actor, subject: pb.Subject, thread: str, *, received_s: int = ASKED, correspondent: str = ""
) -> pb.BeginSendResponse:
    """One whole reply: claim, BeginSend and, when let through, ConfirmSent."""
    token = await claim(actor, subject, thread, received_s=received_s, correspondent=correspondent)
    begun = await actor.begin(subject, token)
    if begun.result == OK:
        assert (await actor.confirm(subject, token)).result == OK
    return begun


def incoming(
    mailbox: str, message_id: str, thread: str, received_s: int, *, notification_id: str = "", automated: str = ""
) -> pb.RecordIncomingRequest:
    return pb.RecordIncomingRequest(
        request_id=new_request_id(),
        mailbox=mailbox,
        message_id=message_id,
        thread_id=thread,
        received_at=Timestamp(seconds=received_s),
        notification_id=notification_id,
        automated=automated,
    )


async def test_the_fourth_agent_reply_in_a_thread_within_the_hour_is_refused_with_words_for_a_person(
    replicas: Pair, mailbox: str
) -> None:
    """The issue's finding: six replies by one agent in one thread within a minute all passed BeginSend."""
    agent = replicas.agent("agent-a")
    for n in range(3):  # each a newer message of the thread, answered in turn
        assert (await reply(agent, message(mailbox, f"m-{n}"), "t-1", received_s=ASKED + n)).result == OK
    subject = message(mailbox, "m-3")
    token = await claim(agent, subject, "t-1", received_s=ASKED + 3)
    refused = await agent.begin(subject, token)
    assert refused.result == REFUSED
    refusal = refused.refusal
    assert (refusal.kind, refusal.scope, refusal.limit, refusal.window_seconds, refusal.counted) == (
        SPENT,
        "thread",
        3,
        3600,
        3,
    )
    assert (
        refusal.reason == "agents stopped: 3 agent replies to this conversation in the last hour — a person should look"
    )
    assert refusal.frees_at.seconds > 0
    # Nothing sent: the claim is still held, and shows people that agents stopped there.
    status = await agent.status(subject)
    assert (status.state, status.fencing_token) == (pb.SUBJECT_STATE_CLAIMED, token)
    assert status.agents_stopped.reason == refusal.reason
    # Another agent, through the other replica, is refused too: the budget is the thread's, not a process's.
    other = replicas.agent("agent-b", second=True)
    later = message(mailbox, "m-4")
    assert (await reply(other, later, "t-1", received_s=ASKED + 4)).result == REFUSED
    # Another thread of the mailbox has its own budget.
    assert (await reply(other, message(mailbox, "m-5"), "t-2", received_s=ASKED + 5)).result == OK


async def test_two_replicas_racing_for_the_thread_budgets_last_unit_let_exactly_one_through(
    replicas: Pair, mailbox: str
) -> None:
    agent = replicas.agent("agent-a")
    for n in range(2):
        assert (await reply(agent, message(mailbox, f"spent-{n}"), "t-race")).result == OK
    # 24 agents on both replicas, each holding another message of the thread (received at the same time, so none
    # moved the conversation on), reach the commit point together: one unit is left.
    racers = [replicas.agent(f"racer-{n}", second=n % 2 == 1) for n in range(24)]
    subjects = [message(mailbox, f"racing-{n}") for n in range(24)]
    tokens = await asyncio.gather(*(claim(a, s, "t-race") for a, s in zip(racers, subjects, strict=True)))
    answers = await asyncio.gather(*(a.begin(s, t) for a, s, t in zip(racers, subjects, tokens, strict=True)))
    results = collections.Counter(answer.result for answer in answers)
    assert results == {OK: 1, REFUSED: 23}
    assert {answer.refusal.kind for answer in answers if answer.result == REFUSED} == {SPENT}
    assert {answer.refusal.counted for answer in answers if answer.result == REFUSED} == {3}


async def test_two_replicas_racing_for_a_correspondents_last_unit_in_many_threads_let_exactly_one_through(
    start_coordinator: StartCoordinator, mailbox: str
) -> None:
    budgets = ReplyBudgets(thread=Budget(3, 3600_000), correspondent=Budget(4, 24 * 3600_000))
    first = await start_coordinator(reply_budgets=lambda _mailbox: budgets)
    second = await start_coordinator(reply_budgets=lambda _mailbox: budgets)
    async with grpc.aio.insecure_channel(first.address) as one, grpc.aio.insecure_channel(second.address) as two:
        pair = Pair(one, two)
        agent = pair.agent("agent-a")
        for n in range(3):  # the address compared without case
            sender = "Ana@Example.com" if n % 2 else "ana@example.COM"
            assert (await reply(agent, message(mailbox, f"spent-{n}"), f"t-{n}", correspondent=sender)).result == OK
        racers = [pair.agent(f"racer-{n}", second=n % 2 == 1) for n in range(20)]
        subjects = [message(mailbox, f"racing-{n}") for n in range(20)]
        tokens = await asyncio.gather(
            *(
                claim(a, s, f"own-thread-{n}", correspondent="ana@example.com")
                for n, (a, s) in enumerate(zip(racers, subjects, strict=True))
            )
        )
        answers = await asyncio.gather(*(a.begin(s, t) for a, s, t in zip(racers, subjects, tokens, strict=True)))
        assert collections.Counter(answer.result for answer in answers) == {OK: 1, REFUSED: 19}
        refusal = next(answer.refusal for answer in answers if answer.result == REFUSED)
        assert (refusal.kind, refusal.scope, refusal.limit, refusal.counted) == (SPENT, "correspondent", 4, 4)
        assert refusal.reason == (
            "agents stopped: 4 agent replies to ana@example.com in the last day — a person should look"
        )
        # Another correspondent in the same mailbox is not stopped.
        assert (await reply(agent, message(mailbox, "bo"), "t-bo", correspondent="bo@example.com")).result == OK


async def test_people_are_never_refused_and_never_counted(replicas: Pair, mailbox: str) -> None:
    agent, ana = replicas.agent("agent-a"), replicas.human("ana@shop.example", second=True)
    # A person answers five times in the thread, through the coordinator: none counts.
    for n in range(5):
        assert (await reply(ana, message(mailbox, f"ana-{n}"), "t-1", received_s=ASKED + n)).result == OK
    # The agent says it answered by hand (MarkReplied): not counted either.
    marked = message(mailbox, "by-hand")
    token = await claim(agent, marked, "t-1", received_s=ASKED + 10)
    assert (await agent.mark_replied(marked, token)).result == OK
    for n in range(3):
        assert (await reply(agent, message(mailbox, f"agent-{n}"), "t-1", received_s=ASKED + 20 + n)).result == OK
    assert (await reply(agent, message(mailbox, "agent-4"), "t-1", received_s=ASKED + 30)).result == REFUSED
    # With the budget spent and the conversation moved on, a person's claim on an older message still sends.
    older = message(mailbox, "older")
    token = await claim(ana, older, "t-1", received_s=ASKED + 1)
    assert (await ana.begin(older, token)).result == OK


async def test_an_aborted_send_gives_its_unit_back(replicas: Pair, mailbox: str) -> None:
    agent = replicas.agent("agent-a")
    for n in range(2):
        assert (await reply(agent, message(mailbox, f"m-{n}"), "t-1", received_s=ASKED + n)).result == OK
    third = message(mailbox, "m-2")
    token = await claim(agent, third, "t-1", received_s=ASKED + 2)
    assert (await agent.begin(third, token)).result == OK
    # The provider refused the send: certainly not sent. The next reply has the unit again.
    assert (await agent.abort(third, token)).result == OK
    assert (await reply(agent, message(mailbox, "m-3"), "t-1", received_s=ASKED + 3)).result == OK
    assert (await reply(agent, message(mailbox, "m-4"), "t-1", received_s=ASKED + 4)).result == REFUSED


async def test_a_conversation_that_moved_on_refuses_the_older_messages_send(replicas: Pair, mailbox: str) -> None:
    """The issue's finding: an agent whose customer wrote again in the thread while it drafted was let send."""
    agent, other = replicas.agent("agent-a"), replicas.agent("agent-b", second=True)
    first = message(mailbox, "m-1")
    token = await claim(agent, first, "t-1", received_s=ASKED)
    # The customer writes again; another worker claims the newer message (on the other replica).
    newer = message(mailbox, "m-2")
    newer_token = await claim(other, newer, "t-1", received_s=ASKED + 60)
    refused = await agent.begin(first, token)
    assert refused.result == REFUSED
    assert refused.refusal.kind == MOVED_ON
    assert refused.refusal.reason == "the customer wrote again; draft again with the new message"
    assert (refused.refusal.newer_message_id, refused.refusal.newer_received_at.seconds) == ("m-2", ASKED + 60)
    assert (await agent.status(first)).state == pb.SUBJECT_STATE_CLAIMED  # nothing changed: release it
    assert (await agent.release(first, token)).result == OK
    # A message nobody claims (found by looking at the thread before the send) moves it on too.
    recorded = await other.stub.RecordIncoming(incoming(mailbox, "m-3", "t-1", ASKED + 120), metadata=other.metadata)
    assert recorded.result == pb.RecordIncomingResponse.RECORDED
    refused = await other.begin(newer, newer_token)
    assert (refused.result, refused.refusal.newer_message_id) == (REFUSED, "m-3")
    # A message received earlier than the newest changes nothing: the newest one's claim sends.
    await other.stub.RecordIncoming(incoming(mailbox, "m-0", "t-1", ASKED - 60), metadata=other.metadata)
    newest = message(mailbox, "m-3")
    assert (await reply(agent, newest, "t-1", received_s=ASKED + 120)).result == OK
    # Nothing was counted by the refusals: that one reply is the thread's first.
    for n in range(2):
        assert (await reply(agent, message(mailbox, f"m-{4 + n}"), "t-1", received_s=ASKED + 200 + n)).result == OK
    assert (await reply(agent, message(mailbox, "m-9"), "t-1", received_s=ASKED + 300)).result == REFUSED


async def test_automated_mail_and_a_persons_claim_of_it_do_not_move_the_conversation_on(
    replicas: Pair, mailbox: str
) -> None:
    """An out-of-office arriving after the customer's message must not stop the agent's reply to the customer
    (else nobody answers): neither its RecordIncoming nor a person claiming it to answer it moves the thread on."""
    agent, reporter = replicas.agent("agent-a"), replicas.agent("worker", second=True)
    customer = message(mailbox, "m-1")
    token = await claim(agent, customer, "t-1", received_s=ASKED)
    automated = incoming(mailbox, "ooo-1", "t-1", ASKED + 60, automated="Auto-Submitted: auto-replied")
    assert (await reporter.stub.RecordIncoming(automated, metadata=reporter.metadata)).status.automated
    # A person claims the out-of-office (on the other replica, which knows nothing of the thread yet).
    ana = replicas.human("ana@shop.example", second=True)
    await claim(ana, message(mailbox, "ooo-1"), "t-1", received_s=ASKED + 60)
    begun = await agent.begin(customer, token)
    assert (begun.result, begun.refusal.kind) == (OK, pb.SendRefusal.KIND_UNSPECIFIED), begun
    assert (await agent.confirm(customer, token)).result == OK
    # The customer's own next message still moves it on.
    second = message(mailbox, "m-2")
    token = await claim(agent, second, "t-1", received_s=ASKED + 120)
    await reporter.stub.RecordIncoming(incoming(mailbox, "m-3", "t-1", ASKED + 180), metadata=reporter.metadata)
    refused = await agent.begin(second, token)
    assert (refused.result, refused.refusal.newer_message_id) == (REFUSED, "m-3")


async def test_people_find_automated_mail_and_stopped_conversations_after_the_agent_let_go(
    replicas: Pair, mailbox: str
) -> None:
    """The board's and inboxctl's source (ListRecentMessages): automated mail nobody claims says why agents leave
    it; a conversation where agents are stopped stays listed after the agent released its claim, on any replica."""
    reporter, agent = replicas.agent("worker"), replicas.agent("agent-a")
    automated = incoming(mailbox, "ooo-1", "t-ooo", ASKED, notification_id="n-ooo", automated="Precedence: bulk")
    automated.summary.subject_line = "Out of office"
    await reporter.stub.RecordIncoming(automated, metadata=reporter.metadata)
    plain = incoming(mailbox, "m-plain", "t-plain", ASKED, notification_id="n-plain")
    await reporter.stub.RecordIncoming(plain, metadata=reporter.metadata)
    for n in range(3):
        assert (await reply(agent, message(mailbox, f"m-{n}"), "t-1", received_s=ASKED + n)).result == OK
    stopped_subject = message(mailbox, "m-3")
    token = await claim(agent, stopped_subject, "t-1", received_s=ASKED + 3, correspondent="ana@example.com")
    refused = await agent.begin(stopped_subject, token)
    assert refused.result == REFUSED
    assert (await agent.release(stopped_subject, token)).result == OK  # what the clients do at once
    person = replicas.human("ana@shop.example", second=True)
    found = await person.stub.ListRecentMessages(
        pb.ListRecentMessagesRequest(mailbox=mailbox), metadata=person.metadata
    )
    why = {item.subject.id: item.automated for item in found.messages}
    assert (why["ooo-1"], why["m-plain"]) == ("Precedence: bulk", "")
    (stopped,) = found.agents_stopped
    assert (stopped.subject.id, stopped.seen_by) == ("m-3", "agent-a")
    assert stopped.agents_stopped.reason == refused.refusal.reason
    assert stopped.agents_stopped.reason.startswith("agents stopped: 3 agent replies to this conversation")
    assert stopped.agents_stopped.frees_at == refused.refusal.frees_at
    # A search narrows both lists alike.
    narrowed = await person.stub.ListRecentMessages(
        pb.ListRecentMessagesRequest(mailbox=mailbox, query="office"), metadata=person.metadata
    )
    assert [item.subject.id for item in narrowed.messages] == ["ooo-1"]
    assert not narrowed.agents_stopped
    # A person can still answer the stopped conversation.
    assert (await reply(person, stopped_subject, "t-1", received_s=ASKED + 3)).result == OK


async def test_a_stopped_conversation_is_listed_until_its_budget_frees_and_no_longer(
    start_coordinator: StartCoordinator, mailbox: str
) -> None:
    """The stopped record lives on an etcd lease until the refusal's frees_at (the shortest window an operator may
    set, one minute): etcd, not a replica's clock, ends it, and agents may answer the conversation again."""
    budgets = ReplyBudgets(thread=Budget(1, 60_000), correspondent=None)
    coordinator = await start_coordinator(reply_budgets=lambda _mailbox: budgets)
    async with grpc.aio.insecure_channel(coordinator.address) as channel:
        agent = Actor(channel, "agent-a")
        assert (await reply(agent, message(mailbox, "m-0"), "t-1", received_s=ASKED)).result == OK
        subject = message(mailbox, "m-1")
        token = await claim(agent, subject, "t-1", received_s=ASKED + 1)
        refused = await agent.begin(subject, token)
        assert refused.result == REFUSED
        await agent.release(subject, token)

        async def stopped() -> list[str]:
            listed = await agent.stub.ListRecentMessages(
                pb.ListRecentMessagesRequest(mailbox=mailbox), metadata=agent.metadata
            )
            return [item.subject.id for item in listed.agents_stopped]

        assert await stopped() == ["m-1"]
        frees_at = refused.refusal.frees_at.ToMilliseconds() / 1000

        async def gone() -> bool:
            return not await stopped()

        await eventually(gone, within=90, interval=1)
        # Not before the budget freed (the lease ends at or after frees_at), and agents may answer again.
        assert time.time() >= frees_at
        assert (await reply(agent, message(mailbox, "m-1"), "t-1", received_s=ASKED + 1)).result == OK


async def test_record_incoming_answers_duplicates_and_retries_and_marks_automated_mail(
    replicas: Pair, mailbox: str
) -> None:
    worker = replicas.agent("worker")
    request = incoming(mailbox, "ooo-1", "t-1", ASKED, notification_id="n-1", automated="Auto-Submitted: auto-replied")
    first = await worker.stub.RecordIncoming(request, metadata=worker.metadata)
    assert first.result == pb.RecordIncomingResponse.RECORDED
    assert first.status.automated == "Auto-Submitted: auto-replied"
    assert first.status.state == pb.SUBJECT_STATE_FREE  # a person can still claim and answer it
    assert (first.delivery.notification_id, first.delivery.subject.id) == ("n-1", "ooo-1")
    # Its retry (same request) is answered as the first; the notification again, from another request, is a
    # duplicate delivery; the same request id with other arguments is refused.
    again = await worker.stub.RecordIncoming(request, metadata=worker.metadata)
    assert again.result == pb.RecordIncomingResponse.RECORDED
    second_worker = replicas.agent("worker-2", second=True)
    duplicate = incoming(mailbox, "ooo-1", "t-1", ASKED, notification_id="n-1")
    answer = await second_worker.stub.RecordIncoming(duplicate, metadata=second_worker.metadata)
    assert answer.result == pb.RecordIncomingResponse.DUPLICATE_DELIVERY
    assert answer.delivery.recorded_by == "worker"
    reused = pb.RecordIncomingRequest()
    reused.CopyFrom(request)
    reused.automated = "List-Id"
    error = await rpc_error(worker.stub.RecordIncoming(reused, metadata=worker.metadata))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_reason(error)[0] == "REQUEST_ID_REUSED"
    # A person asking about it later (inboxctl status) is told why agents leave it, through either replica.
    subject = message(mailbox, "ooo-1")
    asked = await second_worker.status(subject)
    assert (asked.state, asked.automated) == (pb.SUBJECT_STATE_FREE, "Auto-Submitted: auto-replied")
    assert (await worker.status(message(mailbox, "never-recorded"))).automated == ""
    ana = replicas.human("ana@shop.example")
    assert (await reply(ana, subject, "t-1")).result == OK
    # In a Batch too.
    (batched,) = await worker.batch(pb.BatchCall(record_incoming=incoming(mailbox, "ooo-2", "t-1", ASKED + 1)))
    assert batched.record_incoming.result == pb.RecordIncomingResponse.RECORDED


async def test_record_incoming_and_correspondent_limits_are_named(replicas: Pair, mailbox: str) -> None:
    worker = replicas.agent("worker")
    cases = [
        (incoming(mailbox, "m", "t", ASKED, automated="x" * 257), "automated", "256"),
        (incoming(mailbox, "m", "t", ASKED, automated="Auto-Submitted:\nno"), "automated", "control"),
        (incoming(mailbox, "", "t", ASKED), "message_id", "required"),
        (incoming(mailbox, "m", "", ASKED), "thread_id", "required"),
        (
            pb.RecordIncomingRequest(request_id=new_request_id(), mailbox=mailbox, message_id="m", thread_id="t"),
            "received_at",
            "required",
        ),
    ]
    for request, field, words in cases:
        error = await rpc_error(worker.stub.RecordIncoming(request, metadata=worker.metadata))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, error.details())
        assert field in (error.details() or ""), error.details()
        assert words in (error.details() or ""), error.details()
    long_address = "a" * 310 + "@example.com"
    error = await rpc_error(claim(worker, message(mailbox, "m"), "t", correspondent=long_address))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "correspondent" in (error.details() or "")
    assert "320" in (error.details() or "")


@pytest.fixture
async def tokens_server(etcd: EtcdServer, prefix: str, tmp_path: Path) -> AsyncIterator[tuple[grpc.aio.Channel, Json]]:
    server = await serve(etcd, prefix, authenticator=TokenAuthenticator(_token_file(tmp_path / "tokens.toml")))
    assert server.http is not None
    try:
        async with (
            grpc.aio.insecure_channel(server.address) as channel,
            httpx.AsyncClient(base_url=f"http://{server.http.address}", timeout=10) as http,
        ):
            yield channel, Json(http, {"authorization": f"Bearer {TOKENS['worker-acme']}"})
    finally:
        await server.stop(grace=0.5)


async def test_record_incoming_needs_the_report_role_and_speaks_json(
    tokens_server: tuple[grpc.aio.Channel, Json],
) -> None:
    channel, worker_json = tokens_server
    mailbox = f"acme-{uuid.uuid4().hex[:8]}"
    agent_x = Actor(channel, "agent-x", token=TOKENS["agent-x"])
    error = await rpc_error(agent_x.stub.RecordIncoming(incoming(mailbox, "m", "t", ASKED), metadata=agent_x.metadata))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error_reason(error)[0] == "ROLE_MISSING"
    assert "RecordIncoming needs the role 'report'" in (error.details() or "")
    answer = await worker_json.call(
        "RecordIncoming",
        {
            "requestId": new_request_id(),
            "mailbox": mailbox,
            "messageId": "bounce-1",
            "threadId": "t-1",
            "receivedAt": "2026-12-01T10:00:00Z",
            "automated": "delivery status notification",
        },
    )
    assert answer["result"] == "RECORDED"
    assert answer["status"]["automated"] == "delivery status notification"


async def test_a_send_in_doubt_stays_counted(start_coordinator: StartCoordinator, mailbox: str) -> None:
    """It may have gone out: only AbortSend (certainly not sent) gives a unit back."""
    server = await start_coordinator(send_timeout_ms=500)
    async with grpc.aio.insecure_channel(server.address) as channel:
        agent = Actor(channel, "agent-a")
        for n in range(2):
            assert (await reply(agent, message(mailbox, f"m-{n}"), "t-1", received_s=ASKED + n)).result == OK
        doubtful = message(mailbox, "m-2")
        token = await claim(agent, doubtful, "t-1", received_s=ASKED + 2)
        assert (await agent.begin(doubtful, token)).result == OK  # never confirmed: the agent crashed

        async def in_doubt() -> bool:
            return (await agent.status(doubtful)).state == pb.SUBJECT_STATE_IN_DOUBT

        await eventually(in_doubt)
        refused = await reply(agent, message(mailbox, "m-3"), "t-1", received_s=ASKED + 3)
        assert (refused.result, refused.refusal.counted) == (REFUSED, 3)
