"""The per-principal token buckets (call rate, work, and Watch write budget): bounded memory, answers unchanged;
a call's work counted on its meter and paced (coordinator/core/work.py)."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.api.quotas import _BUCKETS_KEPT, RateLimiter, WorkBudget
from coordinator.core import work


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_buckets_of_principals_gone_quiet_are_forgotten() -> None:
    clock = _Clock()
    limiter = RateLimiter(rate=10, burst=10, clock=clock)
    most = 0
    for n in range(3 * _BUCKETS_KEPT):  # without auth, principals are whatever names callers send
        clock.now += 1.0  # every earlier bucket is full again: it answers as a new one would
        assert limiter.acquire(f"caller-{n}") == 0
        most = max(most, limiter.buckets)
    assert most <= _BUCKETS_KEPT


def test_a_principal_over_its_rate_stays_held_however_many_others_come() -> None:
    clock = _Clock()
    limiter = RateLimiter(rate=10, burst=10, clock=clock)
    for _ in range(10):
        assert limiter.acquire("busy") == 0
    for n in range(3 * _BUCKETS_KEPT):  # all at the same moment: none of their buckets is full
        assert limiter.acquire(f"caller-{n}") == 0
    assert limiter.buckets == 3 * _BUCKETS_KEPT + 1  # each still owes its token: none forgotten
    assert limiter.acquire("busy") == 0.1  # one token at 10/s
    clock.now += 0.1
    assert limiter.acquire("busy") == 0


def test_work_is_paid_as_done_and_owed_for_as_long_as_the_budget_takes_to_pay_it() -> None:
    clock = _Clock()
    budget = WorkBudget(rate=1000, burst=2000, clock=clock)
    assert budget.pay("reader", 1500) == 0  # within the burst
    assert budget.pay("reader", 1500) == 1.0  # 1,000 over: a second at 1,000/s
    assert budget.owed("reader") == 1.0
    assert budget.owed("quiet") == 0  # another principal owes nothing
    clock.now += 0.6
    assert budget.owed("reader") == pytest.approx(0.4)
    clock.now += 0.4
    assert budget.owed("reader") == 0
    assert WorkBudget(rate=0, burst=1, clock=clock).pay("reader", 10**9) == 0  # off


async def test_costly_reads_take_turns_each_once_what_its_principal_owes_is_waited_out() -> None:
    """Four calls of one principal reading 1,000 records at once each, on a budget of 1,000 a second with 1,000 at
    once: one read at a time, each waiting what the reads before it left owed; a cheap read counts on its meter."""
    clock = _Clock()
    budget = WorkBudget(rate=1000, burst=1000, clock=clock)
    waits: list[float] = []
    reads: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        clock.now += seconds

    async def call() -> int:
        with work.metered(budget.of("reader")) as meter:
            work.spend(3)  # a small read, charged with the next costly one
            async with work.turn() as read:
                reads.append(clock.now)
                await original_sleep(0)  # the read's round trip: the other calls queue for their turn
                read(1000)
        return meter.units

    original_sleep = asyncio.sleep
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(asyncio, "sleep", sleep)
        units = await asyncio.gather(*(call() for _ in range(4)))
    assert units == [1003] * 4
    # The first within the burst, the second once the small reads are paid; then at the budget's rate, one at a time.
    assert reads == pytest.approx([0.0, 0.006, 1.009, 2.012])
    assert budget.owed("reader") == pytest.approx(1.0)  # the last read's work, owed by whoever reads next
    assert budget.of("other") is not budget.of("reader")
    assert WorkBudget(rate=0, burst=1).of("reader") is None  # off: nothing waits
