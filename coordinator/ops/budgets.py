"""The agents' reply budgets as the operator sets them (docs/operations.md#reply-budgets): a default for every
mailbox and overrides by mailbox pattern, parsed and checked before anything starts.

A budget is written ``N/WINDOW`` (``3/1h``: at most 3 agent replies in any rolling hour) or ``off``. ``0/1h`` is
refused rather than read as "off" or as "never": an operator who wants agents silent stops them, and one who
wants no budget says ``off``; a zero would be read both ways.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

from coordinator.core.storms import (
    BUDGET_LIMIT_MAX,
    BUDGET_WINDOW_MAX_MS,
    BUDGET_WINDOW_MIN_MS,
    Budget,
    ReplyBudgets,
)

__all__ = ["BudgetOverride", "budget", "budgets_for", "check_patterns", "overrides", "show_budget"]

_WINDOW_UNITS = {"m": 60, "h": 3600, "d": 86400}
_BUDGET = re.compile(r"\s*(\d+)\s*/\s*(\d+)\s*([mhd])\s*")


def budget(value: object) -> Budget | None:
    """``N/WINDOW`` (window in m, h or d: 3/1h, 10/24h, 50/7d) or ``off`` (None)."""
    if not isinstance(value, str):
        raise ValueError('not a budget (replies/window: "3/1h", "10/24h", or "off")')
    if value.strip().lower() == "off":
        return None
    match = _BUDGET.fullmatch(value)
    if match is None:
        raise ValueError('not a budget (replies/window, the window in m, h or d: "3/1h", "10/24h"; or "off")')
    limit, window_ms = int(match.group(1)), int(match.group(2)) * _WINDOW_UNITS[match.group(3)] * 1000
    if limit == 0:
        raise ValueError('0 replies: write "off" to turn the budget off (to stop agents replying, stop the agents)')
    if limit > BUDGET_LIMIT_MAX:
        raise ValueError(f"{limit} replies is over the limit of {BUDGET_LIMIT_MAX} per window")
    if not BUDGET_WINDOW_MIN_MS <= window_ms <= BUDGET_WINDOW_MAX_MS:
        raise ValueError("the window must lie between 1m and 30d")
    return Budget(limit, window_ms)


def show_budget(value: Budget | None) -> str:
    if value is None:
        return "off"
    seconds = value.window_ms // 1000
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{value.limit}/{seconds // size}{unit}"
    raise AssertionError("a window is whole minutes")  # pragma: no cover - budget() only makes those


@dataclass(frozen=True)
class BudgetOverride:
    """A mailbox pattern (exact name or glob, as a token file's grants) and the budgets of the mailboxes it
    matches; a budget it does not set (``sets_...`` False) keeps the default."""

    pattern: str
    thread: Budget | None = None
    correspondent: Budget | None = None
    sets_thread: bool = False
    sets_correspondent: bool = False


def _override(pattern: object, thread: object, correspondent: object) -> BudgetOverride:
    if not isinstance(pattern, str) or not pattern.strip():
        raise ValueError("each override needs a mailbox pattern (an exact mailbox or a glob: acme-*)")
    return BudgetOverride(
        pattern.strip(),
        budget(thread) if thread is not None else None,
        budget(correspondent) if correspondent is not None else None,
        sets_thread=thread is not None,
        sets_correspondent=correspondent is not None,
    )


def overrides(value: object) -> tuple[BudgetOverride, ...]:
    """From a flag or variable, ``PATTERN=THREAD[,CORRESPONDENT];...`` (``acme-*=5/1h,off;vip@x.com=1/1h``); from
    the TOML file, an array of tables ``{mailboxes = "acme-*", thread = "5/1h", correspondent = "off"}``."""
    found: list[BudgetOverride] = []
    if isinstance(value, list):
        for entry in value:
            if not isinstance(entry, dict):
                raise ValueError('each override is a table: {mailboxes = "acme-*", thread = "5/1h"}')
            unknown = sorted(set(entry) - {"mailboxes", "thread", "correspondent"})
            if unknown:
                raise ValueError(f"unknown key {unknown[0]!r} in an override (keys: mailboxes, thread, correspondent)")
            found.append(_override(entry.get("mailboxes"), entry.get("thread"), entry.get("correspondent")))
    elif isinstance(value, str):
        for part in filter(None, (item.strip() for item in value.split(";"))):
            pattern, equals, budgets = part.partition("=")
            if not equals:
                raise ValueError(f"{part!r}: write PATTERN=THREAD[,CORRESPONDENT], e.g. acme-*=5/1h,20/24h")
            thread, _, correspondent = budgets.partition(",")
            found.append(_override(pattern, thread.strip() or None, correspondent.strip() or None))
    else:
        raise ValueError("not a list of overrides")
    patterns = [item.pattern for item in found]
    for pattern in patterns:
        if patterns.count(pattern) > 1:
            raise ValueError(f"the pattern {pattern!r} is given twice")
    return tuple(found)


def check_patterns(items: Sequence[BudgetOverride], granted: Sequence[str] | None) -> str | None:
    """The first override whose pattern matches no granted mailbox, said for the operator; None when all match.
    ``granted``: the token file's mailbox patterns (None: development mode, every mailbox). A pattern matches a
    grant when either covers the other (``acme-*`` and ``acme-eu``, ``acme-eu`` and ``acme-*``)."""
    if granted is None:
        return None
    for item in items:
        if not any(fnmatchcase(grant, item.pattern) or fnmatchcase(item.pattern, grant) for grant in granted):
            shown = ", ".join(sorted(set(granted))) or "none"
            return (
                f"the reply budget override for {item.pattern!r} matches no mailbox the token file grants "
                f"(granted: {shown}); a misspelt mailbox would silently keep the default budgets"
            )
    return None


def budgets_for(
    thread: Budget | None, correspondent: Budget | None, items: Sequence[BudgetOverride]
) -> Callable[[str], ReplyBudgets]:
    """A mailbox's budgets: the first override whose pattern matches it, else the defaults."""
    default = ReplyBudgets(thread, correspondent)
    resolved = [
        (
            item.pattern,
            ReplyBudgets(
                item.thread if item.sets_thread else thread,
                item.correspondent if item.sets_correspondent else correspondent,
            ),
        )
        for item in items
    ]
    cache: dict[str, ReplyBudgets] = {}

    def lookup(mailbox: str) -> ReplyBudgets:
        known = cache.get(mailbox)
        if known is None:
            known = next((budgets for pattern, budgets in resolved if fnmatchcase(mailbox, pattern)), default)
            if len(cache) < 100_000:  # BeginSend asks on every send; a bounded memo of the pattern match
                cache[mailbox] = known
        return known

    return lookup
