"""The one core of both clients: requests, responses, errors, retries, paging and watching, without I/O.

Every client method is a *flow*: a generator that yields effects (:class:`Rpc`, :class:`Sleep`,
:class:`Invoke`, :class:`OpenStream`, :class:`ReadStream`, :class:`Emit`) and receives their results. The flow
decides everything (what to send, what an answer means, whether and when to retry, which exception to raise);
:mod:`inbox_claims._sync` and :mod:`inbox_claims._async` only perform the effects, with blocking gRPC and
threads or with ``grpc.aio`` and tasks. A failed RPC comes back into the flow as :class:`RpcFailure`.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import ipaddress
import logging
import operator
import os
import random
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Coroutine, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import (
    TYPE_CHECKING,
    Any,
    Concatenate,
    Generic,
    Literal,
    ParamSpec,
    Protocol,
    Self,
    TypeAlias,
    TypeVar,
    overload,
)

import grpc
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from inbox_wire import BATCH_MAX_CALLS, PRINCIPAL_KIND_METADATA, PRINCIPAL_METADATA, RETRY_AFTER_METADATA, VERSION
from inbox_wire.v1 import coordinator_pb2 as pb

from ._errors import error_for
from ._outgoing import MAILBOX_ADDRESSES_ENV, SENT_FOLDERS_ENV, OutgoingRules
from ._types import (
    CallerIdentity,
    ClaimOutcome,
    ClaimResult,
    ClaimsPage,
    DeliveryRecord,
    DeliveryResult,
    EventType,
    FenceResult,
    HolderKind,
    MessageSummary,
    OutgoingOutcome,
    OutgoingResult,
    OutsideReply,
    RecentMessage,
    RetryPolicy,
    Subject,
    SubjectKind,
    SubjectState,
    SubjectStatus,
    TakeoverOutcome,
    TakeoverResult,
    WatchEvent,
    WatchItem,
    WatchSnapshot,
)

log = logging.getLogger("inbox_claims")

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_TIMEOUT = 10.0
USER_AGENT = "inbox-claims-python/" + ".".join(VERSION.split(".")[:2])

# CANCELLED too: a coordinator that stops past its shutdown grace cancels the calls still running (the
# caller's own cancellation never gets here: it raises asyncio.CancelledError, or the client is closed).
# Every call is safe to repeat, since its retries carry its request id.
RETRYABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED}
)

R = TypeVar("R")
T = TypeVar("T")
P = ParamSpec("P")

# ------------------------------------------------------------------------------------------------ effects


@dataclass(frozen=True, slots=True)
class Rpc:
    """One attempt of a unary call. Answers the response message, or raises :class:`RpcFailure`."""

    method: str
    request: Message
    timeout: float


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


@dataclass(frozen=True, slots=True)
class Invoke:
    """Call the user's function (awaiting its result in the async client). Answers what it returned."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True, slots=True)
class OpenStream:
    """Start a server-streaming call. Answers a handle for :class:`ReadStream`."""

    method: str
    request: Message


@dataclass(frozen=True, slots=True)
class ReadStream:
    """Read the next message of a stream. Answers it, ``None`` at the end, or raises :class:`RpcFailure`."""

    handle: Any


@dataclass(frozen=True, slots=True)
class Emit:
    """Hand one item to the caller of an iterator."""

    item: Any


Effect: TypeAlias = Rpc | Sleep | Invoke | OpenStream | ReadStream | Emit
Flow: TypeAlias = Generator[Effect, Any, R]


class RpcFailure(Exception):
    """What a driver throws into a flow when an RPC ended with a status other than OK."""

    def __init__(self, code: grpc.StatusCode, details: str, retry_after: float | None = None) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.retry_after = retry_after

    @classmethod
    def from_grpc(cls, error: grpc.RpcError) -> RpcFailure:
        """Reads code, details and the ``retry-after-ms`` trailer (sent with RESOURCE_EXHAUSTED)."""
        retry_after = None
        trailing = getattr(error, "trailing_metadata", lambda: None)() or ()
        for key, value in trailing:
            if key == RETRY_AFTER_METADATA:
                with contextlib.suppress(ValueError, TypeError):
                    retry_after = max(int(value), 0) / 1000
        return cls(error.code(), error.details() or "", retry_after)

    def error(self, method: str, attempts: int) -> Exception:
        return error_for(self.code, self.details, method=method, attempts=attempts, retry_after=self.retry_after)


class Stream(Generic[T]):
    """A flow that emits items of type ``T``: the clients turn it into an (async) iterator."""

    __slots__ = ("flow",)

    def __init__(self, flow: Flow[None]) -> None:
        self.flow = flow


class Runner:
    """Steps one flow for a client, which only performs the effects::

        with Runner(flow) as runner:
            for effect in runner:                    # the next effect the flow wants
                with runner.performing(effect):      # an exception raised here goes back into the flow
                    runner.answer = perform(effect)  # the effect's result goes back into the flow

    Leaving the ``with`` ends the flow and cancels the streams it opened. ``returned`` is what the flow returned.
    :class:`Emit` effects are the client's to hand out; they need no answer.
    """

    def __init__(self, flow: Flow[Any]) -> None:
        self._flow = flow
        self._streams: list[Any] = []
        self._error: BaseException | None = None
        self.answer: Any = None
        self.returned: Any = None

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for stream in self._streams:
            stream.cancel()
        self._flow.close()

    def __iter__(self) -> Runner:
        return self

    def __next__(self) -> Effect:
        answer, error, self.answer, self._error = self.answer, self._error, None, None
        try:
            return self._flow.throw(error) if error is not None else self._flow.send(answer)
        except StopIteration as stop:
            self.returned = stop.value
            raise StopIteration from None

    def performing(self, effect: Effect) -> _Performing:
        return _Performing(self, effect)


class _Performing:
    __slots__ = ("effect", "runner")

    def __init__(self, runner: Runner, effect: Effect) -> None:
        self.runner = runner
        self.effect = effect

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, error: BaseException | None, tb: object) -> bool:
        if error is not None:
            self.runner._error = error  # thrown into the flow at the next step: the flow decides
        elif isinstance(self.effect, OpenStream):
            self.runner._streams.append(self.runner.answer)
        return True


@dataclass(frozen=True, slots=True)
class Op(Generic[R]):
    """One logical unary call: the request (with its request id, kept by every retry) and its decoder."""

    method: str
    request: Message
    decode: Callable[[Any], R]


def new_request_id() -> str:
    return uuid.uuid4().hex


# ----------------------------------------------------------------------------------------- conversions


def _enum_from_pb(cls: type[enum.Enum], pb_enum: Any, value: int, prefix: str) -> Any:
    name = pb_enum.Name(value).removeprefix(prefix) if value in pb_enum.values() else ""
    try:
        return cls[name]
    except KeyError:
        raise ValueError(f"the coordinator sent {pb_enum.DESCRIPTOR.name} {value}, unknown to this client") from None


def _time(message: Any, name: str) -> datetime | None:
    if not message.HasField(name):
        return None
    stamp = getattr(message, name)
    return datetime.fromtimestamp(stamp.seconds + stamp.nanos / 1e9, tz=UTC)


def summary_to_pb(summary: MessageSummary | None) -> pb.MessageSummary | None:
    if summary is None:
        return None
    if not isinstance(summary, MessageSummary):
        raise TypeError(f"summary must be an inbox_claims.MessageSummary, not {type(summary).__name__}")
    message = pb.MessageSummary(subject_line=summary.subject_line, sender=summary.sender)
    if summary.received_at is not None:
        message.received_at.FromDatetime(summary.received_at.astimezone(UTC))
    return message


def _timestamp_to_pb(when: datetime, name: str) -> Timestamp:
    if not isinstance(when, datetime):
        raise TypeError(f"{name} must be a datetime, not {type(when).__name__}")
    if when.tzinfo is None:
        raise ValueError(f"{name} must be timezone-aware (a naive datetime names no instant)")
    stamp = Timestamp()
    stamp.FromDatetime(when.astimezone(UTC))
    return stamp


def outside_reply_from_pb(message: pb.SubjectStatus) -> OutsideReply | None:
    if not message.HasField("outside_reply"):
        return None
    reply = message.outside_reply
    return OutsideReply(
        reply.sender, _time(reply, "sent_at"), reply.message_id, reply.recorded_by, reply.stopped_holder
    )


def summary_from_pb(message: pb.SubjectStatus | pb.RecentMessage) -> MessageSummary | None:
    if not message.HasField("summary"):
        return None
    summary = message.summary
    return MessageSummary(summary.subject_line, summary.sender, _time(summary, "received_at"))


def subject_to_pb(subject: Subject) -> pb.Subject:
    if not isinstance(subject, Subject):
        raise TypeError(f"subject must be an inbox_claims.Subject, not {type(subject).__name__}")
    kind = pb.SUBJECT_KIND_MESSAGE if subject.kind is SubjectKind.MESSAGE else pb.SUBJECT_KIND_THREAD
    return pb.Subject(mailbox=subject.mailbox, kind=kind, id=subject.id)


def subject_from_pb(message: pb.Subject) -> Subject:
    kind = SubjectKind.THREAD if message.kind == pb.SUBJECT_KIND_THREAD else SubjectKind.MESSAGE
    return Subject(message.mailbox, kind, message.id)


_HOLDER_KINDS = {pb.HOLDER_KIND_AGENT: HolderKind.AGENT, pb.HOLDER_KIND_HUMAN: HolderKind.HUMAN}


def _caller_identity(response: pb.GetCallerResponse) -> CallerIdentity:
    return CallerIdentity(
        principal=response.principal,
        kind=_HOLDER_KINDS.get(response.kind, HolderKind.AGENT),
        roles=tuple(response.roles),
        mailboxes=tuple(response.mailboxes),
        development_mode=response.development_mode,
    )


def status_from_pb(message: pb.SubjectStatus) -> SubjectStatus:
    return SubjectStatus(
        subject=subject_from_pb(message.subject),
        state=_enum_from_pb(SubjectState, pb.SubjectState, message.state, "SUBJECT_STATE_"),
        holder=message.holder,
        holder_kind=_HOLDER_KINDS.get(message.holder_kind),
        fencing_token=message.fencing_token,
        acquired_at=_time(message, "acquired_at"),
        expires_at=_time(message, "expires_at"),
        note=message.note,
        send_started_at=_time(message, "send_started_at"),
        send_deadline=_time(message, "send_deadline"),
        sent_at=_time(message, "sent_at"),
        sent_message_id=message.sent_message_id,
        revision=message.revision,
        ttl_seconds=message.ttl_seconds,
        replied_by_hand=message.replied_by_hand,
        summary=summary_from_pb(message),
        replied_outside=message.replied_outside,
        outside_reply=outside_reply_from_pb(message),
        settled_by=message.settled_by,
    )


def _recent(response: pb.ListRecentMessagesResponse) -> tuple[RecentMessage, ...]:
    return tuple(
        RecentMessage(
            subject=subject_from_pb(message.subject),
            summary=summary_from_pb(message),
            first_seen_at=_time(message, "first_seen_at"),
            seen_by=message.seen_by,
        )
        for message in response.messages
    )


def delivery_from_pb(message: pb.DeliveryRecord) -> DeliveryRecord:
    return DeliveryRecord(
        mailbox=message.mailbox,
        notification_id=message.notification_id,
        recorded_by=message.recorded_by,
        recorded_at=_time(message, "recorded_at"),
        subject=subject_from_pb(message.subject) if message.HasField("subject") else None,
    )


def _fence(response: Any) -> FenceResult:
    return FenceResult(ok=response.result == pb.FENCE_RESULT_OK, status=status_from_pb(response.status))


def _claim_result(response: pb.ClaimReplyResponse) -> ClaimResult:
    outcome: ClaimOutcome = _enum_from_pb(ClaimOutcome, pb.ClaimReplyResponse.Result, response.result, "")
    return ClaimResult(
        outcome=outcome,
        status=status_from_pb(response.status) if outcome is not ClaimOutcome.DUPLICATE_DELIVERY else None,
        delivery=delivery_from_pb(response.delivery) if response.HasField("delivery") else None,
    )


def _outgoing_result(response: pb.RecordOutgoingResponse) -> OutgoingResult:
    return OutgoingResult(
        outcome=_enum_from_pb(OutgoingOutcome, pb.RecordOutgoingResponse.Result, response.result, ""),
        subjects=tuple(status_from_pb(status) for status in response.subjects),
        delivery=delivery_from_pb(response.delivery) if response.HasField("delivery") else None,
    )


def _takeover_result(response: pb.TakeoverResponse) -> TakeoverResult:
    return TakeoverResult(
        outcome=_enum_from_pb(TakeoverOutcome, pb.TakeoverResponse.Result, response.result, ""),
        status=status_from_pb(response.status),
        previous_holder=response.previous_holder,
        previous_token=response.previous_token,
    )


def _delivery_result(response: pb.RecordDeliveryResponse) -> DeliveryResult:
    return DeliveryResult(
        is_new=response.result == pb.RecordDeliveryResponse.NEW, first=delivery_from_pb(response.first)
    )


def _page(response: pb.ListClaimsResponse) -> ClaimsPage:
    return ClaimsPage(
        subjects=tuple(status_from_pb(s) for s in response.subjects),
        next_page_token=response.next_page_token,
        revision=response.revision,
    )


def watch_item_from_pb(response: pb.WatchResponse) -> WatchItem:
    if response.WhichOneof("kind") == "snapshot":
        snapshot = response.snapshot
        return WatchSnapshot(tuple(status_from_pb(s) for s in snapshot.subjects), snapshot.revision)
    event = response.event
    return WatchEvent(
        type=_enum_from_pb(EventType, pb.EventType, event.type, "EVENT_TYPE_"),
        status=status_from_pb(event.status),
        previous_holder=event.previous_holder,
        previous_token=event.previous_token,
        revision=event.revision,
        reason=event.reason,
    )


def _ttl(ttl: int) -> int:
    value = operator.index(ttl)
    if value < 0:
        raise ValueError(f"ttl must be a whole number of seconds >= 0 (0 means the server's default), not {ttl}")
    return value


def _token(token: int) -> int:
    value = operator.index(token)
    if value <= 0:
        raise ValueError(f"fencing token must be a positive integer (the one a claim granted), not {token}")
    return value


# ------------------------------------------------------------------------------------------- options


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """Everything a client is configured with, validated once (see the clients' ``__init__``)."""

    target: str
    principal: str | None
    kind: HolderKind
    credentials: grpc.ChannelCredentials | None
    """``None``: a plaintext channel (development)."""
    timeout: float
    retry: RetryPolicy
    metadata: tuple[tuple[str, str], ...]
    channel_options: tuple[tuple[str, Any], ...] = field(default=())
    max_batch: int = 64
    """Concurrent calls sent together in one Batch RPC, at most; 1: every call alone."""
    outgoing: OutgoingRules = field(default_factory=OutgoingRules)
    """How the guard tells a message the mailbox sent (never answered) from one it received."""

    def open_channel(self, insecure: Callable[..., T], secure: Callable[..., T]) -> T:
        """A channel from ``grpc`` or ``grpc.aio``: plaintext without credentials, else secure."""
        if self.credentials is None:
            return insecure(self.target, self.channel_options)
        return secure(self.target, self.credentials, self.channel_options)


def _ascii_metadata(name: str, value: str) -> str:
    if not value or not value.isascii() or not value.isprintable():
        raise ValueError(f"{name} must be non-empty printable ASCII (it travels in gRPC metadata), not {value!r}")
    return value


def make_options(
    target: str,
    *,
    principal: str | None,
    kind: HolderKind | Literal["agent", "human"],
    token: str | None,
    tls: bool,
    root_certificates: bytes | None,
    client_certificate: bytes | None,
    client_key: bytes | None,
    credentials: grpc.ChannelCredentials | None,
    timeout: float,
    retry: RetryPolicy | None,
    channel_options: Sequence[tuple[str, Any]],
    max_batch: int = 64,
    sent_folders: str | Iterable[str] | None = None,
    mailbox_addresses: str | Iterable[str] | None = None,
) -> ClientOptions:
    if not target:
        raise ValueError("target must be HOST:PORT (or any gRPC target), e.g. '127.0.0.1:50051'")
    holder_kind = kind if isinstance(kind, HolderKind) else HolderKind(kind)
    wants_tls = tls or any(v is not None for v in (root_certificates, client_certificate, client_key))
    if credentials is not None and wants_tls:
        raise ValueError("pass either credentials= or tls=/root_certificates=/client_certificate=/client_key=")
    if (client_certificate is None) != (client_key is None):
        raise ValueError("mutual TLS needs both client_certificate= and client_key= (PEM bytes)")
    if wants_tls:
        credentials = grpc.ssl_channel_credentials(root_certificates, client_key, client_certificate)
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, not {timeout}")
    if not 1 <= max_batch <= BATCH_MAX_CALLS:
        raise ValueError(f"max_batch must be 1..{BATCH_MAX_CALLS} (the coordinator's limit per batch), not {max_batch}")
    metadata: list[tuple[str, str]] = []
    if principal is not None:
        metadata.append((PRINCIPAL_METADATA, _ascii_metadata("principal", principal)))
        metadata.append((PRINCIPAL_KIND_METADATA, holder_kind.value))
    if token is not None:
        metadata.append(("authorization", "Bearer " + _ascii_metadata("token", token)))
    if token is not None and credentials is None and not _is_loopback(target):
        log.warning("sending a bearer token to %s over a plaintext channel; pass tls=True", target)
    policy = retry if retry is not None else RetryPolicy()
    # gRPC's own reconnection backoff (1 s initial, 120 s cap by default) would make retries find the channel
    # still waiting; keep it within the retry policy's range so a coordinator that comes back is found.
    reconnect_ms = int(max(policy.initial_backoff, 0.05) * 1000)
    defaults: dict[str, Any] = {
        "grpc.primary_user_agent": USER_AGENT,
        "grpc.initial_reconnect_backoff_ms": reconnect_ms,
        "grpc.min_reconnect_backoff_ms": reconnect_ms,
        "grpc.max_reconnect_backoff_ms": int(max(policy.max_backoff * 1000, reconnect_ms)),
    }
    defaults.update(dict(channel_options))
    return ClientOptions(
        target=target,
        principal=principal,
        kind=holder_kind,
        credentials=credentials,
        timeout=float(timeout),
        retry=policy,
        metadata=tuple(metadata),
        channel_options=tuple(defaults.items()),
        max_batch=max_batch,
        outgoing=OutgoingRules.of(sent_folders, mailbox_addresses),
    )


def _is_loopback(target: str) -> bool:
    host = target.removeprefix("dns:").removeprefix("ipv4:").removeprefix("ipv6:").rpartition(":")[0].strip("[]")
    if host == "localhost" or target.startswith("unix:"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ---------------------------------------------------------------------------------------------- the core


class Core:
    """Builds requests, reads responses, decides retries. Its public methods are the clients' methods:
    each returns a flow (or a :class:`Stream`) that a client runs with its own I/O."""

    def __init__(self, options: ClientOptions) -> None:
        self.options = options
        self._rng = random.Random()

    # -- the retry loop ----------------------------------------------------------------------------------

    def call(self, op: Op[R], *, deadline: float | None = None, timeout: float | None = None) -> Flow[R]:
        """Runs ``op`` with retries on UNAVAILABLE, DEADLINE_EXCEEDED and ABORTED, and on RESOURCE_EXHAUSTED
        that comes with a retry hint (the same request, so the same request id). ``deadline`` (a
        ``time.monotonic()`` value) bounds every attempt and the waits; ``timeout`` (seconds, the caller's
        per-call ``timeout=``) bounds them from when the call starts."""
        if timeout is not None:
            if not timeout > 0:
                raise ValueError(f"timeout must be a positive number of seconds, not {timeout}")
            until = time.monotonic() + timeout
            deadline = until if deadline is None else min(deadline, until)
        attempt = 0
        while True:
            attempt += 1
            timeout = self.options.timeout
            if deadline is not None:
                timeout = max(min(timeout, deadline - time.monotonic()), 0.001)
            try:
                response = yield Rpc(op.method, op.request, timeout)
            except RpcFailure as failure:
                delay = self.retry_delay(failure, attempt, deadline)
                if delay is None:
                    raise failure.error(op.method, attempt) from None
                log.info(
                    "%s: %s (attempt %d of %d); retrying in %.2f s",
                    op.method,
                    failure.code.name,
                    attempt,
                    self.options.retry.attempts,
                    delay,
                )
                yield Sleep(delay)
                continue
            return op.decode(response)

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
    ) -> Op[ClaimResult]:
        request = pb.ClaimReplyRequest(
            request_id=new_request_id(),
            subject=subject_to_pb(subject),
            notification_id=notification_id,
            ttl_seconds=_ttl(ttl),
            note=note,
            summary=summary_to_pb(summary),
            thread_id=thread_id,
            received_at=_timestamp_to_pb(received_at, "received_at") if received_at is not None else None,
        )
        return Op("ClaimReply", request, _claim_result)

    def record_outgoing_op(
        self,
        mailbox: str,
        message_id: str,
        thread_id: str,
        sent_at: datetime,
        *,
        sender: str = "",
        notification_id: str = "",
    ) -> Op[OutgoingResult]:
        request = pb.RecordOutgoingRequest(
            request_id=new_request_id(),
            mailbox=mailbox,
            notification_id=notification_id,
            message_id=message_id,
            thread_id=thread_id,
            sent_at=_timestamp_to_pb(sent_at, "sent_at"),
            sender=sender,
        )
        return Op("RecordOutgoing", request, _outgoing_result)

    def renew_op(self, subject: Subject, token: int, *, ttl: int = 0) -> Op[FenceResult]:
        request = pb.RenewClaimRequest(
            request_id=new_request_id(),
            subject=subject_to_pb(subject),
            fencing_token=_token(token),
            ttl_seconds=_ttl(ttl),
        )
        return Op("RenewClaim", request, _fence)

    def release_op(self, subject: Subject, token: int, *, redeliverable: bool = False) -> Op[FenceResult]:
        request = pb.ReleaseClaimRequest(
            request_id=new_request_id(),
            subject=subject_to_pb(subject),
            fencing_token=_token(token),
            redeliverable=redeliverable,
        )
        return Op("ReleaseClaim", request, _fence)

    def begin_send_op(self, subject: Subject, token: int) -> Op[FenceResult]:
        request = pb.BeginSendRequest(
            request_id=new_request_id(), subject=subject_to_pb(subject), fencing_token=_token(token)
        )
        return Op("BeginSend", request, _fence)

    def confirm_sent_op(self, subject: Subject, token: int, sent_message_id: str = "") -> Op[FenceResult]:
        request = pb.ConfirmSentRequest(
            request_id=new_request_id(),
            subject=subject_to_pb(subject),
            fencing_token=_token(token),
            sent_message_id=sent_message_id,
        )
        return Op("ConfirmSent", request, _fence)

    def mark_replied_op(
        self, subject: Subject, token: int, sent_message_id: str = "", note: str = ""
    ) -> Op[FenceResult]:
        request = pb.MarkRepliedRequest(
            request_id=new_request_id(),
            subject=subject_to_pb(subject),
            fencing_token=_token(token),
            sent_message_id=sent_message_id,
            note=note,
        )
        return Op("MarkReplied", request, _fence)

    def abort_send_op(
        self, subject: Subject, token: int, reason: str = "", *, redeliverable: bool = False
    ) -> Op[FenceResult]:
        request = pb.AbortSendRequest(
            request_id=new_request_id(),
            subject=subject_to_pb(subject),
            fencing_token=_token(token),
            reason=reason,
            redeliverable=redeliverable,
        )
        return Op("AbortSend", request, _fence)

    # -- the clients' methods --------------------------------------------------------------------------------

    def record_delivery(
        self, mailbox: str, notification_id: str, *, timeout: float | None = None
    ) -> Flow[DeliveryResult]:
        """Delivery dedup on its own: ``is_new`` on the first sighting of ``notification_id`` in ``mailbox``.

        Prefer ``reply_to`` (or ``claim(..., notification_id=...)``) when the notification leads to a reply:
        then dedup and claim are one etcd transaction.
        """
        request = pb.RecordDeliveryRequest(
            request_id=new_request_id(), mailbox=mailbox, notification_id=notification_id
        )
        return self.call(Op("RecordDelivery", request, _delivery_result), timeout=timeout)

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
        """ClaimReply: the exclusive, TTL'd right to reply to ``subject`` (``ttl`` 0: the server's default).

        Answers a :class:`ClaimResult` (GRANTED, HELD, ALREADY_REPLIED, DUPLICATE_DELIVERY); nothing is
        renewed for you. Agents should use ``reply_to``, which renews, fences the send and cleans up.
        ``thread_id`` and ``received_at`` (both or neither: the message's thread and when it was received, as
        the provider says) let a reply written outside the coordinator in that thread end the claim.
        """
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
        """RecordOutgoing: a message the mailbox sent (in a sent folder, or from one of its own addresses). The
        coordinator answers whether it is the mailbox's own reply (OWN_REPLY) or one written outside it
        (ANSWERED_OUTSIDE: it ended the claims on the messages of its thread received at or before ``sent_at``).
        The guard calls it for you on every outgoing notification; never answer such a message."""
        op = self.record_outgoing_op(
            mailbox, message_id, thread_id, sent_at, sender=sender, notification_id=notification_id
        )
        return self.call(op, timeout=timeout)

    def renew(self, subject: Subject, token: int, *, ttl: int = 0, timeout: float | None = None) -> Flow[FenceResult]:
        """RenewClaim: pushes the claim's expiry ``ttl`` seconds out (``ok`` False: the token is stale)."""
        return self.call(self.renew_op(subject, token, ttl=ttl), timeout=timeout)

    def release(
        self, subject: Subject, token: int, *, redeliverable: bool = False, timeout: float | None = None
    ) -> Flow[FenceResult]:
        """ReleaseClaim: gives the claim up without replying; the subject becomes FREE. ``redeliverable``: this
        is not a decision about the message (the work failed), so a redelivery of its notification may claim
        again; leave it False when you decided not to reply."""
        return self.call(self.release_op(subject, token, redeliverable=redeliverable), timeout=timeout)

    def begin_send(self, subject: Subject, token: int, *, timeout: float | None = None) -> Flow[FenceResult]:
        """BeginSend, the commit point: CLAIMED to SENDING only if ``token`` is current (else ``ok`` False:
        do not send). Afterwards call ``confirm_sent`` or ``abort_send`` before the send deadline."""
        return self.call(self.begin_send_op(subject, token), timeout=timeout)

    def confirm_sent(
        self, subject: Subject, token: int, sent_message_id: str = "", *, timeout: float | None = None
    ) -> Flow[FenceResult]:
        """ConfirmSent: the reply went out (SENDING or IN_DOUBT to REPLIED), with the mail API's message id."""
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
        """AbortSend: the send certainly did not go out (SENDING or IN_DOUBT to FREE); ``redeliverable`` as in
        ``release``."""
        return self.call(self.abort_send_op(subject, token, reason, redeliverable=redeliverable), timeout=timeout)

    def mark_replied(
        self, subject: Subject, token: int, *, sent_message_id: str = "", note: str = "", timeout: float | None = None
    ) -> Flow[FenceResult]:
        """MarkReplied: the holder answered without the coordinator (in a mail client, by phone): CLAIMED to
        REPLIED, so later claims answer ALREADY_REPLIED. Fenced like ``begin_send`` (``ok`` False: not yours)."""
        return self.call(self.mark_replied_op(subject, token, sent_message_id, note), timeout=timeout)

    def caller(self, *, timeout: float | None = None) -> Flow[CallerIdentity]:
        """GetCaller: who the coordinator takes this client's credentials to be (principal, kind, roles, mailboxes)."""
        return self.call(Op("GetCaller", pb.GetCallerRequest(), _caller_identity), timeout=timeout)

    def status(self, subject: Subject, *, timeout: float | None = None) -> Flow[SubjectStatus]:
        """GetStatus: one subject's state (FREE when nothing is recorded)."""
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
        """ListClaims: one page of the mailbox's subjects that are not FREE (only ``states`` if given), in key
        order. Pass the page's ``next_page_token`` for the next one, or use ``iter_claims``."""
        request = pb.ListClaimsRequest(
            mailbox=mailbox,
            states=[_state_to_pb(state) for state in states],
            page_size=operator.index(page_size),
            page_token=page_token,
        )
        return self.call(Op("ListClaims", request, _page), timeout=timeout)

    def recent_messages(
        self, mailbox: str, *, query: str = "", page_size: int = 0, timeout: float | None = None
    ) -> Flow[tuple[RecentMessage, ...]]:
        """ListRecentMessages: the mailbox's recently delivered messages (the delivery retention, 24 h), newest
        first, whose subject line, sender or id contains ``query``: what a person picks one to answer from."""
        request = pb.ListRecentMessagesRequest(mailbox=mailbox, query=query, page_size=operator.index(page_size))
        return self.call(Op("ListRecentMessages", request, _recent), timeout=timeout)

    def iter_claims(
        self, mailbox: str, *, states: Iterable[SubjectState] = (), page_size: int = 0
    ) -> Stream[SubjectStatus]:
        """Every subject ``list_claims`` would list, page after page (each page read at its own revision)."""
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
        """Watch: a :class:`WatchSnapshot` of the mailbox, then a :class:`WatchEvent` for every transition.

        With ``reconnect`` (the default) a stream that ends with UNAVAILABLE (the coordinator restarted, or
        lost its etcd watch) is opened again with the retry policy's backoff, and resumes after the revision of
        the last snapshot or event received: the events missed meanwhile arrive, without a new snapshot (one
        comes only when etcd no longer has that revision). The retry budget is renewed by every item received.
        Runs until you stop iterating.
        """
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
        """Takeover (humans only): ends an agent's claim (its token goes stale at once) and gives the caller a
        new one. From a person only when ``from_person`` names them (the caller confirmed it; otherwise HELD);
        never after the send began (ALREADY_REPLIED)."""
        request = pb.TakeoverRequest(
            request_id=new_request_id(),
            subject=subject_to_pb(subject),
            ttl_seconds=_ttl(ttl),
            note=note,
            summary=summary_to_pb(summary),
            from_person=from_person,
        )
        return self.call(Op("Takeover", request, _takeover_result), timeout=timeout)

    def resolve_in_doubt(
        self, subject: Subject, *, sent: bool, sent_message_id: str = "", note: str = "", timeout: float | None = None
    ) -> Flow[SubjectStatus]:
        """ResolveInDoubt: settles an IN_DOUBT subject after someone checked the sent folder: ``sent=True``
        records it REPLIED (with ``sent_message_id`` when known), ``sent=False`` frees it."""
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


def _state_to_pb(state: SubjectState) -> pb.SubjectState.ValueType:
    if not isinstance(state, SubjectState):
        raise TypeError(f"states must be inbox_claims.SubjectState values, not {state!r}")
    return pb.SubjectState.Value("SUBJECT_STATE_" + state.name)


class _Blocking(Protocol):
    def _drive(self, flow: Flow[R], /) -> R: ...


class _Asynchronous(Protocol):
    def _drive(self, flow: Flow[R], /) -> Coroutine[Any, Any, R]: ...


class _ClientMethod:
    """A client method made from a core method: the parameters and docstring come from ``build``; ``run``
    (the client's ``_drive`` or ``_iterate``) runs the flow it returns."""

    def __init__(self, build: Callable[..., Any], run: Callable[[Any, Any], Any]) -> None:
        self.build = build
        self._run = run
        self._methods: dict[type, Callable[..., Any]] = {}

    def _method_for(self, owner: type) -> Callable[..., Any]:
        method = self._methods.get(owner)
        if method is None:
            build, run = self.build, self._run

            def method(client: Any, /, *args: Any, **kwargs: Any) -> Any:
                return run(client, build(client._core, *args, **kwargs))

            method.__name__ = build.__name__
            method.__qualname__ = f"{owner.__name__}.{build.__name__}"
            method.__doc__ = build.__doc__
            signature = inspect.signature(build).replace(return_annotation=inspect.Signature.empty)
            method.__signature__ = signature  # type: ignore[attr-defined]
            self._methods[owner] = method
        return method

    def __get__(self, obj: Any, owner: type) -> Any:
        method = self._method_for(owner)
        return method if obj is None else method.__get__(obj, owner)


class rpc(_ClientMethod, Generic[P, R]):
    """Declares a client method that runs one core flow, once for both clients.

    ``claim = rpc(Core.claim)`` in :class:`ClientBase` is ``Coordinator.claim(...) -> ClaimResult`` (blocking)
    and ``AsyncCoordinator.claim(...)``, a coroutine of the same result: the parameters, docstring and result
    type come from the core method; the client's ``_drive`` does the I/O.
    """

    def __init__(self, build: Callable[Concatenate[Core, P], Flow[R]]) -> None:
        super().__init__(build, lambda client, flow: client._drive(flow))

    if TYPE_CHECKING:

        @overload
        def __get__(self, obj: None, owner: type) -> Callable[Concatenate[Any, P], Any]: ...
        @overload
        def __get__(self, obj: _Blocking, owner: type) -> Callable[P, R]: ...
        @overload
        def __get__(self, obj: _Asynchronous, owner: type) -> Callable[P, Coroutine[Any, Any, R]]: ...
        def __get__(self, obj: Any, owner: type) -> Any: ...


class stream(_ClientMethod, Generic[P, T]):
    """Like :class:`rpc`, for a core method that returns a :class:`Stream`: an iterator in the blocking client,
    an async iterator in the asyncio client (close it, or leave the loop, to end the underlying call)."""

    def __init__(self, build: Callable[Concatenate[Core, P], Stream[T]]) -> None:
        super().__init__(build, lambda client, stream: client._iterate(stream.flow))

    if TYPE_CHECKING:

        @overload
        def __get__(self, obj: None, owner: type) -> Callable[Concatenate[Any, P], Any]: ...
        @overload
        def __get__(self, obj: _Blocking, owner: type) -> Callable[P, Generator[T, None, None]]: ...
        @overload
        def __get__(self, obj: _Asynchronous, owner: type) -> Callable[P, AsyncGenerator[T, None]]: ...
        def __get__(self, obj: Any, owner: type) -> Any: ...


class ClientBase:
    """Options shared by :class:`~inbox_claims.Coordinator` and :class:`~inbox_claims.AsyncCoordinator`."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        principal: str | None = None,
        kind: HolderKind | Literal["agent", "human"] = "agent",
        token: str | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
        client_certificate: bytes | None = None,
        client_key: bytes | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        retry: RetryPolicy | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
        max_batch: int = 64,
        sent_folders: str | Iterable[str] | None = None,
        mailbox_addresses: str | Iterable[str] | None = None,
    ) -> None:
        """Connects lazily to the coordinator at ``target`` (HOST:PORT, default ``127.0.0.1:50051``).

        Identity: ``principal`` and ``kind`` ("agent" or "human") are sent as the metadata
        ``x-inbox-principal`` / ``x-inbox-principal-kind`` (development mode); ``token`` as
        ``authorization: Bearer <token>`` once the coordinator authenticates.
        Transport: plaintext by default; ``tls=True`` (system roots), or ``root_certificates`` (PEM bytes),
        plus ``client_certificate`` and ``client_key`` for mutual TLS; or a ready ``credentials``
        (``grpc.ChannelCredentials``).
        ``timeout``: the deadline of each attempt of each call, in seconds. ``retry``: a :class:`RetryPolicy`
        (default: 6 attempts, 0.1 s to 2 s exponential backoff with jitter). ``channel_options``: extra gRPC
        channel arguments.
        ``max_batch``: calls made at the same time (by concurrent tasks or threads sharing this client) go
        to the coordinator together, up to this many in one Batch RPC; each is still its own call, with its
        own answer, error and retries. 1 sends every call alone.
        ``sent_folders`` and ``mailbox_addresses``: how the guard tells a message the mailbox sent from one it
        received (docs/client.md, "Outgoing messages"): folder ids of sent mail besides Google's ``SENT`` (for
        Microsoft and IMAP: ``nylas.sent_folder_ids``), and the mailbox's own addresses. A notification about an
        outgoing message is never handed to your code: it is reported with ``record_outgoing``.
        """
        self._core = Core(
            make_options(
                target,
                principal=principal,
                kind=kind,
                token=token,
                tls=tls,
                root_certificates=root_certificates,
                client_certificate=client_certificate,
                client_key=client_key,
                credentials=credentials,
                timeout=timeout,
                retry=retry,
                channel_options=channel_options,
                max_batch=max_batch,
                sent_folders=sent_folders,
                mailbox_addresses=mailbox_addresses,
            )
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Self:
        """A client configured by the environment variables ``inboxctl`` reads (``environ``: default
        ``os.environ``): ``INBOX_COORDINATOR_TARGET`` (default ``127.0.0.1:50051``), ``INBOX_PRINCIPAL``,
        ``INBOX_PRINCIPAL_KIND`` (default ``agent`` here), ``INBOX_TOKEN``, ``INBOX_TLS``, ``INBOX_CA_FILE``,
        ``INBOX_CERT_FILE``, ``INBOX_KEY_FILE``, ``INBOX_CALL_TIMEOUT`` (default 5 s), and for the guard
        ``INBOX_SENT_FOLDERS`` and ``INBOX_MAILBOX_ADDRESSES`` (comma-separated: ``sent_folders`` and
        ``mailbox_addresses``). Keyword arguments override them (``from_env(max_batch=16)``). Raises
        ``ValueError`` naming the variable to set when neither ``INBOX_PRINCIPAL`` nor ``INBOX_TOKEN`` says who
        the client is."""
        from ._settings import client_arguments, from_environment  # _settings imports this module

        variables = os.environ if environ is None else environ
        settings = from_environment(variables)
        if not variables.get("INBOX_PRINCIPAL_KIND"):
            settings["kind"] = "agent"  # inboxctl's default is a human at a terminal; this is an agent
        arguments = client_arguments(settings)
        arguments["sent_folders"] = variables.get(SENT_FOLDERS_ENV)
        arguments["mailbox_addresses"] = variables.get(MAILBOX_ADDRESSES_ENV)
        arguments.update(overrides)
        if arguments["principal"] is None and arguments["token"] is None:
            raise ValueError(
                "from_env() found no identity: set INBOX_TOKEN (a bearer token) or, in development mode, "
                "INBOX_PRINCIPAL (the agent's name)"
            )
        target = arguments.pop("target")
        return cls(target, **arguments)

    _closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} is closed; make a new one")

    @property
    def target(self) -> str:
        return self._core.options.target

    @property
    def principal(self) -> str | None:
        return self._core.options.principal

    @property
    def kind(self) -> HolderKind:
        return self._core.options.kind

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.target!r}, principal={self.principal!r})"

    # -- the RPCs: each runs one core flow (see Core for what it does); the subclass's _drive does the I/O ---

    record_delivery = rpc(Core.record_delivery)
    record_outgoing = rpc(Core.record_outgoing)
    claim = rpc(Core.claim)
    renew = rpc(Core.renew)
    release = rpc(Core.release)
    begin_send = rpc(Core.begin_send)
    confirm_sent = rpc(Core.confirm_sent)
    abort_send = rpc(Core.abort_send)
    mark_replied = rpc(Core.mark_replied)
    status = rpc(Core.status)
    caller = rpc(Core.caller)
    list_claims = rpc(Core.list_claims)
    recent_messages = rpc(Core.recent_messages)
    iter_claims = stream(Core.iter_claims)
    watch = stream(Core.watch)
    takeover = rpc(Core.takeover)
    resolve_in_doubt = rpc(Core.resolve_in_doubt)
