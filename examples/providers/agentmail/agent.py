"""A guarded AgentMail agent (Svix-signed webhooks): one reply per customer message, however often AgentMail
delivers an event, through however many webhooks and to however many replicas, and none when a person answered from
AgentMail's console first (README.md). ``./run`` starts it; everything comes from the environment."""

from __future__ import annotations

from examples.providers.common import draft_reply, serve

# --- the guarded handler (docs/providers.md shows these lines; tests/tools/test_provider_examples.py counts them)
from inbox_claims import AsyncClaim, AsyncCoordinator
from inbox_claims.asgi import webhook_app
from inbox_claims.providers import MessageFacts
from inbox_claims.providers.agentmail import AgentMailProvider

coord = AsyncCoordinator.from_env()  # INBOX_COORDINATOR_TARGET, INBOX_PRINCIPAL (or INBOX_TOKEN)
mail = AgentMailProvider.from_env()  # AGENTMAIL_WEBHOOK_SECRET, AGENTMAIL_API_KEY, AGENTMAIL_API_BASE


async def answer(message: MessageFacts, claim: AsyncClaim) -> None:  # a granted claim on one incoming message
    await claim.send(mail.reply, message, body=await draft_reply(message.subject_line))  # fenced, keyed, stamped


webhook = webhook_app(mail, answer, coordinator=coord)
# --- end of the guarded handler

if __name__ == "__main__":
    serve(webhook)
