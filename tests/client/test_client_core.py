"""The client's pure parts, no coordinator needed: options, the idempotency key, reply_to's arguments, and the
core's retry decisions (its flows are driven by hand here; the real-server retry tests are test_client_retry)."""

from __future__ import annotations

import grpc
import pytest

from inbox_claims import Coordinator, CoordinatorUnavailable, RetryPolicy, Subject
from inbox_claims._effects import Rpc, RpcFailure, Sleep
from inbox_claims.errors import InvalidRequest, QuotaExceeded
from inbox_claims.types import HolderKind, SubjectKind, idempotency_key
from inbox_claims.webhooks import NotificationError, parse_notification
from tests.client.support import nylas_notification

NOWHERE = "127.0.0.1:9"  # never connected to: nothing in these tests makes a call


def test_the_idempotency_key_is_stable_short_and_specific() -> None:
    key = idempotency_key("grant-1", SubjectKind.MESSAGE, "msg-1")
    # A fixed value: every agent, on every version of this package, must compute the same key.
    assert key == "ic1-fac4604f3e211288dfc5652c0957cbb3d3152bbd54a13036b40f0379115ed137"
    assert Subject.message("grant-1", "msg-1").idempotency_key == key
    assert len(key) == 68  # Nylas allows 256
    others = {
        idempotency_key("grant-1", SubjectKind.THREAD, "msg-1"),
        idempotency_key("grant-2", SubjectKind.MESSAGE, "msg-1"),
        idempotency_key("grant-1", SubjectKind.MESSAGE, "msg-2"),
        # No ambiguity from separators inside the ids.
        idempotency_key("grant-1|message", SubjectKind.MESSAGE, "msg-1"),
        idempotency_key('grant-1","message', SubjectKind.MESSAGE, "msg-1"),
    }
    assert key not in others
    assert len(others) == 5


def test_reply_to_takes_its_subject_from_the_notification_or_the_arguments() -> None:
    with Coordinator(NOWHERE, principal="agent-a") as coord:
        notification = nylas_notification("grant-1", "msg-1", notification_id="notif-1", thread_id="thread-1")
        claim = coord.reply_to(notification)
        assert (claim.subject, claim.notification_id, claim.token) == (
            Subject.message("grant-1", "msg-1"),
            "notif-1",
            0,
        )
        assert coord.reply_to(notification, scope="thread").subject == Subject.thread("grant-1", "thread-1")
        # Several grants that see one inbox coordinate on its address instead of their grant ids.
        assert coord.reply_to(notification, mailbox="support@acme.test").subject.mailbox == "support@acme.test"
        explicit = coord.reply_to(mailbox="grant-1", message_id="msg-9")
        assert (explicit.subject, explicit.notification_id) == (Subject.message("grant-1", "msg-9"), "")
        with pytest.raises(RuntimeError, match="inside the claim's block"):
            explicit.send(lambda: "never")  # not entered: nothing claimed, nothing sent

        grant_expired = parse_notification(
            {"id": "n-2", "type": "grant.expired", "data": {"object": {"grant_id": "grant-1"}}}
        )
        with pytest.raises(ValueError, match="not about a message"):
            coord.reply_to(grant_expired)
        with pytest.raises(ValueError, match="needs a thread id"):
            coord.reply_to(mailbox="grant-1", message_id="msg-1", scope="thread")
        with pytest.raises(ValueError, match="needs a mailbox"):
            coord.reply_to(message_id="msg-1")
        with pytest.raises(ValueError, match="scope"):
            coord.reply_to(notification, scope="mailbox")  # type: ignore[arg-type]
        with pytest.raises(NotificationError, match="'type'"):
            coord.reply_to({"id": "a dict that is no notification"})
        with pytest.raises(TypeError, match="the raw body"):
            coord.reply_to(42)  # type: ignore[arg-type]


def test_client_options_are_checked_when_the_client_is_made() -> None:
    with pytest.raises(ValueError, match="either credentials= or tls="):
        Coordinator(NOWHERE, tls=True, credentials=grpc.ssl_channel_credentials())
    with pytest.raises(ValueError, match="client_certificate= and client_key="):
        Coordinator(NOWHERE, client_certificate=b"-----BEGIN CERTIFICATE-----")
    with pytest.raises(ValueError, match="timeout"):
        Coordinator(NOWHERE, timeout=0)
    with pytest.raises(ValueError, match="principal"):
        Coordinator(NOWHERE, principal="ana\n")
    with pytest.raises(ValueError, match="is not a valid HolderKind"):
        Coordinator(NOWHERE, kind="robot")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)

    human = Coordinator(NOWHERE, principal="ana@acme.test", kind="human", token="ict_secret")
    assert (human.target, human.principal, human.kind) == (NOWHERE, "ana@acme.test", HolderKind.HUMAN)
    assert dict(human._core.options.metadata) == {
        "x-inbox-principal": "ana@acme.test",
        "x-inbox-principal-kind": "human",
        "authorization": "Bearer ict_secret",
    }
    assert dict(Coordinator(NOWHERE, token="ict_secret")._core.options.metadata) == {
        "authorization": "Bearer ict_secret"  # with a token the coordinator knows who this is
    }


def test_backoff_grows_exponentially_with_jitter_up_to_its_cap() -> None:
    policy = RetryPolicy(attempts=10, initial_backoff=0.1, max_backoff=1.0)
    for retry, cap in enumerate([0.1, 0.2, 0.4, 0.8, 1.0, 1.0]):
        delays = {policy.backoff(retry) for _ in range(50)}
        assert all(cap / 2 <= delay <= cap for delay in delays)
        assert len(delays) > 1  # jittered


def test_the_core_retries_transient_failures_with_the_same_request() -> None:
    core = Coordinator(NOWHERE, principal="agent-a", retry=RetryPolicy(attempts=3, initial_backoff=0.1))._core
    flow = core.claim(Subject.message("grant-1", "msg-1"), ttl=30)
    first = next(flow)
    assert isinstance(first, Rpc)
    assert first.method == "ClaimReply"
    wait = flow.throw(RpcFailure(grpc.StatusCode.UNAVAILABLE, "connection refused"))
    assert isinstance(wait, Sleep)
    assert 0.05 <= wait.seconds <= 0.1
    second = flow.send(None)
    assert isinstance(second, Rpc)
    assert second.request is first.request  # same request id: the coordinator answers a retry like the original
    hinted = flow.throw(RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED, "over the rate", retry_after=0.7))
    assert isinstance(hinted, Sleep)
    assert hinted.seconds >= 0.7
    assert isinstance(flow.send(None), Rpc)
    with pytest.raises(CoordinatorUnavailable) as exhausted:
        flow.throw(RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, "too slow"))
    assert exhausted.value.attempts == 3

    read = core.status(Subject.message("grant-1", "msg-1"))
    next(read)
    with pytest.raises(InvalidRequest) as invalid:  # not retried: the same request would fail the same way
        read.throw(RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, "subject.id: is required"))
    assert invalid.value.attempts == 1
    read = core.status(Subject.message("grant-1", "msg-1"))
    next(read)
    with pytest.raises(QuotaExceeded):  # RESOURCE_EXHAUSTED without a hint (the watch limit) is not retried
        read.throw(RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED, "64 watches"))
