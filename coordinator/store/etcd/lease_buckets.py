"""Shared etcd leases: one per second of expiry, granted in etcd's current leader's term
(docs/design.md#leases-and-expiry)."""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from coordinator.core.errors import StoreUnavailable

log = logging.getLogger(__name__)

# Keys whose expiries fall within this much of each other share a lease.
SHARED_WITHIN_MS = 1000
# A key shares a lease whose TTL is at most this much longer than the TTL it would be granted itself.
LONGER_TTL_SHARED_S = 1
# A call whose lease grant keeps spanning a change of etcd's leader gives up after this many grants.
GRANTS_PER_CALL = 3


def _ttl_s(due: int, now: int) -> int:
    """etcd's TTLs are whole seconds: the shortest that lasts until ``due``."""
    return max(1, math.ceil((due - now) / 1000))


@dataclass
class _Lease:
    """etcd starts a lease's TTL when it applies the grant: after the request, no later than the answer. So the
    lease ends between ``ends`` (request + TTL) and the answer + TTL; a slow grant (a slow etcd, a slow network)
    ends late by as much as it took.

    ``term`` is the raft term the coordinator knew when it asked. A new etcd leader restarts the TTL of every
    lease it inherits (etcd's lessor, ``Promote``: election timeout + the full ``ttl_s``, from the moment it
    takes over), so a lease is shared only while no later term has been seen, only if its own grant saw none,
    and only by keys whose own TTL is about as long (a 5-second claim on a day-long lease that happens to end
    with it would be held for a day after an election)."""

    future: asyncio.Future[int]
    ends: int
    requested_ms: int
    term: int
    ttl_s: int
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

    A lease granted before etcd's leader changed ends later than its grant said (see _Lease): once ``term``
    (the latest raft term etcd's answers carried) moves on, no key is put on an older lease; keys already on
    one are freed when etcd's new leader lets it run out, which is at most about their own TTL later, since no
    key shares a lease with a TTL more than ``LONGER_TTL_SHARED_S`` longer than its own.

    Only the distance from now to an expiry counts, and leases are kept on the monotonic clock: a step of the
    wall clock (NTP, a VM resumed) must not hand a new claim a lease granted minutes earlier for another instant.
    """

    def __init__(
        self,
        grant: Callable[[int], Awaitable[int]],
        clock: Callable[[], int],
        monotonic_ms: Callable[[], int] = lambda: time.monotonic_ns() // 1_000_000,
        *,
        term: Callable[[], int] = lambda: 0,
    ) -> None:
        self._grant = grant
        self._clock = clock
        self._monotonic_ms = monotonic_ms
        self._term = term
        self._leases_term = 0  # the term every lease in the table was asked for in
        self._ends: list[int] = []  # sorted: the earliest each lease can end, on the monotonic clock
        self._leases: dict[int, _Lease] = {}

    async def lease_for(self, expires_ms: int) -> int:
        for _ in range(GRANTS_PER_CALL):
            term = self._term()
            now = self._monotonic_ms()
            due = now + expires_ms - self._clock()
            self._forget(now, term)
            lease = self._shareable(due, now) or await self._granted(due, now, term)
            lease_id = await asyncio.shield(lease.future)
            if lease.term == self._term():
                return lease_id
            # etcd's leader changed while the lease was granted, or while this call waited for it: ask again.
        raise StoreUnavailable(
            f"etcd changed leader during each of {GRANTS_PER_CALL} lease grants in a row (raft term now "
            f"{self._term()}); retry the call with the same request id"
        )

    def _shareable(self, due: int, now: int) -> _Lease | None:
        longest_ttl_s = _ttl_s(due, now) + LONGER_TTL_SHARED_S
        index = bisect.bisect_left(self._ends, due)
        while index < len(self._ends) and self._ends[index] < due + SHARED_WITHIN_MS:
            lease = self._leases[self._ends[index]]
            if lease.future.done() and lease.future.exception() is not None:
                self._drop(self._ends[index])
                continue
            if lease.latest_end(now) < due + SHARED_WITHIN_MS and lease.ttl_s <= longest_ttl_s:
                return lease
            index += 1
        return None

    async def _granted(self, due: int, now: int, term: int) -> _Lease:
        ttl_s = _ttl_s(due, now)
        ends = now + ttl_s * 1000
        lease = _Lease(asyncio.get_running_loop().create_future(), ends, now, term, ttl_s)
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
        current = term == self._term()
        if not current and self._leases.get(ends) is lease:
            self._drop(ends)
        lease_id = lease.future.result()
        log.debug(
            "granted etcd lease %x (TTL %d s) in raft term %d in %d ms%s",
            lease_id,
            ttl_s,
            term,
            lease.answered_ms - now,
            "" if current else f"; not used: etcd's raft term moved to {self._term()} meanwhile",
            extra={
                "fields": {
                    "event": "lease_granted",
                    "lease": lease_id,
                    "ttl_s": ttl_s,
                    "term": term,
                    "took_ms": lease.answered_ms - now,
                    "current": current,
                }
            },
        )
        return lease

    def _drop(self, ends: int) -> None:
        del self._leases[ends]
        self._ends.pop(bisect.bisect_left(self._ends, ends))

    def _forget(self, now: int, term: int) -> None:
        """Leases that have ended, and, once etcd's term has moved on, every lease asked for before."""
        if term != self._leases_term:
            self._leases_term = term
            for ends in [ends for ends, lease in self._leases.items() if lease.term != term]:
                self._drop(ends)
        past = bisect.bisect_left(self._ends, now)
        if past:
            for ends in self._ends[:past]:
                del self._leases[ends]
            del self._ends[:past]

    def __len__(self) -> int:
        return len(self._leases)
