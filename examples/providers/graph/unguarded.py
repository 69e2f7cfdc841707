"""The same Microsoft 365 agent without the coordinator, as a Graph webhook usually is: the handshake answered, the
clientState checked, each new message read and answered (createReply + send) after the 202, Sent Items skipped.
Every replica answers every delivery it gets, and a person's reply from Outlook stops nothing: ``./run
--unguarded``, to see what the guard prevents."""

from __future__ import annotations

import hmac
import os

import httpx
from starlette.background import BackgroundTasks
from starlette.requests import Request
from starlette.responses import PlainTextResponse

from examples.providers.common import draft_reply, serve

API = os.environ.get("GRAPH_API_BASE", "https://graph.microsoft.com/v1.0").rstrip("/")
MAILBOX = f"{API}/users/{os.environ['GRAPH_USER']}"
STATE = os.environ["GRAPH_CLIENT_STATE"].encode()
http = httpx.AsyncClient(
    headers={"Authorization": f"Bearer {os.environ['GRAPH_TOKEN']}", "Prefer": 'IdType="ImmutableId"'}
)


async def reply(message_id: str) -> None:
    message = (await http.get(f"{MAILBOX}/messages/{message_id}", params={"$select": "subject,parentFolderId"})).json()
    sent_items = (await http.get(f"{MAILBOX}/mailFolders/sentitems", params={"$select": "id"})).json()["id"]
    if message.get("parentFolderId") == sent_items:
        return
    body = await draft_reply(str(message.get("subject") or ""))
    draft = (await http.post(f"{MAILBOX}/messages/{message_id}/createReply", json={"comment": body})).json()
    await http.post(f"{MAILBOX}/messages/{draft['id']}/send")


async def webhook(request: Request) -> PlainTextResponse:
    if "validationToken" in request.query_params:
        return PlainTextResponse(request.query_params["validationToken"])
    notes = (await request.json()).get("value", [])
    if not all(hmac.compare_digest(str(note.get("clientState", "")).encode(), STATE) for note in notes):
        return PlainTextResponse("wrong clientState", status_code=401)
    tasks = BackgroundTasks()
    for note in notes:
        if note.get("changeType") in ("created", "updated"):
            tasks.add_task(reply, note["resourceData"]["id"])
    return PlainTextResponse("", status_code=202, background=tasks)


if __name__ == "__main__":
    serve(webhook)
