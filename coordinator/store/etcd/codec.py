"""How records are written as etcd values: compact JSON with one-letter keys, readable with etcdctl.

Values are kept small because etcd's quota bounds reply records times their retention (docs/operations.md,
"Capacity"): what the key already says (a delivery's mailbox and notification id) is not repeated, empty
fields are left out, and a REPLIED record keeps only what a reply record is for (who sent what, when).

    subject:   {"s": state, "h": holder, "k": kind, "a": acquired ms, "l": ttl s, "x": expires ms, "n": note,
                 "r": request id, "f": its arguments' fingerprint, "q": last request id, "g": its fingerprint,
                 "b": send started ms, "d": send deadline ms, "t": sent ms, "m": sent message id,
                 "y": 1 when replied by hand (MarkReplied), "v": [subject line, sender, received ms],
                 "j": 1 when replied outside, "o": the outside reply, "w": the message's received ms,
                 "e": the outgoing message taken for this send's copy (an outside reply's shape),
                 "z": who settled it (ResolveInDoubt SENT), "i": the thread of the outside reply "o",
                 "th": the claimed message's thread, "c": its correspondent, "as": the refusal that stopped
                 agents (a refusal's shape)}
    refusal:   [kind, reason, scope, limit, window ms, counted, frees ms, newer message id, its received ms]
    counted send (docs/design.md#reply-storms): {"b": when it began, ms} (its token is in its key)
    a thread's newest inbound message: [message id, received ms]
    delivery:  {"b": recorded by, "t": recorded ms, "r": request id, "s": [kind, subject id],
                "o": RecordOutgoing's answer ("own" or "out"), "g": its arguments' fingerprint,
                "v": [subject line, sender, received ms]}
    outside reply (a subject's "o", a thread's latest): [sender, sent ms, message id, recorded by, stopped holder]
                (five items, as every release before wrote and reads them: its thread id goes beside it, "i")
    thread entry: {"w": the message's received ms, "b": the principal that named the thread, "u": 0 when that
                principal does not report the mailbox's mail (entries without "b" predate both: vouched)}
    end mark:  {"w": reason, "b": by, "o": token, "p": previous holder, "r": request id, "g": its fingerprint,
                "t": at ms, "n": detail, "u": 0 when it leaves its notification redeliverable,
                "x": the outside reply an undo withdrew, "i": its thread}
    cursor:    {"v": value, "p": position, "q": last advance's request id, "g": its fingerprint}
    range:     {"b": holder, "r": request id, "g": its fingerprint, "x": expires ms}
"""

from __future__ import annotations

import json
from typing import Any

from coordinator.core.domain import (
    CursorRange,
    CursorRecord,
    DeliveryRecord,
    EndMark,
    EndReason,
    HolderKind,
    OutgoingResult,
    OutsideReply,
    State,
    Subject,
    SubjectKind,
    SubjectRecord,
    Summary,
    ThreadLink,
)
from coordinator.core.storms import Inbound, Refusal, RefusalKind, Stopped

_STATES = {State.CLAIMED: "c", State.SENDING: "s", State.REPLIED: "r", State.IN_DOUBT: "d"}
_STATES_IN = {code: state for state, code in _STATES.items()}
_KINDS = {HolderKind.AGENT: "a", HolderKind.HUMAN: "h"}
_KINDS_IN = {code: kind for kind, code in _KINDS.items()}
_OUTGOING = {OutgoingResult.OWN_REPLY: "own", OutgoingResult.ANSWERED_OUTSIDE: "out"}
_OUTGOING_IN = {code: result for result, code in _OUTGOING.items()}
# What a reply record no longer needs once the reply went out: the claim's bookkeeping.
# The last request ("q", "g") stays when there is one: only ResolveInDoubt (SENT) leaves one on a reply record.
_CLAIM_ONLY = ("a", "l", "r", "f", "d")


# One encoder for every record: json.dumps with options builds a new JSONEncoder on each call.
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def _dump(data: dict[str, Any]) -> bytes:
    return _ENCODER.encode({k: v for k, v in data.items() if v not in (None, "")}).encode()


def encode_record(record: SubjectRecord) -> bytes:
    data: dict[str, Any] = {
        "s": _STATES[record.state],
        "h": record.holder,
        "k": _KINDS[record.holder_kind],
        "a": record.acquired_ms,
        "l": record.ttl_seconds,
        "x": record.expires_ms,
        "n": record.note,
        "r": record.request_id,
        "f": record.fingerprint,
        "q": record.last_request_id,
        "g": record.last_fingerprint,
        "b": record.send_started_ms,
        "d": record.send_deadline_ms,
        "t": record.sent_ms,
        "m": record.sent_message_id,
        "y": 1 if record.replied_by_hand else None,
        "v": _summary(record.summary),
        "j": 1 if record.replied_outside else None,
        "o": _outside(record.outside_reply),
        "w": record.received_ms,
        "e": _outside(record.echo),
        "z": record.settled_by,
        "i": record.outside_reply.thread_id if record.outside_reply is not None else None,
        "th": record.thread_id,
        "c": record.correspondent,
        "as": _refusal(record.agents_stopped),
    }
    if record.state is State.REPLIED:
        for key in _CLAIM_ONLY:
            del data[key]
    return _dump(data)


# How every record this codec writes begins: its state first, one letter ("s" is the first key of the dict).
_STATE_AT = len(b'{"s":"')


def state_of(value: bytes) -> State:
    """A subject record's state, read without decoding the rest (a listing filtered by state skips most records
    it reads); a value of another shape is decoded whole."""
    if value.startswith(b'{"s":"') and value[_STATE_AT + 1 : _STATE_AT + 2] == b'"':
        state = _STATES_IN.get(value[_STATE_AT : _STATE_AT + 1].decode("ascii", "replace"))
        if state is not None:
            return state
    return decode_record(value).state


def decode_record(value: bytes) -> SubjectRecord:
    data = json.loads(value)
    return SubjectRecord(
        state=_STATES_IN[data["s"]],
        holder=data["h"],
        holder_kind=_KINDS_IN[data["k"]],
        acquired_ms=data.get("a", 0),
        ttl_seconds=data.get("l", 0),
        expires_ms=data.get("x"),
        note=data.get("n", ""),
        request_id=data.get("r", ""),
        fingerprint=data.get("f", ""),
        last_request_id=data.get("q", ""),
        last_fingerprint=data.get("g", ""),
        send_started_ms=data.get("b"),
        send_deadline_ms=data.get("d"),
        sent_ms=data.get("t"),
        sent_message_id=data.get("m", ""),
        replied_by_hand=bool(data.get("y")),
        summary=Summary(*data["v"]) if "v" in data else None,
        replied_outside=bool(data.get("j")),
        outside_reply=_outside_in(data["o"], data.get("i", "")) if "o" in data else None,
        received_ms=data.get("w"),
        echo=_outside_in(data["e"]) if "e" in data else None,
        settled_by=data.get("z", ""),
        thread_id=data.get("th", ""),
        correspondent=data.get("c", ""),
        agents_stopped=_refusal_in(data["as"]) if "as" in data else None,
    )


_REFUSAL_KINDS_IN = {kind.value: kind for kind in RefusalKind}


def _refusal(refusal: Refusal | None) -> list[Any] | None:
    if refusal is None:
        return None
    return [
        refusal.kind.value,
        refusal.reason,
        refusal.scope,
        refusal.limit,
        refusal.window_ms,
        refusal.counted,
        refusal.frees_ms,
        refusal.newer_message_id,
        refusal.newer_received_ms,
    ]


def _refusal_in(fields: list[Any]) -> Refusal:
    kind, reason, scope, limit, window_ms, counted, frees_ms, newer_id, newer_ms = fields[:9]
    return Refusal(_REFUSAL_KINDS_IN[kind], reason, scope, limit, window_ms, counted, frees_ms, newer_id, newer_ms)


def encode_stopped(stopped: Stopped) -> bytes:
    subject = stopped.subject
    return _dump(
        {
            "k": subject.kind.value,
            "id": subject.id,
            "th": stopped.thread_id,
            "as": _refusal(stopped.refusal),
            "h": stopped.stopped_holder,
            "at": stopped.stopped_ms,
            "v": _summary(stopped.summary),
        }
    )


def decode_stopped(value: bytes, mailbox: str) -> Stopped:
    data = json.loads(value)
    return Stopped(
        Subject(mailbox, SubjectKind(data["k"]), data["id"]),
        data.get("th", ""),
        _refusal_in(data["as"]),
        data.get("h", ""),
        int(data["at"]),
        Summary(*data["v"]) if "v" in data else None,
    )


def encode_send(began_ms: int) -> bytes:
    return _dump({"b": began_ms})


def decode_send(value: bytes) -> int:
    return int(json.loads(value)["b"])


def encode_inbound(inbound: Inbound) -> bytes:
    return _ENCODER.encode([inbound.message_id, inbound.received_ms]).encode()


def decode_inbound(value: bytes) -> Inbound:
    message_id, received_ms = json.loads(value)[:2]
    return Inbound(message_id, int(received_ms))


def _summary(summary: Summary | None) -> list[Any] | None:
    return [summary.subject_line, summary.sender, summary.received_ms] if summary else None


def _outside(reply: OutsideReply | None) -> list[Any] | None:
    if reply is None:
        return None
    return [reply.sender, reply.sent_ms, reply.message_id, reply.recorded_by, reply.stopped_holder]


def _outside_in(fields: list[Any], thread_id: str = "") -> OutsideReply:
    sender, sent_ms, message_id, recorded_by, stopped_holder = fields[:5]
    return OutsideReply(sender, sent_ms, message_id, recorded_by, stopped_holder, thread_id)


def encode_outside_reply(reply: OutsideReply) -> bytes:
    return _ENCODER.encode(_outside(reply)).encode()


def decode_outside_reply(value: bytes) -> OutsideReply:
    return _outside_in(json.loads(value))


def encode_thread_entry(link: ThreadLink) -> bytes:
    return _dump({"w": link.received_ms, "b": link.entered_by, "u": None if link.vouched else 0})


def decode_thread_entry(value: bytes, thread_id: str) -> ThreadLink:
    data = json.loads(value)
    return ThreadLink(thread_id, int(data["w"]), data.get("b", ""), "u" not in data)


def encode_end_mark(mark: EndMark) -> bytes:
    return _dump(
        {
            "w": mark.reason.value,
            "b": mark.by,
            "o": mark.token,
            "p": mark.previous_holder,
            "r": mark.request_id,
            "g": mark.fingerprint,
            "t": mark.at_ms,
            "n": mark.detail,
            "u": None if mark.settles_delivery else 0,
            "x": _outside(mark.undone),
            "i": mark.undone.thread_id if mark.undone is not None else None,
        }
    )


def decode_end_mark(value: bytes) -> EndMark:
    data = json.loads(value)
    return EndMark(
        reason=EndReason(data["w"]),
        by=data["b"],
        token=data["o"],
        previous_holder=data.get("p", ""),
        request_id=data.get("r", ""),
        at_ms=data["t"],
        detail=data.get("n", ""),
        settles_delivery="u" not in data,
        fingerprint=data.get("g", ""),
        undone=_outside_in(data["x"], data.get("i", "")) if "x" in data else None,
    )


def encode_delivery(delivery: DeliveryRecord) -> bytes:
    subject = [delivery.subject.kind.value, delivery.subject.id] if delivery.subject is not None else None
    outgoing = _OUTGOING[delivery.outgoing] if delivery.outgoing is not None else None
    return _dump(
        {
            "b": delivery.recorded_by,
            "t": delivery.recorded_ms,
            "r": delivery.request_id,
            "s": subject,
            "o": outgoing,
            "g": delivery.fingerprint,
            "v": _summary(delivery.summary),
        }
    )


def may_contain(value: bytes, folded: str) -> bool:
    """Whether a record's text fields may contain ``folded`` (casefolded), read without decoding it: JSON writes
    every text as it is (``ensure_ascii=False``), but for the characters it escapes (``"``, ``\\``, controls), and
    casefolding goes character by character, so a text that contains ``folded`` leaves it in the casefolded value.
    True for a ``folded`` with an escaped character (the caller decodes and checks)."""
    if not folded.isprintable() or '"' in folded or "\\" in folded:
        return True
    return folded in value.decode("utf-8", "replace").casefold()


def decode_delivery(value: bytes, mailbox: str, notification_id: str) -> DeliveryRecord:
    """``mailbox`` and ``notification_id`` are those of the key the value was read from."""
    data = json.loads(value)
    subject = None
    if "s" in data:
        kind, subject_id = data["s"]
        subject = Subject(mailbox, SubjectKind(kind), subject_id)
    return DeliveryRecord(
        mailbox=mailbox,
        notification_id=notification_id,
        recorded_by=data["b"],
        recorded_ms=data["t"],
        request_id=data.get("r", ""),
        subject=subject,
        outgoing=_OUTGOING_IN[data["o"]] if "o" in data else None,
        fingerprint=data.get("g", ""),
        summary=Summary(*data["v"]) if "v" in data else None,
    )


def encode_cursor(cursor: CursorRecord) -> bytes:
    return _dump({"v": cursor.value, "p": cursor.position, "q": cursor.last_request_id, "g": cursor.last_fingerprint})


def decode_cursor(value: bytes) -> CursorRecord:
    data = json.loads(value)
    return CursorRecord(data.get("v", ""), int(data.get("p", 0)), data.get("q", ""), data.get("g", ""))


def encode_cursor_range(taken: CursorRange) -> bytes:
    return _dump({"b": taken.holder, "r": taken.request_id, "g": taken.fingerprint, "x": taken.expires_ms})


def decode_cursor_range(value: bytes) -> CursorRange:
    data = json.loads(value)
    return CursorRange(data.get("b", ""), data.get("r", ""), data.get("g", ""), int(data.get("x", 0)))
