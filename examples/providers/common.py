"""What the provider examples share besides their handlers: the stand-in for your LLM call, and serving a webhook
app on ``$HOST:$PORT`` at ``/webhook`` (uvicorn, with the app's lifespan: on SIGTERM, running replies finish)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.routing import Route


async def draft_reply(about: str) -> str:
    """Your LLM call. This stand-in takes ``LLM_DELAY`` seconds (default 1), as a model would, and answers."""
    await asyncio.sleep(float(os.environ.get("LLM_DELAY", "1")))
    return f"Thank you for your message ({about}). Your order ships today."


def nylas_api_base() -> str:
    """``NYLAS_API_BASE`` (default ``https://api.us.nylas.com``); ``NYLAS_API_URI``, its older name, is still read,
    with a line saying so."""
    if "NYLAS_API_BASE" not in os.environ and "NYLAS_API_URI" in os.environ:
        print("NYLAS_API_URI is deprecated: set NYLAS_API_BASE instead", file=sys.stderr)
        return os.environ["NYLAS_API_URI"]
    return os.environ.get("NYLAS_API_BASE", "https://api.us.nylas.com")


def svix_signed(headers: Mapping[str, str], raw: bytes, secret: str) -> bool:
    """What the unguarded agents check, as Svix's own library does: one of ``svix-signature``'s ``v1,<base64>`` is
    the HMAC-SHA256 of ``<svix-id>.<svix-timestamp>.<body>`` with the secret's bytes."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{headers.get('svix-id', '')}.{headers.get('svix-timestamp', '')}.".encode() + raw
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    return any(hmac.compare_digest(s.partition(",")[2], expected) for s in headers.get("svix-signature", "").split())


def serve(webhook: Any) -> None:
    """Serves ``webhook`` (an ASGI app, or a Starlette endpoint) at ``/webhook`` on ``$HOST`` (default 127.0.0.1)
    and ``$PORT`` (default 8000) until SIGTERM or Ctrl-C, with its ``lifespan`` if it has one (the webhook apps'
    let running replies finish); one INFO line per refusal on stderr."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    route = Route("/webhook", webhook, methods=["GET", "POST"])
    app = Starlette(routes=[route], lifespan=getattr(webhook, "lifespan", None))
    host, port = os.environ.get("HOST", "127.0.0.1"), int(os.environ.get("PORT", "8000"))
    uvicorn.run(app, host=host, port=port, log_level="warning", ws="none")
