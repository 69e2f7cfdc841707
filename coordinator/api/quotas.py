"""Abuse limits per principal: a call rate (token bucket) and a number of concurrent watches."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class QuotaSettings:
    # Sustained calls per second per principal (0 turns the limit off) and the burst above it.
    calls_per_second: float = 500.0
    burst: int = 1000
    # Concurrent Watch streams per principal.
    max_watches: int = 64
    # Every unary call is cut off after this long, whatever deadline the client set (or none).
    call_deadline_s: float = 30.0
    # A Watch stream whose next message gRPC has not taken within this long is ended with ABORTED: its client
    # stopped reading (HTTP/2 flow control holds the write back). docs/operations.md, "Slow watchers".
    watch_drain_timeout_s: float = 10.0
    # Messages per second that all Watch streams of one principal may be written together (0: no limit); a
    # stream that stays behind for watch_drain_timeout_s is ended. docs/operations.md, "Slow watchers".
    watch_events_per_second: float = 2000.0


# Buckets kept before the full ones are forgotten (a full bucket answers as a new one does). Without auth,
# principals are whatever names callers send, so the table must not grow with them.
_BUCKETS_KEPT = 4096


class RateLimiter:
    """One token bucket per principal; ``acquire`` answers 0 when the calls may go, else seconds to wait."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._rate = rate
        self._burst = float(burst)
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}
        self._forget_full_at = _BUCKETS_KEPT

    @property
    def buckets(self) -> int:
        return len(self._buckets)

    def acquire(self, key: str, calls: int = 1) -> float:
        """Takes ``calls`` tokens. A batch larger than the burst goes once the bucket is full and leaves
        it in debt, so that it is admitted at all and still pays for every call it carried."""
        if self._rate <= 0:
            return 0.0
        now = self._clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self._forget_full_at:
                self._forget_full(now)
            bucket = (self._burst, now)
        tokens, stamp = bucket
        tokens = min(self._burst, tokens + (now - stamp) * self._rate)
        needed = min(float(calls), self._burst)
        if tokens >= needed:
            self._buckets[key] = (tokens - calls, now)
            return 0.0
        self._buckets[key] = (tokens, now)
        return (needed - tokens) / self._rate

    def _forget_full(self, now: float) -> None:
        self._buckets = {
            key: (tokens, stamp)
            for key, (tokens, stamp) in self._buckets.items()
            if tokens + (now - stamp) * self._rate < self._burst
        }
        # Swept again only once the table doubled: a crowd of busy principals costs O(1) a call, not a sweep each.
        self._forget_full_at = max(_BUCKETS_KEPT, 2 * len(self._buckets))


class WatchSlots:
    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._used: dict[str, int] = {}

    def acquire(self, key: str) -> bool:
        used = self._used.get(key, 0)
        if used >= self._limit:
            return False
        self._used[key] = used + 1
        return True

    def release(self, key: str) -> None:
        left = self._used.get(key, 0) - 1
        if left > 0:
            self._used[key] = left
        else:
            self._used.pop(key, None)
