"""Shared etcd leases: one per expiry bucket (docs/design.md#leases-and-expiry)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable


class LeaseBuckets:
    """One etcd lease per expiry instant, shared by every key that expires then.

    A LeaseGrant costs as much as a transaction; a lease per claim would halve throughput. Keys are put
    with the lease of their (rounded-up) expiry, so the hot path grants at most once per bucket.

    Only the distance from now to an expiry counts, and buckets are kept on the monotonic clock: a step of the
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
        self._leases: dict[int, asyncio.Future[int]] = {}

    async def lease_for(self, expires_ms: int) -> int:
        now = self._monotonic_ms()
        bucket = _round_up(now + expires_ms - self._clock(), 1000)
        future = self._leases.get(bucket)
        if future is None or (future.done() and future.exception() is not None):
            future = asyncio.get_running_loop().create_future()
            self._leases[bucket] = future
            self._forget_past(now)
            try:
                ttl = max(1, math.ceil((bucket - now) / 1000))
                future.set_result(await self._grant(ttl))
            except BaseException as exc:
                del self._leases[bucket]
                future.set_exception(exc)
                future.exception()  # mark retrieved: the other waiters re-raise it themselves
                raise
        return await asyncio.shield(future)

    def _forget_past(self, now: int) -> None:
        for expiry in [e for e in self._leases if e < now]:
            del self._leases[expiry]

    def __len__(self) -> int:
        return len(self._leases)


def _round_up(ms: int, step: int) -> int:
    return math.ceil(ms / step) * step
