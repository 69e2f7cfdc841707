"""Fairness by cost, not by call count (docs/security.md, "Fair use"), on a real coordinator and etcd: a principal's
calls pay for the records they read (coordinator/core/work.py); one that reads more than its budget is paced, its
reads spread out, and refused (WORK_LIMITED, with when to retry) when its calls in flight owe more than a second of
it, while another principal's calls go on. How much that keeps others' latency is measured by ``python -m bench
fair-reads`` (docs/performance.md), not here: these are bounds that only an unpaced coordinator misses."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from coordinator.api.quotas import QuotaSettings
from inbox_wire.v1 import coordinator_pb2 as pb
from tests.conftest import StartCoordinator
from tests.helpers import Actor, error_reason, error_retry_delay_ms, message, new_request_id, rpc_error

RATE = 2000  # records per second, and as many at once
SUBJECTS = 3000  # three ranges of a filtered listing (1,000 each)


async def _fill(channel: grpc.aio.Channel, mailbox: str) -> None:
    filler = Actor(channel, "filler")
    for start in range(0, SUBJECTS, 250):
        calls = [
            pb.BatchCall(
                claim_reply=pb.ClaimReplyRequest(
                    request_id=new_request_id(),
                    subject=message(mailbox, f"m-{n:05d}"),
                    notification_id=f"n-{n:05d}",
                    ttl_seconds=600,
                    summary=pb.MessageSummary(subject_line=f"Order {n}", sender="customer@example.org"),
                )
            )
            for n in range(start, min(start + 250, SUBJECTS))
        ]
        await filler.batch(*calls)


def _in_doubt(mailbox: str) -> pb.ListClaimsRequest:
    """A page of IN_DOUBT subjects, of which there are none: it reads the whole mailbox to list nothing."""
    return pb.ListClaimsRequest(mailbox=mailbox, states=[pb.SUBJECT_STATE_IN_DOUBT], page_size=1)


@dataclass
class Readers:
    mailbox: str
    heavy: Actor
    quiet: Actor


@pytest.fixture
async def readers(start_coordinator: StartCoordinator) -> AsyncIterator[Readers]:
    """A coordinator with a small work budget, a mailbox of SUBJECTS claimed subjects, and two principals."""
    server = await start_coordinator(quotas=QuotaSettings(calls_per_second=0, work_per_second=RATE, work_burst=RATE))
    mailbox = f"fair-{uuid.uuid4().hex[:8]}"
    async with grpc.aio.insecure_channel(server.address) as channel:
        await _fill(channel, mailbox)
        yield Readers(
            mailbox, Actor(channel, "heavy-reader", kind="human"), Actor(channel, "quiet-sidebar", kind="human")
        )


async def test_costly_reads_are_paced_to_the_principals_budget_and_others_go_on(readers: Readers) -> None:
    """The finding: within its call rate, one principal's filtered listings took the coordinator from another."""
    mailbox, heavy, quiet = readers.mailbox, readers.heavy, readers.quiet
    started = time.monotonic()
    for _ in range(2):
        page = await heavy.stub.ListClaims(_in_doubt(mailbox), metadata=heavy.metadata)
        assert (list(page.subjects), page.next_page_token) == ([], "")
    # 6,000 records read at 2,000 a second with 2,000 at once: the reads past the first 2,000 wait their turn.
    assert time.monotonic() - started >= (2 * SUBJECTS - RATE) / RATE - 0.5
    # Meanwhile another principal owes nothing: its calls are not refused, nor made to wait for the reader's.
    assert (await quiet.status(message(mailbox, "m-00001"))).state == pb.SUBJECT_STATE_CLAIMED


async def test_a_principal_whose_calls_in_flight_wait_their_turns_is_refused_with_when_to_retry(
    readers: Readers,
) -> None:
    mailbox, heavy, quiet = readers.mailbox, readers.heavy, readers.quiet

    async def page() -> pb.ListClaimsResponse:
        return await heavy.stub.ListClaims(_in_doubt(mailbox), metadata=heavy.metadata)

    in_flight = [asyncio.create_task(page()) for _ in range(9)]
    await asyncio.sleep(0.5)  # one reads, the others wait for their turn
    error = await rpc_error(heavy.stub.ListClaims(_in_doubt(mailbox), metadata=heavy.metadata))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert error_reason(error)[0] == "WORK_LIMITED"
    assert "records read per second" in (error.details() or "")
    assert (error_retry_delay_ms(error) or 0) > 0
    # Any call of that principal is refused meanwhile, a search of the recent messages too.
    recent = await rpc_error(
        heavy.stub.ListRecentMessages(pb.ListRecentMessagesRequest(mailbox=mailbox, query="x"), metadata=heavy.metadata)
    )
    assert error_reason(recent)[0] == "WORK_LIMITED"
    assert (await quiet.recent(mailbox, query="order 12")).messages
    done, waiting = await asyncio.wait(in_flight, timeout=0.1)
    assert all(not task.exception() for task in done)  # paced, not dropped: what has its turn answers
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
