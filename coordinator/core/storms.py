"""Reply storms (docs/design.md#reply-storms): the agents' reply budget and the conversation that moved on.

Pure values and rules, no I/O. The store keeps, per thread and per correspondent of a mailbox, the agents' sends
begun in the recent past (a "guard" record); BeginSend of an agent's claim decides on them here and, when it
lets the send through, counts it in the same etcd transaction that moves the subject to SENDING, compared on
the guard records' revisions: two replicas racing for the budget's last unit cannot both win.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# A guard record keeps at most this many sends: a budget's limit is at most BUDGET_LIMIT_MAX.
BUDGET_LIMIT_MAX = 1000
BUDGET_WINDOW_MIN_MS = 60_000
BUDGET_WINDOW_MAX_MS = 30 * 24 * 3600 * 1000


@dataclass(frozen=True)
class Budget:
    """At most ``limit`` agent replies in any rolling ``window_ms``."""

    limit: int
    window_ms: int


DEFAULT_THREAD_BUDGET = Budget(3, 3600 * 1000)
DEFAULT_CORRESPONDENT_BUDGET = Budget(10, 24 * 3600 * 1000)


@dataclass(frozen=True)
class ReplyBudgets:
    """A mailbox's budgets; None: that budget is off (the operator's choice, docs/operations.md)."""

    thread: Budget | None = DEFAULT_THREAD_BUDGET
    correspondent: Budget | None = DEFAULT_CORRESPONDENT_BUDGET

    def longest_window_ms(self) -> int:
        return max((b.window_ms for b in (self.thread, self.correspondent) if b is not None), default=0)


# One agent send counted: (when it began, ms; the claim's fencing token, which AbortSend gives back by).
Send = tuple[int, int]


@dataclass(frozen=True)
class Inbound:
    """The newest inbound message of a thread the coordinator heard of (ClaimReply, RecordIncoming)."""

    message_id: str
    received_ms: int


@dataclass(frozen=True)
class ThreadGuard:
    sends: tuple[Send, ...] = ()
    latest: Inbound | None = None


@dataclass(frozen=True)
class GuardView:
    """A claim's guard records as read: its thread's and its correspondent's, each with the revision it was
    written at (0: absent), which the commit compares."""

    thread_id: str
    correspondent: str
    thread: ThreadGuard
    thread_revision: int
    correspondent_sends: tuple[Send, ...]
    correspondent_revision: int


@dataclass(frozen=True)
class Counting:
    """What a transition writes to the guard records: their new lists of sends (None: unchanged)."""

    thread: tuple[Send, ...] | None
    correspondent: tuple[Send, ...] | None


class RefusalKind(enum.Enum):
    REPLY_BUDGET_SPENT = "budget"
    CONVERSATION_MOVED_ON = "moved_on"


@dataclass(frozen=True)
class Refusal:
    kind: RefusalKind
    reason: str
    scope: str = ""
    limit: int = 0
    window_ms: int = 0
    counted: int = 0
    frees_ms: int = 0
    newer_message_id: str = ""
    newer_received_ms: int = 0


MOVED_ON_REASON = "the customer wrote again; draft again with the new message"


def normalised_correspondent(address: str) -> str:
    """Addresses are compared without case (docs/design.md#reply-storms)."""
    return address.strip().casefold()


def window_words(window_ms: int) -> str:
    """A window as a person says it: "hour", "day", "30 minutes", "2 days"."""
    seconds = window_ms // 1000
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds % size == 0 and seconds >= size:
            count = seconds // size
            return unit if count == 1 else f"{count} {unit}s"
    return f"{seconds} seconds"


def in_window(sends: tuple[Send, ...], budget: Budget, now_ms: int) -> tuple[Send, ...]:
    return tuple(send for send in sends if send[0] > now_ms - budget.window_ms)


def _spent(scope: str, whom: str, sends: tuple[Send, ...], budget: Budget) -> Refusal:
    oldest = min(send[0] for send in sends)
    replies = "agent reply" if budget.limit == 1 else "agent replies"
    return Refusal(
        RefusalKind.REPLY_BUDGET_SPENT,
        f"agents stopped: {budget.limit} {replies} to {whom} in the last {window_words(budget.window_ms)} — "
        "a person should look",
        scope=scope,
        limit=budget.limit,
        window_ms=budget.window_ms,
        counted=len(sends),
        frees_ms=oldest + budget.window_ms,
    )


def check_send(
    guard: GuardView, budgets: ReplyBudgets, *, received_ms: int | None, message_id: str, token: int, now_ms: int
) -> Refusal | Counting:
    """An agent's send: refused (the conversation moved on, or a budget is spent), or counted."""
    latest = guard.thread.latest
    if (
        latest is not None
        and received_ms is not None
        and latest.received_ms > received_ms
        and latest.message_id != message_id
    ):
        return Refusal(
            RefusalKind.CONVERSATION_MOVED_ON,
            MOVED_ON_REASON,
            newer_message_id=latest.message_id,
            newer_received_ms=latest.received_ms,
        )
    thread_sends: tuple[Send, ...] | None = None
    if guard.thread_id:
        thread_sends = guard.thread.sends
        if budgets.thread is not None:
            thread_sends = in_window(thread_sends, budgets.thread, now_ms)
            if len(thread_sends) >= budgets.thread.limit:
                return _spent("thread", "this conversation", thread_sends, budgets.thread)
        thread_sends = (*thread_sends, (now_ms, token))
    correspondent_sends: tuple[Send, ...] | None = None
    if guard.correspondent:
        correspondent_sends = guard.correspondent_sends
        if budgets.correspondent is not None:
            correspondent_sends = in_window(correspondent_sends, budgets.correspondent, now_ms)
            if len(correspondent_sends) >= budgets.correspondent.limit:
                return _spent("correspondent", guard.correspondent, correspondent_sends, budgets.correspondent)
        correspondent_sends = (*correspondent_sends, (now_ms, token))
    return Counting(_bounded(thread_sends), _bounded(correspondent_sends))


def _bounded(sends: tuple[Send, ...] | None) -> tuple[Send, ...] | None:
    # With a budget off, nothing prunes the list by window: keep it to the most any budget can need.
    return sends[-BUDGET_LIMIT_MAX:] if sends is not None else None


def give_back(guard: GuardView, token: int) -> Counting | None:
    """AbortSend (certainly not sent): the send's unit back to both budgets; None when it was not counted."""
    thread = tuple(send for send in guard.thread.sends if send[1] != token)
    correspondent = tuple(send for send in guard.correspondent_sends if send[1] != token)
    thread_changed = len(thread) != len(guard.thread.sends)
    correspondent_changed = len(correspondent) != len(guard.correspondent_sends)
    if not thread_changed and not correspondent_changed:
        return None
    return Counting(thread if thread_changed else None, correspondent if correspondent_changed else None)
