"""Abuse limits per principal: a call rate and a work rate (token buckets), and a number of concurrent watches."""

from __future__ import annotations

import asyncio
import contextlib
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
    # Work per second per principal (0 turns the limit off): each key or record a call reads, and each one it
    # searches, is a unit (coordinator/core/work.py). A principal's costly reads take turns, each once what it
    # owes is waited out, so that they cannot take the coordinator and etcd from the others; one that owes much,
    # or has many reads waiting, is refused (RESOURCE_EXHAUSTED, WORK_LIMITED). docs/security.md, "Fair use";
    # docs/performance.md, "Fair reads", measured the default.
    work_per_second: float = 5_000.0
    # The work a principal may do at once above its rate: a filtered ListClaims page reads up to 5,000 subjects,
    # a Watch snapshot a whole mailbox, a search of recent messages twice the mailbox's deliveries.
    work_burst: int = 10_000


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

    def charge(self, key: str, units: float) -> None:
        """Takes ``units`` tokens whatever is left: work already done is paid for, into debt if it must be."""
        now = self._clock()
        tokens, stamp = self._buckets.get(key, (self._burst, now))
        self._buckets[key] = (min(self._burst, tokens + (now - stamp) * self._rate) - units, now)

    def _forget_full(self, now: float) -> None:
        self._buckets = {
            key: (tokens, stamp)
            for key, (tokens, stamp) in self._buckets.items()
            if tokens + (now - stamp) * self._rate < self._burst
        }
        # Swept again only once the table doubled: a crowd of busy principals costs O(1) a call, not a sweep each.
        self._forget_full_at = max(_BUCKETS_KEPT, 2 * len(self._buckets))


class WorkBudget:
    """Work units per principal (coordinator/core/work.py), as a token bucket paid as the work is done. ``of``
    hands a call its principal's budget: the lock its costly reads take one at a time, and ``pay``, which answers
    how long the principal owes work for (waited out before its next costly read: reads go at the budget's rate
    whatever the number of calls); ``owed`` says it before a call starts (one owing more than OWED_MAX_S has
    that much read by calls in flight: it is refused)."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._buckets = RateLimiter(rate, burst, clock)
        self._rate = rate
        self._budgets: dict[str, PrincipalWork] = {}

    def owed(self, principal: str) -> float:
        """Seconds until ``principal``'s work is paid for; 0 when it owes none."""
        return self._buckets.acquire(principal, 0)

    def pay(self, principal: str, units: int) -> float:
        if self._rate <= 0:
            return 0.0
        if units > 0:
            self._buckets.charge(principal, units)
        return self.owed(principal)

    def waiting(self, principal: str) -> int:
        """How many costly reads of ``principal`` wait for their turn."""
        budget = self._budgets.get(principal)
        return budget.lock.waiting if budget is not None else 0

    def of(self, principal: str) -> PrincipalWork | None:
        """The budget of ``principal``'s calls; None when work is not limited."""
        if self._rate <= 0:
            return None
        budget = self._budgets.get(principal)
        if budget is None:
            if len(self._budgets) >= _BUCKETS_KEPT:  # those no read holds are made again when needed
                self._budgets = {name: held for name, held in self._budgets.items() if held.lock.locked()}
            budget = self._budgets[principal] = PrincipalWork(self, principal)
        return budget


class Turns(contextlib.AbstractAsyncContextManager[None]):
    """The lock a principal's costly reads take one at a time, counting those waiting for it."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self.waiting = 0

    def locked(self) -> bool:
        return self._lock.locked()

    async def __aenter__(self) -> None:
        self.waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self.waiting -= 1

    async def __aexit__(self, *exc: object) -> None:
        self._lock.release()


class PrincipalWork:
    """One principal's work budget, as coordinator/core/work.py's ``Budget``."""

    def __init__(self, budgets: WorkBudget, principal: str) -> None:
        self._budgets = budgets
        self._principal = principal
        self.turns = Turns()

    @property
    def lock(self) -> Turns:
        return self.turns

    def pay(self, units: int) -> float:
        return self._budgets.pay(self._principal, units)


# A principal that owes more work than this many seconds of its budget, or that owes any and has this many costly
# reads waiting for their turn, is refused new calls (WORK_LIMITED) until it owes and waits less: its calls in
# flight read that much.
OWED_MAX_S = 1.0
TURNS_WAITING_MAX = 8


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
