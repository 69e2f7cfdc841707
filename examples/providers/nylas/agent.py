"""A guarded Nylas agent: one reply per customer message, however often Nylas delivers a notification and to however
many replicas, and none when a person answered first (README.md). ``./run`` starts it; everything comes from the
environment."""

from __future__ import annotations

import os

from examples.providers.common import draft_reply, nylas_api_base, serve

# --- the guarded handler (docs/providers.md shows these lines; tests/tools/test_provider_examples.py counts them)
from inbox_claims import AsyncClaim, AsyncCoordinator, Notification
from inbox_claims.asgi import nylas_webhook_app
from inbox_claims.nylas import AsyncNylas, NylasReply

coord = AsyncCoordinator.from_env()  # INBOX_COORDINATOR_TARGET, INBOX_PRINCIPAL (or INBOX_TOKEN)
nylas = AsyncNylas(os.environ["NYLAS_API_KEY"], api_base=nylas_api_base())


async def answer(notification: Notification, claim: AsyncClaim) -> None:  # a granted claim on one new message
    reply = NylasReply.answering(notification, body=await draft_reply(notification.object.get("subject", "")))
    await claim.send(nylas.send, claim.subject.mailbox, reply, idempotency_key=claim.idempotency_key)


webhook = nylas_webhook_app(os.environ["NYLAS_WEBHOOK_SECRET"], answer, coordinator=coord)
# --- end of the guarded handler

if __name__ == "__main__":
    serve(webhook)
