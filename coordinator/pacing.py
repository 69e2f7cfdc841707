"""Watch writes yield to every other call: a few per turn of the event loop, and a rate per principal."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

# Watch writes started per turn of the event loop. Measured with `bench slow-watchers` (docs/performance.md,
# "Slow watchers"): 1, 2 and 4 protect other callers alike; writing a whole fan-out in one turn does not.
WRITES_PER_TURN = 4
# Principals remembered with a full bucket and nothing waiting before the idle ones are forgotten.
_IDLE_PRINCIPALS_KEPT = 4096


@dataclass
class _Principal:
    tokens: float
    stamp: float
    waiting: deque[asyncio.Future[None]] = field(default_factory=deque)


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
        self._rate = events_per_second
        self._burst = max(events_per_second, 1.0)
        self._per_turn = per_turn
        self._clock = clock
        self._principals: dict[str, _Principal] = {}
        self._queued: deque[str] = deque()  # principals with streams waiting, in round-robin order
        self._started_this_turn = 0
        self._next_turn: asyncio.Handle | asyncio.TimerHandle | None = None

    @property
    def waiting(self) -> int:
        return sum(len(principal.waiting) for principal in self._principals.values())

    async def turn(self, principal: str) -> None:
        """Returns when the principal's stream may write."""
        state = self._state(principal)
        if not state.waiting and self._started_this_turn < self._per_turn and self._take(state):
            self._started_this_turn += 1
            self._schedule(0.0)
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not state.waiting:
            self._queued.append(principal)
        state.waiting.append(waiter)
        self._schedule(0.0)
        await waiter

    def _state(self, principal: str) -> _Principal:
        state = self._principals.get(principal)
        if state is None:
            if len(self._principals) >= _IDLE_PRINCIPALS_KEPT:
                self._forget_idle()
            state = self._principals[principal] = _Principal(self._burst, self._clock())
        return state

    def _take(self, state: _Principal) -> bool:
        if self._rate <= 0:
            return True
        now = self._clock()
        state.tokens = min(self._burst, state.tokens + (now - state.stamp) * self._rate)
        state.stamp = now
        if state.tokens >= 1.0:
            state.tokens -= 1.0
            return True
        return False

    def _seconds_to_token(self, state: _Principal) -> float:
        return max(0.0, (1.0 - state.tokens) / self._rate) if self._rate > 0 else 0.0

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
                state = self._principals.get(principal)
                if state is None:
                    continue
                while state.waiting and state.waiting[0].done():  # its stream was cancelled while waiting
                    state.waiting.popleft()
                if not state.waiting:
                    continue
                if self._take(state):
                    state.waiting.popleft().set_result(None)
                    self._started_this_turn += 1
                    progress = True
                else:
                    wait = self._seconds_to_token(state)
                    soonest = wait if soonest is None else min(soonest, wait)
                if state.waiting:
                    self._queued.append(principal)
        if self._started_this_turn:
            self._schedule(0.0)  # the next turn resets the count, and goes on with what still waits
        elif self._queued:
            self._schedule(soonest or 0.001)

    def _forget_idle(self) -> None:
        now = self._clock()
        for principal, state in list(self._principals.items()):
            if not state.waiting and (
                self._rate <= 0 or state.tokens + (now - state.stamp) * self._rate >= self._burst
            ):
                del self._principals[principal]
