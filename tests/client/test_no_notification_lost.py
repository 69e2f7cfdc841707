"""No notification is acknowledged that nothing recorded (docs/design.md#no-notification-lost): the ASGI and WSGI
adapters answer Nylas only once the coordinator recorded the notification, 503 while it cannot, so that Nylas
delivers it again. Each test stops a real coordinator, delivers, starts it again on the same port and etcd,
delivers again as Nylas would: the message is answered once. The adapters' other answers are in
test_webhook_adapters.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from coordinator.store.etcd.process import EtcdServer, free_port
from inbox_claims import AsyncClaim, AsyncCoordinator, Claim, Coordinator, Notification, RetryPolicy, Subject
from inbox_claims.asgi import nylas_webhook_app
from inbox_claims.testing import running_coordinator, sign_nylas
from inbox_claims.types import SubjectState
from inbox_claims.wsgi import nylas_webhook_wsgi
from tests.client.test_webhook_adapters import wsgi_server

SECRET = "nylas-webhook-secret"
PATH = "/webhooks/nylas"
# Quick to give up while the coordinator is down: the point is the answer, not the patience.
RETRY = RetryPolicy(attempts=3, initial_backoff=0.05, max_backoff=0.2)
ADMISSION_S = 1.0


def delivery(mailbox: str, message_id: str, attempt: int = 1, *, notification_id: str = "") -> bytes:
    """The notification as Nylas POSTs it; a retry of a delivery repeats the notification id."""
    document = {
        "specversion": "1.0",
        "type": "message.created",
        "id": notification_id or f"notif-{message_id}",
        "time": 1723821985,
        "webhook_delivery_attempt": attempt,
        "data": {
            "object": {
                "id": message_id,
                "grant_id": mailbox,
                "thread_id": f"thread-{message_id}",
                "object": "message",
                "date": 1723821980,
                "folders": ["INBOX"],
                "from": [{"email": "bea@example.org"}],
            }
        },
    }
    return json.dumps(document).encode()


def signed(body: bytes) -> dict[str, str]:
    return {"content-type": "application/json", "x-nylas-signature": sign_nylas(body, SECRET)}


class Sends:
    def __init__(self) -> None:
        self.made: list[str] = []
        self._lock = threading.Lock()

    def send(self, message_id: str) -> str:
        with self._lock:
            self.made.append(message_id)
            return f"sent-{len(self.made)}"


@contextlib.contextmanager
def coordinator_on(port: int, etcd: EtcdServer, prefix: str) -> Iterator[None]:
    with running_coordinator(etcd_endpoint=etcd.endpoint, listen=f"127.0.0.1:{port}", prefix=prefix):
        yield


async def test_asgi_answers_503_while_the_coordinator_is_down_and_the_redelivery_is_answered_once(
    shared_etcd: EtcdServer, serve: Any, mailbox: str
) -> None:
    port, prefix = free_port(), f"lost-{uuid.uuid4().hex}/"
    sends = Sends()

    async def answer(notification: Notification, claim: AsyncClaim) -> None:
        await claim.send(sends.send, claim.subject.id)

    async with AsyncCoordinator(f"127.0.0.1:{port}", principal="agent-a", retry=RETRY, timeout=0.5) as agent:
        app = nylas_webhook_app(SECRET, answer, coordinator=agent, admission_timeout=ADMISSION_S)
        url = await serve(app) + PATH
        async with httpx.AsyncClient(timeout=10) as http:
            with coordinator_on(port, shared_etcd, prefix):
                first = delivery(mailbox, "msg-1")
                assert (await http.post(url, content=first, headers=signed(first))).status_code == 200
                await _until(lambda: sends.made == ["msg-1"])
            # The coordinator is gone: a new message is not acknowledged, within the stated bound.
            late = delivery(mailbox, "msg-2")
            started = time.monotonic()
            refused = await http.post(url, content=late, headers=signed(late))
            assert time.monotonic() - started < ADMISSION_S + 1.5
            assert (refused.status_code, refused.headers["retry-after"]) == (503, "5")
            assert "deliver it again" in refused.text
            await asyncio.sleep(0.2)
            assert sends.made == ["msg-1"]
            with coordinator_on(port, shared_etcd, prefix):
                # Nylas delivers again (the same notification id) until it gets a 2xx: recorded, replied to once.
                for attempt in range(2, 12):
                    again = delivery(mailbox, "msg-2", attempt=attempt)
                    if (await http.post(url, content=again, headers=signed(again))).status_code == 200:
                        break
                    await asyncio.sleep(0.2)
                else:
                    raise AssertionError("the redelivery was never accepted")
                redelivered = delivery(mailbox, "msg-1", attempt=2)
                assert (await http.post(url, content=redelivered, headers=signed(redelivered))).status_code == 200
                await _until(lambda: sends.made == ["msg-1", "msg-2"])
                replied = Subject.message(mailbox, "msg-2")
                for _ in range(200):  # the send went out; its ConfirmSent follows
                    if (await agent.status(replied)).state is SubjectState.REPLIED:
                        break
                    await asyncio.sleep(0.02)
                assert (await agent.status(replied)).state is SubjectState.REPLIED
            await asyncio.sleep(0.2)
            assert sends.made == ["msg-1", "msg-2"]


def test_wsgi_answers_503_while_the_coordinator_is_down_and_the_redelivery_is_answered_once(
    shared_etcd: EtcdServer, mailbox: str
) -> None:
    port, prefix = free_port(), f"lost-{uuid.uuid4().hex}/"
    sends = Sends()

    def answer(notification: Notification, claim: Claim) -> None:
        claim.send(sends.send, claim.subject.id)

    with Coordinator(f"127.0.0.1:{port}", principal="agent-w", retry=RETRY, timeout=0.5) as agent:
        webhook = nylas_webhook_wsgi(SECRET, answer, coordinator=agent, workers=2, admission_timeout=ADMISSION_S)
        with wsgi_server(webhook) as url, httpx.Client(timeout=10) as http:
            body = delivery(mailbox, "msg-1")
            started = time.monotonic()
            refused = http.post(url, content=body, headers=signed(body))
            assert time.monotonic() - started < ADMISSION_S + 1.5
            assert refused.status_code == 503
            assert sends.made == []
            with coordinator_on(port, shared_etcd, prefix):
                # Nylas delivers again until it gets a 2xx (the client may take a moment to reconnect), then once
                # more as a duplicate: answered once.
                for attempt in range(2, 12):
                    again = delivery(mailbox, "msg-1", attempt=attempt)
                    if http.post(url, content=again, headers=signed(again)).status_code == 200:
                        break
                    time.sleep(0.2)
                else:
                    raise AssertionError("the redelivery was never accepted")
                duplicate = delivery(mailbox, "msg-1", attempt=attempt + 1)
                assert http.post(url, content=duplicate, headers=signed(duplicate)).status_code == 200
                deadline = time.monotonic() + 10
                while sends.made != ["msg-1"] and time.monotonic() < deadline:
                    time.sleep(0.02)
                webhook.close()
        assert sends.made == ["msg-1"]


async def _until(check: Any, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        await asyncio.sleep(0.02)


def test_the_admission_bound_is_checked_at_start() -> None:
    async def answer(notification: Notification, claim: AsyncClaim) -> None:
        pass

    with pytest.raises(ValueError, match="admission_timeout must be between 0 and 10 seconds"):
        nylas_webhook_app(SECRET, answer, coordinator=AsyncCoordinator(principal="a"), admission_timeout=12)
