"""The "LLM" of the handlers here and of the examples in docs/client.md (which import it as ``llm``): slow
enough (DRAFT_SECONDS) that concurrent deliveries overlap, and deterministic."""

import asyncio
import os
import time
from typing import Any

from inbox_claims import Notification

DRAFT_SECONDS = float(os.environ.get("LLM_DRAFT_SECONDS", "0.3"))


def _draft(message: dict[str, Any]) -> dict[str, Any]:
    sender = message["from"][0]
    return {
        "reply_to_message_id": message["id"],
        "to": [{"email": sender["email"]}],
        "subject": f"Re: {message.get('subject', '')}",
        "body": f"<p>Thank you for writing about {message.get('subject', 'this')}. We are on it.</p>",
    }


async def draft_reply(message: dict[str, Any]) -> dict[str, Any]:
    await asyncio.sleep(DRAFT_SECONDS)
    return _draft(message)


def draft_reply_sync(message: dict[str, Any]) -> dict[str, Any]:
    time.sleep(DRAFT_SECONDS)
    return _draft(message)


async def write_reply(notification: Notification) -> str:
    """The text of a reply (docs/client.md's adapter examples)."""
    await asyncio.sleep(DRAFT_SECONDS)
    return f"<p>Thank you for writing about {notification.object.get('subject', 'this')}.</p>"


def write_reply_sync(notification: Notification) -> str:
    time.sleep(DRAFT_SECONDS)
    return f"<p>Thank you for writing about {notification.object.get('subject', 'this')}.</p>"
