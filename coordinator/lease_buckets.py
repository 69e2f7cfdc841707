"""Shared etcd leases: one per second of expiry (docs/design.md#leases-and-expiry)."""

from __future__ import annotations

import asyncio
import bisect
import math
import time
from collections.abc import Awaitable, Callable

# Keys whose expiries fall within this much of each other share a lease.
SHARED_WITHIN_MS = 1000


class LeaseBuckets:
    """Etcd leases shared by every key that expires at about the same moment.

    A LeaseGrant costs as much as a transaction; a lease per claim would halve throughput. A key is put with
    the lease that etcd will expire at or after the key's expiry and less than ``SHARED_WITHIN_MS`` after it;
    only when there is none is a lease granted, so the hot path grants at most about once a second.

    Leases are kept by the moment they themselves end, not by a fixed grid: etcd's TTLs are whole seconds
    counted from the grant, so a lease granted for a grid boundary would end up to a second after it, and a key
    on it up to two seconds after its expiry (found by the fault run's claim-free bound, docs/reliability.md).

    Only the distance from now to an expiry counts, and leases are kept on the monotonic clock: a step of the
    wall clock (NTP, a VM resumed) must not hand a new claim a lease granted minutes earlier for another instant.
    """

    def __init__(
        self,
        grant: Callable[[int], Awaitable[int]],
        clock: Callable[[], int],
        monotonic_ms: Callable[[], int] = lambda: time.monotonic_ns() // 1_000_000,
    ) -> None:
        self._grant = grant
        self._clock = clock
        self._monotonic_ms = monotonic_ms
        self._ends: list[int] = []  # sorted: when each lease ends, on the monotonic clock
        self._leases: dict[int, asyncio.Future[int]] = {}

    async def lease_for(self, expires_ms: int) -> int:
        now = self._monotonic_ms()
        due = now + expires_ms - self._clock()
        self._forget_past(now)
        index = bisect.bisect_left(self._ends, due)
        if index < len(self._ends) and self._ends[index] < due + SHARED_WITHIN_MS:
            future = self._leases[self._ends[index]]
            if not (future.done() and future.exception() is not None):
                return await asyncio.shield(future)
            self._drop(self._ends[index])
        ttl_s = max(1, math.ceil((due - now) / 1000))
        ends = now + ttl_s * 1000  # etcd counts from when it applies the grant, a little later: never earlier
        future = asyncio.get_running_loop().create_future()
        if ends in self._leases:
            self._drop(ends)
        bisect.insort(self._ends, ends)
        self._leases[ends] = future
        try:
            future.set_result(await self._grant(ttl_s))
        except BaseException as exc:
            if self._leases.get(ends) is future:
                self._drop(ends)
            future.set_exception(exc)
            future.exception()  # mark retrieved: the other waiters re-raise it themselves
            raise
        if self._monotonic_ms() - now > SHARED_WITHIN_MS // 4 and self._leases.get(ends) is future:
            # etcd applied the grant somewhere between the request and the answer, so this lease may end that
            # much later than `ends`: keep it for this key, share it with none (a slow etcd, a slow network).
            self._drop(ends)
        return await asyncio.shield(future)

    def _drop(self, ends: int) -> None:
        del self._leases[ends]
        self._ends.pop(bisect.bisect_left(self._ends, ends))

    def _forget_past(self, now: int) -> None:
        past = bisect.bisect_left(self._ends, now)
        if past:
            for ends in self._ends[:past]:
                del self._leases[ends]
            del self._ends[:past]

    def __len__(self) -> int:
        return len(self._leases)
