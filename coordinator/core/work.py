"""What a call costs the coordinator, in units of work: each key or record it reads, and each record it searches.

Calls are cheap to make and some are costly to answer: a ListClaims page filtered by state reads up to 5,000
subjects to list none, a ListRecentMessages search has etcd read and sort every delivery of the mailbox. Counting
calls let one principal, well within its call rate, keep the coordinator (one event loop) and etcd busy for
everyone else. So the store and the engine count the work each call does here, on the call's meter, and the API
has it paid from the caller's budget (coordinator/api/quotas.py, ``WorkBudget``). A costly read is made in its
principal's turn (``turn``): one at a time per principal, each once what it owes is paid, so that its reads are
spread out at its budget's rate whatever the number of its calls. Work done outside any call (the sweeps) is
nobody's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Budget", "Meter", "metered", "spend", "turn"]


class Budget(Protocol):
    """One principal's work budget, as the API keeps it."""

    @property
    def lock(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Held by the costly read of that principal being made."""
        ...

    def pay(self, units: int) -> float:
        """Charges ``units``; answers how long the principal now owes work for (seconds; 0: nothing owed)."""
        ...


@dataclass
class Meter:
    """One call's work: ``units`` in all, ``unpaid`` of them not yet charged to ``budget``."""

    budget: Budget | None = None
    units: int = 0
    unpaid: int = 0


# The current call's meter; the tasks a call starts (a Batch's calls) get a copy of the context: the same meter.
_METER: ContextVar[Meter | None] = ContextVar("inbox_coordinator_work", default=None)


def spend(units: int) -> None:
    """Counts ``units`` of a small read against the call being served, if any (charged at its end, or its next
    costly read)."""
    meter = _METER.get()
    if meter is not None:
        meter.units += units
        meter.unpaid += units


@contextlib.asynccontextmanager
async def turn() -> AsyncIterator[Callable[[int], None]]:
    """A costly read, made in its principal's turn: once no other read of that principal is being made and what it
    owes is paid (waited out). The block reads, and says how much with the function it is given; that is charged
    before the next read of the principal may start."""
    meter = _METER.get()
    if meter is None or meter.budget is None:
        yield spend
        return
    budget = meter.budget
    async with budget.lock:
        owed = budget.pay(meter.unpaid)
        meter.unpaid = 0
        while owed > 0:
            await asyncio.sleep(owed)
            owed = budget.pay(0)
        read = [0]

        def did(units: int) -> None:
            read[0] += units

        try:
            yield did
        finally:
            meter.units += read[0]
            budget.pay(read[0])


@contextlib.contextmanager
def metered(budget: Budget | None = None) -> Iterator[Meter]:
    """A meter for the work done in this block (and the tasks it starts); what is unpaid at its end is charged."""
    meter = Meter(budget)
    token = _METER.set(meter)
    try:
        yield meter
    finally:
        _METER.reset(token)
        if budget is not None and meter.unpaid:
            budget.pay(meter.unpaid)
