"""The guarded claim whose block runs in this task or thread: set by the guard, read by the send adapters (Nylas's
``send``, the providers' ``reply``), which need only what this protocol says, so that they import no client."""

from __future__ import annotations

import contextvars
from typing import Protocol

from ._automated import AUTO_SUBMITTED_HEADER, AUTO_SUBMITTED_VALUE
from ._types import Subject

__all__ = ["CurrentClaim", "agent_headers", "current", "current_claim_base"]


class CurrentClaim(Protocol):
    @property
    def subject(self) -> Subject: ...

    @property
    def token(self) -> int: ...

    @property
    def idempotency_key(self) -> str: ...

    @property
    def sending(self) -> bool: ...

    @property
    def by_person(self) -> bool: ...


current: contextvars.ContextVar[CurrentClaim | None] = contextvars.ContextVar("inbox_claims_claim", default=None)


def current_claim_base() -> CurrentClaim | None:
    """The guarded claim whose block (or ``guard``-ed function) is running in this task or thread, if any."""
    return current.get()


def agent_headers() -> tuple[tuple[str, str], ...]:
    """The headers a reply sent now carries to say it is automatic (RFC 3834 section 5: ``Auto-Submitted:
    auto-replied``), so that auto-responders and other agents do not answer it and no loop starts. Every send path of
    the clients adds them, unless the claim it is sent under is a person's: a person's reply is never marked.
    (Outside any claim the send path is an agent's: people answer through their mail client or inboxctl.)"""
    claim = current.get()
    if claim is not None and claim.by_person:
        return ()
    return ((AUTO_SUBMITTED_HEADER, AUTO_SUBMITTED_VALUE),)
