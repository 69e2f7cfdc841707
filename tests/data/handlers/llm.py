"""The handlers' "LLM": slow enough (DRAFT_SECONDS) that concurrent deliveries overlap, and deterministic."""

import asyncio
import time
from typing import Any

DRAFT_SECONDS = 0.3


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
