"""The Batch RPC, and the clients sending their concurrent calls together in it: on a real coordinator and etcd.

A batched call must behave exactly as the same call alone: same answer, same error, same state in etcd, same
metrics and log line. These tests hold the batch to that, under concurrency and faults.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from coordinator.api.service import CoordinatorServicer
from coordinator.core.engine import Engine
from coordinator.ops.server import CoordinatorServer, wall_clock_ms
from coordinator.store.etcd.process import EtcdServer
from coordinator.store.etcd.settings import EtcdSettings
from coordinator.store.etcd.store import EtcdStore
from inbox_claims import AsyncCoordinator, Coordinator, Subject
from inbox_claims._batch import MAX_BATCHES_IN_FLIGHT, Coalescer
from inbox_claims._effects import Rpc
from inbox_claims.errors import InvalidRequest
from inbox_claims.types import ClaimOutcome
from inbox_wire import BATCH_MAX_CALLS
from inbox_wire.v1 import coordinator_pb2 as pb
from inbox_wire.v1 import coordinator_pb2_grpc as pb_grpc
from tests.conftest import PATIENT, LateCoordinator, StartCoordinator, test_rules
from tests.helpers import Actor, message, new_request_id, rpc_error

GRANTED = pb.ClaimReplyResponse.GRANTED
SERVICE = "inbox.coordinator.v1.Coordinator"


def claim(subject: pb.Subject, *, ttl: int = 0, notification_id: str = "", request_id: str = "") -> pb.BatchCall:
    request = pb.ClaimReplyRequest(
        request_id=request_id or new_request_id(), subject=subject, ttl_seconds=ttl, notification_id=notification_id
    )
    return pb.BatchCall(claim_reply=request)


def threaded(subject: pb.Subject, thread_id: str, received_s: int) -> pb.BatchCall:
    request = pb.ClaimReplyRequest(request_id=new_request_id(), subject=subject, thread_id=thread_id)
    request.received_at.seconds = received_s
    return pb.BatchCall(claim_reply=request)


def outgoing(mailbox: str, thread_id: str, message_id: str, sent_s: int) -> pb.BatchCall:
    request = pb.RecordOutgoingRequest(
        request_id=new_request_id(), mailbox=mailbox, thread_id=thread_id, message_id=message_id, sender="Ana"
    )
    if sent_s:
        request.sent_at.seconds = sent_s
    return pb.BatchCall(record_outgoing=request)


def status(subject: pb.Subject) -> pb.BatchCall:
    return pb.BatchCall(get_status=pb.GetStatusRequest(subject=subject))


def fenced(field: str, subject: pb.Subject, token: int, **fields: Any) -> pb.BatchCall:
    """renew_claim, release_claim, begin_send, confirm_sent or abort_send on ``subject`` with ``token``."""
    request_type = type(getattr(pb.BatchCall(), field))
    request = request_type(request_id=new_request_id(), subject=subject, fencing_token=token, **fields)
    return pb.BatchCall(**{field: request})


def record(mailbox: str, notification_id: str) -> pb.BatchCall:
    request = pb.RecordDeliveryRequest(request_id=new_request_id(), mailbox=mailbox, notification_id=notification_id)
    return pb.BatchCall(record_delivery=request)


def rpcs(server: CoordinatorServer, method: str, result: str) -> float:
    labels = {"service": SERVICE, "method": method, "result": result}
    return server.metrics.value("inbox_coordinator_rpcs_total", labels) or 0.0


async def test_each_call_is_answered_as_the_same_call_alone(agent: Actor, mailbox: str) -> None:
    first, second, free = (message(mailbox, f"m-{n}") for n in range(3))
    results = await agent.batch(
        claim(first), claim(second, notification_id="n-2"), status(free), record(mailbox, "n-9")
    )
    assert [r.WhichOneof("result") for r in results] == ["claim_reply", "claim_reply", "get_status", "record_delivery"]
    token = results[0].claim_reply.status.fencing_token
    assert results[0].claim_reply.result == GRANTED
    assert token > 0
    assert results[1].claim_reply.result == GRANTED
    assert results[2].get_status.status.state == pb.SUBJECT_STATE_FREE
    assert results[3].record_delivery.result == pb.RecordDeliveryResponse.NEW

    # What the batch did is what unary calls see afterwards.
    seen = await agent.status(first)
    assert (seen.state, seen.fencing_token, seen.holder) == (pb.SUBJECT_STATE_CLAIMED, token, agent.name)
    assert (await agent.record_delivery(mailbox, "n-9")).result == pb.RecordDeliveryResponse.DUPLICATE
    again = await agent.claim(message(mailbox, "m-7"), notification_id="n-2")
    assert again.result == pb.ClaimReplyResponse.DUPLICATE_DELIVERY

    # The send sequence, one step per batch, fenced as always.
    (renewed, stale) = await agent.batch(fenced("renew_claim", first, token), fenced("begin_send", first, token + 1))
    assert renewed.renew_claim.result == pb.FENCE_RESULT_OK
    assert stale.begin_send.result == pb.FENCE_RESULT_STALE_TOKEN
    (began,) = await agent.batch(fenced("begin_send", first, token))
    assert began.begin_send.status.state == pb.SUBJECT_STATE_SENDING
    (confirmed,) = await agent.batch(fenced("confirm_sent", first, token, sent_message_id="sent-1"))
    assert confirmed.confirm_sent.status.state == pb.SUBJECT_STATE_REPLIED
    assert (await agent.claim(first)).result == pb.ClaimReplyResponse.ALREADY_REPLIED


async def _run_script(agent: Actor, mailbox: str, alone: bool) -> list[tuple[str, int, int, str] | tuple[str, str]]:
    """The same steps, each step's calls made one RPC each (``alone``) or as one Batch; the outcomes with
    everything that differs between two runs (tokens, times, the mailbox's name) taken out."""
    subjects = [message(mailbox, f"m-{n}") for n in range(6)]
    tokens: dict[int, int] = {}

    def steps() -> list[list[pb.BatchCall]]:
        return [
            [
                claim(subjects[0]),
                claim(subjects[1], notification_id="n-1"),
                record(mailbox, "n-2"),
                status(subjects[2]),
                threaded(subjects[4], "t-1", 1_000),
            ],
            [
                outgoing(mailbox, "t-1", "gmail-1", 2_000),
                outgoing(mailbox, "t-1", "gmail-2", 0),
                claim(subjects[0]),
                claim(subjects[3], notification_id="n-1"),
                fenced("renew_claim", subjects[1], tokens.get(1, 0)),
                fenced("release_claim", subjects[2], 1),
                fenced("begin_send", subjects[0], tokens.get(0, 0) + 1),
                claim(subjects[2], ttl=99_999),
                record(mailbox, "n-2"),
            ],
            [
                fenced("begin_send", subjects[1], tokens.get(1, 0)),
                fenced("release_claim", subjects[0], tokens.get(0, 0)),
            ],
            [
                fenced("confirm_sent", subjects[1], tokens.get(1, 0), sent_message_id="s-1"),
                claim(subjects[0]),
                fenced("abort_send", subjects[2], 5, reason="no"),
            ],
            [
                claim(subjects[1]),
                status(subjects[0]),
                status(subjects[1]),
                fenced("begin_send", subjects[4], tokens.get(4, 0)),
                threaded(subjects[5], "t-1", 1_500),
            ],
        ]

    outcomes: list[tuple[str, int, int, str] | tuple[str, str]] = []
    for step in range(5):
        calls = steps()[step]
        results = [await _alone(agent, call) for call in calls] if alone else list(await agent.batch(*calls))
        for call, result in zip(calls, results, strict=True):
            field = result.WhichOneof("result")
            assert field is not None
            if field == "error":
                outcomes.append(
                    (grpc.StatusCode(_code(result.error.code)).name, result.error.message.replace(mailbox, "MB"))
                )
                continue
            response = getattr(result, field)
            has_status = "status" in response.DESCRIPTOR.fields_by_name and response.HasField("status")
            state = response.status.state if has_status else 0
            holder = response.status.holder if has_status else ""
            outcomes.append((field, getattr(response, "result", -1), state, holder))
            if field == "claim_reply" and response.result == GRANTED:
                tokens[int(call.claim_reply.subject.id.split("-")[1])] = response.status.fencing_token
    return outcomes


def _code(number: int) -> grpc.StatusCode:
    return next(code for code in grpc.StatusCode if code.value[0] == number)


async def _alone(agent: Actor, call: pb.BatchCall) -> pb.BatchResult:
    """One call as its own unary RPC, its answer in a BatchResult for comparison."""
    field = call.WhichOneof("call")
    assert field is not None
    method = "".join(part.title() for part in field.split("_"))
    try:
        response = await getattr(agent.stub, method)(getattr(call, field), metadata=agent.metadata)
    except grpc.aio.AioRpcError as error:
        return pb.BatchResult(error=pb.CallError(code=error.code().value[0], message=error.details() or ""))
    result = pb.BatchResult()
    getattr(result, field).CopyFrom(response)
    return result


async def test_batched_and_unary_calls_give_identical_outcomes(agent: Actor) -> None:
    alone = await _run_script(agent, "acme-alone", alone=True)
    batched = await _run_script(agent, "acme-batched", alone=False)
    assert batched == alone
    # The script covers what it claims to: grants, refusals, a duplicate, a stale token, an invalid TTL.
    assert ("claim_reply", GRANTED, pb.SUBJECT_STATE_CLAIMED, agent.name) in alone
    assert any(o[:2] == ("claim_reply", pb.ClaimReplyResponse.DUPLICATE_DELIVERY) for o in alone)
    assert any(o[:2] == ("begin_send", pb.FENCE_RESULT_STALE_TOKEN) for o in alone)
    assert any(o[0] == "INVALID_ARGUMENT" and "ttl_seconds" in str(o[1]) for o in alone)
    assert any(o[:3] == ("confirm_sent", pb.FENCE_RESULT_OK, pb.SUBJECT_STATE_REPLIED) for o in alone)
    # A reply written outside, batched like the rest: it ends the thread's claim and answers its later messages.
    assert ("record_outgoing", pb.RecordOutgoingResponse.ANSWERED_OUTSIDE, 0, "") in alone
    assert any(o[0] == "INVALID_ARGUMENT" and "sent_at" in str(o[1]) for o in alone)
    assert alone[-2:] == [
        ("begin_send", pb.FENCE_RESULT_STALE_TOKEN, pb.SUBJECT_STATE_REPLIED, "Ana"),
        ("claim_reply", pb.ClaimReplyResponse.ALREADY_REPLIED, pb.SUBJECT_STATE_REPLIED, "Ana"),
    ]


async def test_one_bad_call_is_refused_alone_and_stores_nothing(agent: Actor, mailbox: str) -> None:
    short_ttl, good = message(mailbox, "short-ttl"), message(mailbox, "good")
    results = await agent.batch(
        claim(short_ttl, ttl=1), claim(good), pb.BatchCall(), claim(pb.Subject(kind=pb.SUBJECT_KIND_MESSAGE, id="x"))
    )
    assert results[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "ttl_seconds" in results[0].error.message
    assert "is outside" in results[0].error.message
    assert results[1].claim_reply.result == GRANTED
    assert results[2].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "calls[].call" in results[2].error.message
    assert results[3].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "mailbox" in results[3].error.message
    assert (await agent.status(short_ttl)).state == pb.SUBJECT_STATE_FREE


async def test_a_batch_over_the_limit_is_refused_whole(agent: Actor, mailbox: str) -> None:
    calls = [claim(message(mailbox, f"m-{n}")) for n in range(BATCH_MAX_CALLS + 1)]
    error = await rpc_error(agent.batch(*calls))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{BATCH_MAX_CALLS + 1} calls" in (error.details() or "")
    assert f"limit is {BATCH_MAX_CALLS}" in (error.details() or "")
    assert (await agent.status(message(mailbox, "m-0"))).state == pb.SUBJECT_STATE_FREE
    full = await agent.batch(*calls[:BATCH_MAX_CALLS])
    assert all(result.claim_reply.result == GRANTED for result in full)
    assert await agent.batch() == ()


async def test_batched_calls_are_counted_and_logged_under_their_own_method(
    coordinator: CoordinatorServer, agent: Actor, mailbox: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="inbox_coordinator.rpc"):
        await agent.batch(
            claim(message(mailbox, "a")), claim(message(mailbox, "b")), claim(message(mailbox, "c"), ttl=1)
        )
    assert rpcs(coordinator, "ClaimReply", "granted") == 2
    assert rpcs(coordinator, "ClaimReply", "invalid_argument") == 1
    assert rpcs(coordinator, "Batch", "ok") == 1
    lines = [r for r in caplog.records if getattr(r, "fields", {}).get("method") == "ClaimReply"]
    assert sorted(r.fields["subject_id"] for r in lines) == ["a", "b", "c"]  # type: ignore[attr-defined]
    assert {r.fields["principal"] for r in lines} == {agent.name}  # type: ignore[attr-defined]
    assert [r.fields["code"] for r in lines if r.fields["subject_id"] == "c"] == ["INVALID_ARGUMENT"]  # type: ignore[attr-defined]
    # Without --access-log an answered call is a debug line, a refused one info, as for unary calls.
    levels = {r.fields["subject_id"]: r.levelname for r in lines}  # type: ignore[attr-defined]
    assert levels == {"a": "DEBUG", "b": "DEBUG", "c": "INFO"}


async def test_many_clients_batching_claims_on_one_subject_grant_it_once(
    coordinator: CoordinatorServer, mailbox: str
) -> None:
    subject = Subject.message(mailbox, "contested")
    clients = [AsyncCoordinator(coordinator.address, principal=f"agent-{n}") for n in range(8)]
    try:
        results = await asyncio.gather(*(client.claim(subject) for client in clients for _ in range(25)))
    finally:
        await asyncio.gather(*(client.close() for client in clients))
    outcomes = Counter(result.outcome for result in results)
    assert outcomes == {ClaimOutcome.GRANTED: 1, ClaimOutcome.HELD: 199}
    winner = next(result for result in results if result.granted)
    holders = {result.status.holder if result.status else None for result in results}
    assert holders == {winner.status.holder if winner.status else None}
    assert rpcs(coordinator, "ClaimReply", "granted") + rpcs(coordinator, "ClaimReply", "held") == 200
    assert 8 <= rpcs(coordinator, "Batch", "ok") < 200  # the calls went together, at least one batch per client


async def test_many_clients_batching_distinct_claims_get_their_own_tokens(
    coordinator: CoordinatorServer, mailbox: str
) -> None:
    clients = [AsyncCoordinator(coordinator.address, principal=f"agent-{n}") for n in range(4)]
    subjects = [Subject.message(mailbox, f"m-{n}") for n in range(200)]
    try:
        results = await asyncio.gather(*(clients[n % 4].claim(s) for n, s in enumerate(subjects)))
        statuses = await asyncio.gather(*(clients[0].status(s) for s in subjects))
    finally:
        await asyncio.gather(*(client.close() for client in clients))
    assert all(result.granted for result in results)
    tokens = [result.token for result in results]
    assert all(token > 0 for token in tokens)  # claims committed in one etcd transaction share its revision
    assert [s.fencing_token for s in statuses] == tokens
    assert [s.holder for s in statuses] == [f"agent-{n % 4}" for n in range(200)]
    assert rpcs(coordinator, "Batch", "ok") < 200


async def test_a_caller_cancelled_before_its_batch_goes_sends_nothing(
    coordinator: CoordinatorServer, mailbox: str
) -> None:
    async with AsyncCoordinator(coordinator.address, principal="agent-a") as client:
        subjects = [Subject.message(mailbox, f"m-{n}") for n in range(10)]
        tasks = [asyncio.create_task(client.claim(subject)) for subject in subjects]
        await asyncio.sleep(0)  # every task has queued its call; the batch goes on the next pass of the loop
        tasks[0].cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(results[0], asyncio.CancelledError)
        assert all(result.granted for result in results[1:])  # type: ignore[union-attr]
        assert (await client.status(subjects[0])).state.name == "FREE"


async def test_each_batched_call_keeps_its_own_error(coordinator: CoordinatorServer, mailbox: str) -> None:
    async with AsyncCoordinator(coordinator.address, principal="agent-a") as client:
        good, bad = client.claim(Subject.message(mailbox, "good")), client.renew(Subject.message(mailbox, "x" * 600), 1)
        results = await asyncio.gather(good, bad, return_exceptions=True)
    assert not isinstance(results[0], BaseException)
    assert results[0].granted
    assert isinstance(results[1], InvalidRequest)
    assert "512 bytes" in str(results[1])
    assert rpcs(coordinator, "Batch", "ok") == 1


async def test_sync_threads_share_batches_and_one_subject_is_granted_once(
    coordinator: CoordinatorServer, mailbox: str
) -> None:
    def threads_claiming() -> None:  # in a thread of its own: this loop keeps serving the coordinator meanwhile
        with Coordinator(coordinator.address, principal="agent-a") as client:
            contested = Subject.message(mailbox, "contested")
            outcomes = _in_threads(32, lambda n: client.claim(contested).outcome)
            assert Counter(outcomes) == {ClaimOutcome.GRANTED: 1, ClaimOutcome.HELD: 31}
            results = _in_threads(32, lambda n: client.claim(Subject.message(mailbox, f"m-{n}")))
            assert all(result.granted for result in results)
            assert all(result.token > 0 for result in results)
            assert client.renew(Subject.message(mailbox, "m-0"), results[0].token).ok

    await asyncio.to_thread(threads_claiming)
    assert rpcs(coordinator, "Batch", "ok") >= 1
    assert rpcs(coordinator, "ClaimReply", "granted") == 33


def _in_threads(count: int, work: Callable[[int], Any]) -> list[Any]:
    start = threading.Barrier(count)
    results: list[Any] = [None] * count

    def run(n: int) -> None:
        start.wait()
        results[n] = work(n)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    return results


class _CoordinatorWithoutBatch(CoordinatorServicer):
    """A coordinator from before the Batch RPC: the generated base answers it UNIMPLEMENTED."""

    Batch = pb_grpc.CoordinatorServicer.Batch  # type: ignore[assignment]


@contextlib.asynccontextmanager
async def _old_coordinator(etcd: EtcdServer, prefix: str) -> AsyncIterator[str]:
    store = EtcdStore(EtcdSettings([etcd.endpoint], prefix=prefix), wall_clock_ms)
    server = grpc.aio.server()
    pb_grpc.add_CoordinatorServicer_to_server(
        _CoordinatorWithoutBatch(Engine(store, test_rules(), wall_clock_ms)), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)
        await store.close()


async def test_clients_fall_back_to_single_calls_on_a_coordinator_without_batch(
    etcd: EtcdServer, prefix: str, mailbox: str
) -> None:
    async with _old_coordinator(etcd, prefix) as address:
        async with AsyncCoordinator(address, principal="agent-a") as client:
            results = await asyncio.gather(*(client.claim(Subject.message(mailbox, f"a-{n}")) for n in range(20)))
            assert all(result.granted for result in results)
            later = await asyncio.gather(*(client.claim(Subject.message(mailbox, f"b-{n}")) for n in range(5)))
            assert all(result.granted for result in later)

        def sync_claims() -> list[ClaimOutcome]:
            with Coordinator(address, principal="agent-b") as client:
                return _in_threads(16, lambda n: client.claim(Subject.message(mailbox, f"c-{n}")).outcome)

        assert await asyncio.to_thread(sync_claims) == [ClaimOutcome.GRANTED] * 16


async def test_batched_claims_survive_a_paused_etcd_and_still_grant_once(
    private_etcd: EtcdServer, start_coordinator: StartCoordinator, mailbox: str
) -> None:
    server = await start_coordinator(endpoint=private_etcd.endpoint, etcd_options={"call_timeout_s": 0.5})
    clients = [AsyncCoordinator(server.address, principal=f"agent-{n}", timeout=2.0) for n in range(4)]
    try:
        private_etcd.pause()
        pending = [
            asyncio.create_task(clients[n % 4].claim(Subject.message(mailbox, f"m-{n % 10}"))) for n in range(80)
        ]
        await asyncio.sleep(1.5)  # every batch out now times out against the frozen etcd, and is retried
        private_etcd.resume()
        results = await asyncio.gather(*pending)
    finally:
        if private_etcd.is_paused:
            private_etcd.resume()
        await asyncio.gather(*(client.close() for client in clients))
    by_subject: dict[str, Counter[ClaimOutcome]] = {}
    for n, result in enumerate(results):
        by_subject.setdefault(f"m-{n % 10}", Counter())[result.outcome] += 1
    # The retried claims carry their request ids: a grant answered late is still the caller's own grant.
    assert all(counts[ClaimOutcome.GRANTED] == 1 for counts in by_subject.values()), by_subject
    assert rpcs(server, "ClaimReply", "unavailable") >= 1


@pytest.mark.parametrize("waiting", [1, 2, 7, 8, 9, 16, 33, 64, 65, 200])
@pytest.mark.parametrize("max_batch", [1, 8, 64])
def test_the_coalescer_sends_every_call_once_within_its_limits(waiting: int, max_batch: int) -> None:
    coalescer: Coalescer[int] = Coalescer(max_batch)
    for n in range(waiting):
        coalescer.add(Rpc("ClaimReply", pb.ClaimReplyRequest(), 1.0), n)
    sent: list[int] = []
    while coalescer.pending:
        batches = []
        while (batch := coalescer.next_batch()) is not None:
            batches.append(batch)
        assert 1 <= len(batches) <= MAX_BATCHES_IN_FLIGHT
        assert coalescer.in_flight == len(batches)
        for batch in batches:
            assert 1 <= len(batch) <= max_batch
            sent += [waiter for _rpc, waiter in batch]
            coalescer.finished()
    assert sent == list(range(waiting))  # every call once, in the order they came
    assert coalescer.in_flight == 0


async def test_batched_claims_survive_the_coordinator_stopping_under_them(
    etcd: EtcdServer, prefix: str, mailbox: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="inbox_claims")
    late = LateCoordinator(etcd, prefix)
    await late.start()
    clients = [AsyncCoordinator(late.address, principal=f"agent-{n}", retry=PATIENT) for n in range(4)]
    try:
        claims = [
            asyncio.create_task(clients[n % 4].claim(Subject.message(mailbox, f"m-{n % 100}"))) for n in range(2000)
        ]
        await asyncio.sleep(0.05)  # batches are in flight
        await late.stop()
        await asyncio.sleep(0.3)
        await late.start()
        results = await asyncio.wait_for(asyncio.gather(*claims), 60)
        statuses = await asyncio.gather(*(clients[0].status(Subject.message(mailbox, f"m-{n}")) for n in range(100)))
    finally:
        await asyncio.gather(*(client.close() for client in clients))
        await late.stop()
    assert any("retrying" in r.getMessage() for r in caplog.records if r.name == "inbox_claims")
    granted: dict[str, list[Any]] = {}
    for result in results:
        assert result.outcome in (ClaimOutcome.GRANTED, ClaimOutcome.HELD), result
        if result.granted and result.status is not None:
            granted.setdefault(result.status.subject.id, []).append(result)
    # Each subject granted once: a claim retried after its answer was lost gets its own grant back, no other.
    assert sorted(granted) == sorted(f"m-{n}" for n in range(100))
    for n, status in enumerate(statuses):
        (grant,) = {(r.status.holder, r.token) for r in granted[f"m-{n}"] if r.status is not None}
        assert (status.holder, status.fencing_token) == grant


async def test_sync_batched_claims_survive_the_coordinator_stopping_under_them(
    etcd: EtcdServer, prefix: str, mailbox: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="inbox_claims")
    late = LateCoordinator(etcd, prefix)
    await late.start()
    client = Coordinator(late.address, principal="agent-a", retry=PATIENT)

    def claim_many(n: int) -> list[Any]:
        return [client.claim(Subject.message(mailbox, f"m-{k % 50}")) for k in range(n * 1000, n * 1000 + 100)]

    try:
        threads = asyncio.gather(*(asyncio.to_thread(claim_many, n) for n in range(16)))
        await asyncio.sleep(0.1)  # batches are in flight
        await late.stop()
        await asyncio.sleep(0.3)
        await late.start()
        results = [result for chunk in await asyncio.wait_for(threads, 60) for result in chunk]
    finally:
        client.close()
        await late.stop()
    assert any("retrying" in r.getMessage() for r in caplog.records if r.name == "inbox_claims")
    granted = Counter(r.status.subject.id for r in results if r.granted and r.status is not None)
    assert all(r.outcome in (ClaimOutcome.GRANTED, ClaimOutcome.HELD) for r in results)
    # One principal: its later claims on a subject it holds answer HELD (by itself); one grant per subject.
    assert granted == dict.fromkeys((f"m-{k}" for k in range(50)), 1)


async def test_closing_the_client_fails_its_waiting_calls_instead_of_leaving_them_waiting(
    coordinator: CoordinatorServer, mailbox: str
) -> None:
    client = AsyncCoordinator(coordinator.address, principal="agent-a")
    calls = [asyncio.create_task(client.claim(Subject.message(mailbox, f"m-{n}"))) for n in range(100)]
    await asyncio.sleep(0)  # queued; the first batches go on the next pass of the loop
    await client.close()
    results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
    for result in results:
        assert not isinstance(result, asyncio.CancelledError)  # the callers were not cancelled: they were told
        if isinstance(result, BaseException):
            assert isinstance(result, RuntimeError)
            assert "closed" in str(result)
    assert any(isinstance(result, RuntimeError) for result in results)
