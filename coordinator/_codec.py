"""How records are written as etcd values: compact JSON, readable with etcdctl."""

from __future__ import annotations

import json
from typing import Any

from .domain import (
    DeliveryRecord,
    EndMark,
    EndReason,
    HolderKind,
    State,
    Subject,
    SubjectKind,
    SubjectRecord,
)


def _dump(data: dict[str, Any]) -> bytes:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()


def encode_record(record: SubjectRecord) -> bytes:
    data: dict[str, Any] = {
        "state": record.state.value,
        "holder": record.holder,
        "holder_kind": record.holder_kind.value,
        "acquired_ms": record.acquired_ms,
        "ttl": record.ttl_seconds,
        "expires_ms": record.expires_ms,
        "note": record.note,
        "request_id": record.request_id,
        "send_started_ms": record.send_started_ms,
        "send_deadline_ms": record.send_deadline_ms,
        "sent_ms": record.sent_ms,
        "sent_message_id": record.sent_message_id,
    }
    return _dump({k: v for k, v in data.items() if v not in (None, "")})


def decode_record(value: bytes) -> SubjectRecord:
    data = json.loads(value)
    return SubjectRecord(
        state=State(data["state"]),
        holder=data["holder"],
        holder_kind=HolderKind(data["holder_kind"]),
        acquired_ms=data["acquired_ms"],
        ttl_seconds=data["ttl"],
        expires_ms=data.get("expires_ms"),
        note=data.get("note", ""),
        request_id=data.get("request_id", ""),
        send_started_ms=data.get("send_started_ms"),
        send_deadline_ms=data.get("send_deadline_ms"),
        sent_ms=data.get("sent_ms"),
        sent_message_id=data.get("sent_message_id", ""),
    )


def encode_end_mark(mark: EndMark) -> bytes:
    return _dump(
        {
            "reason": mark.reason.value,
            "by": mark.by,
            "token": mark.token,
            "previous_holder": mark.previous_holder,
            "request_id": mark.request_id,
            "at_ms": mark.at_ms,
            "detail": mark.detail,
        }
    )


def decode_end_mark(value: bytes) -> EndMark:
    data = json.loads(value)
    return EndMark(
        reason=EndReason(data["reason"]),
        by=data["by"],
        token=data["token"],
        previous_holder=data["previous_holder"],
        request_id=data["request_id"],
        at_ms=data["at_ms"],
        detail=data.get("detail", ""),
    )


def encode_delivery(delivery: DeliveryRecord) -> bytes:
    data: dict[str, Any] = {
        "mailbox": delivery.mailbox,
        "notification_id": delivery.notification_id,
        "recorded_by": delivery.recorded_by,
        "recorded_ms": delivery.recorded_ms,
        "request_id": delivery.request_id,
    }
    if delivery.subject is not None:
        data["subject"] = [delivery.subject.kind.value, delivery.subject.id]
    return _dump(data)


def decode_delivery(value: bytes) -> DeliveryRecord:
    data = json.loads(value)
    subject = None
    if "subject" in data:
        kind, subject_id = data["subject"]
        subject = Subject(data["mailbox"], SubjectKind(kind), subject_id)
    return DeliveryRecord(
        mailbox=data["mailbox"],
        notification_id=data["notification_id"],
        recorded_by=data["recorded_by"],
        recorded_ms=data["recorded_ms"],
        request_id=data["request_id"],
        subject=subject,
    )
