"""The public API used exactly as an application would, importing only from ``inbox_claims``.

``mypy --strict`` checks this file with the rest of the repository: every ``assert_type`` pins a type users
see in their editors, so a change that loosens one (to ``Any``, or to a protobuf type) fails the type check.
pytest runs it against a real coordinator started by ``inbox_claims.testing``.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from datetime import datetime
from typing import assert_type

import pytest

from inbox_claims import (
    AlreadyReplied,
    AsyncClaim,
    AsyncCoordinator,
    Claim,
    ClaimLost,
    ClaimNotGranted,
    Coordinator,
    CoordinatorError,
    DuplicateDelivery,
    InboxClaimsError,
    Notification,
    ReplyHeld,
    RetryPolicy,
    SendOutcomeUnknown,
    SendRejected,
    Subject,
    SubjectState,
    SubjectStatus,
)
from inbox_claims.testing import RunningCoordinator, running_coordinator, sign_nylas
from inbox_claims.types import (
    ClaimOutcome,
    ClaimResult,
    ClaimsPage,
    DeliveryResult,
    FenceResult,
    HolderKind,
    LossReason,
    TakeoverOutcome,
    TakeoverResult,
    WatchEvent,
    WatchSnapshot,
)
from inbox_claims.webhooks import (
    NYLAS_SIGNATURE_HEADER,
    WebhookVerificationError,
    parse_notification,
    verify_nylas_signature,
)

pytestmark = pytest.mark.etcd  # starts etcd (or a coordinator with its own) itself

SECRET = "nylas-webhook-secret"


@pytest.fixture(scope="module")
def running() -> Iterator[RunningCoordinator]:
    with running_coordinator(min_ttl=2, send_timeout=0.5) as coordinator:
        yield coordinator


def webhook_body(grant: str, message_id: str, notification_id: str) -> bytes:
    envelope = {
        "specversion": "1.0",
        "type": "message.created",
        "source": "/google/emails/realtime",
        "id": notification_id,
        "time": 1723821985,
        "webhook_delivery_attempt": 1,
        "data": {
            "application_id": "app",
            "object": {"id": message_id, "grant_id": grant, "thread_id": "thread-1", "object": "message"},
        },
    }
    return json.dumps(envelope).encode()


class MailApiRefused(SendRejected):
    """What an application raises when the mail API answered 4xx: nothing was sent."""


async def send_with_mail_api(draft: str, *, idempotency_key: str) -> str:
    assert idempotency_key.startswith("ic1-")
    await asyncio.sleep(0)
    return f"sent:{draft}"


async def test_an_async_webhook_handler_end_to_end(running: RunningCoordinator) -> None:
    body = webhook_body("grant-async", "msg-1", "notif-1")
    headers = {NYLAS_SIGNATURE_HEADER: sign_nylas(body, SECRET)}
    verify_nylas_signature(body, headers[NYLAS_SIGNATURE_HEADER], SECRET)
    with pytest.raises(WebhookVerificationError):
        verify_nylas_signature(body + b" ", headers[NYLAS_SIGNATURE_HEADER], SECRET)
    notification = parse_notification(body)
    assert_type(notification, Notification)

    lost_seen: list[AsyncClaim] = []
    async with AsyncCoordinator(
        running.target, principal="support-agent-1", timeout=5.0, retry=RetryPolicy(attempts=3)
    ) as coord:
        async with coord.reply_to(notification, ttl=30, note="drafting", on_lost=lost_seen.append) as claim:
            assert_type(claim, AsyncClaim)
            assert_type(claim.subject, Subject)
            assert_type(claim.token, int)
            assert_type(claim.expires_at, datetime | None)
            assert_type(claim.lost, asyncio.Event)
            assert_type(claim.idempotency_key, str)
            sent = await claim.send(send_with_mail_api, "Hello", idempotency_key=claim.idempotency_key)
            assert_type(sent, str | None)
        assert sent == "sent:Hello"
        assert lost_seen == []

        refusal: ClaimNotGranted | None = None
        try:
            async with coord.reply_to(notification):
                pytest.fail("a redelivery was answered")
        except ClaimNotGranted as error:
            refusal = error
        assert isinstance(refusal, DuplicateDelivery)
        assert_type(refusal.recorded_by, str)
        assert refusal.recorded_by == "support-agent-1"

        status = await coord.status(claim.subject)
        assert_type(status, SubjectStatus)
        assert_type(status.state, SubjectState)
        assert_type(status.sent_at, datetime | None)
        assert status.state is SubjectState.REPLIED

        page = await coord.list_claims("grant-async", states=[SubjectState.REPLIED], page_size=10)
        assert_type(page, ClaimsPage)
        every = [item async for item in coord.iter_claims("grant-async")]
        assert_type(every, list[SubjectStatus])
        assert [item.subject for item in page.subjects] == [item.subject for item in every] == [claim.subject]

        watch = coord.watch("grant-async")
        first = await anext(watch)
        assert_type(first, WatchSnapshot | WatchEvent)
        assert isinstance(first, WatchSnapshot)
        await watch.aclose()


async def test_the_low_level_calls_of_a_humans_tool(running: RunningCoordinator) -> None:
    subject = Subject.message("grant-tool", "msg-1")
    async with (
        AsyncCoordinator(running.target, principal="agent-1") as agent,
        AsyncCoordinator(running.target, principal="ana@acme.test", kind=HolderKind.HUMAN) as human,
    ):
        delivery = await agent.record_delivery("grant-tool", "notif-7")
        assert_type(delivery, DeliveryResult)
        assert delivery.is_new
        result = await agent.claim(subject, ttl=30)
        assert_type(result, ClaimResult)
        assert result.outcome is ClaimOutcome.GRANTED
        renewed = await agent.renew(subject, result.token, ttl=30)
        assert_type(renewed, FenceResult)
        assert renewed.ok
        taken = await human.takeover(subject, note="I'll answer")
        assert_type(taken, TakeoverResult)
        assert taken.outcome is TakeoverOutcome.TAKEN_OVER
        assert (await agent.begin_send(subject, result.token)).stale
        released = await human.release(subject, taken.status.fencing_token)
        assert released.status.state is SubjectState.FREE

        doubtful = Subject.thread("grant-tool", "thread-2")
        token = (await agent.claim(doubtful, ttl=30)).token
        assert (await agent.begin_send(doubtful, token)).ok
        for _ in range(100):  # the coordinator's sweeper reports it 0.5 s after BeginSend
            if (await human.status(doubtful)).state is SubjectState.IN_DOUBT:
                break
            await asyncio.sleep(0.05)
        settled = await human.resolve_in_doubt(doubtful, sent=False, note="not in the sent folder")
        assert_type(settled, SubjectStatus)
        assert settled.state is SubjectState.FREE


def test_a_blocking_worker_with_the_decorator(running: RunningCoordinator) -> None:
    notification = parse_notification(webhook_body("grant-sync", "msg-1", "notif-1"))
    with Coordinator(running.target, principal="worker-1") as coord, running.client("worker-2") as rival:

        @coord.guarded(ttl=2)
        def answer(notification: Notification, claim: Claim, draft: str) -> str | None:
            assert_type(claim.lost, threading.Event)
            with pytest.raises(ReplyHeld) as held, rival.reply_to(notification, notification_id="another-notification"):
                pytest.fail("two workers held one message")
            assert_type(held.value.holder_kind, HolderKind | None)
            return claim.send(lambda: f"sent:{draft}")

        assert_type(answer(notification, "Hi"), str | None)

        def refused() -> str:
            raise MailApiRefused("422: invalid recipient")

        with pytest.raises(MailApiRefused), coord.reply_to(mailbox="grant-sync", message_id="msg-2") as claim:
            claim.send(refused)
        assert coord.status(claim.subject).state is SubjectState.FREE

        def timed_out() -> str:
            raise TimeoutError("no answer from the mail API")

        with pytest.raises(SendOutcomeUnknown), coord.reply_to(mailbox="grant-sync", message_id="msg-3") as claim:
            claim.send(timed_out)
        with pytest.raises(AlreadyReplied) as replied, rival.reply_to(mailbox="grant-sync", message_id="msg-3"):
            pytest.fail("a send in progress was answered again")
        assert_type(replied.value.state, SubjectState)
        assert replied.value.state in (SubjectState.SENDING, SubjectState.IN_DOUBT)


def test_every_error_is_an_inbox_claims_error() -> None:
    lost = ClaimLost(Subject.message("grant", "m"), 7, LossReason.TAKEN_OVER, None)
    assert_type(lost.reason, LossReason)
    for error_type in (ClaimNotGranted, ClaimLost, SendRejected, SendOutcomeUnknown, CoordinatorError):
        assert issubclass(error_type, InboxClaimsError)
    assert "taken over" in str(lost)
