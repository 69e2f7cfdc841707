"""An agent as its developer writes it: a Nylas webhook endpoint (``inbox_claims.asgi.nylas_webhook_app``) with a
coordinator, answering through ``inbox_claims.nylas.send``, traced with OpenTelemetry's SDK exporting OTLP/HTTP to
the receiver named on the command line. tests/client/test_guard_traces.py runs it and reads what it prints.

Nylas's send endpoint is a small HTTP server on loopback answering as Nylas documents it
(``POST /v3/grants/{grant_id}/messages/send``: 200 with ``{"request_id", "data": {"id", ...}}``); it keeps the
``traceparent`` each send came with.

Modes: ``outcomes`` claims a message another agent holds (refused: held) and loses a claim to a person's
takeover; ``reply`` delivers one signed notification under a web framework's span and prints its trace;
``stop-mid-run`` delivers one, prints ``delivered`` and waits for a line on stdin (the test stops the receiver
meanwhile), then delivers two more and prints every delivery's answer and the replies sent.
"""

import asyncio
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from inbox_claims import AsyncCoordinator, Notification, nylas
from inbox_claims._webhooks import sign_nylas
from inbox_claims.asgi import nylas_webhook_app
from inbox_claims.nylas import NylasReply

SECRET = "webhook-secret-7f3a9c"
API_KEY = "nyk_v0_api-key-4be1d2"
SUBJECT_LINE = "Where is my order 4411?"
SENDER = "carla.customer@example.org"

endpoint, target, mailbox, mode = sys.argv[1:5]
protocol = sys.argv[5] if len(sys.argv) > 5 else "grpc"  # http-json: target is the coordinator's HTTP face
provider = TracerProvider(resource=Resource.create({"service.name": "python-agent"}))
# Short waits: a span reaches the receiver soon, and a receiver that went away costs the export thread only.
provider.add_span_processor(
    BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces", timeout=2), schedule_delay_millis=50)
)
trace.set_tracer_provider(provider)
tracer = trace.get_tracer("agent")
sends: list[dict[str, Any]] = []


class NylasSendApi(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        length = int(self.headers.get("content-length", "0"))
        json.loads(self.rfile.read(length))
        sends.append({"path": self.path, "traceparent": self.headers.get("traceparent", "")})
        body = json.dumps({"request_id": "req-1", "data": {"id": f"sent-{len(sends)}", "object": "message"}})
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, format: str, *args: Any) -> None:
        pass


api = ThreadingHTTPServer(("127.0.0.1", 0), NylasSendApi)
threading.Thread(target=api.serve_forever, daemon=True).start()


def notification(message_id: str) -> bytes:
    document = {
        "specversion": "1.0",
        "type": "message.created",
        "source": "/google/emails/realtime",
        "id": f"notif-{message_id}",
        "time": 1723821985,
        "webhook_delivery_attempt": 1,
        "data": {
            "application_id": "app-1",
            "object": {
                "id": message_id,
                "grant_id": mailbox,
                "thread_id": f"thread-{message_id}",
                "object": "message",
                "subject": SUBJECT_LINE,
                "from": [{"name": "Carla", "email": SENDER}],
                "date": 1723821980,
            },
        },
    }
    return json.dumps(document).encode()


async def deliver(app: Any, body: bytes) -> int:
    """One POST through the ASGI app, as a server would make it; the status answered."""
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/webhooks/nylas",
        "query_string": b"",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-nylas-signature", sign_nylas(body, SECRET).encode()),
        ],
    }
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    answered: list[int] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answered.append(message["status"])

    await app(scope, receive, send)
    return answered[0]


async def main() -> dict[str, Any]:
    out: dict[str, Any] = {"statuses": []}
    async with (
        AsyncCoordinator(target, principal="agent-1", protocol=protocol) as coord,  # type: ignore[arg-type]
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{api.server_port}") as http,
    ):

        async def answer(event: Notification, claim: Any) -> None:
            with tracer.start_as_current_span("draft reply"):
                if mode == "reply":
                    await asyncio.sleep(2.2)  # past a third of the 5 s TTL: one renewal
            reply = NylasReply.answering(event, body="It ships today.")
            await nylas.send(http, event.grant_id, reply, api_key=API_KEY)

        app = nylas_webhook_app(SECRET, answer, coordinator=coord, ttl=5)
        with tracer.start_as_current_span("POST /webhooks/nylas", kind=trace.SpanKind.SERVER) as framework:
            out["trace_id"] = f"{framework.get_span_context().trace_id:032x}"
            out["statuses"].append(await deliver(app, notification("msg-1")))
        await app.aclose()  # its reply sent
        if mode == "stop-mid-run":
            print("delivered", flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            for message_id in ("msg-2", "msg-3"):
                app = nylas_webhook_app(SECRET, answer, coordinator=coord, ttl=5)
                with tracer.start_as_current_span("POST /webhooks/nylas", kind=trace.SpanKind.SERVER):
                    out["statuses"].append(await deliver(app, notification(message_id)))
                await app.aclose()  # its reply sent
    out["sends"] = sends
    return out


def outcomes() -> dict[str, Any]:
    """A claim refused because another holds it, and a claim lost to a person's takeover, each under a span."""
    from inbox_claims import ClaimLost, Coordinator, Subject

    out: dict[str, Any] = {}
    with (
        Coordinator(target, principal="agent-1") as one,
        Coordinator(target, principal="agent-2") as other,
        Coordinator(target, principal="ana", kind="human") as person,
    ):
        with tracer.start_as_current_span("agent turn: held") as turn:
            out["held"] = f"{turn.get_span_context().trace_id:032x}"
            with one.reply_to(mailbox=mailbox, message_id="o-1"):
                answered = other.guard(lambda event: "drafted")(notification_event("o-1"))
                out["held_answer"] = answered
        with tracer.start_as_current_span("agent turn: lost") as turn:
            out["lost"] = f"{turn.get_span_context().trace_id:032x}"
            try:
                with one.reply_to(mailbox=mailbox, message_id="o-2", ttl=5) as claim:
                    person.takeover(Subject.message(mailbox, "o-2"), from_person="agent-1", note="I'll call her")
                    out["noticed"] = claim.lost.wait(10)
                    claim.send(lambda: "never")
            except ClaimLost as lost:
                out["loss"] = lost.reason.name.lower()
    return out


def notification_event(message_id: str) -> dict[str, Any]:
    return json.loads(notification(message_id))


result = asyncio.run(main()) if mode != "outcomes" else outcomes()
provider.shutdown()
api.shutdown()
print(json.dumps(result), flush=True)
