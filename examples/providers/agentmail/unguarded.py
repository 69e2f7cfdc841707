"""The same AgentMail agent without the coordinator, as an AgentMail webhook usually is: the Svix signature checked,
each message.received answered after the 200 (a reply without an idempotency key: the agent has none to share
between its replicas). Every replica answers every delivery it gets, and a person's reply from the console stops
nothing: ``./run --unguarded``, to see what the guard prevents."""

from __future__ import annotations

import json
import os
from urllib.parse import quote

import httpx
from starlette.background import BackgroundTasks
from starlette.requests import Request
from starlette.responses import PlainTextResponse

from examples.providers.common import draft_reply, serve, svix_signed

API = os.environ.get("AGENTMAIL_API_BASE", "https://api.agentmail.to").rstrip("/")
SECRET = os.environ["AGENTMAIL_WEBHOOK_SECRET"]
http = httpx.AsyncClient(headers={"Authorization": f"Bearer {os.environ['AGENTMAIL_API_KEY']}"})


async def reply(message: dict[str, str]) -> None:
    body = await draft_reply(str(message.get("subject") or ""))
    inbox, message_id = quote(message["inbox_id"], safe="@"), quote(message["message_id"], safe="")
    await http.post(f"{API}/v0/inboxes/{inbox}/messages/{message_id}/reply", json={"text": body})


async def webhook(request: Request) -> PlainTextResponse:
    raw = await request.body()
    if not svix_signed(request.headers, raw, SECRET):
        return PlainTextResponse("bad signature", status_code=401)
    event = json.loads(raw)
    tasks = BackgroundTasks()
    if event.get("event_type") == "message.received":
        tasks.add_task(reply, event["message"])
    return PlainTextResponse("ok", background=tasks)


if __name__ == "__main__":
    serve(webhook)
