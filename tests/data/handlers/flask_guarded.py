import hashlib
import hmac
import json
import os
from typing import Any

import httpx
from flask import Flask, abort, request
from inbox_claims import guard, nylas as guarded_nylas

from llm import draft_reply_sync

app = Flask(__name__)
http = httpx.Client(
    base_url=os.environ["NYLAS_API_BASE"], headers={"Authorization": f"Bearer {os.environ['NYLAS_API_KEY']}"}
)
SECRET = os.environ["NYLAS_WEBHOOK_SECRET"].encode()
seen: set[str] = set()


@guard
def answer(event: dict[str, Any]) -> None:
    message = event["data"]["object"]
    draft = draft_reply_sync(message)
    guarded_nylas.send(http, message["grant_id"], draft)


@app.post("/webhooks/nylas")
def nylas_webhook() -> dict[str, str]:
    body = request.get_data()
    signature = hmac.new(SECRET, body, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(signature, request.headers.get("X-Nylas-Signature", "")):
        abort(401)
    event = json.loads(body)
    if event["type"] in ("message.created", "message.updated") and event["id"] not in seen:
        seen.add(event["id"])
        answer(event)
    return {"status": "ok"}
