"""The same Resend inbound agent without the coordinator, as a Resend webhook usually is: the Svix signature
checked, each email.received read from the received-emails API and answered after the 200 (no idempotency key: the
agent has none to share between its replicas), mail from the mailbox itself skipped. Every replica answers every
delivery it gets, and a person's reply stops nothing: ``./run --unguarded``, to see what the guard prevents."""

from __future__ import annotations

import json
import os

import httpx
from starlette.background import BackgroundTasks
from starlette.requests import Request
from starlette.responses import PlainTextResponse

from examples.providers.common import draft_reply, serve, svix_signed

API = os.environ.get("RESEND_API_BASE", "https://api.resend.com").rstrip("/")
SECRET = os.environ["RESEND_WEBHOOK_SECRET"]
MAILBOX = os.environ["RESEND_MAILBOX"]
SENDER = os.environ.get("RESEND_FROM") or MAILBOX
http = httpx.AsyncClient(headers={"Authorization": f"Bearer {os.environ['RESEND_API_KEY']}"})


async def reply(email_id: str) -> None:
    email = (await http.get(f"{API}/emails/receiving/{email_id}")).json()
    if MAILBOX in str(email.get("from")):
        return
    body = await draft_reply(str(email.get("subject") or ""))
    thread = {"In-Reply-To": email["message_id"], "References": email["message_id"]}
    subject = "Re: " + str(email.get("subject") or "")
    document = {"from": SENDER, "to": [email["from"]], "subject": subject, "text": body, "headers": thread}
    await http.post(f"{API}/emails", json=document)


async def webhook(request: Request) -> PlainTextResponse:
    raw = await request.body()
    if not svix_signed(request.headers, raw, SECRET):
        return PlainTextResponse("bad signature", status_code=401)
    event = json.loads(raw)
    tasks = BackgroundTasks()
    if event.get("type") == "email.received":
        tasks.add_task(reply, event["data"]["email_id"])
    return PlainTextResponse("ok", background=tasks)


if __name__ == "__main__":
    serve(webhook)
