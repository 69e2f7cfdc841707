"""The calls of both clients, without I/O: what each sends, how its answer is read, and when it is retried.

:class:`Core` builds every request (:mod:`._convert`), runs it as a flow of effects (:mod:`._effects`) with the
retry policy, and decodes the answer; paging and watching are flows that emit items. ``Coordinator.claim`` and
``AsyncCoordinator.claim`` (:mod:`._sync`, :mod:`._async`) are each one line that runs ``Core.claim``'s flow
with the client's own I/O, and the guard (:mod:`._guard`) builds its calls from the ``*_op`` methods here.
"""

from __future__ import annotations

import logging
import operator
import random
import time
import uuid
from collections.abc import Iterable
from datetime import datetime
from typing import Any, TypeVar

import grpc

from inbox_wire.v1 import coordinator_pb2 as pb

from . import _tracing
from ._convert import (
    caller_identity_from_pb,
    claim_result_from_pb,
    claims_page_from_pb,
    delivery_result_from_pb,
    fence_result_from_pb,
    incoming_result_from_pb,
    outgoing_result_from_pb,
    recent_messages_from_pb,
    state_to_pb,
    status_from_pb,
    subject_to_pb,
    summary_to_pb,
    takeover_result_from_pb,
    timestamp_to_pb,
    token_to_pb,
    ttl_to_pb,
    undone_from_pb,
    waiting_from_pb,
    watch_item_from_pb,
)
from ._effects import Emit, Flow, Op, OpenStream, ReadStream, Rpc, RpcFailure, Sleep, Stream
from ._options import ClientOptions
from ._types import (
    CallerIdentity,
    ClaimResult,
    ClaimsPage,
    DeliveryResult,
    FenceResult,
    IncomingResult,
    MessageSummary,
    OutgoingResult,
    OutsideReplyUndone,
    RecentMessage,
    Subject,
    SubjectState,
    SubjectStatus,
    TakeoverResult,
    WatchItem,
)
from .providers._seam import CursorRange

__all__ = ["RETRYABLE", "Core"]

log = logging.getLogger("inbox_claims")

# CANCELLED too: a coordinator that stops past its shutdown grace cancels the calls still running (the
# caller's own cancellation never gets here: it raises asyncio.CancelledError, or the client is closed).
# Every call is safe to repeat, since its retries carry its request id.
RETRYABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED}
)

R = TypeVar("R")


def _identity(response: Any) -> Any:
    return response


def new_request_id() -> str:
    return uuid.uuid4().hex


class Core:
    """Builds requests, reads responses, decides retries. Each of its call methods is the flow of the clients'
    method of the same name (``Core.claim`` of ``Coordinator.claim`` and ``AsyncCoordinator.claim``, whose
    docstrings say what the call does): it returns a flow, or a :class:`Stream` of items, that the client runs
    with its own I/O."""

    def __init__(self, options: ClientOptions) -> None:
        self.options = options
        self._rng = random.Random()

    # -- the retry loop ----------------------------------------------------------------------------------

    def call(
        self,
        op: Op[R],
        *,
        deadline: float | None = None,
        timeout: float | None = None,
        parent: _tracing.GuardSpan | None = None,
    ) -> Flow[R]:
        """Runs ``op`` with retries on UNAVAILABLE, DEADLINE_EXCEEDED and ABORTED, and on RESOURCE_EXHAUSTED
        that comes with a retry hint (the same request, so the same request id). ``deadline`` (a
        ``time.monotonic()`` value) bounds every attempt and the waits; ``timeout`` (seconds, the caller's
        per-call ``timeout=``) bounds them from when the call starts. ``parent``: the guard's span the call is made
        for (its span's parent; else the current span)."""
        if timeout is not None:
            if not timeout > 0:
                raise ValueError(f"timeout must be a positive number of seconds, not {timeout}")
            until = time.monotonic() + timeout
            deadline = until if deadline is None else min(deadline, until)
        span = _tracing.call_started(op.method, op.request, parent)
        metadata = span.metadata if span is not None else ()
        attempt = 0
        try:
            while True:
                attempt += 1
                timeout = self.options.timeout
                if deadline is not None:
                    timeout = max(min(timeout, deadline - time.monotonic()), 0.001)
                try:
                    response = yield Rpc(op.method, op.request, timeout, metadata)
                except RpcFailure as failure:
                    delay = self.retry_delay(failure, attempt, deadline)
                    if delay is None:
                        if span is not None:
                            span.failed(failure.code, attempt)
                        raise failure.error(op.method, attempt) from None
                    log.info(
                        "%s: %s (attempt %d of %d); retrying in %.2f s",
                        op.method,
                        failure.code.name,
                        attempt,
                        self.options.retry.attempts,
                        delay,
                    )
                    if span is not None:
                        span.retrying(failure.code, attempt, delay)
                    yield Sleep(delay)
                    continue
                if span is not None:
                    span.answered(response)
                return op.decode(response)
        finally:
            if span is not None:
                span.end()

    def retry_delay(self, failure: RpcFailure, attempt: int, deadline: float | None = None) -> float | None:
        """How long to wait before trying again after ``attempt`` failed attempts; ``None``: give up."""
        policy = self.options.retry
        retryable = failure.code in RETRYABLE or (
            failure.code is grpc.StatusCode.RESOURCE_EXHAUSTED and failure.retry_after is not None
        )
        if not retryable or attempt >= policy.attempts:
            return None
        delay = max(policy.backoff(attempt - 1, self._rng), failure.retry_after or 0.0)
        if deadline is not None and time.monotonic() + delay >= deadline:
            return None
        return delay

    # -- operations (the guard builds these once and runs them with call(), keeping their request ids) -----

    def claim_op(
        self,
        subject: Subject,
        *,
        ttl: int = 0,
        notification_id: str = "",
        note: str = "",
        summary: MessageSummary | None = None,
        thread_id: str = "",
        received_at: datetime | None = None,
        correspondent: str = "",
    ) -> Op[ClaimResult]:
        request = pb.ClaimReplyRequest(
            request_id=new_request_id(),
            subject=subject_to_pb(subject),
            notification_id=notification_id,
            ttl_seconds=ttl_to_pb(ttl),
            note=note,
            summary=summary_to_pb(summary),
            thread_id=thread_id,
            received_at=timestamp_to_pb(received_at, "received_at") if received_at is not None else None,
            correspondent=correspondent,
        )
        return Op("ClaimReply", request, claim_result_from_pb)

    def record_incoming_op(
        self,
        mailbox: str,
        message_id: str,
        thread_id: str,
        received_at: datetime,
        *,
        automated: str = "",
        summary: MessageSummary | None = None,
        notification_id: str = "",
    ) -> Op[IncomingResult]:
        request = pb.RecordIncomingRequest(
            request_id=new_request_id(),
            mailbox=mailbox,
            notification_id=notification_id,
            message_id=message_id,
            thread_id=thread_id,
            received_at=timestamp_to_pb(received_at, "received_at"),
            summary=summary_to_pb(summary),
            automated=automated,
        )
        return Op("RecordIncoming", request, incoming_result_from_pb)

    def record_outgoing_op(
        self,
        mailbox: str,
        message_id: str,
        thread_id: str,
        sent_at: datetime,
        *,
        sender: str = "",
        notification_id: str = "",
        claim_token: int = 0,
    ) -> Op[OutgoingResult]:
        request = pb.RecordOutgoingRequest(
            request_id=new_request_id(),
            mailbox=mailbox,
            notification_id=notification_id,
            message_id=message_id,
            thread_id=thread_id,
            sent_at=timestamp_to_pb(sent_at, "sent_at"),
            sender=sender,
            claim_token=claim_token,
        )
        return Op("RecordOutgoing", request, outgoing_result_from_pb)

    def renew_op(self, subject: Subject, token: int, *, ttl: int = 0) -> Op[FenceResult]:
        request = pb.RenewClaimRequest(
            request_id=new_request_id(),
            subject=subject_to_pb(subject),
            fencing_token=token_to_pb(token),
            ttl_seconds=ttl_to_pb(ttl),
        )
        return Op("RenewClaim", request, fence_result_from_pb)

    def release_op(self, subject: Subject, token: int, *, redeliverable: bool = False) -> Op[FenceResult]:
        request = pb.ReleaseClaimRequest(
            request_id=new_request_id(),
            subject=subject_to_pb(subject),
            fencing_token=token_to_pb(token),
            redeliverable=redeliverable,
        )
        return Op("ReleaseClaim", request, fence_result_from_pb)

    def begin_send_op(self, subject: Subject, token: int) -> Op[FenceResult]:
        request = pb.BeginSendRequest(
            request_id=new_request_id(), subject=subject_to_pb(subject), fencing_token=token_to_pb(token)
        )
        return Op("BeginSend", request, fence_result_from_pb)

    def confirm_sent_op(self, subject: Subject, token: int, sent_message_id: str = "") -> Op[FenceResult]:
        request = pb.ConfirmSentRequest(
            request_id=new_request_id(),
            subject=subject_to_pb(subject),
            fencing_token=token_to_pb(token),
            sent_message_id=sent_message_id,
        )
        return Op("ConfirmSent", request, fence_result_from_pb)

    def mark_replied_op(
        self, subject: Subject, token: int, sent_message_id: str = "", note: str = ""
    ) -> Op[FenceResult]:
        request = pb.MarkRepliedRequest(
            request_id=new_request_id(),
            subject=subject_to_pb(subject),
            fencing_token=token_to_pb(token),
            sent_message_id=sent_message_id,
            note=note,
        )
        return Op("MarkReplied", request, fence_result_from_pb)

    def abort_send_op(
        self, subject: Subject, token: int, reason: str = "", *, redeliverable: bool = False
    ) -> Op[FenceResult]:
        request = pb.AbortSendRequest(
            request_id=new_request_id(),
            subject=subject_to_pb(subject),
            fencing_token=token_to_pb(token),
            reason=reason,
            redeliverable=redeliverable,
        )
        return Op("AbortSend", request, fence_result_from_pb)

    # -- cursors (docs/design.md#cursors): what the providers' batches take and advance -----------------------

    def take_cursor_range(self, mailbox: str, name: str, through_position: int, ttl: int) -> Flow[CursorRange]:
        request = pb.TakeCursorRangeRequest(
            request_id=new_request_id(),
            mailbox=mailbox,
            name=name,
            through_position=through_position,
            ttl_seconds=ttl_to_pb(ttl),
        )
        response = yield from self.call(Op("TakeCursorRange", request, _identity))
        outcome = pb.TakeCursorRangeResponse.Result.Name(response.result)
        busy = response.busy if response.HasField("busy") else None
        return CursorRange(
            outcome,  # type: ignore[arg-type]
            response.value,
            response.position,
            response.range_token,
            busy.holder if busy is not None else "",
            max(busy.expires_at.ToMilliseconds() / 1000 - time.time(), 0.0) if busy is not None else 0.0,
        )

    def advance_cursor(self, mailbox: str, name: str, taken: CursorRange, value: str, position: int) -> Flow[bool]:
        request = pb.AdvanceCursorRequest(
            request_id=new_request_id(),
            mailbox=mailbox,
            name=name,
            range_token=taken.token,
            value=value,
            position=position,
        )
        response = yield from self.call(Op("AdvanceCursor", request, _identity))
        return bool(response.result == pb.AdvanceCursorResponse.OK)

    def get_cursor(self, mailbox: str, name: str, *, timeout: float | None = None) -> Flow[tuple[str, int]]:
        request = pb.GetCursorRequest(mailbox=mailbox, name=name)
        response = yield from self.call(Op("GetCursor", request, _identity), timeout=timeout)
        return response.value, response.position

    def take(self, mailbox: str, name: str, through_position: int, ttl: int) -> Flow[CursorRange]:
        """The seam's ``Cursors.take``: this core is the cursors of the client that runs the flow."""
        return self.take_cursor_range(mailbox, name, through_position, ttl)

    def advance(self, mailbox: str, name: str, taken: CursorRange, value: str, position: int) -> Flow[bool]:
        """The seam's ``Cursors.advance``."""
        return self.advance_cursor(mailbox, name, taken, value, position)

    # -- the clients' calls, one flow each -----------------------------------------------------------------

    def record_delivery(
        self, mailbox: str, notification_id: str, *, timeout: float | None = None
    ) -> Flow[DeliveryResult]:
        request = pb.RecordDeliveryRequest(
            request_id=new_request_id(), mailbox=mailbox, notification_id=notification_id
        )
        return self.call(Op("RecordDelivery", request, delivery_result_from_pb), timeout=timeout)

    def claim(
        self,
        subject: Subject,
        *,
        ttl: int = 0,
        notification_id: str = "",
        note: str = "",
        summary: MessageSummary | None = None,
        thread_id: str = "",
        received_at: datetime | None = None,
        timeout: float | None = None,
    ) -> Flow[ClaimResult]:
        op = self.claim_op(
            subject,
            ttl=ttl,
            notification_id=notification_id,
            note=note,
            summary=summary,
            thread_id=thread_id,
            received_at=received_at,
        )
        return self.call(op, timeout=timeout)

    def record_outgoing(
        self,
        mailbox: str,
        message_id: str,
        thread_id: str,
        sent_at: datetime,
        *,
        sender: str = "",
        notification_id: str = "",
        timeout: float | None = None,
    ) -> Flow[OutgoingResult]:
        op = self.record_outgoing_op(
            mailbox, message_id, thread_id, sent_at, sender=sender, notification_id=notification_id
        )
        return self.call(op, timeout=timeout)

    def record_incoming(self, *args: Any, timeout: float | None = None, **fields: Any) -> Flow[IncomingResult]:
        """RecordIncoming: the arguments of :meth:`record_incoming_op`."""
        return self.call(self.record_incoming_op(*args, **fields), timeout=timeout)

    def renew(self, subject: Subject, token: int, *, ttl: int = 0, timeout: float | None = None) -> Flow[FenceResult]:
        return self.call(self.renew_op(subject, token, ttl=ttl), timeout=timeout)

    def release(
        self, subject: Subject, token: int, *, redeliverable: bool = False, timeout: float | None = None
    ) -> Flow[FenceResult]:
        return self.call(self.release_op(subject, token, redeliverable=redeliverable), timeout=timeout)

    def begin_send(self, subject: Subject, token: int, *, timeout: float | None = None) -> Flow[FenceResult]:
        return self.call(self.begin_send_op(subject, token), timeout=timeout)

    def confirm_sent(
        self, subject: Subject, token: int, sent_message_id: str = "", *, timeout: float | None = None
    ) -> Flow[FenceResult]:
        return self.call(self.confirm_sent_op(subject, token, sent_message_id), timeout=timeout)

    def abort_send(
        self,
        subject: Subject,
        token: int,
        reason: str = "",
        *,
        redeliverable: bool = False,
        timeout: float | None = None,
    ) -> Flow[FenceResult]:
        return self.call(self.abort_send_op(subject, token, reason, redeliverable=redeliverable), timeout=timeout)

    def mark_replied(
        self, subject: Subject, token: int, *, sent_message_id: str = "", note: str = "", timeout: float | None = None
    ) -> Flow[FenceResult]:
        return self.call(self.mark_replied_op(subject, token, sent_message_id, note), timeout=timeout)

    def caller(self, *, timeout: float | None = None) -> Flow[CallerIdentity]:
        return self.call(Op("GetCaller", pb.GetCallerRequest(), caller_identity_from_pb), timeout=timeout)

    def status(self, subject: Subject, *, timeout: float | None = None) -> Flow[SubjectStatus]:
        request = pb.GetStatusRequest(subject=subject_to_pb(subject))
        return self.call(Op("GetStatus", request, lambda response: status_from_pb(response.status)), timeout=timeout)

    def list_claims(
        self,
        mailbox: str,
        *,
        states: Iterable[SubjectState] = (),
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> Flow[ClaimsPage]:
        request = pb.ListClaimsRequest(
            mailbox=mailbox,
            states=[state_to_pb(state) for state in states],
            page_size=operator.index(page_size),
            page_token=page_token,
        )
        return self.call(Op("ListClaims", request, claims_page_from_pb), timeout=timeout)

    def recent_messages(
        self, mailbox: str, *, query: str = "", page_size: int = 0, timeout: float | None = None
    ) -> Flow[tuple[RecentMessage, ...]]:
        request = pb.ListRecentMessagesRequest(mailbox=mailbox, query=query, page_size=operator.index(page_size))
        return self.call(Op("ListRecentMessages", request, recent_messages_from_pb), timeout=timeout)

    def waiting_for_a_person(self, mailbox: str, *, timeout: float | None = None) -> Flow[tuple[RecentMessage, ...]]:
        request = pb.ListRecentMessagesRequest(mailbox=mailbox, page_size=100)
        return self.call(Op("ListRecentMessages", request, waiting_from_pb), timeout=timeout)

    def iter_claims(
        self, mailbox: str, *, states: Iterable[SubjectState] = (), page_size: int = 0
    ) -> Stream[SubjectStatus]:
        return Stream(self._all_pages(mailbox, tuple(states), page_size))

    def _all_pages(self, mailbox: str, states: tuple[SubjectState, ...], page_size: int) -> Flow[None]:
        token = ""
        while True:
            page = yield from self.list_claims(mailbox, states=states, page_size=page_size, page_token=token)
            for status in page.subjects:
                yield Emit(status)
            if not page.next_page_token:
                return
            token = page.next_page_token

    def watch(self, mailbox: str, *, reconnect: bool = True) -> Stream[WatchItem]:
        return Stream(self._watch(mailbox, reconnect))

    def _watch(self, mailbox: str, reconnect: bool) -> Flow[None]:
        revision = 0  # of the last snapshot or event received: a reconnection resumes after it
        failures = 0
        while True:
            try:
                handle = yield OpenStream("Watch", pb.WatchRequest(mailbox=mailbox, after_revision=revision))
                while (message := (yield ReadStream(handle))) is not None:
                    failures = 0
                    item = watch_item_from_pb(message)
                    revision = item.revision
                    yield Emit(item)
                return
            except RpcFailure as failure:
                failures += 1
                delay = self.retry_delay(failure, failures) if reconnect else None
                if delay is None:
                    raise failure.error("Watch", failures) from None
                log.info("Watch of %r ended with %s; watching again in %.2f s", mailbox, failure.code.name, delay)
                yield Sleep(delay)

    def takeover(
        self,
        subject: Subject,
        *,
        ttl: int = 0,
        note: str = "",
        summary: MessageSummary | None = None,
        from_person: str = "",
        timeout: float | None = None,
    ) -> Flow[TakeoverResult]:
        request = pb.TakeoverRequest(
            request_id=new_request_id(),
            subject=subject_to_pb(subject),
            ttl_seconds=ttl_to_pb(ttl),
            note=note,
            summary=summary_to_pb(summary),
            from_person=from_person,
        )
        return self.call(Op("Takeover", request, takeover_result_from_pb), timeout=timeout)

    def resolve_in_doubt(
        self, subject: Subject, *, sent: bool, sent_message_id: str = "", note: str = "", timeout: float | None = None
    ) -> Flow[SubjectStatus]:
        outcome = pb.ResolveInDoubtRequest.OUTCOME_SENT if sent else pb.ResolveInDoubtRequest.OUTCOME_NOT_SENT
        request = pb.ResolveInDoubtRequest(
            request_id=new_request_id(),
            subject=subject_to_pb(subject),
            outcome=outcome,
            sent_message_id=sent_message_id,
            note=note,
        )
        return self.call(
            Op("ResolveInDoubt", request, lambda response: status_from_pb(response.status)), timeout=timeout
        )

    def undo_outside_reply(
        self, subject: Subject, *, note: str = "", timeout: float | None = None
    ) -> Flow[OutsideReplyUndone]:
        request = pb.UndoOutsideReplyRequest(request_id=new_request_id(), subject=subject_to_pb(subject), note=note)
        return self.call(Op("UndoOutsideReply", request, undone_from_pb), timeout=timeout)
