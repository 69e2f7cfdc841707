import hashlib
import hmac
import json
import os
from typing import Any

import httpx
from fastapi import BackgroundTasks, FastAPI, HTTPException, Request
from inbox_claims import guard, nylas as guarded_nylas

from llm import draft_reply

app = FastAPI()
http = httpx.AsyncClient(
    base_url=os.environ["NYLAS_API_BASE"], headers={"Authorization": f"Bearer {os.environ['NYLAS_API_KEY']}"}
)
SECRET = os.environ["NYLAS_WEBHOOK_SECRET"].encode()
seen: set[str] = set()


@guard
async def answer(event: dict[str, Any]) -> None:
    message = event["data"]["object"]
    draft = await draft_reply(message)
    await guarded_nylas.send(http, message["grant_id"], draft)


@app.post("/webhooks/nylas")
async def nylas_webhook(request: Request, tasks: BackgroundTasks) -> dict[str, str]:
    body = await request.body()
    signature = hmac.new(SECRET, body, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(signature, request.headers.get("x-nylas-signature", "")):
        raise HTTPException(status_code=401, detail="bad signature")
    event = json.loads(body)
    if event["type"] in ("message.created", "message.updated") and event["id"] not in seen:
        seen.add(event["id"])
        tasks.add_task(answer, event)
    return {"status": "ok"}
