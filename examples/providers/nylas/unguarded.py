"""The same Nylas agent without the coordinator, as a webhook handler usually is: the signature checked, the reply
drafted and sent after the 200, its own sent mail skipped. Every replica answers every delivery it gets, and a
person's reply from Gmail stops nothing: ``./run --unguarded``, to see what the guard prevents."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import PlainTextResponse

from examples.providers.common import draft_reply, nylas_api_base, serve

SECRET = os.environ["NYLAS_WEBHOOK_SECRET"].encode()
http = httpx.AsyncClient(base_url=nylas_api_base(), headers={"Authorization": f"Bearer {os.environ['NYLAS_API_KEY']}"})


async def reply(message: dict[str, Any]) -> None:
    subject = str(message.get("subject") or "")
    document = {
        "reply_to_message_id": message["id"],
        "to": message.get("reply_to") or message.get("from") or [],
        "subject": f"Re: {subject}",
        "body": await draft_reply(subject),
    }
    await http.post(f"/v3/grants/{message['grant_id']}/messages/send", json=document)


async def webhook(request: Request) -> PlainTextResponse:
    if request.method == "GET":
        return PlainTextResponse(request.query_params.get("challenge", ""))
    body = await request.body()
    signature = hmac.new(SECRET, body, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(signature, request.headers.get("x-nylas-signature", "")):
        return PlainTextResponse("bad signature", status_code=401)
    event = json.loads(body)
    message = event.get("data", {}).get("object", {})
    if event.get("type") in ("message.created", "message.updated") and "SENT" not in message.get("folders", []):
        return PlainTextResponse("ok", background=BackgroundTask(reply, message))
    return PlainTextResponse("ok")


if __name__ == "__main__":
    serve(webhook)
