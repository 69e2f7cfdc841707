"""Shared leases: a key's lease ends at or after its expiry and less than a second after it, whatever the
moment of the grant; keys that expire within a second of each other share one grant."""

from __future__ import annotations

import random

import pytest

from coordinator.lease_buckets import SHARED_WITHIN_MS, LeaseBuckets


class Clocks:
    """The wall clock and the monotonic clock, a fixed (odd) distance apart, moved together."""

    def __init__(self, wall_ms: int, offset_ms: int) -> None:
        self.wall_ms = wall_ms
        self.offset_ms = offset_ms

    def wall(self) -> int:
        return self.wall_ms

    def monotonic(self) -> int:
        return self.wall_ms - self.offset_ms


class Etcd:
    """Grants leases with whole-second TTLs counted from the grant, as etcd does."""

    def __init__(self, clocks: Clocks) -> None:
        self.clocks = clocks
        self.ends: dict[int, int] = {}  # lease id -> when etcd expires it, wall ms

    async def grant(self, ttl_s: int) -> int:
        lease = len(self.ends) + 1
        self.ends[lease] = self.clocks.wall_ms + ttl_s * 1000
        return lease


async def test_a_lease_ends_at_or_after_the_expiry_and_less_than_a_second_later() -> None:
    rng = random.Random(12)
    clocks = Clocks(1_700_000_000_000, offset_ms=rng.randrange(10**9))
    etcd = Etcd(clocks)
    leases = LeaseBuckets(etcd.grant, clocks.wall, clocks.monotonic)
    for _ in range(2000):
        clocks.wall_ms += rng.randrange(0, 400)
        # Expiries as the domain makes them: now + TTL rounded up to a whole second of the wall clock.
        expires = -(-(clocks.wall_ms + rng.randrange(5, 60) * 1000) // 1000) * 1000
        lease = await leases.lease_for(expires)
        late = etcd.ends[lease] - expires
        assert 0 <= late < SHARED_WITHIN_MS, (expires, etcd.ends[lease])


async def test_keys_expiring_within_a_second_share_one_grant() -> None:
    clocks = Clocks(1_700_000_000_250, offset_ms=123_456_789)
    etcd = Etcd(clocks)
    leases = LeaseBuckets(etcd.grant, clocks.wall, clocks.monotonic)
    expires = 1_700_000_030_000
    first = await leases.lease_for(expires)
    for step in range(10):  # the same expiry, asked over the next 900 ms
        clocks.wall_ms += 90 * (step > 0)
        assert await leases.lease_for(expires) == first
    assert len(etcd.ends) == 1
    later = await leases.lease_for(expires + 1000)
    assert later != first
    assert len(etcd.ends) == 2


async def test_a_failed_grant_is_tried_again_by_the_next_key() -> None:
    clocks = Clocks(1_700_000_000_000, offset_ms=0)
    etcd = Etcd(clocks)
    failing = True

    async def grant(ttl_s: int) -> int:
        if failing:
            raise ConnectionError("etcd unreachable")
        return await etcd.grant(ttl_s)

    leases = LeaseBuckets(grant, clocks.wall, clocks.monotonic)
    with pytest.raises(ConnectionError):
        await leases.lease_for(1_700_000_010_000)
    failing = False
    lease = await leases.lease_for(1_700_000_010_000)
    assert etcd.ends[lease] >= 1_700_000_010_000


async def test_leases_that_ended_are_forgotten() -> None:
    clocks = Clocks(1_700_000_000_000, offset_ms=5)
    etcd = Etcd(clocks)
    leases = LeaseBuckets(etcd.grant, clocks.wall, clocks.monotonic)
    for second in range(1, 11):
        await leases.lease_for(1_700_000_000_000 + second * 1000)
    assert len(leases) == 10
    clocks.wall_ms += 20_000
    await leases.lease_for(clocks.wall_ms + 5000)
    assert len(leases) == 1


async def test_a_lease_whose_grant_was_slow_is_not_shared() -> None:
    """etcd starts a lease when it applies the grant, which may be as late as its answer: a grant that took
    long may end that much after the coordinator's reckoning, so no later key is put on it."""
    clocks = Clocks(1_700_000_000_000, offset_ms=0)
    etcd = Etcd(clocks)

    async def slow_grant(ttl_s: int) -> int:
        clocks.wall_ms += 800  # the grant is applied, and answered, 0.8 s after it was asked for
        return await etcd.grant(ttl_s)

    leases = LeaseBuckets(slow_grant, clocks.wall, clocks.monotonic)
    expires = 1_700_000_010_000
    first = await leases.lease_for(expires)
    second = await leases.lease_for(expires)
    assert second != first
    assert len(leases) == 0  # neither kept for sharing: both grants were slow
