"""Shared leases: a key's lease ends at or after its expiry and less than a second after it, whatever the
moment of the grant; keys that expire within a second of each other share one grant; after etcd's leader
changes (which restarts every lease's TTL), no key goes on a lease granted before."""

from __future__ import annotations

import asyncio
import random

import pytest

from coordinator.core.errors import StoreUnavailable
from coordinator.store.etcd.lease_buckets import GRANTS_PER_CALL, LONGER_TTL_SHARED_S, SHARED_WITHIN_MS, LeaseBuckets


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
    """Grants leases with whole-second TTLs counted from the grant, as etcd does; a new leader restarts every
    lease it inherits at the election timeout plus its full TTL (etcd's lessor, ``Promote``; no checkpoints)."""

    ELECTION_TIMEOUT_MS = 1000

    def __init__(self, clocks: Clocks) -> None:
        self.clocks = clocks
        self.ends: dict[int, int] = {}  # lease id -> when etcd expires it, wall ms
        self.ttls: dict[int, int] = {}
        self.term = 2

    async def grant(self, ttl_s: int) -> int:
        lease = len(self.ends) + 1
        self.ends[lease] = self.clocks.wall_ms + ttl_s * 1000
        self.ttls[lease] = ttl_s
        return lease

    def new_leader(self) -> None:
        self.term += 1
        now = self.clocks.wall_ms
        for lease, ends in self.ends.items():
            if ends > now:
                self.ends[lease] = now + self.ELECTION_TIMEOUT_MS + self.ttls[lease] * 1000


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


def _expiry(clocks: Clocks, ttl_s: int) -> int:
    """As the domain makes it: now + TTL rounded up to a whole second of the wall clock."""
    return -(-(clocks.wall_ms + ttl_s * 1000) // 1000) * 1000


async def test_after_a_leader_change_keys_go_on_leases_of_the_new_term() -> None:
    """The failed fault run (seed 9031): a lease granted before an election, which the new leader restarted,
    was still shared by a key put after it, and that claim freed 3.4 s after its expiry."""
    clocks = Clocks(1_700_000_000_400, offset_ms=77)
    etcd = Etcd(clocks)
    leases = LeaseBuckets(etcd.grant, clocks.wall, clocks.monotonic, term=lambda: etcd.term)
    expires = 1_700_000_009_000
    before = await leases.lease_for(expires)
    clocks.wall_ms += 1500
    etcd.new_leader()  # the earlier lease now ends at election timeout + its 9 s TTL from here
    assert etcd.ends[before] - expires > SHARED_WITHIN_MS
    after = await leases.lease_for(expires)
    assert after != before
    assert 0 <= etcd.ends[after] - expires < SHARED_WITHIN_MS
    assert await leases.lease_for(expires) == after  # shared again within the new term
    assert len(leases) == 1  # the earlier term's lease is forgotten


async def test_a_grant_that_spans_a_leader_change_is_asked_again_and_never_shared() -> None:
    clocks = Clocks(1_700_000_000_000, offset_ms=0)
    etcd = Etcd(clocks)
    elections = 1

    async def grant(ttl_s: int) -> int:
        nonlocal elections
        lease = await etcd.grant(ttl_s)
        clocks.wall_ms += 20
        if elections:  # etcd's answer comes from the new leader: the coordinator learns the new term with it
            elections -= 1
            etcd.new_leader()
        return lease

    leases = LeaseBuckets(grant, clocks.wall, clocks.monotonic, term=lambda: etcd.term)
    expires = 1_700_000_010_000
    lease = await leases.lease_for(expires)
    assert lease == 2
    assert len(etcd.ends) == 2
    assert 0 <= etcd.ends[lease] - expires < SHARED_WITHIN_MS
    assert await leases.lease_for(expires) == lease


async def test_keys_waiting_for_a_grant_ask_again_when_the_term_moves_on_meanwhile() -> None:
    clocks = Clocks(1_700_000_000_000, offset_ms=3)
    etcd = Etcd(clocks)
    answer: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def grant(ttl_s: int) -> int:
        if len(etcd.ends) == 0:
            await answer  # the first grant hangs until the election below
        return await etcd.grant(ttl_s)

    leases = LeaseBuckets(grant, clocks.wall, clocks.monotonic, term=lambda: etcd.term)
    expires = 1_700_000_010_000
    waiting = [asyncio.create_task(leases.lease_for(expires)) for _ in range(5)]
    await asyncio.sleep(0)
    etcd.term += 1  # another call's answer carried the new term
    answer.set_result(None)
    got = await asyncio.gather(*waiting)
    assert set(got) == {2}, got  # one more grant, shared by all five
    assert len(etcd.ends) == 2


async def test_a_call_whose_grants_keep_spanning_elections_is_refused_as_unavailable() -> None:
    clocks = Clocks(1_700_000_000_000, offset_ms=0)
    etcd = Etcd(clocks)

    async def grant(ttl_s: int) -> int:
        etcd.new_leader()
        return await etcd.grant(ttl_s)

    leases = LeaseBuckets(grant, clocks.wall, clocks.monotonic, term=lambda: etcd.term)
    with pytest.raises(StoreUnavailable, match="changed leader during each of 3 lease grants"):
        await leases.lease_for(1_700_000_010_000)
    assert len(etcd.ends) == GRANTS_PER_CALL


async def test_across_random_leader_changes_every_key_put_after_one_ends_within_the_second() -> None:
    """Keys put while the coordinator knows etcd's current term end less than a second after their expiry
    (checked at the put, against the lease's end as etcd's leader keeps it); keys already on a lease when the
    leader changes are freed when etcd lets it run out: at most the election timeout plus about their own TTL
    after the change, never the TTL of a longer-lived lease that happened to end with them."""
    rng = random.Random(26)
    clocks = Clocks(1_700_000_000_000, offset_ms=rng.randrange(10**9))
    etcd = Etcd(clocks)
    leases = LeaseBuckets(etcd.grant, clocks.wall, clocks.monotonic, term=lambda: etcd.term)
    changes = 0
    puts: list[tuple[int, int, int]] = []  # (lease, expiry, the key's own TTL in whole seconds)
    for _ in range(3000):
        clocks.wall_ms += rng.randrange(0, 300)
        if rng.random() < 0.01:
            etcd.new_leader()
            changes += 1
            for lease, expires, own_ttl_s in puts:
                # Keys already on a lease: it restarts at election timeout + its TTL, about the key's own.
                if expires > clocks.wall_ms - SHARED_WITHIN_MS:
                    restarted = etcd.ends[lease] - clocks.wall_ms
                    assert restarted <= Etcd.ELECTION_TIMEOUT_MS + (own_ttl_s + LONGER_TTL_SHARED_S) * 1000
        expires = _expiry(clocks, rng.choice((5, 8, 10, 60, 3600)))
        lease = await leases.lease_for(expires)
        assert 0 <= etcd.ends[lease] - expires < SHARED_WITHIN_MS, (expires, etcd.ends[lease], etcd.term)
        puts.append((lease, expires, -(-(expires - clocks.wall_ms) // 1000)))
    assert changes >= 20


async def test_a_key_never_shares_a_lease_much_longer_than_its_own_ttl() -> None:
    """A day-long lease (a delivery record's) that ends in the same second as a 5-second claim: after an
    election etcd would keep that claim for a day."""
    clocks = Clocks(1_700_000_000_000, offset_ms=11)
    etcd = Etcd(clocks)
    leases = LeaseBuckets(etcd.grant, clocks.wall, clocks.monotonic)
    day = await leases.lease_for(clocks.wall_ms + 86_400_000)
    clocks.wall_ms += 86_395_000
    claim = await leases.lease_for(clocks.wall_ms + 5_000)
    assert claim != day
    assert etcd.ttls[claim] == 5
    assert await leases.lease_for(clocks.wall_ms + 5_000) == claim
    clocks.wall_ms += 1_100  # the same second of expiry a second later: a 4-second key takes the 5-second lease
    assert await leases.lease_for(clocks.wall_ms + 3_900) == claim
    clocks.wall_ms += 1_000  # and two seconds later a 3-second key does not
    assert await leases.lease_for(clocks.wall_ms + 2_900) != claim
