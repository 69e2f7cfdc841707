"""Reply storms (docs/design.md#reply-storms): the agents' reply budget and the conversation that moved on.

Pure values and rules, no I/O. The store keeps, per thread and per correspondent of a mailbox, the agents' sends
begun in the recent past (a "guard" record); BeginSend of an agent's claim decides on them here and, when it
lets the send through, counts it in the same etcd transaction that moves the subject to SENDING, compared on
the guard records' revisions: two replicas racing for the budget's last unit cannot both win.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.core.values import Subject, Summary

# A budget's limits, as the operator may set them (coordinator/ops/budgets.py).
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


# One agent send counted: (when it began, ms, for people: when it leaves the window; the claim's fencing token,
# which names it and which AbortSend gives it back by).
Send = tuple[int, int]


@dataclass(frozen=True)
class Inbound:
    """The newest inbound message of a thread the coordinator heard of (ClaimReply, RecordIncoming)."""

    message_id: str
    received_ms: int


@dataclass(frozen=True)
class GuardView:
    """A claim's guard records as the store read them, at one revision: the agents' sends counted in its
    thread's and its correspondent's windows (only those still in them: in etcd each is a key on a lease of its
    window, so etcd's clock, not a replica's, ends it) with the newest create revision among each's (0: none),
    and the thread's newest inbound message with the revision it was written at (0: none)."""

    thread_id: str
    correspondent: str
    thread_sends: tuple[Send, ...] = ()
    correspondent_sends: tuple[Send, ...] = ()
    latest: Inbound | None = None
    latest_revision: int = 0
    thread_created: int = 0
    correspondent_created: int = 0


@dataclass(frozen=True)
class Counting:
    """What a transition writes to the guard records, with the subject, only while they are as read: ``send``
    counted in the thread's window (until ``thread_expires_ms``, 0: not counted there) and the correspondent's;
    or ``give_back``: the sends of that token removed (AbortSend)."""

    send: Send | None = None
    thread_expires_ms: int = 0
    correspondent_expires_ms: int = 0
    give_back: int = 0


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


@dataclass(frozen=True)
class Stopped:
    """A conversation where agents are stopped: the message whose agent's send a spent reply budget refused, and
    that refusal; kept until the budget frees (``refusal.frees_ms``) so that people see it after the agent let go
    of the message (docs/design.md#reply-storms)."""

    subject: Subject
    thread_id: str
    refusal: Refusal
    stopped_holder: str
    stopped_ms: int
    summary: Summary | None = None


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


def in_window(sends: tuple[Send, ...], window_ms: int, now_ms: int) -> tuple[Send, ...]:
    """For a store whose records expire by its own clock (coordinator/store/memory.py); etcd expires them."""
    return tuple(send for send in sends if send[0] + window_ms > now_ms)


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
    guard: GuardView,
    budgets: ReplyBudgets,
    *,
    received_ms: int | None,
    message_id: str,
    token: int,
    now_ms: int,
    expiry: Callable[[int], int],
) -> Refusal | Counting:
    """An agent's send: refused (the conversation moved on, or a budget is spent), or counted in each window
    (``expiry``: when a send begun now leaves a window of that length, as the store's leases round it)."""
    latest = guard.latest
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
    thread, correspondent = budgets.thread, budgets.correspondent
    if guard.thread_id and thread is not None and len(guard.thread_sends) >= thread.limit:
        return _spent("thread", "this conversation", guard.thread_sends, thread)
    if guard.correspondent and correspondent is not None and len(guard.correspondent_sends) >= correspondent.limit:
        return _spent("correspondent", guard.correspondent, guard.correspondent_sends, correspondent)
    return Counting(
        (now_ms, token),
        expiry(thread.window_ms) if guard.thread_id and thread is not None else 0,
        expiry(correspondent.window_ms) if guard.correspondent and correspondent is not None else 0,
    )


def give_back(guard: GuardView, token: int) -> Counting | None:
    """AbortSend (certainly not sent): the send's unit back to both budgets; None when it was not counted."""
    counted = any(send[1] == token for send in (*guard.thread_sends, *guard.correspondent_sends))
    return Counting(give_back=token) if counted else None
