"""The values a call is made of, shared by the commands (coordinator.core.commands) and the rules
(coordinator.core.domain), which import them from here; the domain re-exports them, as the rest of the server
knows them from there."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["ResolveOutcome", "Subject", "SubjectKind", "Summary"]


class SubjectKind(enum.Enum):
    MESSAGE = "m"
    THREAD = "t"


@dataclass(frozen=True)
class Subject:
    mailbox: str
    kind: SubjectKind
    id: str


@dataclass(frozen=True)
class Summary:
    """What a person tells one email from another by: personal data, stored only when the operator allows
    (``Rules.store_summaries``) and deleted with the record that carries it."""

    subject_line: str = ""
    sender: str = ""
    received_ms: int | None = None

    def __bool__(self) -> bool:
        return bool(self.subject_line or self.sender or self.received_ms)


class ResolveOutcome(enum.Enum):
    SENT = "sent"
    NOT_SENT = "not_sent"
