"""Watch writes yield to every other call: a few per turn of the event loop, and a rate per principal."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from coordinator.api.quotas import RateLimiter

# Watch writes started per turn of the event loop. Measured with `bench slow-watchers` (docs/performance.md,
# "Slow watchers"): 1, 2 and 4 protect other callers alike; writing a whole fan-out in one turn does not.
WRITES_PER_TURN = 4


class WritePacer:
    """Decides when a Watch stream may write its next message.

    Two rules. An event on a mailbox with many watchers wakes every watcher's stream at once; written in one
    go, those writes would hold the event loop for the whole fan-out and every other call would wait behind
    them, so at most ``per_turn`` writes start per turn of the loop and the rest wait for the next turns,
    taken round-robin by principal. And each principal's streams together write at most
    ``events_per_second`` messages (a token bucket holding one second's worth): what one principal's watches
    cost the server is bounded like its calls are. Streams over that rate fall behind; the engine ends a
    stream that stays behind for the watch drain timeout (SlowConsumer), and its client watches again.

    Only our own futures are awaited here, so a stream cancelled while it waits is safe (unlike a gRPC write,
    see service._DrainWatch)."""

    def __init__(
        self,
        events_per_second: float,
        per_turn: int = WRITES_PER_TURN,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._budget = RateLimiter(events_per_second, max(1, int(events_per_second)), clock)
        self._per_turn = per_turn
        # The streams waiting, by principal; a principal with none has no entry (its budget is the RateLimiter's).
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}
        self._queued: deque[str] = deque()  # principals with streams waiting, in round-robin order
        self._started_this_turn = 0
        self._next_turn: asyncio.Handle | asyncio.TimerHandle | None = None

    @property
    def waiting(self) -> int:
        return sum(len(waiting) for waiting in self._waiting.values())

    async def turn(self, principal: str) -> None:
        """Returns when the principal's stream may write."""
        waiting = self._waiting.get(principal)
        if waiting is None and self._started_this_turn < self._per_turn and self._budget.acquire(principal) == 0:
            self._started_this_turn += 1
            self._schedule(0.0)
            return
        if waiting is None:
            waiting = self._waiting[principal] = deque()
            self._queued.append(principal)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting.append(waiter)
        self._schedule(0.0)
        await waiter

    def _schedule(self, delay: float) -> None:
        if self._next_turn is not None:
            return
        loop = asyncio.get_running_loop()
        if delay <= 0:
            self._next_turn = loop.call_soon(self._run_turn)
        else:
            self._next_turn = loop.call_later(delay, self._run_turn)

    def _run_turn(self) -> None:
        self._next_turn = None
        self._started_this_turn = 0
        soonest: float | None = None
        progress = True
        while progress and self._queued and self._started_this_turn < self._per_turn:
            progress = False
            for _ in range(len(self._queued)):
                if self._started_this_turn >= self._per_turn:
                    break
                principal = self._queued.popleft()
                waiting = self._waiting[principal]
                while waiting and waiting[0].done():  # its stream was cancelled while waiting
                    waiting.popleft()
                wait = self._budget.acquire(principal) if waiting else None
                if wait == 0:
                    waiting.popleft().set_result(None)
                    self._started_this_turn += 1
                    progress = True
                elif wait is not None:
                    soonest = wait if soonest is None else min(soonest, wait)
                if waiting:
                    self._queued.append(principal)
                else:
                    del self._waiting[principal]
        if self._started_this_turn:
            self._schedule(0.0)  # the next turn resets the count, and goes on with what still waits
        elif self._queued:
            self._schedule(soonest or 0.001)
