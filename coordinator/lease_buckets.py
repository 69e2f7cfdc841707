"""Shared etcd leases: one per second of expiry (docs/design.md#leases-and-expiry)."""

from __future__ import annotations

import asyncio
import bisect
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

# Keys whose expiries fall within this much of each other share a lease.
SHARED_WITHIN_MS = 1000


@dataclass
class _Lease:
    """etcd starts a lease's TTL when it applies the grant: after the request, no later than the answer. So the
    lease ends between ``ends`` (request + TTL) and the answer + TTL; a slow grant (a slow etcd, a slow network)
    ends late by as much as it took."""

    future: asyncio.Future[int]
    ends: int
    requested_ms: int
    answered_ms: int | None = None

    def latest_end(self, now: int) -> int:
        return self.ends + ((self.answered_ms if self.answered_ms is not None else now) - self.requested_ms)


class LeaseBuckets:
    """Etcd leases shared by every key that expires at about the same moment.

    A LeaseGrant costs as much as a transaction; a lease per claim would halve throughput. A key is put with
    the lease that etcd will expire at or after the key's expiry and less than ``SHARED_WITHIN_MS`` after it;
    only when there is none is a lease granted, so the hot path grants at most about once a second.

    Leases are kept by the moment they themselves end, not by a fixed grid: etcd's TTLs are whole seconds
    counted from the grant, so a lease granted for a grid boundary would end up to a second after it, and a key
    on it up to two seconds after its expiry (found by the fault run's claim-free bound, docs/reliability.md).
    A lease is shared only while the latest it can end is still inside that second (see _Lease).

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
        self._ends: list[int] = []  # sorted: the earliest each lease can end, on the monotonic clock
        self._leases: dict[int, _Lease] = {}

    async def lease_for(self, expires_ms: int) -> int:
        now = self._monotonic_ms()
        due = now + expires_ms - self._clock()
        self._forget_past(now)
        index = bisect.bisect_left(self._ends, due)
        while index < len(self._ends) and self._ends[index] < due + SHARED_WITHIN_MS:
            lease = self._leases[self._ends[index]]
            if lease.future.done() and lease.future.exception() is not None:
                self._drop(self._ends[index])
                continue
            if lease.latest_end(now) < due + SHARED_WITHIN_MS:
                return await asyncio.shield(lease.future)
            index += 1
        ttl_s = max(1, math.ceil((due - now) / 1000))
        ends = now + ttl_s * 1000
        lease = _Lease(asyncio.get_running_loop().create_future(), ends, now)
        if ends in self._leases:
            self._drop(ends)
        bisect.insort(self._ends, ends)
        self._leases[ends] = lease
        try:
            lease.future.set_result(await self._grant(ttl_s))
        except BaseException as exc:
            if self._leases.get(ends) is lease:
                self._drop(ends)
            lease.future.set_exception(exc)
            lease.future.exception()  # mark retrieved: the other waiters re-raise it themselves
            raise
        lease.answered_ms = self._monotonic_ms()
        return await asyncio.shield(lease.future)

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
