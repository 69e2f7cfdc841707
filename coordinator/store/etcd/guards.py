"""What this replica last knew of the reply rules' guard records (docs/design.md#reply-storms): a guess that lets an
agent's BeginSend decide and commit in one etcd request, as the send path does without the rules, instead of
reading the records first. The guess is never trusted: the commit compares the windows' newest create revisions
and the newest inbound message's revision with the guess, so a stale guess only fails the transaction, and the
call then reads etcd and decides again. A refusal is never answered from a guess.

The common case it serves: the ClaimReply and the BeginSend of one reply reach the same replica, which recorded the
thread's newest inbound message itself; a thread or correspondent this replica never saw is guessed empty.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

from coordinator.core.storms import Inbound, Send

__all__ = ["GuardMemory"]

V = TypeVar("V")

_ENTRIES = 4096  # windows and threads remembered (each a few hundred bytes at most)
_TRUSTED_S = 60.0  # older knowledge is not used: the guess would only fail


class GuardMemory:
    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._now = monotonic
        self._windows: OrderedDict[bytes, tuple[tuple[Send, ...], int, float]] = OrderedDict()
        self._inbound: OrderedDict[bytes, tuple[Inbound | None, int, float]] = OrderedDict()

    def window(self, prefix: bytes) -> tuple[tuple[Send, ...], int]:
        """A window's counted sends and the newest create revision among them, as last known ((), 0: empty)."""
        known = self._windows.get(prefix)
        if known is None or self._now() - known[2] > _TRUSTED_S:
            return (), 0
        return known[0], known[1]

    def inbound(self, key: bytes) -> tuple[Inbound | None, int]:
        """A thread's newest inbound message and the revision it was written at, as last known (None, 0: none)."""
        known = self._inbound.get(key)
        if known is None or self._now() - known[2] > _TRUSTED_S:
            return None, 0
        return known[0], known[1]

    def saw_window(self, prefix: bytes, sends: tuple[Send, ...], created: int) -> None:
        _put(self._windows, prefix, (sends, created, self._now()))

    def saw_inbound(self, key: bytes, inbound: Inbound | None, revision: int) -> None:
        _put(self._inbound, key, (inbound, revision, self._now()))

    def counted(self, prefix: bytes, send: Send, revision: int) -> None:
        sends, _ = self.window(prefix)
        self.saw_window(prefix, (*sends, send), revision)

    def gave_back(self, prefix: bytes, token: int) -> None:
        self._windows.pop(prefix, None)  # read again next time: the newest create revision may be another's


def _put(entries: OrderedDict[bytes, V], key: bytes, value: V) -> None:
    entries[key] = value
    entries.move_to_end(key)
    if len(entries) > _ENTRIES:
        entries.popitem(last=False)
