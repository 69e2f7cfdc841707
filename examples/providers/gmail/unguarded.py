"""The same Gmail agent without the coordinator, as a Pub/Sub push endpoint usually is: the history read since the
position this process keeps in memory (from the mailbox's profile at start), each new message answered in its
thread after the 200, SENT skipped, and no token check. Every replica reads, and answers, the same history, and a
person's reply from the Gmail UI stops nothing: ``./run --unguarded``, to see what the guard prevents."""

from __future__ import annotations

import base64
import os
from email.message import EmailMessage

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import PlainTextResponse

from examples.providers.common import draft_reply, serve

API = os.environ.get("GMAIL_API_BASE", "https://gmail.googleapis.com").rstrip("/") + "/gmail/v1/users/me"
AUTHORIZATION = {"Authorization": f"Bearer {os.environ['GMAIL_TOKEN']}"}
http = httpx.AsyncClient(headers=AUTHORIZATION)
position = [httpx.get(f"{API}/profile", headers=AUTHORIZATION).json()["historyId"]]  # where this process starts


async def answer_new_messages() -> None:
    listing = await http.get(f"{API}/history", params={"startHistoryId": position[0], "historyTypes": "messageAdded"})
    position[0] = listing.json()["historyId"]
    for record in listing.json().get("history", []):
        for added in record.get("messagesAdded", []):
            if "SENT" not in added["message"].get("labelIds", []):
                await answer(added["message"]["id"])


async def answer(message_id: str) -> None:
    asked = {"format": "metadata", "metadataHeaders": ["From", "Subject", "Message-ID"]}
    message = (await http.get(f"{API}/messages/{message_id}", params=asked)).json()
    headers = {h["name"].lower(): h["value"] for h in message["payload"]["headers"]}
    reply = EmailMessage()
    reply["To"], reply["Subject"] = headers["from"], "Re: " + headers.get("subject", "")
    reply["In-Reply-To"] = reply["References"] = headers["message-id"]
    reply.set_content(await draft_reply(headers.get("subject", "")))
    raw = base64.urlsafe_b64encode(bytes(reply)).decode()
    await http.post(f"{API}/messages/send", json={"raw": raw, "threadId": message["threadId"]})


async def webhook(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok", background=BackgroundTask(answer_new_messages))


if __name__ == "__main__":
    serve(webhook)
