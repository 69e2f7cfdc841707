"""A fake LLM: it takes a while (``delay`` seconds) and writes a polite, deterministic reply."""

from __future__ import annotations

import asyncio

from inbox_claims import Notification


class FakeLLM:
    def __init__(self, delay: float = 1.0, *, signature: str = "the support agent") -> None:
        self.delay = delay
        self.signature = signature

    async def draft(self, notification: Notification) -> str:
        await asyncio.sleep(self.delay)  # a real model takes seconds to minutes: the claim is renewed meanwhile
        subject = notification.object.get("subject") or "your message"
        return f"<p>Thank you for writing about “{subject}”. We are on it.</p><p>— {self.signature}</p>"
