"""The fenced sink: a fake mail API on loopback that records every send and never dedupes.

``POST /v3/grants/<grant>/messages/send`` with the reply as JSON and these headers: ``Idempotency-Key`` (the
shim's ``claim.idempotency_key``), ``X-Chaos-Token`` (the fencing token the sender holds), ``X-Chaos-Sender`` and
``X-Chaos-Sender-Kind`` (who), ``X-Chaos-Notification`` (the notification the send answers; empty for a human),
``X-Chaos-Subject-Kind`` and ``X-Chaos-Subject-Id`` (what was claimed; for a person answering from Gmail, what
they answered), ``X-Chaos-Mode`` (``outside`` for that person: never fails; ``X-Chaos-Sent-Id`` is then its
message id). The reply's ``Auto-Submitted`` header (in Nylas's ``custom_headers``) is logged as
``auto_submitted``. Every request is one JSON line in the log, ``sent`` true when the reply "went out". The sink
accepts duplicates on purpose (a real API's idempotency cache is the last-resort backstop, which the chaos run
wants to see past): the checker must see exactly what went out.

It also answers what the Nylas provider reads before an agent's claim: ``GET /v3/grants/<grant>/messages/<id>
?fields=include_headers``, the message with its headers (``headers``: a list of ``{"name", "value"}``, as Nylas
documents it); 404 for a message it does not know. The harness gives it each message before its first
notification (``PUT /chaos/messages/<grant>/<id>``, the message object): a webhook carries no headers. And what
the Nylas provider asks right before an agent's commit point ("look before you send"): ``GET
/v3/grants/<grant>/messages?thread_id=<thread>&received_after=<unix seconds>&fields=include_headers``, the
thread's messages received after that time. The harness gives the sink each inbound message when it arrives
(before its notification) and each person's reply from Gmail when it is sent; the agents' own replies are not
listed (the harness has no notifications of them either).

With ``--fail-rate`` some sends end with an outcome the sender cannot know: half of them go out and then
answer 500, half do not go out and the connection is dropped. Both must end IN_DOUBT, never as a second reply.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from urllib.parse import parse_qsl

from .common import JsonlLog, Request, Response, announce, exit_at, serve_http

SEND_PATH_PREFIX = "/v3/grants/"
SEND_PATH_SUFFIX = "/messages/send"
MESSAGES_PREFIX = "/chaos/messages/"


async def run(listen: str, log_path: Path, fail_rate: float, seed: int, deadline: float) -> None:
    log = JsonlLog(log_path)
    rng = random.Random(f"sink/{seed}")
    counter = 0
    messages: dict[tuple[str, str], bytes] = {}

    async def handle(request: Request) -> Response:
        nonlocal counter
        if request.method == "GET" and request.path == "/health":
            return Response(200, b"{}")
        if request.method == "PUT" and request.path.startswith(MESSAGES_PREFIX):
            grant, _, message_id = request.path[len(MESSAGES_PREFIX) :].partition("/")
            messages[(grant, message_id)] = request.body
            return Response(200, b"{}")
        if request.method == "GET" and request.path.startswith(SEND_PATH_PREFIX) and "/messages?" in request.path:
            path, _, query = request.path.partition("?")
            grant = path[len(SEND_PATH_PREFIX) : -len("/messages")]
            params = dict(parse_qsl(query))
            thread, after = params.get("thread_id", ""), int(params.get("received_after", "0") or 0)
            listed = [
                document
                for (box, _), body in messages.items()
                if box == grant
                and (document := json.loads(body)).get("thread_id") == thread
                and int(document.get("date", 0)) > after
            ]
            log.write("look", grant=grant, thread_id=thread, received_after=after, found=[m["id"] for m in listed])
            return Response(200, json.dumps({"data": listed}).encode())
        if request.method == "GET" and request.path.startswith(SEND_PATH_PREFIX) and "/messages/" in request.path:
            path, _, query = request.path.partition("?")
            grant, _, message_id = path[len(SEND_PATH_PREFIX) :].partition("/messages/")
            known = messages.get((grant, message_id))
            if known is None:
                return Response(404, b'{"error":"message not found"}')
            document = json.loads(known)
            if "fields=include_headers" not in query.split("&"):
                document.pop("headers", None)
            log.write("read", grant=grant, message_id=message_id, headers="headers" in document)
            return Response(200, json.dumps({"data": document}).encode())
        if not (
            request.method == "POST"
            and request.path.startswith(SEND_PATH_PREFIX)
            and request.path.endswith(SEND_PATH_SUFFIX)
        ):
            return Response(404, b'{"error":"not found"}')
        grant = request.path[len(SEND_PATH_PREFIX) : -len(SEND_PATH_SUFFIX)]
        try:
            payload = json.loads(request.body or b"{}")
        except ValueError:
            return Response(400, b'{"error":"body is not JSON"}')
        counter += 1
        h = request.headers
        outside = h.get("x-chaos-mode", "") == "outside"
        sent_id = h.get("x-chaos-sent-id", "") if outside else f"sent-{counter:06d}"
        draw = rng.random()
        if outside:
            outcome, sent = "sent", True  # a person's mail client: Gmail sends it
        elif draw < fail_rate / 2:
            outcome, sent = "sent_then_error", True
        elif draw < fail_rate:
            outcome, sent = "dropped_unsent", False
        else:
            outcome, sent = "sent", True
        log.write(
            "send",
            sent=sent,
            outcome=outcome,
            sent_id=sent_id if sent else "",
            grant=grant,
            idempotency_key=h.get("idempotency-key", ""),
            token=int(h.get("x-chaos-token", "0") or 0),
            sender=h.get("x-chaos-sender", ""),
            sender_kind=h.get("x-chaos-sender-kind", ""),
            notification_id=h.get("x-chaos-notification", ""),
            subject_kind=h.get("x-chaos-subject-kind", ""),
            subject_id=h.get("x-chaos-subject-id", ""),
            reply_to=str(payload.get("reply_to_message_id", "")),
            mode=h.get("x-chaos-mode", ""),
            auto_submitted=_custom_header(payload, "auto-submitted"),
        )
        if outcome == "sent_then_error":
            return Response(500, b'{"error":"internal error"}')
        if outcome == "dropped_unsent":
            return Response(0, abort=True)
        return Response(200, json.dumps({"data": {"id": sent_id}}).encode())

    host, _, port = listen.rpartition(":")
    server = await serve_http(host, int(port), handle)
    bound = server.sockets[0].getsockname()
    announce(f"ready {bound[0]}:{bound[1]}")
    await exit_at(deadline)


def _custom_header(payload: dict[str, object], name: str) -> str:
    """A header of the reply's ``custom_headers`` (Nylas's list of ``{"name", "value"}``); empty when absent."""
    headers = payload.get("custom_headers")
    for item in headers if isinstance(headers, list) else []:
        if isinstance(item, dict) and str(item.get("name", "")).lower() == name:
            return str(item.get("value", ""))
    return ""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos sink")
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--fail-rate", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lifetime", type=float, default=3600.0, help="seconds before it exits by itself")
    options = parser.parse_args(argv)
    asyncio.run(run(options.listen, options.log, options.fail_rate, options.seed, time.time() + options.lifetime))
    return 0
