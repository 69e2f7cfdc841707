"""Claims whose etcd lease was restarted, ended when their TTL has passed as this replica measured it.

etcd restarts the TTL of every lease when a new leader takes over, and a cluster stopped and started again has a
new leader: a claim made at 10:00 with a 20 s TTL, whose etcd was down from 10:00:05 to 10:01, is held until about
10:01:21, not 10:00:20 (docs/design.md#leases-and-expiry, "Across an outage or a restart"). So the store remembers
the claims this replica wrote: the key's mod revision as written, and when its TTL passes by this process's
monotonic clock (which no wall-clock offset moves). A claim written before the raft term changed may be on a
restarted lease: once its time has passed, it is deleted, and only while its key is still as this replica wrote
it (the compare on the mod revision), so a renewal through another replica, or any other change, keeps it. A
deletion without an end mark reads, for watchers and for delivery dedup, exactly as a lease running out.

The rules are here, pure (the monotonic clock passed in); ``EtcdStore`` does the reads and the deletes.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.core.domain import State, SubjectRecord

__all__ = ["LapseKeeper", "Lapsed"]

# Claims remembered at most (about 150 bytes each). Past it the oldest written is forgotten, and etcd's own
# lease is what ends it: later by a restart's TTL, never earlier.
KEPT_CLAIMS = 100_000
# A claim whose time passed this long ago with no change of etcd's term was ended by its lease (its lease ends
# at most 1 s after it, and etcd checks leases about every 0.5 s): forgotten.
ENDED_BY_ITS_LEASE_S = 5.0


@dataclass(frozen=True)
class Lapsed:
    """A claim to delete now: its key, and the mod revision it must still have."""

    key: bytes
    revision: int


@dataclass
class _Claim:
    revision: int
    ends_at: float  # monotonic seconds: its TTL has passed, as this replica measures it
    term: int  # etcd's raft term when it was written; 0: not known (adopted after a restart)
    written: int  # which write of this keeper: a heap entry of an earlier write of the key is stale


class LapseKeeper:
    def __init__(self, monotonic: Callable[[], float], kept: int = KEPT_CLAIMS) -> None:
        self._monotonic = monotonic
        self._kept = kept
        self._claims: OrderedDict[bytes, _Claim] = OrderedDict()
        # (ends_at, write, key) by time: the next claim to end is looked at without a scan of them all.
        self._by_time: list[tuple[float, int, bytes]] = []
        self._writes = 0

    def __len__(self) -> int:
        return len(self._claims)

    def wrote(self, key: bytes, record: SubjectRecord | None, revision: int, term: int, wall_now_ms: int) -> None:
        """This replica wrote ``record`` (None: deleted it) at ``revision``, in raft term ``term``. A claim is
        remembered until the later of its ``expires_ms`` (this replica wrote it from its own wall clock a moment
        ago: the difference is measured on one clock) and its TTL from now: never before either."""
        if record is None or record.state is not State.CLAIMED or record.expires_ms is None:
            self._claims.pop(key, None)
            return
        left_ms = max(record.expires_ms - wall_now_ms, record.ttl_seconds * 1000)
        self._remember(key, revision, self._monotonic() + left_ms / 1000, term)

    def adopt(self, key: bytes, revision: int, left_s: float) -> None:
        """A claim found in etcd after a restart, whose TTL passes ``left_s`` from now (0: it has passed)."""
        self._remember(key, revision, self._monotonic() + max(left_s, 0.0), 0)

    def forget(self, key: bytes) -> None:
        self._claims.pop(key, None)

    def _remember(self, key: bytes, revision: int, ends_at: float, term: int) -> None:
        self._writes += 1
        self._claims[key] = _Claim(revision, ends_at, term, self._writes)
        self._claims.move_to_end(key)
        heapq.heappush(self._by_time, (ends_at, self._writes, key))
        while len(self._claims) > self._kept:
            self._claims.popitem(last=False)
        if len(self._by_time) > 2 * len(self._claims) + 1024:  # mostly stale: rebuilt from what is remembered
            self._by_time = [(claim.ends_at, claim.written, key) for key, claim in self._claims.items()]
            heapq.heapify(self._by_time)

    def _current(self, entry: tuple[float, int, bytes]) -> _Claim | None:
        claim = self._claims.get(entry[2])
        return claim if claim is not None and claim.written == entry[1] else None

    def overdue(self) -> bool:
        """Whether any remembered claim's time has passed (only then is etcd asked anything)."""
        while self._by_time and self._current(self._by_time[0]) is None:
            heapq.heappop(self._by_time)
        return bool(self._by_time) and self._by_time[0][0] <= self._monotonic()

    def due(self, term: int) -> list[Lapsed]:
        """The claims to delete, etcd's raft term being ``term`` now: those whose time has passed and that were
        written in an earlier term (their lease may have been restarted since). Those whose time passed long
        enough ago in this very term were ended by their lease: forgotten."""
        now = self._monotonic()
        lapsed: list[Lapsed] = []
        waiting: list[tuple[float, int, bytes]] = []
        while self._by_time and self._by_time[0][0] <= now:
            entry = heapq.heappop(self._by_time)
            claim = self._current(entry)
            if claim is None:
                continue
            if claim.term < term:
                lapsed.append(Lapsed(entry[2], claim.revision))
                waiting.append(entry)  # until the store forgets it, having deleted it or found it changed
            elif now - claim.ends_at >= ENDED_BY_ITS_LEASE_S:
                del self._claims[entry[2]]
            else:
                waiting.append(entry)
        for entry in waiting:
            heapq.heappush(self._by_time, entry)
        return lapsed
