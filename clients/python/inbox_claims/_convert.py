"""Conversions between the wire's protobuf messages (:mod:`inbox_wire.v1`) and the client's value types.

``*_to_pb`` check what the caller passed and build request fields (raising ``TypeError``/``ValueError`` before
anything is sent); ``*_from_pb`` read answers. Separate from the flows (:mod:`._core`) so that a flow reads as the
calls it makes, and so that a change to the ``.proto`` lands in one module.
"""

from __future__ import annotations

import enum
import operator
from datetime import UTC, datetime
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from inbox_wire.v1 import coordinator_pb2 as pb

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
    IncomingOutcome,
    IncomingResult,
    MessageSummary,
    OutgoingOutcome,
    OutgoingResult,
    OutsideReply,
    OutsideReplyUndone,
    RecentMessage,
    RefusalKind,
    SendRefusal,
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

__all__ = [
    "caller_identity_from_pb",
    "claim_result_from_pb",
    "claims_page_from_pb",
    "delivery_from_pb",
    "delivery_result_from_pb",
    "fence_result_from_pb",
    "outgoing_result_from_pb",
    "outside_reply_from_pb",
    "recent_messages_from_pb",
    "state_to_pb",
    "status_from_pb",
    "subject_from_pb",
    "subject_to_pb",
    "summary_from_pb",
    "summary_to_pb",
    "takeover_result_from_pb",
    "timestamp_to_pb",
    "token_to_pb",
    "ttl_to_pb",
    "undone_from_pb",
    "waiting_from_pb",
    "watch_item_from_pb",
]


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


def timestamp_to_pb(when: datetime, name: str) -> Timestamp:
    if not isinstance(when, datetime):
        raise TypeError(f"{name} must be a datetime, not {type(when).__name__}")
    if when.tzinfo is None:
        raise ValueError(f"{name} must be timezone-aware (a naive datetime names no instant)")
    stamp = Timestamp()
    stamp.FromDatetime(when.astimezone(UTC))
    return stamp


def outside_reply_from_pb(message: Any, field: str = "outside_reply") -> OutsideReply | None:
    """The OutsideReply in ``message``'s ``field`` (a status's ``outside_reply``, an event's ``undone``)."""
    if not message.HasField(field):
        return None
    reply = getattr(message, field)
    return OutsideReply(
        reply.sender, _time(reply, "sent_at"), reply.message_id, reply.recorded_by, reply.stopped_holder
    )


def undone_from_pb(response: pb.UndoOutsideReplyResponse) -> OutsideReplyUndone:
    return OutsideReplyUndone(
        status_from_pb(response.status),
        outside_reply_from_pb(response, "undone"),
        response.undone_by,
        _time(response, "undone_at"),
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


def caller_identity_from_pb(response: pb.GetCallerResponse) -> CallerIdentity:
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
        automated=message.automated,
        agents_stopped=refusal_from_pb(message.agents_stopped) if message.HasField("agents_stopped") else None,
    )


def refusal_from_pb(message: pb.SendRefusal) -> SendRefusal:
    return SendRefusal(
        kind=_enum_from_pb(RefusalKind, pb.SendRefusal.Kind, message.kind, ""),
        reason=message.reason,
        scope=message.scope,
        limit=message.limit,
        window_seconds=message.window_seconds,
        counted=message.counted,
        frees_at=_time(message, "frees_at"),
        newer_message_id=message.newer_message_id,
        newer_received_at=_time(message, "newer_received_at"),
    )


def recent_messages_from_pb(response: pb.ListRecentMessagesResponse) -> tuple[RecentMessage, ...]:
    return tuple(_recent_from_pb(message) for message in response.messages)


def waiting_from_pb(response: pb.ListRecentMessagesResponse) -> tuple[RecentMessage, ...]:
    """What agents leave to people: the stopped conversations, then the automated messages."""
    automated = (message for message in response.messages if message.automated)
    return tuple(_recent_from_pb(message) for message in (*response.agents_stopped, *automated))


def _recent_from_pb(message: pb.RecentMessage) -> RecentMessage:
    return RecentMessage(
        subject=subject_from_pb(message.subject),
        summary=summary_from_pb(message),
        first_seen_at=_time(message, "first_seen_at"),
        seen_by=message.seen_by,
        automated=message.automated,
        agents_stopped=refusal_from_pb(message.agents_stopped) if message.HasField("agents_stopped") else None,
    )


def delivery_from_pb(message: pb.DeliveryRecord) -> DeliveryRecord:
    return DeliveryRecord(
        mailbox=message.mailbox,
        notification_id=message.notification_id,
        recorded_by=message.recorded_by,
        recorded_at=_time(message, "recorded_at"),
        subject=subject_from_pb(message.subject) if message.HasField("subject") else None,
    )


def fence_result_from_pb(response: Any) -> FenceResult:
    refused = response.result == pb.FENCE_RESULT_REFUSED and response.HasField("refusal")
    return FenceResult(
        ok=response.result == pb.FENCE_RESULT_OK,
        status=status_from_pb(response.status),
        refusal=refusal_from_pb(response.refusal) if refused else None,
    )


def incoming_result_from_pb(response: pb.RecordIncomingResponse) -> IncomingResult:
    outcome: IncomingOutcome = _enum_from_pb(IncomingOutcome, pb.RecordIncomingResponse.Result, response.result, "")
    return IncomingResult(
        outcome=outcome,
        status=status_from_pb(response.status) if response.HasField("status") else None,
        delivery=delivery_from_pb(response.delivery) if response.HasField("delivery") else None,
    )


def claim_result_from_pb(response: pb.ClaimReplyResponse) -> ClaimResult:
    outcome: ClaimOutcome = _enum_from_pb(ClaimOutcome, pb.ClaimReplyResponse.Result, response.result, "")
    return ClaimResult(
        outcome=outcome,
        status=status_from_pb(response.status) if outcome is not ClaimOutcome.DUPLICATE_DELIVERY else None,
        delivery=delivery_from_pb(response.delivery) if response.HasField("delivery") else None,
    )


def outgoing_result_from_pb(response: pb.RecordOutgoingResponse) -> OutgoingResult:
    return OutgoingResult(
        outcome=_enum_from_pb(OutgoingOutcome, pb.RecordOutgoingResponse.Result, response.result, ""),
        subjects=tuple(status_from_pb(status) for status in response.subjects),
        delivery=delivery_from_pb(response.delivery) if response.HasField("delivery") else None,
    )


def takeover_result_from_pb(response: pb.TakeoverResponse) -> TakeoverResult:
    return TakeoverResult(
        outcome=_enum_from_pb(TakeoverOutcome, pb.TakeoverResponse.Result, response.result, ""),
        status=status_from_pb(response.status),
        previous_holder=response.previous_holder,
        previous_token=response.previous_token,
    )


def delivery_result_from_pb(response: pb.RecordDeliveryResponse) -> DeliveryResult:
    return DeliveryResult(
        is_new=response.result == pb.RecordDeliveryResponse.NEW, first=delivery_from_pb(response.first)
    )


def claims_page_from_pb(response: pb.ListClaimsResponse) -> ClaimsPage:
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
        by=event.by,
        at=_time(event, "at"),
        undone=outside_reply_from_pb(event, "undone"),
    )


def ttl_to_pb(ttl: int) -> int:
    value = operator.index(ttl)
    if value < 0:
        raise ValueError(f"ttl must be a whole number of seconds >= 0 (0 means the server's default), not {ttl}")
    return value


def token_to_pb(token: int) -> int:
    value = operator.index(token)
    if value <= 0:
        raise ValueError(f"fencing token must be a positive integer (the one a claim granted), not {token}")
    return value


def state_to_pb(state: SubjectState) -> pb.SubjectState.ValueType:
    if not isinstance(state, SubjectState):
        raise TypeError(f"states must be inbox_claims.SubjectState values, not {state!r}")
    return pb.SubjectState.Value("SUBJECT_STATE_" + state.name)
