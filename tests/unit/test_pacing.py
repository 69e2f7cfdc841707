"""The Watch write pacer: a few writes per turn of the event loop, a rate per principal, round-robin."""

from __future__ import annotations

import asyncio
import time

from coordinator.api.encoded import Encoded, writes_encoded
from coordinator.api.pacing import WritePacer
from coordinator.core.memo import LastConverted
from inbox_wire.v1 import coordinator_pb2 as pb


async def _turns(pacer: WritePacer, principal: str, count: int, done: list[str]) -> None:
    for _ in range(count):
        await pacer.turn(principal)
        done.append(principal)


async def test_at_most_per_turn_writes_start_in_one_turn_of_the_loop() -> None:
    pacer = WritePacer(events_per_second=0, per_turn=3)
    done: list[str] = []
    tasks = [asyncio.create_task(_turns(pacer, f"p{i}", 1, done)) for i in range(20)]
    counts = []
    while len(done) < 20:
        before = len(done)
        await asyncio.sleep(0)  # one turn of the loop
        counts.append(len(done) - before)
    await asyncio.gather(*tasks)
    assert max(counts) <= 3, counts
    assert len(counts) >= 7  # 20 writes, 3 a turn


async def test_a_principal_is_held_to_its_rate_while_another_principal_is_not_slowed() -> None:
    pacer = WritePacer(events_per_second=20)  # a bucket of 20, refilled at 20/s
    done: list[str] = []
    started = time.monotonic()
    busy = asyncio.create_task(_turns(pacer, "busy", 40, done))
    await asyncio.sleep(0.05)
    assert 20 <= done.count("busy") <= 22  # the burst went, then the rate holds it
    quiet_started = time.monotonic()
    await _turns(pacer, "quiet", 5, done)
    assert time.monotonic() - quiet_started < 0.2  # not queued behind the busy principal's backlog
    await busy
    # 40 writes at 20/s from a bucket of 20 cannot finish in less than a second.
    assert time.monotonic() - started >= 0.9


async def test_waiting_principals_take_turns() -> None:
    pacer = WritePacer(events_per_second=0, per_turn=1)
    done: list[str] = []
    await asyncio.gather(_turns(pacer, "a", 6, done), _turns(pacer, "b", 6, done), _turns(pacer, "c", 2, done))
    assert sorted(done) == sorted(["a"] * 6 + ["b"] * 6 + ["c"] * 2)
    # "c" is not kept waiting until "a" and "b" are done: round-robin by principal.
    assert max(i for i, who in enumerate(done) if who == "c") < 8, done


async def test_a_stream_cancelled_while_waiting_is_skipped() -> None:
    pacer = WritePacer(events_per_second=10)
    for _ in range(10):
        await pacer.turn("p")  # the bucket is empty now
    cancelled = asyncio.create_task(pacer.turn("p"))
    await asyncio.sleep(0)
    cancelled.cancel()
    async with asyncio.timeout(2):
        await pacer.turn("p")  # the next token goes to the stream still there
    assert cancelled.cancelled()
    assert pacer.waiting == 0


def test_an_encoded_message_is_written_as_its_bytes_and_others_are_serialized() -> None:
    response = pb.WatchResponse(event=pb.WatchEvent(revision=7))
    serialize = writes_encoded(pb.WatchResponse.SerializeToString)
    encoded = Encoded.of(response)
    assert serialize(encoded) is encoded.data
    assert pb.WatchResponse.FromString(serialize(encoded)) == response
    assert serialize(response) == response.SerializeToString()


def test_last_converted_converts_each_object_once_and_forgets_the_oldest() -> None:
    calls: list[object] = []

    def convert(key: list[int]) -> int:
        calls.append(key)
        return sum(key)

    remember = LastConverted(convert, size=2)
    first, second, third = [1], [2], [3]
    assert [remember(first), remember(first), remember(second), remember(first)] == [1, 1, 2, 1]
    assert calls == [first, second]
    remember(third)  # forgets the oldest entry
    equal_but_other = [1]
    assert remember(equal_but_other) == 1
    assert calls[-1] is equal_but_other  # by identity, not equality
