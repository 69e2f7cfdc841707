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


async def test_a_slow_grant_is_shared_only_where_its_late_start_still_fits() -> None:
    """etcd starts a lease when it applies the grant, which may be as late as its answer (the fake etcd here
    always does, the worst case): with grants taking up to 0.7 s, no key put on a lease someone else asked for
    ends a second or more after its expiry; a grant slower than a second is shared with no one."""
    rng = random.Random(7)
    clocks = Clocks(1_700_000_000_000, offset_ms=rng.randrange(10**9))
    etcd = Etcd(clocks)
    grant_takes_ms = 0

    async def slow_grant(ttl_s: int) -> int:
        clocks.wall_ms += grant_takes_ms
        return await etcd.grant(ttl_s)

    leases = LeaseBuckets(slow_grant, clocks.wall, clocks.monotonic)
    for _ in range(1000):
        clocks.wall_ms += rng.randrange(0, 300)
        grant_takes_ms = rng.randrange(0, 700)
        expires = -(-(clocks.wall_ms + rng.randrange(5, 30) * 1000) // 1000) * 1000
        granted_before = len(etcd.ends)
        lease = await leases.lease_for(expires)
        # The key whose call asked for the lease waits for the grant and is late by as much as it took; every
        # key that shares the lease afterwards is within the second.
        own_grant = len(etcd.ends) > granted_before
        assert 0 <= etcd.ends[lease] - expires < SHARED_WITHIN_MS + (grant_takes_ms if own_grant else 0)

    grant_takes_ms = 1200
    expires = clocks.wall_ms + 60_000
    first = await leases.lease_for(expires)
    assert await leases.lease_for(expires) != first
