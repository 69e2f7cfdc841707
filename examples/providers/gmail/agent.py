"""A guarded Gmail agent (Cloud Pub/Sub push): one reply per customer message, however often Pub/Sub delivers a
push and to however many replicas, a dropped push found by the periodic history check, and none when a person
answered from the Gmail UI first (README.md). ``./run`` starts it; everything comes from the environment."""

from __future__ import annotations

from examples.providers.common import draft_reply, serve

# --- the guarded handler (docs/providers.md shows these lines; tests/tools/test_provider_examples.py counts them)
from inbox_claims import AsyncClaim, AsyncCoordinator
from inbox_claims.asgi import webhook_app
from inbox_claims.providers import MessageFacts
from inbox_claims.providers.gmail import GmailProvider

coord = AsyncCoordinator.from_env()  # INBOX_COORDINATOR_TARGET, INBOX_PRINCIPAL (or INBOX_TOKEN)
mail = GmailProvider.from_env()  # GMAIL_PUSH_AUDIENCE, GMAIL_USER, GMAIL_TOKEN, GMAIL_API_BASE, GMAIL_JWKS_URL


async def answer(message: MessageFacts, claim: AsyncClaim) -> None:  # a granted claim on one incoming message
    await claim.send(mail.reply, message, body=await draft_reply(message.subject_line))  # fenced, stamped


webhook = webhook_app(mail, answer, coordinator=coord)
# --- end of the guarded handler

if __name__ == "__main__":
    serve(webhook)
