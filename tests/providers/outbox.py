"""What the provider doubles share: the replies the mailbox sent (by the agent through the API, or by a person from
the provider's own app), counted per message they answer, and the double as a blocking client's transport."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from inbox_claims.providers._seam import HttpRequest, HttpResponse


@dataclass
class Sent:
    """One reply the mailbox sent: by the agent (through the API) or by a person (Outlook, the Gmail UI)."""

    by: Literal["agent", "person"]
    id: str
    in_reply_to: str
    """The id of the message it answers."""


class Outbox:
    """The sends of a double's mailbox; ``messages`` by id, ``_lock`` guarding both."""

    sends: list[Sent]
    messages: dict[str, dict[str, Any]]
    _lock: threading.RLock

    def replies_to(self, message_id: str, by: str = "agent") -> int:
        """How many replies to ``message_id`` went out (by the agent, unless ``by`` says otherwise)."""
        with self._lock:
            return sum(1 for sent in self.sends if sent.in_reply_to == message_id and sent.by == by)

    def sent_copy(self, message_id: str) -> dict[str, Any]:
        """The sent-mail copy of the agent's reply to ``message_id``."""
        with self._lock:
            sent = next(s for s in self.sends if s.in_reply_to == message_id and s.by == "agent")
            return self.messages[sent.id]


class Answers(Protocol):
    def answer(self, request: HttpRequest) -> HttpResponse: ...


class Blocking:
    """A double as a blocking client's transport (the doubles themselves are asyncio ones)."""

    is_async = False

    def __init__(self, double: Answers) -> None:
        self.double = double

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.double.answer(request)
