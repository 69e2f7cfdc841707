"""A guarded Resend inbound agent (Svix-signed webhooks): one reply per customer email, however often Resend
delivers an event and to however many replicas, and none when a person answered first (their reply, from the
mailbox's address with the receiving address in Bcc, arrives in the thread) (README.md). ``./run`` starts it;
everything comes from the environment."""

from __future__ import annotations

from examples.providers.common import draft_reply, serve

# --- the guarded handler (docs/providers.md shows these lines; tests/tools/test_provider_examples.py counts them)
from inbox_claims import AsyncClaim, AsyncCoordinator
from inbox_claims.asgi import webhook_app
from inbox_claims.providers import MessageFacts
from inbox_claims.providers.resend import ResendProvider

coord = AsyncCoordinator.from_env()  # INBOX_COORDINATOR_TARGET, INBOX_PRINCIPAL (or INBOX_TOKEN)
mail = ResendProvider.from_env()  # RESEND_WEBHOOK_SECRET, RESEND_MAILBOX, RESEND_API_KEY, RESEND_FROM


async def answer(message: MessageFacts, claim: AsyncClaim) -> None:  # a granted claim on one incoming email
    await claim.send(mail.reply, message, body=await draft_reply(message.subject_line))  # fenced, keyed, stamped


webhook = webhook_app(mail, answer, coordinator=coord)
# --- end of the guarded handler

if __name__ == "__main__":
    serve(webhook)
