"""inbox_claims.asgi and inbox_claims.wsgi over real HTTP, against a real coordinator.

ASGI: the app under uvicorn on a loopback port (alone, and as a Starlette route). WSGI: as a Flask view through
Flask's test client, and alone under a real WSGI server. Each checks the challenge, that a bad or unsigned body
is refused before anything is stored, that a good one is answered 200 while its work is still running, that
the work replies once through reply_to, and that shutdown lets running work finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import httpx
import pytest
from flask import Flask
from starlette.applications import Starlette
from starlette.routing import Route
from werkzeug.serving import make_server

from coordinator.ops.server import CoordinatorServer
from coordinator.store.etcd.process import EtcdServer
from inbox_claims import AsyncClaim, AsyncCoordinator, Claim, Notification, Subject, SubjectState
from inbox_claims.asgi import WebhookApp, nylas_webhook_app
from inbox_claims.testing import RunningCoordinator, running_coordinator, sign_nylas, sign_standard_webhook
from inbox_claims.wsgi import WebhookWSGIApp, nylas_webhook_wsgi

SECRET = "nylas-webhook-secret"
SW_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
PATH = "/webhooks/nylas"

Serve = Callable[..., Awaitable[str]]


def envelope(mailbox: str, message_id: str, *, notification_id: str = "", type_: str = "message.created") -> bytes:
    document = {
        "specversion": "1.0",
        "type": type_,
        "source": "/google/emails/realtime",
        "id": notification_id or f"notif-{uuid.uuid4().hex[:10]}",
        "time": 1723821985,
        "webhook_delivery_attempt": 1,
        "data": {
            "application_id": "app-1",
            "object": {"id": message_id, "grant_id": mailbox, "thread_id": "t-1", "object": "message"},
        },
    }
    return json.dumps(document, separators=(",", ":")).encode()


def signed(body: bytes, secret: str = SECRET) -> dict[str, str]:
    return {"content-type": "application/json", "x-nylas-signature": sign_nylas(body, secret)}


class Recorder:
    """What the handlers did (thread-safe): notifications seen, sends made; ``gate`` holds them until opened."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.sends: list[str] = []
        self.finished: list[str] = []
        self.cancelled: list[str] = []
        self.gate = threading.Event()
        self._lock = threading.Lock()

    def saw(self, notification: Notification) -> None:
        with self._lock:
            self.seen.append(notification.notification_id)

    def send(self, message_id: str) -> str:
        with self._lock:
            self.sends.append(message_id)
            return f"sent-{len(self.sends)}"

    async def wait_gate(self) -> None:
        assert await asyncio.to_thread(self.gate.wait, 10)


async def eventually(check: Callable[[], Awaitable[bool]], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not await check():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        await asyncio.sleep(0.02)


# ----------------------------------------------------------------------------------------------- ASGI


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as client:
        yield client


@pytest.fixture
async def agent(coordinator: CoordinatorServer) -> AsyncIterator[AsyncCoordinator]:
    async with AsyncCoordinator(coordinator.address, principal="agent-a") as client:
        yield client


def guarded_asgi(agent: AsyncCoordinator, recorder: Recorder, **options: Any) -> WebhookApp:
    async def answer(notification: Notification, claim: AsyncClaim) -> None:
        recorder.saw(notification)
        await recorder.wait_gate()  # drafting...
        await claim.send(recorder.send, claim.subject.id)

    return nylas_webhook_app(SECRET, answer, coordinator=agent, **options)


async def test_asgi_answers_the_nylas_challenge(serve: Serve, http: httpx.AsyncClient) -> None:
    async def never(notification: Notification) -> None:
        raise AssertionError("no notification expected")

    url = await serve(nylas_webhook_app(SECRET, never)) + PATH

    answer = await http.get(url, params={"challenge": "a1b2 c3&d4"})
    assert (answer.status_code, answer.text) == (200, "a1b2 c3&d4")
    assert answer.headers["content-type"].startswith("text/plain")
    assert (await http.get(url)).status_code == 400
    assert (await http.get(url, params={"challenge": ""})).status_code == 400
    assert (await http.put(url, content=b"{}")).status_code == 405


async def test_asgi_refuses_bad_bodies_before_anything_is_stored(
    serve: Serve, http: httpx.AsyncClient, agent: AsyncCoordinator, mailbox: str
) -> None:
    recorder = Recorder()
    url = await serve(guarded_asgi(agent, recorder, max_body_bytes=10_000)) + PATH
    body = envelope(mailbox, "msg-1", notification_id="notif-forged")
    reserialised = json.dumps(json.loads(body), indent=2).encode()

    unsigned = await http.post(url, content=body, headers={"content-type": "application/json"})
    forged = await http.post(url, content=body, headers=signed(body, "another-secret"))
    altered = await http.post(url, content=reserialised, headers=signed(body))
    not_json = await http.post(url, content=b"{not json", headers=signed(b"{not json"))
    no_id = await http.post(url, content=b'{"type": "message.created"}', headers=signed(b'{"type": "message.created"}'))
    huge = b"x" * 10_001
    too_large = await http.post(url, content=huge, headers=signed(huge))

    assert (unsigned.status_code, unsigned.text) == (401, "signature refused: missing x-nylas-signature header")
    assert forged.status_code == altered.status_code == 401
    assert "does not match" in forged.text
    assert not_json.status_code == no_id.status_code == 400
    assert "not valid JSON" in not_json.text
    assert "top-level 'id'" in no_id.text
    assert too_large.status_code == 413
    await asyncio.sleep(0.1)
    assert recorder.seen == []
    assert (await agent.list_claims(mailbox)).subjects == ()
    assert (await agent.record_delivery(mailbox, "notif-forged")).is_new  # the forged delivery was not recorded


async def test_starlette_route_acks_at_once_and_replies_once(
    serve: Serve, http: httpx.AsyncClient, agent: AsyncCoordinator, mailbox: str
) -> None:
    recorder = Recorder()
    webhook = guarded_asgi(agent, recorder)
    app = Starlette(routes=[Route(PATH, webhook, methods=["GET", "POST"])], lifespan=webhook.lifespan)
    url = await serve(app) + PATH
    subject = Subject.message(mailbox, "msg-1")
    created = envelope(mailbox, "msg-1", notification_id="notif-1")
    updated = envelope(mailbox, "msg-1", notification_id="notif-2", type_="message.updated")

    first = await http.post(url, content=created, headers=signed(created))
    # Answered while the reply is still being drafted: the claim is held, the handler is running.
    assert (first.status_code, first.text) == (200, "ok")
    await eventually(lambda: _state_is(agent, subject, SubjectState.CLAIMED))
    assert webhook.running == 1
    redelivered = await http.post(url, content=created, headers=signed(created))
    second_event = await http.post(url, content=updated, headers=signed(updated))
    assert redelivered.status_code == second_event.status_code == 200
    # The redelivery and the update run too, and are refused (a duplicate; held): only the first goes on.
    await eventually(lambda: _true(webhook.running == 1))
    assert recorder.seen == ["notif-1"]

    recorder.gate.set()
    await eventually(lambda: _state_is(agent, subject, SubjectState.REPLIED))
    assert recorder.sends == ["msg-1"]
    assert recorder.seen == ["notif-1"]
    status = await agent.status(subject)
    assert (status.holder, status.sent_message_id) == ("agent-a", "sent-1")


async def _state_is(client: AsyncCoordinator, subject: Subject, state: SubjectState) -> bool:
    return (await client.status(subject)).state is state


async def test_asgi_shutdown_lets_running_work_finish_then_refuses(
    serve: Serve, http: httpx.AsyncClient, mailbox: str, caplog: pytest.LogCaptureFixture
) -> None:
    recorder = Recorder()

    async def slow(notification: Notification) -> None:
        recorder.saw(notification)
        try:
            await asyncio.sleep(0.3 if notification.message_id == "quick" else 60)
            recorder.finished.append(notification.notification_id)
        except asyncio.CancelledError:
            recorder.cancelled.append(notification.notification_id)
            raise

    webhook = nylas_webhook_app(SECRET, slow, shutdown_grace=1.0)
    url = await serve(webhook) + PATH  # uvicorn runs the app's own lifespan protocol
    quick, stuck = (
        envelope(mailbox, "quick", notification_id="n-quick"),
        envelope(mailbox, "stuck", notification_id="n-stuck"),
    )
    assert (await http.post(url, content=quick, headers=signed(quick))).status_code == 200
    assert (await http.post(url, content=stuck, headers=signed(stuck))).status_code == 200
    assert webhook.running == 2

    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="inbox_claims.webhooks"):
        await webhook.aclose()
    assert 0.9 < time.monotonic() - started < 5
    assert recorder.finished == ["n-quick"]  # finished within the grace
    assert recorder.cancelled == ["n-stuck"]  # cancelled past it, and said so
    assert "cancelling 1 webhook task(s)" in caplog.text
    assert webhook.running == 0
    late = envelope(mailbox, "late")
    refused = await http.post(url, content=late, headers=signed(late))
    assert (refused.status_code, refused.headers["retry-after"]) == (503, "5")
    assert len(recorder.seen) == 2


async def test_asgi_handler_errors_are_logged_and_the_app_goes_on(
    serve: Serve, http: httpx.AsyncClient, mailbox: str, caplog: pytest.LogCaptureFixture
) -> None:
    recorder = Recorder()

    async def flaky(notification: Notification) -> None:
        recorder.saw(notification)
        if notification.message_id == "boom":
            raise RuntimeError("the LLM fell over")

    url = await serve(nylas_webhook_app(SECRET, flaky)) + PATH
    boom, fine = envelope(mailbox, "boom", notification_id="n-boom"), envelope(mailbox, "fine", notification_id="n-ok")
    with caplog.at_level(logging.ERROR, logger="inbox_claims.webhooks"):
        assert (await http.post(url, content=boom, headers=signed(boom))).status_code == 200
        assert (await http.post(url, content=fine, headers=signed(fine))).status_code == 200
        await eventually(lambda: _true(len(recorder.seen) == 2))
        await asyncio.sleep(0.05)
    assert "handling notification n-boom (message.created) failed" in caplog.text
    assert "the LLM fell over" in caplog.text


async def _true(value: bool) -> bool:
    return value


async def test_asgi_standard_webhooks_scheme(serve: Serve, http: httpx.AsyncClient, mailbox: str) -> None:
    recorder = Recorder()

    async def handle(notification: Notification) -> None:
        recorder.saw(notification)

    url = await serve(nylas_webhook_app(SW_SECRET, handle, scheme="standard", tolerance=60)) + PATH
    body = envelope(mailbox, "msg-sw", notification_id="n-sw")

    def headers(timestamp: int) -> dict[str, str]:
        signature = sign_standard_webhook(body, msg_id="msg_1", timestamp=timestamp, secret=SW_SECRET)
        return {"webhook-id": "msg_1", "webhook-timestamp": str(timestamp), "webhook-signature": signature}

    stale = await http.post(url, content=body, headers=headers(int(time.time()) - 600))
    nylas_only = await http.post(url, content=body, headers=signed(body))
    fresh = await http.post(url, content=body, headers=headers(int(time.time())))

    assert stale.status_code == 401
    assert "too old" in stale.text
    assert nylas_only.status_code == 401
    assert fresh.status_code == 200
    await eventually(lambda: _true(recorder.seen == ["n-sw"]))


def test_a_misconfigured_secret_fails_at_start() -> None:
    async def handle(notification: Notification) -> None:
        pass

    with pytest.raises(ValueError, match="empty"):
        nylas_webhook_app("", handle)
    with pytest.raises(ValueError, match="base64"):
        nylas_webhook_wsgi("whsec_not base64!", lambda n: None, scheme="standard")


# ----------------------------------------------------------------------------------------------- WSGI


@pytest.fixture
def running(shared_etcd: EtcdServer) -> Iterator[RunningCoordinator]:
    with running_coordinator(etcd_endpoint=shared_etcd.endpoint) as coordinator:
        yield coordinator


def guarded_wsgi(running: RunningCoordinator, recorder: Recorder, **options: Any) -> WebhookWSGIApp:
    coord = running.client("agent-w")

    def answer(notification: Notification, claim: Claim) -> None:
        recorder.saw(notification)
        assert recorder.gate.wait(10)  # drafting...
        claim.send(recorder.send, claim.subject.id)

    return nylas_webhook_wsgi(SECRET, answer, coordinator=coord, workers=4, **options)


def wait_until(check: Callable[[], bool], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        time.sleep(0.02)


def test_flask_view_verifies_acks_and_replies_once(running: RunningCoordinator, mailbox: str) -> None:
    recorder = Recorder()
    webhook = guarded_wsgi(running, recorder)
    app = Flask(__name__)
    app.add_url_rule(PATH, view_func=webhook.flask_view(), methods=["GET", "POST"])
    client = app.test_client()
    created = envelope(mailbox, "msg-1", notification_id="notif-1")
    updated = envelope(mailbox, "msg-1", notification_id="notif-2", type_="message.updated")
    subject = Subject.message(mailbox, "msg-1")

    with running.client("observer") as observer:
        challenge = client.get(PATH, query_string={"challenge": "xyz 1"})
        assert (challenge.status_code, challenge.get_data(as_text=True)) == (200, "xyz 1")
        forged = envelope(mailbox, "msg-1", notification_id="notif-forged")
        assert client.post(PATH, data=forged, headers={"content-type": "application/json"}).status_code == 401
        assert client.post(PATH, data=forged, headers=signed(forged, "wrong")).status_code == 401
        assert client.post(PATH, data=b"[]", headers=signed(b"[]")).status_code == 400
        assert observer.list_claims(mailbox).subjects == ()
        assert observer.record_delivery(mailbox, "notif-forged").is_new  # the refused ones recorded nothing

        first = client.post(PATH, data=created, headers=signed(created))
        assert (first.status_code, first.get_data(as_text=True)) == (200, "ok")
        wait_until(lambda: observer.status(subject).state is SubjectState.CLAIMED)  # drafting in a worker
        assert webhook.running == 1
        assert client.post(PATH, data=created, headers=signed(created)).status_code == 200
        assert client.post(PATH, data=updated, headers=signed(updated)).status_code == 200
        recorder.gate.set()
        wait_until(lambda: observer.status(subject).state is SubjectState.REPLIED)
        wait_until(lambda: webhook.running == 0)
    webhook.close()
    assert recorder.sends == ["msg-1"]
    assert recorder.seen == ["notif-1"]


@contextlib.contextmanager
def wsgi_server(app: WebhookWSGIApp) -> Iterator[str]:
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}{PATH}"
    finally:
        server.shutdown()
        server.server_close()


def test_plain_wsgi_over_http_finishes_running_work_on_close(mailbox: str) -> None:
    recorder = Recorder()

    def slow(notification: Notification) -> None:
        recorder.saw(notification)
        assert recorder.gate.wait(10)
        time.sleep(0.2)
        recorder.finished.append(notification.notification_id)

    webhook = nylas_webhook_wsgi(SECRET, slow, workers=2, shutdown_grace=5)
    body = envelope(mailbox, "msg-1", notification_id="n-1")
    with wsgi_server(webhook) as url, httpx.Client(timeout=10) as http:
        assert http.get(url, params={"challenge": "ok?"}).text == "ok?"
        assert http.post(url, content=body, headers={"x-nylas-signature": "0" * 64}).status_code == 401
        assert http.post(url, content=body, headers=signed(body)).status_code == 200
        wait_until(lambda: recorder.seen == ["n-1"])
        assert recorder.finished == []  # answered while the work runs
        recorder.gate.set()
        webhook.close()
        assert recorder.finished == ["n-1"]  # close() waited for it
        assert http.post(url, content=body, headers=signed(body)).status_code == 503
