"""Cursors (docs/design.md#cursors) on etcd: many workers taking ranges of one cursor at once never hold two ranges
together, the cursor only moves forward and only by its range's holder, a covered position is answered COVERED, a
retried take answers its own range, and a range advanced after another worker took the cursor is STALE_RANGE."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest

from inbox_wire.v1 import coordinator_pb2 as pb
from tests.helpers import Actor

pytestmark = pytest.mark.etcd
TAKE, ADVANCE = pb.TakeCursorRangeResponse, pb.AdvanceCursorResponse


def take(mailbox: str, through: int = 0, request_id: str = "") -> pb.TakeCursorRangeRequest:
    return pb.TakeCursorRangeRequest(
        request_id=request_id or uuid.uuid4().hex, mailbox=mailbox, name="gmail-history", through_position=through
    )


def advance(mailbox: str, token: int, position: int) -> pb.AdvanceCursorRequest:
    return pb.AdvanceCursorRequest(
        request_id=uuid.uuid4().hex,
        mailbox=mailbox,
        name="gmail-history",
        range_token=token,
        value=str(position),
        position=position,
    )


async def test_sixteen_workers_never_hold_two_ranges_and_the_cursor_only_moves_forward(
    agent: Actor, mailbox: str
) -> None:
    holding: list[int] = []
    overlaps = 0
    positions: list[int] = []

    async def worker(pushes: list[int]) -> None:
        nonlocal overlaps
        for through in pushes:
            while True:
                answer = await agent.stub.TakeCursorRange(take(mailbox, through), metadata=agent.metadata)
                if answer.result == TAKE.COVERED:
                    break
                if answer.result == TAKE.BUSY:
                    await asyncio.sleep(0.01)
                    continue
                assert answer.result == TAKE.TAKEN
                holding.append(answer.range_token)
                overlaps += len(holding) > 1
                await asyncio.sleep(0.005)  # reading the history, recording each message
                holding.remove(answer.range_token)
                done = await agent.stub.AdvanceCursor(
                    advance(mailbox, answer.range_token, max(through, answer.position)), metadata=agent.metadata
                )
                assert done.result == ADVANCE.OK
                positions.append(done.position)
                break

    await asyncio.gather(*(worker([10 * i + j for j in range(1, 6)]) for i in range(16)))
    assert overlaps == 0
    assert positions == sorted(positions)
    final = await agent.stub.GetCursor(
        pb.GetCursorRequest(mailbox=mailbox, name="gmail-history"), metadata=agent.metadata
    )
    assert final.position == 155
    assert not final.HasField("range")
    covered = await agent.stub.TakeCursorRange(take(mailbox, 100), metadata=agent.metadata)
    assert covered.result == TAKE.COVERED


async def test_a_retried_take_answers_its_range_and_a_stale_range_advances_nothing(
    agent: Actor, other_agent: Actor, mailbox: str
) -> None:
    request_id = uuid.uuid4().hex
    first = await agent.stub.TakeCursorRange(take(mailbox, 5, request_id), metadata=agent.metadata)
    again = await agent.stub.TakeCursorRange(take(mailbox, 5, request_id), metadata=agent.metadata)
    assert (first.result, again.result, again.range_token) == (TAKE.TAKEN, TAKE.TAKEN, first.range_token)
    busy = await other_agent.stub.TakeCursorRange(take(mailbox, 5), metadata=other_agent.metadata)
    assert busy.result == TAKE.BUSY
    assert busy.busy.holder == "agent-a"
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await other_agent.stub.AdvanceCursor(advance(mailbox, first.range_token, 5), metadata=other_agent.metadata)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    gave_back = await agent.stub.AdvanceCursor(advance(mailbox, first.range_token, 0), metadata=agent.metadata)
    assert gave_back.result == ADVANCE.OK
    second = await other_agent.stub.TakeCursorRange(take(mailbox, 5), metadata=other_agent.metadata)
    assert second.result == TAKE.TAKEN
    stale = await agent.stub.AdvanceCursor(advance(mailbox, first.range_token, 5), metadata=agent.metadata)
    assert stale.result == ADVANCE.STALE_RANGE
    with pytest.raises(grpc.aio.AioRpcError) as backwards:
        await other_agent.stub.AdvanceCursor(advance(mailbox, second.range_token, -1), metadata=other_agent.metadata)
    assert backwards.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_dead_workers_range_is_taken_again_after_its_ttl(
    agent: Actor, other_agent: Actor, mailbox: str
) -> None:
    request = take(mailbox, 7)
    request.ttl_seconds = 5
    dead = await agent.stub.TakeCursorRange(request, metadata=agent.metadata)
    assert dead.result == TAKE.TAKEN
    for _ in range(80):  # etcd expires the range's lease: 5 s, plus its bucket and its expiry check
        answer = await other_agent.stub.TakeCursorRange(take(mailbox, 7), metadata=other_agent.metadata)
        if answer.result == TAKE.TAKEN:
            break
        await asyncio.sleep(0.1)
    assert answer.result == TAKE.TAKEN
    late = await agent.stub.AdvanceCursor(advance(mailbox, dead.range_token, 7), metadata=agent.metadata)
    assert late.result == ADVANCE.STALE_RANGE
