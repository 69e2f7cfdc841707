"""Helpers shared by the client tests (test_client_*.py); no tests of its own.

Everything here talks to real coordinators: these are conveniences, not stand-ins.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import AsyncIterator

from inbox_claims import AsyncCoordinator, Notification
from inbox_claims.types import EventType, WatchEvent, WatchSnapshot
from inbox_claims.webhooks import parse_notification

HUMAN = "ana@example.com"


def nylas_notification(
    mailbox: str,
    message_id: str,
    *,
    notification_id: str | None = None,
    thread_id: str | None = None,
    type_: str = "message.created",
) -> Notification:
    """A Nylas v3 message notification, as a webhook would deliver it."""
    return parse_notification(
        {
            "specversion": "1.0",
            "type": type_,
            "source": "/google/emails/realtime",
            "id": notification_id or f"notif-{uuid.uuid4().hex[:12]}",
            "time": 1723821985,
            "webhook_delivery_attempt": 1,
            "data": {
                "application_id": "app-1",
                "object": {
                    "id": message_id,
                    "grant_id": mailbox,
                    "thread_id": thread_id or f"thread-of-{message_id}",
                    "object": "message",
                    "subject": "Where is my order?",
                },
            },
        }
    )


class SendLog:
    """A send function that records each call (thread-safe) and returns a new sent message id."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._lock = threading.Lock()

    def send(self, draft: str = "draft") -> str:
        with self._lock:
            self.calls.append(draft)
            return f"sent-{len(self.calls)}"

    async def send_async(self, draft: str = "draft") -> str:
        await asyncio.sleep(0.01)  # an HTTP call would yield here
        return self.send(draft)


@contextlib.asynccontextmanager
async def watching(client: AsyncCoordinator, mailbox: str) -> AsyncIterator[list[WatchEvent]]:
    """Collects every event of a mailbox (after its first snapshot) while the block runs."""
    events: list[WatchEvent] = []
    ready = asyncio.Event()

    async def collect() -> None:
        async for item in client.watch(mailbox):
            if isinstance(item, WatchSnapshot):
                ready.set()
            else:
                events.append(item)

    task = asyncio.create_task(collect())
    await asyncio.wait_for(ready.wait(), 10)
    try:
        yield events
    finally:
        task.cancel()
        await asyncio.wait([task])


async def wait_for_event(events: list[WatchEvent], type_: EventType, *, within: float = 10.0) -> WatchEvent:
    async with asyncio.timeout(within):
        while True:
            for event in events:
                if event.type is type_:
                    return event
            await asyncio.sleep(0.05)
