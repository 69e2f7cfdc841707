"""The guarded claim whose block runs in this task or thread: set by the guard, read by the send adapters (Nylas's
``send``, the providers' ``reply``), which need only what this protocol says, so that they import no client."""

from __future__ import annotations

import contextvars
from typing import Protocol

from ._types import Subject

__all__ = ["CurrentClaim", "current", "current_claim_base"]


class CurrentClaim(Protocol):
    @property
    def subject(self) -> Subject: ...

    @property
    def token(self) -> int: ...

    @property
    def idempotency_key(self) -> str: ...

    @property
    def sending(self) -> bool: ...


current: contextvars.ContextVar[CurrentClaim | None] = contextvars.ContextVar("inbox_claims_claim", default=None)


def current_claim_base() -> CurrentClaim | None:
    """The guarded claim whose block (or ``guard``-ed function) is running in this task or thread, if any."""
    return current.get()
