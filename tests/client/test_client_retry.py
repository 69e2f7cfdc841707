"""Retries with backoff against real coordinators that start late, stop, or never come."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import pytest

from coordinator.ops.server import CoordinatorServer, ServerSettings
from coordinator.store.etcd.process import EtcdServer, free_port
from coordinator.store.etcd.settings import EtcdSettings
from inbox_claims import AsyncCoordinator, Coordinator, CoordinatorUnavailable, RetryPolicy, Subject
from inbox_claims.types import ClaimOutcome, WatchEvent, WatchSnapshot
from tests.conftest import PATIENT, LateCoordinator, test_rules

IMPATIENT = RetryPolicy(attempts=4, initial_backoff=0.1, max_backoff=0.2)


@pytest.fixture
async def late(etcd: EtcdServer, prefix: str) -> AsyncIterator[LateCoordinator]:
    coordinator = LateCoordinator(etcd, prefix)
    yield coordinator
    await coordinator.stop()


def retries_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "inbox_claims" and "retrying" in r.getMessage()]


async def wait_for_a_retry(caplog: pytest.LogCaptureFixture) -> None:
    async with asyncio.timeout(5):
        while True:
            if retries_logged(caplog):
                return
            await asyncio.sleep(0.02)


async def test_the_async_client_waits_out_a_coordinator_that_starts_late(
    late: LateCoordinator, mailbox: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="inbox_claims")
    async with AsyncCoordinator(late.address, principal="agent-a", retry=PATIENT) as client:
        call = asyncio.create_task(client.claim(Subject.message(mailbox, "msg-1"), ttl=30, notification_id="n-1"))
        await wait_for_a_retry(caplog)  # the first attempt found nothing listening
        assert not call.done()
        await late.start()
        result = await asyncio.wait_for(call, 10)
    assert result.outcome is ClaimOutcome.GRANTED
    assert "ClaimReply: UNAVAILABLE (attempt 1 of 12)" in retries_logged(caplog)[0]


async def test_the_blocking_client_waits_out_a_coordinator_that_starts_late(
    late: LateCoordinator, mailbox: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="inbox_claims")
    with Coordinator(late.address, principal="agent-a", retry=PATIENT) as client:
        subject = Subject.message(mailbox, "msg-1")
        call = asyncio.create_task(asyncio.to_thread(client.claim, subject, ttl=30))
        await wait_for_a_retry(caplog)
        assert not call.done()
        await late.start()
        result = await asyncio.wait_for(call, 10)
        assert result.outcome is ClaimOutcome.GRANTED
        assert (await asyncio.to_thread(client.status, subject)).holder == "agent-a"


async def test_both_clients_give_up_after_their_retry_budget(mailbox: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="inbox_claims")
    nowhere = f"127.0.0.1:{free_port()}"
    subject = Subject.message(mailbox, "msg-1")

    started = time.monotonic()
    async with AsyncCoordinator(nowhere, principal="agent-a", retry=IMPATIENT) as client:
        with pytest.raises(CoordinatorUnavailable) as async_error:
            await client.status(subject)
    async_elapsed = time.monotonic() - started

    started = time.monotonic()
    with (
        Coordinator(nowhere, principal="agent-a", retry=IMPATIENT) as blocking,
        pytest.raises(CoordinatorUnavailable) as sync_error,
    ):
        await asyncio.to_thread(blocking.status, subject)
    sync_elapsed = time.monotonic() - started

    for error, elapsed in ((async_error.value, async_elapsed), (sync_error.value, sync_elapsed)):
        assert (error.method, error.attempts) == ("GetStatus", 4)
        assert "after 4 attempts" in str(error)
        # Three waits of 0.05-0.1, 0.1-0.2 and 0.1-0.2 s: backoff happened, and the budget bounded it.
        assert 0.25 <= elapsed < 3
    assert len(retries_logged(caplog)) == 6


async def test_a_retried_claim_with_the_same_request_id_gets_the_same_grant(
    late: LateCoordinator, mailbox: str
) -> None:
    """What makes retrying a mutation safe: a lost answer, retried with the same request (id), gives the same
    fencing token, not HELD. Runs one logical ClaimReply twice, as the retry loop would."""
    await late.start()
    async with AsyncCoordinator(late.address, principal="agent-a") as client:
        core = client._core
        op = core.claim_op(Subject.message(mailbox, "msg-1"), ttl=30, notification_id="n-1")
        first = await client._drive(core.call(op))
        again = await client._drive(core.call(op))
        fresh = await client.claim(Subject.message(mailbox, "msg-1"), ttl=30, notification_id="n-1")
    assert first.outcome is ClaimOutcome.GRANTED
    assert again.outcome is ClaimOutcome.GRANTED
    assert again.token == first.token
    assert fresh.outcome is ClaimOutcome.DUPLICATE_DELIVERY  # a new request id is a new delivery attempt


async def test_watch_resumes_after_a_coordinator_restart_with_the_missed_events_and_no_snapshot(
    late: LateCoordinator, etcd: EtcdServer, prefix: str, mailbox: str
) -> None:
    await late.start()
    replica = CoordinatorServer(
        ServerSettings(EtcdSettings([etcd.endpoint], prefix=prefix), listen="127.0.0.1:0", rules=test_rules())
    )
    await replica.start()
    try:
        async with (
            AsyncCoordinator(late.address, principal="agent-a", retry=PATIENT) as client,
            AsyncCoordinator(replica.address, principal="agent-b") as other,
        ):
            stream = client.watch(mailbox)
            assert isinstance(await anext(stream), WatchSnapshot)
            first, second = Subject.message(mailbox, "msg-1"), Subject.message(mailbox, "msg-2")
            await client.claim(first, ttl=30)
            event = await anext(stream)
            assert isinstance(event, WatchEvent)
            assert event.status.subject == first

            await late.stop()  # the stream ends with UNAVAILABLE; the client keeps trying
            pending = asyncio.create_task(anext(stream))
            # What happens while it is away, through another replica: it must not be missed.
            await other.claim(second, ttl=30)
            await asyncio.sleep(0.5)
            assert not pending.done()
            await late.start()
            resumed = await asyncio.wait_for(pending, 10)
            await stream.aclose()
    finally:
        await replica.stop(grace=0)
    assert isinstance(resumed, WatchEvent), resumed  # resumed after the last event: no snapshot
    assert resumed.status.subject == second
    assert resumed.status.holder == "agent-b"
    assert resumed.revision > event.revision
