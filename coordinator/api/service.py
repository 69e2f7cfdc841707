"""The gRPC servicer: protobuf in, engine call, protobuf out; coordinator errors to status codes."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from coordinator.api.auth import Authenticator, CallCredentials, DevelopmentAuthenticator, current_principal
from coordinator.api.batch import BatchObserver, BatchRunner
from coordinator.api.encoded import Encoded
from coordinator.api.pacing import WritePacer
from coordinator.api.quotas import (
    OWED_MAX_S,
    TURNS_WAITING_MAX,
    QuotaSettings,
    RateLimiter,
    WatchSlots,
    WorkBudget,
)
from coordinator.api.status import (
    CALL_DEADLINE_REASON,
    abort,
    deadline_message,
    error_metadata,
    retry_after_ms,
    status_code,
)
from coordinator.core import commands, work
from coordinator.core.domain import (
    AdvanceResult,
    Caller,
    ClaimResult,
    CursorView,
    DeliveryRecord,
    EventType,
    FenceResult,
    HolderKind,
    OutgoingResult,
    OutsideReply,
    ResolveOutcome,
    State,
    Stored,
    Subject,
    SubjectKind,
    Summary,
    TakeoverResult,
    TakeResult,
)
from coordinator.core.engine import Engine, Event, Snapshot
from coordinator.core.errors import (
    CoordinatorError,
    InvalidArgument,
    ResourceExhausted,
    SlowConsumer,
    WatcherBehind,
)
from coordinator.core.memo import LastConverted
from coordinator.core.storms import Refusal, RefusalKind
from inbox_wire import BATCH_MAX_CALLS
from inbox_wire.v1 import coordinator_pb2 as pb
from inbox_wire.v1 import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

__all__ = ["SERVICE_NAME", "CoordinatorServicer"]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name

_KINDS = {pb.SUBJECT_KIND_MESSAGE: SubjectKind.MESSAGE, pb.SUBJECT_KIND_THREAD: SubjectKind.THREAD}
_KINDS_OUT = {v: k for k, v in _KINDS.items()}
_HOLDER_KINDS_OUT = {HolderKind.AGENT: pb.HOLDER_KIND_AGENT, HolderKind.HUMAN: pb.HOLDER_KIND_HUMAN}
_STATES = {
    State.FREE: pb.SUBJECT_STATE_FREE,
    State.CLAIMED: pb.SUBJECT_STATE_CLAIMED,
    State.SENDING: pb.SUBJECT_STATE_SENDING,
    State.REPLIED: pb.SUBJECT_STATE_REPLIED,
    State.IN_DOUBT: pb.SUBJECT_STATE_IN_DOUBT,
}
_STATES_IN = {v: k for k, v in _STATES.items()}
_CLAIM_RESULTS = {
    ClaimResult.GRANTED: pb.ClaimReplyResponse.GRANTED,
    ClaimResult.HELD: pb.ClaimReplyResponse.HELD,
    ClaimResult.ALREADY_REPLIED: pb.ClaimReplyResponse.ALREADY_REPLIED,
    ClaimResult.DUPLICATE_DELIVERY: pb.ClaimReplyResponse.DUPLICATE_DELIVERY,
}
_FENCE_RESULTS = {
    FenceResult.OK: pb.FENCE_RESULT_OK,
    FenceResult.STALE_TOKEN: pb.FENCE_RESULT_STALE_TOKEN,
    FenceResult.REFUSED: pb.FENCE_RESULT_REFUSED,
}
_REFUSAL_KINDS = {
    RefusalKind.REPLY_BUDGET_SPENT: pb.SendRefusal.REPLY_BUDGET_SPENT,
    RefusalKind.CONVERSATION_MOVED_ON: pb.SendRefusal.CONVERSATION_MOVED_ON,
}
_TAKEOVER_RESULTS = {
    TakeoverResult.TAKEN_OVER: pb.TakeoverResponse.TAKEN_OVER,
    TakeoverResult.GRANTED: pb.TakeoverResponse.GRANTED,
    TakeoverResult.HELD: pb.TakeoverResponse.HELD,
    TakeoverResult.ALREADY_REPLIED: pb.TakeoverResponse.ALREADY_REPLIED,
}
_EVENT_TYPES = {
    EventType.CLAIMED: pb.EVENT_TYPE_CLAIMED,
    EventType.RENEWED: pb.EVENT_TYPE_RENEWED,
    EventType.RELEASED: pb.EVENT_TYPE_RELEASED,
    EventType.EXPIRED: pb.EVENT_TYPE_EXPIRED,
    EventType.SENDING: pb.EVENT_TYPE_SENDING,
    EventType.REPLIED: pb.EVENT_TYPE_REPLIED,
    EventType.ABORTED: pb.EVENT_TYPE_ABORTED,
    EventType.TAKEN_OVER: pb.EVENT_TYPE_TAKEN_OVER,
    EventType.IN_DOUBT: pb.EVENT_TYPE_IN_DOUBT,
    EventType.RESOLVED_NOT_SENT: pb.EVENT_TYPE_RESOLVED_NOT_SENT,
    EventType.RETENTION_ENDED: pb.EVENT_TYPE_RETENTION_ENDED,
    EventType.MARKED_REPLIED: pb.EVENT_TYPE_MARKED_REPLIED,
    EventType.ANSWERED_OUTSIDE: pb.EVENT_TYPE_ANSWERED_OUTSIDE,
    EventType.OUTSIDE_REPLY_UNDONE: pb.EVENT_TYPE_OUTSIDE_REPLY_UNDONE,
}
_OUTGOING_RESULTS = {
    OutgoingResult.OWN_REPLY: pb.RecordOutgoingResponse.OWN_REPLY,
    OutgoingResult.ANSWERED_OUTSIDE: pb.RecordOutgoingResponse.ANSWERED_OUTSIDE,
    OutgoingResult.DUPLICATE_DELIVERY: pb.RecordOutgoingResponse.DUPLICATE_DELIVERY,
}
_RESOLVE_OUTCOMES = {
    pb.ResolveInDoubtRequest.OUTCOME_SENT: ResolveOutcome.SENT,
    pb.ResolveInDoubtRequest.OUTCOME_NOT_SENT: ResolveOutcome.NOT_SENT,
}


_TAKE_RESULTS = {
    TakeResult.TAKEN: pb.TakeCursorRangeResponse.TAKEN,
    TakeResult.COVERED: pb.TakeCursorRangeResponse.COVERED,
    TakeResult.BUSY: pb.TakeCursorRangeResponse.BUSY,
}
_ADVANCE_RESULTS = {
    AdvanceResult.OK: pb.AdvanceCursorResponse.OK,
    AdvanceResult.STALE_RANGE: pb.AdvanceCursorResponse.STALE_RANGE,
}


def _cursor_range_out(view: CursorView) -> pb.CursorRangeInfo | None:
    if view.range is None:
        return None
    return pb.CursorRangeInfo(
        holder=view.range.holder, expires_at=_timestamp(view.range.expires_ms), range_token=view.range_token
    )


def _timestamp(ms: int | None) -> Timestamp | None:
    if not ms:  # None, or 0: not kept (a reply record drops its claim's acquisition time)
        return None
    stamp = Timestamp()
    stamp.FromMilliseconds(ms)
    return stamp


def subject_in(message: pb.Subject, field: str = "subject") -> Subject:
    kind = _KINDS.get(message.kind)
    if kind is None:
        raise InvalidArgument(f"{field}.kind", "must be SUBJECT_KIND_MESSAGE or SUBJECT_KIND_THREAD")
    return Subject(message.mailbox, kind, message.id)


# protobuf's Timestamp range: 0001-01-01T00:00:00Z to 9999-12-31T23:59:59.999999999Z.
_TIMESTAMP_MIN_SECONDS = -62_135_596_800
_TIMESTAMP_MAX_SECONDS = 253_402_300_799
_TIMESTAMP = "google.protobuf.Timestamp"
# Every Timestamp field of a request message, as paths of field names, by message type (made once per type).
_TIME_FIELDS: dict[str, tuple[tuple[str, ...], ...]] = {}


def _time_paths(descriptor: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The paths to every singular Timestamp field of ``descriptor``, inside singular messages too. Repeated
    messages are not entered: the only request with any is Batch, whose calls are checked one by one."""
    found: list[tuple[str, ...]] = []
    for field in descriptor.fields:
        if field.message_type is None or field.is_repeated:
            continue
        if field.message_type.full_name == _TIMESTAMP:
            found.append((*path, field.name))
        elif len(path) < 8:  # no request message is recursive; the bound only stops one that would be
            found += _time_paths(field.message_type, (*path, field.name))
    return found


def check_times(request: Any) -> None:
    """Every Timestamp of ``request`` within protobuf's range, else INVALID_ARGUMENT naming its field: a stamp
    outside it (year 10000, nanos over a second) cannot be converted, and would otherwise fail deep in a call as
    INTERNAL. What each time may be beyond that (not before 1970, not far ahead) the engine checks."""
    name = request.DESCRIPTOR.full_name
    paths = _TIME_FIELDS.get(name)
    if paths is None:
        paths = _TIME_FIELDS[name] = tuple(_time_paths(request.DESCRIPTOR))
    for path in paths:
        container = request
        for part in path:
            if not container.HasField(part):
                break
            container = getattr(container, part)
        else:
            _check_stamp(container, ".".join(path))


def _check_stamp(stamp: Timestamp, field: str) -> None:
    if not 0 <= stamp.nanos <= 999_999_999:
        raise InvalidArgument(f"{field}.nanos", f"is {stamp.nanos}; it must be 0..999999999")
    if not _TIMESTAMP_MIN_SECONDS <= stamp.seconds <= _TIMESTAMP_MAX_SECONDS:
        raise InvalidArgument(
            field, f"is {stamp.seconds} s from 1970, outside a Timestamp's range (years 0001 to 9999)"
        )


def time_in(container: Any, name: str) -> int | None:
    """A Timestamp field (checked by ``check_times``) in milliseconds; None when unset."""
    if not container.HasField(name):
        return None
    stamp: Timestamp = getattr(container, name)
    return int(stamp.ToMilliseconds())


def summary_in(message: pb.MessageSummary) -> Summary:
    received = message.received_at
    return Summary(message.subject_line, message.sender, received.ToMilliseconds() if received.seconds else None)


def outside_reply_out(reply: OutsideReply | None) -> pb.OutsideReply | None:
    if reply is None:
        return None
    return pb.OutsideReply(
        sender=reply.sender,
        sent_at=_timestamp(reply.sent_ms),
        message_id=reply.message_id,
        recorded_by=reply.recorded_by,
        stopped_holder=reply.stopped_holder,
    )


def summary_out(summary: Summary | None) -> pb.MessageSummary | None:
    if not summary:
        return None
    return pb.MessageSummary(
        subject_line=summary.subject_line, sender=summary.sender, received_at=_timestamp(summary.received_ms)
    )


def subject_out(subject: Subject) -> pb.Subject:
    return pb.Subject(mailbox=subject.mailbox, kind=_KINDS_OUT[subject.kind], id=subject.id)


def status_out(subject: Subject, stored: Stored | None) -> pb.SubjectStatus:
    if stored is None:
        return pb.SubjectStatus(subject=subject_out(subject), state=pb.SUBJECT_STATE_FREE)
    record = stored.record
    return pb.SubjectStatus(
        subject=subject_out(subject),
        state=_STATES[record.state],
        holder=record.holder,
        holder_kind=_HOLDER_KINDS_OUT[record.holder_kind],
        fencing_token=stored.token,
        acquired_at=_timestamp(record.acquired_ms),
        expires_at=_timestamp(record.expires_ms),
        note=record.note,
        send_started_at=_timestamp(record.send_started_ms),
        send_deadline=_timestamp(record.send_deadline_ms),
        sent_at=_timestamp(record.sent_ms),
        sent_message_id=record.sent_message_id,
        revision=stored.revision,
        ttl_seconds=record.ttl_seconds,
        replied_by_hand=record.replied_by_hand,
        summary=summary_out(record.summary),
        replied_outside=record.replied_outside,
        outside_reply=outside_reply_out(record.outside_reply),
        settled_by=record.settled_by,
        agents_stopped=refusal_out(record.agents_stopped),
    )


def _recent_out(
    subject: Subject,
    summary: Summary | None,
    seen_ms: int,
    seen_by: str,
    automated: str = "",
    *,
    stopped: pb.SendRefusal | None = None,
) -> pb.RecentMessage:
    return pb.RecentMessage(
        subject=subject_out(subject),
        summary=summary_out(summary),
        first_seen_at=_timestamp(seen_ms),
        seen_by=seen_by,
        automated=automated,
        agents_stopped=stopped,
    )


def refusal_out(refusal: Refusal | None) -> pb.SendRefusal | None:
    if refusal is None:
        return None
    return pb.SendRefusal(
        kind=_REFUSAL_KINDS[refusal.kind],
        reason=refusal.reason,
        scope=refusal.scope,
        limit=refusal.limit,
        window_seconds=refusal.window_ms // 1000,
        counted=refusal.counted,
        frees_at=_timestamp(refusal.frees_ms),
        newer_message_id=refusal.newer_message_id,
        newer_received_at=_timestamp(refusal.newer_received_ms),
    )


def delivery_out(delivery: DeliveryRecord) -> pb.DeliveryRecord:
    return pb.DeliveryRecord(
        mailbox=delivery.mailbox,
        notification_id=delivery.notification_id,
        recorded_by=delivery.recorded_by,
        recorded_at=_timestamp(delivery.recorded_ms),
        subject=subject_out(delivery.subject) if delivery.subject is not None else None,
    )


def event_out(event: Event) -> pb.WatchEvent:
    change = event.change
    previous = change.previous
    # A reply written outside ends a claim without deleting its key: the claim it ended is named as a deletion's.
    ended = change.now is None or (
        event.type is EventType.ANSWERED_OUTSIDE and previous is not None and previous.record.state is State.CLAIMED
    )
    end = change.end
    return pb.WatchEvent(
        type=_EVENT_TYPES[event.type],
        status=status_out(change.subject, change.now),
        previous_holder=previous.record.holder
        if previous is not None and (ended or event.type is EventType.CLAIMED)
        else "",
        previous_token=previous.token if previous is not None and ended else 0,
        revision=change.revision,
        reason=end.detail if end is not None else "",
        by=end.by if end is not None else "",
        at=_timestamp(end.at_ms) if end is not None else None,
        undone=outside_reply_out(end.undone) if end is not None else None,
    )


def _slow_consumer_details(error: SlowConsumer) -> str:
    """What a watcher cut off is told, naming the server settings that bound it."""
    if not isinstance(error, WatcherBehind):
        return str(error)
    return (
        f"this watcher stayed behind the mailbox's changes for {error.lag_s:g} s (the server's watch drain timeout) "
        "and is cut off; watch again: a new Watch starts from a fresh snapshot. A principal's watches share a "
        "limit of events per second (the server's --watch-events-per-second): one stream per mailbox keeps up "
        "where many fall behind"
    )


def credentials_of(context: grpc.aio.ServicerContext[Any, Any], with_certificates: bool = True) -> CallCredentials:
    metadata = {key: value for key, value in (context.invocation_metadata() or ()) if isinstance(value, str)}
    if not with_certificates:
        return CallCredentials(metadata)
    auth = context.auth_context()
    names = [
        name.decode(errors="replace")
        for key in ("x509_common_name", "x509_subject_alternative_name")
        for name in auth.get(key, ())
    ]
    return CallCredentials(metadata, names)


Req = TypeVar("Req")
Resp = TypeVar("Resp")
Handler = Callable[["CoordinatorServicer", Caller, Req], Awaitable[Resp]]


async def _abort(context: grpc.aio.ServicerContext[Any, Any], error: CoordinatorError) -> NoReturn:
    await abort(
        context,
        status_code(error),
        str(error),
        error.reason,
        retry_after_ms=retry_after_ms(error),
        metadata=error_metadata(error),
    )


class _DrainWatch:
    """Notices a Watch stream whose client stopped reading. Once it does, HTTP/2 flow control holds the stream's
    write back; a write still not taken by gRPC after ``timeout_s`` marks the stream slow and closes its feed
    (so no more events are queued or converted for it), and the stream then ends with ABORTED.

    The write itself is awaited plainly and never cancelled: grpc.aio drops a batch's operations when the
    coroutine awaiting it is cancelled while gRPC core still holds them (grpc/grpc#43360), the crash described
    in docs/reliability.md, "Slow watchers". One guard task per stream checks the write's age four times per
    timeout, so a healthy stream's writes cost nothing extra."""

    def __init__(
        self, timeout_s: float, feed: AsyncGenerator[Any, None], who: str, pacer: WritePacer, principal: str
    ) -> None:
        self.timeout_s = timeout_s
        self._pacer = pacer
        self._principal = principal
        self._who = who
        self.slow = False
        self._feed = feed
        self._writing_since: float | None = None

    async def write(self, context: grpc.aio.ServicerContext[Any, Any], message: Any) -> None:
        await self._pacer.turn(self._principal)
        loop = asyncio.get_running_loop()
        self._writing_since = loop.time()
        try:
            await context.write(message)
        finally:
            self._writing_since = None
        self.raise_if_slow()

    def raise_if_slow(self) -> None:
        if self.slow:
            raise SlowConsumer(
                f"this watcher did not read its stream for {self.timeout_s:g} s (the server's watch drain timeout) "
                "and missed events; watch again: a new Watch starts from a fresh snapshot"
            )

    async def guard(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.timeout_s / 4)
            since = self._writing_since
            if since is not None and loop.time() - since >= self.timeout_s:
                self.slow = True
                log.warning(
                    "%s: no write taken for %g s, the client stopped reading; cut off", self._who, self.timeout_s
                )
                # The feed is suspended at its yield while the handler waits in write: closing it unsubscribes.
                await self._feed.aclose()
                return


async def _checked(handler: Handler[Req, Resp], servicer: CoordinatorServicer, caller: Caller, request: Req) -> Resp:
    """A unary RPC's handler, alone or in a Batch, after what every request is checked for."""
    check_times(request)
    return await handler(servicer, caller, request)


def _unary(handler: Handler[Req, Resp]) -> Any:  # Any: it overrides the generated base's loosely typed method
    """A unary RPC: authenticates, bounds the call's time, and turns coordinator errors into their status
    codes; anything else is a bug, answered INTERNAL by the interceptor (coordinator.api.interceptor)."""

    @functools.wraps(handler)
    async def rpc(self: CoordinatorServicer, request: Req, context: grpc.aio.ServicerContext[Any, Any]) -> Resp:
        deadline = self.quotas.call_deadline_s
        try:
            caller = self._authenticate(context)
            with work.metered(self._work.of(caller.principal)):
                async with asyncio.timeout(deadline):
                    return await _checked(handler, self, caller, request)
        except TimeoutError:
            await abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, deadline_message(deadline), CALL_DEADLINE_REASON)
        except CoordinatorError as error:
            await _abort(context, error)

    return rpc


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(
        self,
        engine: Engine,
        authenticator: Authenticator | None = None,
        quotas: QuotaSettings | None = None,
        batch_observer: BatchObserver | None = None,
    ) -> None:
        self._engine = engine
        self.authenticator = authenticator or DevelopmentAuthenticator()
        self.quotas = quotas or QuotaSettings()
        self.batch_observer = batch_observer
        self._rates = RateLimiter(self.quotas.calls_per_second, self.quotas.burst)
        self._work = WorkBudget(self.quotas.work_per_second, self.quotas.work_burst)
        self._watches = WatchSlots(self.quotas.max_watches)
        self._pacer = WritePacer(self.quotas.watch_events_per_second)
        handlers = {field: functools.partial(_checked, handler, self) for field, handler in _BATCH_CALLS.items()}
        self._batch = BatchRunner(handlers, SERVICE_NAME, self.quotas.call_deadline_s, batch_observer)
        # The engine hands every watcher of a mailbox the same event: it is serialized once, for all of them.
        self._encoded_events: LastConverted[Event, Encoded] = LastConverted(
            lambda event: Encoded.of(pb.WatchResponse(event=event_out(event)))
        )

    def _authenticate(self, context: grpc.aio.ServicerContext[Any, Any], calls: int = 1) -> Caller:
        caller = self.authenticator.authenticate(credentials_of(context, self.authenticator.uses_certificates))
        current_principal.set(caller.principal)
        wait = self._rates.acquire(caller.principal, calls)
        if wait > 0:
            raise ResourceExhausted(
                f"principal {caller.principal!r} is over its limit of {self.quotas.calls_per_second:g} calls/s; "
                f"retry in {math.ceil(wait * 1000)} ms",
                wait,
            )
        owed = self._work.owed(caller.principal)
        # Reads queued behind each other are refused only once the principal's burst is spent: a board opening a
        # Watch on each of its twenty mailboxes at once owes nothing and waits a few milliseconds in turn.
        if owed > OWED_MAX_S or (owed > 0 and self._work.waiting(caller.principal) >= TURNS_WAITING_MAX):
            wait = max(owed - OWED_MAX_S, 1.0)
            raise ResourceExhausted(
                f"principal {caller.principal!r} is over its budget of {self.quotas.work_per_second:g} records read "
                f"per second: its calls in flight read much (listings filtered by state, searches of recent "
                f"messages, watch snapshots) and wait their turn; retry in {math.ceil(wait * 1000)} ms, or read "
                "less at a time",
                wait,
                reason="WORK_LIMITED",
            )
        return caller

    async def _record_delivery(self, caller: Caller, request: pb.RecordDeliveryRequest) -> pb.RecordDeliveryResponse:
        new, record = await self._engine.record_delivery(
            caller,
            commands.RecordDelivery(
                request_id=request.request_id, mailbox=request.mailbox, notification_id=request.notification_id
            ),
        )
        result = pb.RecordDeliveryResponse.NEW if new else pb.RecordDeliveryResponse.DUPLICATE
        return pb.RecordDeliveryResponse(result=result, first=delivery_out(record))

    async def _claim_reply(self, caller: Caller, request: pb.ClaimReplyRequest) -> pb.ClaimReplyResponse:
        subject = subject_in(request.subject)
        outcome = await self._engine.claim_reply(
            caller,
            commands.ClaimReply(
                request_id=request.request_id,
                subject=subject,
                notification_id=request.notification_id,
                ttl_seconds=request.ttl_seconds,
                note=request.note,
                summary=summary_in(request.summary),
                thread_id=request.thread_id,
                received_ms=time_in(request, "received_at"),
                correspondent=request.correspondent,
            ),
        )
        return pb.ClaimReplyResponse(
            result=_CLAIM_RESULTS[outcome.result],
            status=status_out(subject, outcome.stored),
            delivery=delivery_out(outcome.delivery) if outcome.delivery is not None else None,
        )

    async def _record_outgoing(self, caller: Caller, request: pb.RecordOutgoingRequest) -> pb.RecordOutgoingResponse:
        outcome = await self._engine.record_outgoing(
            caller,
            commands.RecordOutgoing(
                request_id=request.request_id,
                mailbox=request.mailbox,
                notification_id=request.notification_id,
                message_id=request.message_id,
                thread_id=request.thread_id,
                sent_ms=time_in(request, "sent_at"),
                sender=request.sender,
                claim_token=request.claim_token,
            ),
        )
        return pb.RecordOutgoingResponse(
            result=_OUTGOING_RESULTS[outcome.result],
            subjects=[status_out(subject, stored) for subject, stored in outcome.subjects],
            delivery=delivery_out(outcome.delivery) if outcome.delivery is not None else None,
        )

    async def _record_incoming(self, caller: Caller, request: pb.RecordIncomingRequest) -> pb.RecordIncomingResponse:
        outcome = await self._engine.record_incoming(
            caller,
            commands.RecordIncoming(
                request_id=request.request_id,
                mailbox=request.mailbox,
                notification_id=request.notification_id,
                message_id=request.message_id,
                thread_id=request.thread_id,
                received_ms=time_in(request, "received_at"),
                summary=summary_in(request.summary),
                automated=request.automated,
            ),
        )
        status = status_out(outcome.subject, outcome.stored)
        if outcome.recorded and request.automated:
            status.automated = await self._engine.automated(caller, outcome.subject)
        return pb.RecordIncomingResponse(
            result=pb.RecordIncomingResponse.RECORDED
            if outcome.recorded
            else pb.RecordIncomingResponse.DUPLICATE_DELIVERY,
            status=status,
            delivery=delivery_out(outcome.delivery) if outcome.delivery is not None else None,
        )

    async def _get_cursor(self, caller: Caller, request: pb.GetCursorRequest) -> pb.GetCursorResponse:
        view = await self._engine.get_cursor(caller, request.mailbox, request.name)
        return pb.GetCursorResponse(value=view.value, position=view.position, range=_cursor_range_out(view))

    async def _take_cursor_range(
        self, caller: Caller, request: pb.TakeCursorRangeRequest
    ) -> pb.TakeCursorRangeResponse:
        outcome = await self._engine.take_cursor_range(
            caller,
            commands.TakeCursorRange(
                request_id=request.request_id,
                mailbox=request.mailbox,
                name=request.name,
                through_position=request.through_position,
                ttl_seconds=request.ttl_seconds,
            ),
        )
        view = outcome.view
        return pb.TakeCursorRangeResponse(
            result=_TAKE_RESULTS[outcome.result],
            value=view.value,
            position=view.position,
            range_token=outcome.token,
            busy=_cursor_range_out(view) if outcome.result is TakeResult.BUSY else None,
        )

    async def _advance_cursor(self, caller: Caller, request: pb.AdvanceCursorRequest) -> pb.AdvanceCursorResponse:
        result, view = await self._engine.advance_cursor(
            caller,
            commands.AdvanceCursor(
                request_id=request.request_id,
                mailbox=request.mailbox,
                name=request.name,
                range_token=request.range_token,
                value=request.value,
                position=request.position,
            ),
        )
        return pb.AdvanceCursorResponse(result=_ADVANCE_RESULTS[result], value=view.value, position=view.position)

    async def _renew_claim(self, caller: Caller, request: pb.RenewClaimRequest) -> pb.RenewClaimResponse:
        subject = subject_in(request.subject)
        result, stored = await self._engine.renew(
            caller,
            commands.RenewClaim(
                request_id=request.request_id,
                subject=subject,
                token=request.fencing_token,
                ttl_seconds=request.ttl_seconds,
            ),
        )
        return pb.RenewClaimResponse(result=_FENCE_RESULTS[result], status=status_out(subject, stored))

    async def _release_claim(self, caller: Caller, request: pb.ReleaseClaimRequest) -> pb.ReleaseClaimResponse:
        subject = subject_in(request.subject)
        result, stored = await self._engine.release(
            caller,
            commands.ReleaseClaim(
                request_id=request.request_id,
                subject=subject,
                token=request.fencing_token,
                redeliverable=request.redeliverable,
            ),
        )
        return pb.ReleaseClaimResponse(result=_FENCE_RESULTS[result], status=status_out(subject, stored))

    async def _begin_send(self, caller: Caller, request: pb.BeginSendRequest) -> pb.BeginSendResponse:
        subject = subject_in(request.subject)
        result, stored, refusal = await self._engine.begin_send(
            caller, commands.BeginSend(request_id=request.request_id, subject=subject, token=request.fencing_token)
        )
        return pb.BeginSendResponse(
            result=_FENCE_RESULTS[result], status=status_out(subject, stored), refusal=refusal_out(refusal)
        )

    async def _confirm_sent(self, caller: Caller, request: pb.ConfirmSentRequest) -> pb.ConfirmSentResponse:
        subject = subject_in(request.subject)
        result, stored = await self._engine.confirm_sent(
            caller,
            commands.ConfirmSent(
                request_id=request.request_id,
                subject=subject,
                token=request.fencing_token,
                sent_message_id=request.sent_message_id,
            ),
        )
        return pb.ConfirmSentResponse(result=_FENCE_RESULTS[result], status=status_out(subject, stored))

    async def _abort_send(self, caller: Caller, request: pb.AbortSendRequest) -> pb.AbortSendResponse:
        subject = subject_in(request.subject)
        result, stored = await self._engine.abort_send(
            caller,
            commands.AbortSend(
                request_id=request.request_id,
                subject=subject,
                token=request.fencing_token,
                reason=request.reason,
                redeliverable=request.redeliverable,
            ),
        )
        return pb.AbortSendResponse(result=_FENCE_RESULTS[result], status=status_out(subject, stored))

    async def _mark_replied(self, caller: Caller, request: pb.MarkRepliedRequest) -> pb.MarkRepliedResponse:
        subject = subject_in(request.subject)
        result, stored = await self._engine.mark_replied(
            caller,
            commands.MarkReplied(
                request_id=request.request_id,
                subject=subject,
                token=request.fencing_token,
                sent_message_id=request.sent_message_id,
                note=request.note,
            ),
        )
        return pb.MarkRepliedResponse(result=_FENCE_RESULTS[result], status=status_out(subject, stored))

    async def _undo_outside_reply(
        self, caller: Caller, request: pb.UndoOutsideReplyRequest
    ) -> pb.UndoOutsideReplyResponse:
        subject = subject_in(request.subject)
        outcome = await self._engine.undo_outside_reply(
            caller, commands.UndoOutsideReply(request_id=request.request_id, subject=subject, note=request.note)
        )
        end = outcome.end
        return pb.UndoOutsideReplyResponse(
            status=status_out(subject, outcome.stored),
            undone=outside_reply_out(end.undone) if end is not None else None,
            undone_by=end.by if end is not None else "",
            undone_at=_timestamp(end.at_ms) if end is not None else None,
        )

    async def _get_status(self, caller: Caller, request: pb.GetStatusRequest) -> pb.GetStatusResponse:
        subject = subject_in(request.subject)
        status = status_out(subject, await self._engine.status(caller, subject))
        if status.state == pb.SUBJECT_STATE_FREE:
            # Automated mail agents leave (RecordIncoming): a person asking about it is told, and may answer it.
            # Only while nobody holds it: the one read more stays off the claims' and sends' path.
            status.automated = await self._engine.automated(caller, subject)
        return pb.GetStatusResponse(status=status)

    async def _get_caller(self, caller: Caller, request: pb.GetCallerRequest) -> pb.GetCallerResponse:
        identity = self.authenticator.identity(caller)
        return pb.GetCallerResponse(
            principal=identity.principal,
            kind=_HOLDER_KINDS_OUT[identity.kind],
            roles=identity.roles,
            mailboxes=identity.mailboxes,
            development_mode=identity.development_mode,
        )

    async def _list_claims(self, caller: Caller, request: pb.ListClaimsRequest) -> pb.ListClaimsResponse:
        states = set()
        for state in request.states:
            if state not in _STATES_IN:
                raise InvalidArgument("states", f"{state} is not a SubjectState")
            states.add(_STATES_IN[state])
        page = await self._engine.list_claims(
            caller,
            mailbox=request.mailbox,
            states=frozenset(states),
            page_size=request.page_size,
            page_token=request.page_token or None,
        )
        return pb.ListClaimsResponse(
            subjects=[status_out(subject, stored) for subject, stored in page.subjects],
            next_page_token=page.next_token or "",
            revision=page.revision,
        )

    async def _list_recent_messages(
        self, caller: Caller, request: pb.ListRecentMessagesRequest
    ) -> pb.ListRecentMessagesResponse:
        recent = await self._engine.recent_messages(
            caller, mailbox=request.mailbox, query=request.query, page_size=request.page_size
        )
        # A stopped conversation is listed by its refused message: when and by whom agents were stopped.
        return pb.ListRecentMessagesResponse(
            messages=[
                _recent_out(d.subject, d.summary, d.recorded_ms, d.recorded_by, recent.automated.get(d.subject, ""))
                for d in recent.messages
                if d.subject is not None
            ],
            agents_stopped=[
                _recent_out(s.subject, s.summary, s.stopped_ms, s.stopped_holder, stopped=refusal_out(s.refusal))
                for s in recent.stopped
            ],
        )

    async def _takeover(self, caller: Caller, request: pb.TakeoverRequest) -> pb.TakeoverResponse:
        subject = subject_in(request.subject)
        outcome = await self._engine.takeover(
            caller,
            commands.Takeover(
                request_id=request.request_id,
                subject=subject,
                ttl_seconds=request.ttl_seconds,
                note=request.note,
                summary=summary_in(request.summary),
                from_person=request.from_person,
            ),
        )
        return pb.TakeoverResponse(
            result=_TAKEOVER_RESULTS[outcome.result],
            status=status_out(subject, outcome.stored),
            previous_holder=outcome.previous_holder,
            previous_token=outcome.previous_token,
        )

    async def _resolve_in_doubt(self, caller: Caller, request: pb.ResolveInDoubtRequest) -> pb.ResolveInDoubtResponse:
        subject = subject_in(request.subject)
        outcome = _RESOLVE_OUTCOMES.get(request.outcome)
        if outcome is None:
            raise InvalidArgument("outcome", "must be OUTCOME_SENT or OUTCOME_NOT_SENT")
        stored = await self._engine.resolve_in_doubt(
            caller,
            commands.ResolveInDoubt(
                request_id=request.request_id,
                subject=subject,
                outcome=outcome,
                sent_message_id=request.sent_message_id,
                note=request.note,
            ),
        )
        return pb.ResolveInDoubtResponse(status=status_out(subject, stored))

    RecordDelivery = _unary(_record_delivery)
    ClaimReply = _unary(_claim_reply)
    RenewClaim = _unary(_renew_claim)
    ReleaseClaim = _unary(_release_claim)
    BeginSend = _unary(_begin_send)
    ConfirmSent = _unary(_confirm_sent)
    AbortSend = _unary(_abort_send)
    GetStatus = _unary(_get_status)
    ListClaims = _unary(_list_claims)
    ListRecentMessages = _unary(_list_recent_messages)
    Takeover = _unary(_takeover)
    ResolveInDoubt = _unary(_resolve_in_doubt)
    UndoOutsideReply = _unary(_undo_outside_reply)
    MarkReplied = _unary(_mark_replied)
    RecordOutgoing = _unary(_record_outgoing)
    RecordIncoming = _unary(_record_incoming)
    GetCursor = _unary(_get_cursor)
    TakeCursorRange = _unary(_take_cursor_range)
    AdvanceCursor = _unary(_advance_cursor)
    GetCaller = _unary(_get_caller)

    # The generated base declares a response iterator; a handler that writes with context.write returns None.
    async def Watch(  # type: ignore[override]
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        # Written with context.write, not as an async generator: a generator's messages are written by gRPC,
        # which gives no way to bound how long one write may wait for a client that stopped reading.
        try:
            caller = self._authenticate(context)
            if not self._watches.acquire(caller.principal):
                raise ResourceExhausted(
                    f"principal {caller.principal!r} already has {self.quotas.max_watches} watches open, the limit; "
                    "close one first",
                    1.0,
                    reason="TOO_MANY_WATCHES",
                )
            # The slot is held until the call is over for gRPC, not just for this handler: a stream ended for
            # being slow still holds buffers until its client reads its status or goes away.
            # grpc-stubs declare the callback type as a class, where any callable of the context will do.
            context.add_done_callback(lambda _context: self._watches.release(caller.principal))  # type: ignore[arg-type]
            watch = self._engine.watch(
                caller, request.mailbox, request.after_revision, max_lag_s=self.quotas.watch_drain_timeout_s
            )
            # The snapshot (or the history since a revision) is the watch's work, paced as it is read.
            with work.metered(self._work.of(caller.principal)):
                await self._watch(caller, request, context, watch)
        except SlowConsumer as error:
            # Not context.abort(): it awaits sending the status, which waits behind the messages the client is
            # not reading, and an awaited gRPC batch must never be left to be cancelled (see _DrainWatch). Set
            # here, the status goes out after the buffered messages, when the client reads or goes away.
            context.set_code(status_code(error))
            context.set_details(_slow_consumer_details(error))
        except CoordinatorError as error:
            await _abort(context, error)

    async def _watch(
        self,
        caller: Caller,
        request: pb.WatchRequest,
        context: grpc.aio.ServicerContext[Any, Any],
        watch: AsyncGenerator[Snapshot | Event, None],
    ) -> None:
        async with contextlib.aclosing(watch) as items:
            drain = _DrainWatch(
                self.quotas.watch_drain_timeout_s,
                items,
                f"Watch of mailbox {request.mailbox!r} by {caller.principal!r}",
                self._pacer,
                caller.principal,
            )
            guard = asyncio.create_task(drain.guard(), name="watch drain guard")
            try:
                async for item in items:
                    message: pb.WatchResponse | Encoded
                    if isinstance(item, Snapshot):
                        message = pb.WatchResponse(
                            snapshot=pb.WatchSnapshot(
                                subjects=[status_out(subject, stored) for subject, stored in item.subjects],
                                revision=item.revision,
                            )
                        )
                    else:
                        message = self._encoded_events(item)
                    await drain.write(context, message)
            finally:
                guard.cancel()
            drain.raise_if_slow()

    async def Batch(self, request: pb.BatchRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.BatchResponse:
        calls = request.calls
        try:
            if len(calls) > BATCH_MAX_CALLS:
                raise InvalidArgument("calls", f"has {len(calls)} calls; the limit is {BATCH_MAX_CALLS} per batch")
            caller = self._authenticate(context, max(len(calls), 1))
        except CoordinatorError as error:
            await _abort(context, error)
        with work.metered(self._work.of(caller.principal)):  # every call of the batch adds to it
            return await self._batch.run(caller, calls, context)


# The calls a Batch may carry: its oneof field -> the handler of the unary RPC of the same name.
_BATCH_CALLS: dict[str, Handler[Any, Any]] = {
    "record_delivery": CoordinatorServicer._record_delivery,
    "claim_reply": CoordinatorServicer._claim_reply,
    "renew_claim": CoordinatorServicer._renew_claim,
    "release_claim": CoordinatorServicer._release_claim,
    "begin_send": CoordinatorServicer._begin_send,
    "confirm_sent": CoordinatorServicer._confirm_sent,
    "abort_send": CoordinatorServicer._abort_send,
    "get_status": CoordinatorServicer._get_status,
    "mark_replied": CoordinatorServicer._mark_replied,
    "record_outgoing": CoordinatorServicer._record_outgoing,
    "record_incoming": CoordinatorServicer._record_incoming,
}
