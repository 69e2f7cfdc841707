"""The example agent: a Starlette app whose Nylas webhook answers each new message once, however often and to
however many replicas Nylas delivers it.

::

    python -m examples.agent.app --port 8001 --principal agent-1 \\
        --coordinator 127.0.0.1:50051 --webhook-secret demo-secret \\
        --nylas-api-base http://127.0.0.1:8999 --nylas-api-key demo-key --llm-delay 2

What a notification goes through (``inbox_claims.asgi`` and the client do everything but the drafting):
signature check on the raw body, then ``reply_to``: ONE ClaimReply that records the delivery (a redelivery stops
here) and claims the message (another replica, or a human, holding it stops here; a message the mailbox sent is
reported instead, and stops here), then 200; in the background the fake LLM drafts while the claim is renewed;
``claim.send`` passes the fenced commit point, sends through the Nylas API with the claim's idempotency key, and
records the reply.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from inbox_claims import AsyncClaim, AsyncCoordinator, Notification
from inbox_claims.asgi import nylas_webhook_app
from inbox_claims.nylas import AsyncNylas, NylasReply

from .llm import FakeLLM

log = logging.getLogger("examples.agent")


@dataclass(frozen=True)
class AgentSettings:
    principal: str
    webhook_secret: str
    nylas_api_key: str
    coordinator: str = "127.0.0.1:50051"
    nylas_api_base: str = "https://api.us.nylas.com"
    llm_delay: float = 1.0
    claim_ttl: int = 30


def build_app(settings: AgentSettings) -> Starlette:
    """The agent's web app: ``/webhooks/nylas`` (GET challenge, POST notifications) and ``/healthz``."""
    coordinator = AsyncCoordinator(settings.coordinator, principal=settings.principal)
    nylas = AsyncNylas(settings.nylas_api_key, api_base=settings.nylas_api_base, timeout=30)
    llm = FakeLLM(settings.llm_delay, signature=settings.principal)

    async def answer(notification: Notification, claim: AsyncClaim) -> None:
        # (A message the mailbox sent, its own reply or a person's from Gmail, never gets here: the guard reports it.)
        draft = await llm.draft(notification)
        claim.raise_if_lost()  # taken over by a human while drafting? stop here (the send would be refused anyway)
        reply = NylasReply.answering(notification, body=draft)
        grant_id = notification.grant_id or claim.subject.mailbox
        sent_id = await claim.send(nylas.send, grant_id, reply, idempotency_key=claim.idempotency_key)
        log.info("%s replied to %s (sent message %s)", settings.principal, claim.subject.id, sent_id)

    webhook = nylas_webhook_app(
        settings.webhook_secret,
        answer,
        coordinator=coordinator,
        ttl=settings.claim_ttl,
        note=f"{settings.principal} is drafting",
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with webhook.lifespan():  # on shutdown: let the replies being drafted finish
            yield
        await nylas.close()
        await coordinator.close()
        log.info("%s stopped after finishing its work", settings.principal)

    async def healthz(request: Request) -> PlainTextResponse:
        return PlainTextResponse(f"ok {settings.principal}, {webhook.running} notification(s) in progress\n")

    return Starlette(
        routes=[Route("/webhooks/nylas", webhook, methods=["GET", "POST"]), Route("/healthz", healthz)],
        lifespan=lifespan,
    )


def main(argv: list[str] | None = None) -> None:
    env = os.environ.get
    parser = argparse.ArgumentParser(description="The example agent's webhook receiver (see examples/README.md).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--principal", default=env("INBOX_PRINCIPAL", "agent-1"), help="this replica's identity")
    parser.add_argument("--coordinator", default=env("INBOX_COORDINATOR_TARGET", "127.0.0.1:50051"))
    parser.add_argument("--webhook-secret", default=env("NYLAS_WEBHOOK_SECRET", "demo-secret"))
    parser.add_argument("--nylas-api-base", default=env("NYLAS_API_BASE", "http://127.0.0.1:8999"))
    parser.add_argument("--nylas-api-key", default=env("NYLAS_API_KEY", "demo-key"))
    parser.add_argument("--llm-delay", type=float, default=1.0, help="seconds the fake LLM takes per draft")
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {options.principal} %(name)s: %(message)s")
    settings = AgentSettings(
        principal=options.principal,
        webhook_secret=options.webhook_secret,
        nylas_api_key=options.nylas_api_key,
        coordinator=options.coordinator,
        nylas_api_base=options.nylas_api_base,
        llm_delay=options.llm_delay,
    )
    uvicorn.run(build_app(settings), host=options.host, port=options.port, log_level="warning", ws="none")


if __name__ == "__main__":
    main()
