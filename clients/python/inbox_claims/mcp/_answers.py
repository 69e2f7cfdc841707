"""What a model is told: each outcome of a claim or a send as one value, with a sentence it acts on.

Every answer names the message, says whether the model may reply, and, when it may not, who is answering it
or has answered it (an agent or a person) and until or since when, ending in the instruction ("do not
reply"). The tools return the value as structured content and the sentence as text.
"""

from __future__ import annotations

import dataclasses
import enum
from datetime import UTC, datetime
from typing import Any

from .._errors import ClaimLost, ConversationMovedOn, ReplyRefused
from .._types import HolderKind, LossReason, OutsideReply, Subject, SubjectState, SubjectStatus


class Outcome(enum.Enum):
    """What happened; the ``outcome`` field of every tool's structured answer."""

    GRANTED = "granted"
    """This session holds the claim: it may draft and send."""
    HELD = "held"
    """Someone else (another agent, a person, another session of this agent) is answering: do not reply."""
    ALREADY_REPLIED = "already_replied"
    """A reply went out, is going out, or may have gone out: do not reply."""
    SENT = "sent"
    """The reply went out and is recorded."""
    NOT_SENT = "not_sent"
    """The mail service refused the send: nothing went out, and the message is free again."""
    IN_DOUBT = "in_doubt"
    """The send began and its outcome is unknown: it may have gone out; a person must check."""
    LOST = "lost"
    """This session held the claim and no longer does (taken over, lapsed): nothing was sent."""
    MARKED_REPLIED = "marked_replied"
    """Recorded as answered outside the coordinator: nobody will reply to it."""
    RELEASED = "released"
    """This session gave the claim up: others may answer the message."""
    NOT_HELD = "not_held"
    """This session held no claim on the message: nothing to release."""


# The outcomes after which this session may go on to send a reply to the message.
MAY_REPLY = frozenset({Outcome.GRANTED})


def when(moment: datetime | None) -> str:
    """A time as a model reads it back to a person: ``2026-05-02 14:03:07 UTC``."""
    return "an unknown time" if moment is None else moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.astimezone(UTC).isoformat()


def who(status: SubjectStatus, me: str) -> str:
    """``ana@example.com (a person)``, ``agent-2 (an agent)``, ``another session of agent-1 (this agent)``."""
    if status.holder and status.holder == me:
        return f"another session of {me} (this agent)"
    kind = {HolderKind.HUMAN: "a person", HolderKind.AGENT: "an agent"}.get(status.holder_kind or HolderKind.AGENT)
    return f"{status.holder or 'someone'} ({kind})"


@dataclasses.dataclass(frozen=True)
class Answer:
    """One tool's answer about one message."""

    outcome: Outcome
    message: str
    """The sentence the model acts on."""
    subject: Subject
    holder: str = ""
    """Who holds or answered the message (empty when nobody, or this session)."""
    holder_kind: str = ""
    """``agent`` or ``person``."""
    until: datetime | None = None
    """GRANTED, HELD: when the claim ends unless renewed."""
    at: datetime | None = None
    """SENT, ALREADY_REPLIED, MARKED_REPLIED, IN_DOUBT: when the reply was sent or the send began; LOST: when
    the loss was found."""
    sent_message_id: str = ""
    detail: str = ""
    """What the mail service or the coordinator said, when it explains the outcome."""
    handle: str = ""
    """GRANTED: the claim's handle, for a client without a session to pass back (``claim_handle``)."""

    @property
    def may_reply(self) -> bool:
        return self.outcome in MAY_REPLY

    @property
    def is_error(self) -> bool:
        """Answered as a tool error: the call's purpose failed (nothing was sent, or the outcome is unknown)."""
        return self.outcome in (Outcome.HELD, Outcome.ALREADY_REPLIED, Outcome.NOT_SENT, Outcome.IN_DOUBT, Outcome.LOST)

    def structured(self) -> dict[str, Any]:
        """The structured content: JSON values only, empty fields left out."""
        document: dict[str, Any] = {
            "outcome": self.outcome.value,
            "may_reply": self.may_reply,
            "message": self.message,
            "mailbox": self.subject.mailbox,
            "subject_kind": self.subject.kind.value,
            "subject_id": self.subject.id,
        }
        optional = {
            "holder": self.holder,
            "holder_kind": self.holder_kind,
            "until": _iso(self.until),
            "at": _iso(self.at),
            "sent_message_id": self.sent_message_id,
            "detail": self.detail,
            "claim_handle": self.handle,
        }
        document.update({name: value for name, value in optional.items() if value})
        return document


def _holder_fields(status: SubjectStatus, me: str) -> dict[str, Any]:
    kind = "person" if status.holder_kind is HolderKind.HUMAN else "agent"
    return {"holder": status.holder, "holder_kind": kind if status.holder else ""}


def granted(
    subject: Subject, until: datetime | None, *, again: bool = False, handle: str = "", sessionless: bool = False
) -> Answer:
    held = "You already hold this message" if again else "Granted"
    if sessionless:
        keep = (
            f'It stays yours while you use it (renewed for you): pass claim_handle "{handle}" to send_reply, '
            "release_message or mark_replied for it; without the handle, a call is not yours."
        )
    else:
        keep = "It stays yours while this session lasts (renewed for you)."
    return Answer(
        Outcome.GRANTED,
        f"{held} until {when(until)}: you are answering this message, and nobody else will. {keep} Send the reply "
        "with send_reply, or give it back with release_message if you will not answer it.",
        subject,
        until=until,
        handle=handle,
    )


def refusal(status: SubjectStatus, me: str, *, sessionless: bool = False) -> Answer:
    """HELD or ALREADY_REPLIED, from the subject's status. ``sessionless``: the caller has no session, so a claim
    of this agent may be its own, made under a handle it did not pass back."""
    fields = _holder_fields(status, me)
    name = who(status, me)
    subject = status.subject
    if status.state is SubjectState.CLAIMED:
        yours = (
            " If you claimed it yourself, call again with the claim_handle claim_message gave you."
            if sessionless and status.holder == me
            else ""
        )
        return Answer(
            Outcome.HELD,
            f"Being answered by {name} until {when(status.expires_at)}: do not reply.{yours}",
            subject,
            until=status.expires_at,
            **fields,
        )
    if status.state is SubjectState.SENDING:
        message = f"A reply by {name} is being sent right now (since {when(status.send_started_at)}): do not reply."
        at = status.send_started_at
    elif status.state is SubjectState.IN_DOUBT:
        message = (
            f"A reply by {name} was started at {when(status.send_started_at)} and nobody knows whether it went out; "
            "a person must check the sent folder: do not reply."
        )
        at = status.send_started_at
    elif status.replied_outside and status.outside_reply is not None:
        reply = status.outside_reply
        message = (
            f"Already answered from the mailbox by {reply.sender or 'someone'} at {when(reply.sent_at)} "
            f"({_outside_these_tools(reply)}): do not reply."
        )
        at = reply.sent_at
    else:
        how = " by hand" if status.replied_by_hand else ""
        message = f"Already answered{how} by {name} at {when(status.sent_at)}: do not reply."
        at = status.sent_at
    return Answer(Outcome.ALREADY_REPLIED, message, subject, at=at, sent_message_id=status.sent_message_id, **fields)


def sent(status: SubjectStatus) -> Answer:
    """The reply this principal sent, from its reply record: the same answer for the call that sent it and for
    every repeat of it, in this process or after a restart."""
    at = status.sent_at
    identity = f" (message id {status.sent_message_id})" if status.sent_message_id else ""
    return Answer(
        Outcome.SENT,
        f"Sent at {when(at)}{identity}. The message is answered: do not send it again.",
        status.subject,
        at=at,
        sent_message_id=status.sent_message_id,
    )


def different_reply(first: Answer) -> Answer:
    """A second, different reply to a message this session already answered."""
    return dataclasses.replace(
        first,
        outcome=Outcome.ALREADY_REPLIED,
        message=f"You already answered this message at {when(first.at)}"
        + (f" (message id {first.sent_message_id})" if first.sent_message_id else "")
        + "; this other reply was not sent: do not reply again.",
    )


def not_sent(subject: Subject, reason: str) -> Answer:
    return Answer(
        Outcome.NOT_SENT,
        f"Not sent: the mail service refused it ({reason}). Nothing went out and the message is free again: "
        "fix the reply and send it again, or leave it.",
        subject,
        detail=reason,
    )


def refused(refusal: ReplyRefused) -> Answer:
    """BeginSend REFUSED: the mailbox's reply rules stopped the send before anything went out; the claim is let go."""
    if isinstance(refusal, ConversationMovedOn):
        newer = f" (message {refusal.newer_message_id})" if refusal.newer_message_id else ""
        text = (
            f"Not sent: {refusal.reason}{newer}. Nothing went out. Read the customer's newest message and answer "
            "that one: its own claim_message decides who replies."
        )
    else:
        text = (
            f"Not sent: {refusal.reason}. Nothing went out. Do not send anything more to this conversation: it is "
            "left for a person."
        )
    return Answer(Outcome.NOT_SENT, text, refusal.subject, detail=refusal.reason)


def not_reached(subject: Subject, reason: str, *, claimed: bool) -> Answer:
    """The mail service could not take the send (unreachable, or not the server the guard was started for): the
    send never got there. ``claimed``: the message was claimed
    (and passed the commit point) first, and is free again now."""
    free = "the message is free again" if claimed else "the message was not claimed"
    return Answer(
        Outcome.NOT_SENT,
        f"Not sent: the email server could not take it ({reason}). Nothing went out and {free}: try the same "
        "send again in a moment.",
        subject,
        detail=reason,
    )


def other_reply_running(subject: Subject, me: str) -> Answer:
    """A send of a different reply to a message while this principal's first send of it is still running."""
    return Answer(
        Outcome.HELD,
        f"A reply to this message by {me} (this agent: another conversation, or an earlier call) is being sent right "
        "now; this different one was not sent: do not reply.",
        subject,
        holder=me,
        holder_kind="agent",
    )


def in_doubt(subject: Subject, detail: str, *, sent_message_id: str = "") -> Answer:
    return Answer(
        Outcome.IN_DOUBT,
        "The outcome of the send is unknown: the reply may have gone out. Do not send it again; the message "
        "is marked in doubt until a person checks the sent folder and settles it.",
        subject,
        at=datetime.now(UTC),
        sent_message_id=sent_message_id,
        detail=detail,
    )


def lost(loss: ClaimLost, me: str) -> Answer:
    status = loss.status
    subject = loss.subject
    now = datetime.now(UTC)
    if loss.reason is LossReason.ANSWERED_OUTSIDE:
        reply = status.outside_reply if status is not None else None
        by = f"{reply.sender} " if reply is not None and reply.sender else "someone "
        at = f" at {when(reply.sent_at)}" if reply is not None and reply.sent_at is not None else ""
        outside = _outside_these_tools(reply) if reply is not None else "outside these tools"
        return Answer(
            Outcome.LOST,
            f"Not sent: {by}already answered this email from the mailbox{at} ({outside}): do not reply.",
            subject,
            at=now,
            **(_holder_fields(status, me) if status is not None else {}),
        )
    if loss.reason is LossReason.TAKEN_OVER and status is not None:
        return Answer(
            Outcome.LOST,
            f"Not sent: {who(status, me)} took this message over; they are answering it: do not reply.",
            subject,
            at=now,
            **_holder_fields(status, me),
        )
    why = {
        LossReason.EXPIRED: "it lapsed before it could be renewed",
        LossReason.RENEWAL_FAILED: "the coordinator could not be reached to renew it",
        LossReason.STALE_TOKEN: "it was released or taken by someone else",
        LossReason.TAKEN_OVER: "a person took it over",
    }.get(loss.reason, "it ended")
    return Answer(
        Outcome.LOST,
        f"Not sent: your claim on this message ended ({why}). Someone else may be answering it: call "
        "claim_message to find out before you do anything more.",
        subject,
        at=now,
    )


def marked(status: SubjectStatus) -> Answer:
    return Answer(
        Outcome.MARKED_REPLIED,
        f"Recorded as answered at {when(status.sent_at)}: no agent will reply to this message.",
        status.subject,
        at=status.sent_at,
        sent_message_id=status.sent_message_id,
    )


def released(subject: Subject) -> Answer:
    return Answer(Outcome.RELEASED, "Released: you no longer hold this message; others may answer it.", subject)


def not_held(subject: Subject) -> Answer:
    return Answer(Outcome.NOT_HELD, "You do not hold this message: nothing to release.", subject)


def _outside_these_tools(reply: OutsideReply) -> str:
    """Where an outside reply's record comes from: the sender is what its From line says (anyone can write it),
    and the principal that reported it to the coordinator vouches for it."""
    if not reply.recorded_by:
        return "outside these tools"
    return f"outside these tools; the sender as its From line says, recorded by {reply.recorded_by}"


def described(status: SubjectStatus, me: str) -> dict[str, Any]:
    """One live claim, for who_is_answering."""
    document: dict[str, Any] = {
        "subject_kind": status.subject.kind.value,
        "subject_id": status.subject.id,
        "state": status.state.value,
        "holder": status.holder,
        "holder_kind": "person" if status.holder_kind is HolderKind.HUMAN else "agent",
        "yours": bool(me) and status.holder == me,
    }
    if status.expires_at is not None and status.state is SubjectState.CLAIMED:
        document["until"] = _iso(status.expires_at)
    if status.send_started_at is not None and status.state is not SubjectState.CLAIMED:
        document["since"] = _iso(status.send_started_at)
    if status.summary is not None:
        if status.summary.subject_line:
            document["subject_line"] = status.summary.subject_line
        if status.summary.sender:
            document["sender"] = status.summary.sender
    if status.note:
        document["note"] = status.note
    reply = status.outside_reply
    if reply is not None:
        # Who answered from the mailbox as its From line says, and who reported it: never one without the other.
        document["answered_from_mailbox"] = {
            "sender": reply.sender,
            "recorded_by": reply.recorded_by,
            **({"at": _iso(reply.sent_at)} if reply.sent_at is not None else {}),
        }
    return document
