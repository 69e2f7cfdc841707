"""The state machine's rules alone: pure functions, clock passed in, no etcd."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from coordinator.core import domain
from coordinator.core.commands import (
    AbortSend,
    BeginSend,
    ClaimReply,
    Command,
    ConfirmSent,
    MarkReplied,
    RecordOutgoing,
    ReleaseClaim,
    RenewClaim,
    ResolveInDoubt,
    Takeover,
)
from coordinator.core.domain import (
    Caller,
    EndMark,
    EndReason,
    EventType,
    FenceResult,
    HolderKind,
    Rules,
    State,
    Stored,
    Subject,
    SubjectKind,
)
from coordinator.core.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from coordinator.core.limits import Limits

RULES = Rules(Limits(), claim_bucket_ms=1_000, send_timeout_ms=60_000)
AGENT = Caller("agent-a", HolderKind.AGENT)
OTHER = Caller("agent-b", HolderKind.AGENT)
HUMAN = Caller("ana", HolderKind.HUMAN)
NOW = 1_800_000_000_000
SUBJECT = Subject("mb", SubjectKind.MESSAGE, "m-1")


def _claimed(token: int = 10, caller: Caller = AGENT, now: int = NOW) -> Stored:
    record = domain.new_claim(RULES, caller, ClaimReply(request_id="r-1", subject=SUBJECT, ttl_seconds=30), now_ms=now)
    return Stored(record, token=token, revision=token)


def _renew(token: int, ttl_seconds: int = 30) -> RenewClaim:
    return RenewClaim(request_id="", subject=SUBJECT, token=token, ttl_seconds=ttl_seconds)


def _begin(token: int = 10) -> BeginSend:
    return BeginSend(request_id="", subject=SUBJECT, token=token)


def _confirm(sent_message_id: str) -> ConfirmSent:
    return ConfirmSent(request_id="", subject=SUBJECT, token=10, sent_message_id=sent_message_id)


def test_claim_expiry_rounds_up_to_the_bucket_never_down() -> None:
    assert RULES.claim_expiry(NOW, 30) == NOW + 30_000
    assert RULES.claim_expiry(NOW + 1, 30) == NOW + 31_000
    assert RULES.claim_expiry(NOW + 999, 30) == NOW + 31_000
    for offset in range(0, 2000, 7):
        expiry = RULES.claim_expiry(NOW + offset, 30)
        assert NOW + offset + 30_000 <= expiry < NOW + offset + 31_000


def test_renew_needs_the_current_token_and_the_holder() -> None:
    current = _claimed()
    assert domain.renew(RULES, current, AGENT, _renew(9), now_ms=NOW).result is FenceResult.STALE_TOKEN
    assert domain.renew(RULES, None, AGENT, _renew(10), now_ms=NOW).result is FenceResult.STALE_TOKEN
    with pytest.raises(PermissionDenied):
        domain.renew(RULES, current, OTHER, _renew(10), now_ms=NOW)
    renewed = domain.renew(RULES, current, AGENT, _renew(10, ttl_seconds=90), now_ms=NOW + 5_000)
    assert renewed.write is not None
    assert renewed.write.expires_ms == NOW + 95_000
    assert renewed.write.acquired_ms == NOW


def test_begin_send_is_the_fenced_commit_point() -> None:
    current = _claimed()
    begun = domain.begin_send(RULES, current, AGENT, _begin(), now_ms=NOW)
    assert begun.write is not None
    assert begun.write.state is State.SENDING
    assert begun.write.expires_ms is None, "a SENDING subject must never expire by itself"
    assert begun.write.send_deadline_ms == NOW + 60_000
    assert domain.begin_send(RULES, current, AGENT, _begin(9), now_ms=NOW).write is None
    sending = Stored(begun.write, token=10, revision=11)
    again = domain.begin_send(RULES, sending, AGENT, _begin(), now_ms=NOW)
    assert (again.result, again.write) == (FenceResult.OK, None)


def test_in_doubt_only_on_what_the_sweep_saw_and_never_from_a_clock() -> None:
    begun = domain.begin_send(RULES, _claimed(), AGENT, _begin(), now_ms=NOW).write
    assert begun is not None
    sending = Stored(begun, token=10, revision=11)
    # The sweep saw the send marker gone at revision 10: the subject was written after that, so not judged.
    assert domain.mark_in_doubt(sending, swept_revision=10).write is None
    doubt = domain.mark_in_doubt(sending, swept_revision=11).write
    assert doubt is not None
    assert doubt.state is State.IN_DOUBT
    assert doubt.expires_ms is None
    assert domain.mark_in_doubt(_claimed(), swept_revision=99).write is None


def test_release_after_begin_send_is_refused() -> None:
    begun = domain.begin_send(RULES, _claimed(), AGENT, _begin(), now_ms=NOW).write
    assert begun is not None
    release = ReleaseClaim(request_id="r", subject=SUBJECT, token=10)
    with pytest.raises(FailedPrecondition, match="AbortSend"):
        domain.release(Stored(begun, 10, 11), None, AGENT, release, now_ms=NOW)


def test_takeover_only_by_humans_from_agents_or_from_the_colleague_named() -> None:
    takeover = Takeover(request_id="r", subject=SUBJECT)
    with pytest.raises(PermissionDenied):
        domain.takeover_release(_claimed(), AGENT, takeover, now_ms=NOW)
    taken = domain.takeover_release(_claimed(), HUMAN, takeover, now_ms=NOW)
    assert taken.end is not None
    assert (taken.end.reason, taken.end.previous_holder, taken.end.token) == (EndReason.TAKEN_OVER, "agent-a", 10)
    bo = Caller("bo", HolderKind.HUMAN)
    # A colleague's claim: only when the caller names that very colleague (having confirmed it on screen).
    assert domain.takeover_release(_claimed(caller=bo), HUMAN, takeover, now_ms=NOW).end is None
    assert domain.takeover_refusal(_claimed(caller=bo), HUMAN) is domain.TakeoverResult.HELD
    assert domain.takeover_refusal(_claimed(caller=bo), HUMAN, "carla") is domain.TakeoverResult.HELD
    from_bo = domain.takeover_release(
        _claimed(caller=bo), HUMAN, Takeover(request_id="r", subject=SUBJECT, from_person="bo"), now_ms=NOW
    )
    assert from_bo.end is not None
    assert (from_bo.end.reason, from_bo.end.previous_holder, from_bo.end.by) == (EndReason.TAKEN_OVER, "bo", "ana")
    # Never from oneself, named or not; an agent's claim whatever person is named.
    assert domain.takeover_refusal(_claimed(caller=HUMAN), HUMAN, "ana") is domain.TakeoverResult.HELD
    assert domain.takeover_refusal(_claimed(), HUMAN, "bo") is None


def test_a_send_settled_as_sent_credits_the_person_who_settled_it() -> None:
    begun = domain.begin_send(RULES, _claimed(), AGENT, _begin(), now_ms=NOW).write
    assert begun is not None
    in_doubt = domain.mark_in_doubt(Stored(begun, 10, 11), swept_revision=11).write
    assert in_doubt is not None
    settled = domain.resolve_in_doubt(
        RULES,
        Stored(in_doubt, 10, 12),
        HUMAN,
        ResolveInDoubt(request_id="q", subject=SUBJECT, outcome=domain.ResolveOutcome.SENT, note="found it in Sent"),
        now_ms=NOW,
    ).write
    assert settled is not None
    assert (settled.state, settled.holder, settled.settled_by) == (domain.State.REPLIED, "agent-a", "ana")


def test_classify_change_names_every_transition() -> None:
    claimed = _claimed()
    begun = domain.begin_send(RULES, claimed, AGENT, _begin(), now_ms=NOW).write
    assert begun is not None
    sending = Stored(begun, 10, 11)
    replied_record = domain.confirm_sent(RULES, sending, AGENT, _confirm("s"), now_ms=NOW).write
    assert replied_record is not None
    replied = Stored(replied_record, 10, 12)
    renewed = Stored(claimed.record, 10, 13)

    def mark(reason: EndReason, token: int = 10) -> EndMark:
        return EndMark(reason, "x", token, "agent-a", "r", NOW)

    assert domain.classify_change(None, claimed, None) is EventType.CLAIMED
    assert domain.classify_change(claimed, renewed, None) is EventType.RENEWED
    assert domain.classify_change(claimed, sending, None) is EventType.SENDING
    assert domain.classify_change(sending, replied, None) is EventType.REPLIED
    assert domain.classify_change(claimed, None, None) is EventType.EXPIRED
    assert domain.classify_change(replied, None, None) is EventType.RETENTION_ENDED
    assert domain.classify_change(claimed, None, mark(EndReason.RELEASED)) is EventType.RELEASED
    assert domain.classify_change(sending, None, mark(EndReason.ABORTED)) is EventType.ABORTED
    assert domain.classify_change(claimed, None, mark(EndReason.TAKEN_OVER)) is EventType.TAKEN_OVER
    # A mark left from an earlier claim of the subject does not explain this deletion.
    assert domain.classify_change(claimed, None, mark(EndReason.RELEASED, token=3)) is EventType.EXPIRED
    assert domain.classify_change(None, None, None) is None


def test_mark_replied_is_fenced_and_a_retry_gets_the_first_answer() -> None:
    current = _claimed(caller=HUMAN)

    def mark(
        stored: Stored | None, caller: Caller = HUMAN, token: int = 10, request_id: str = "m-1"
    ) -> domain.Transition:
        return domain.mark_replied(
            RULES,
            stored,
            caller,
            MarkReplied(request_id=request_id, subject=SUBJECT, token=token, sent_message_id="g-1", note="by phone"),
            now_ms=NOW,
        )

    assert mark(current, token=9).result is FenceResult.STALE_TOKEN
    assert mark(None).result is FenceResult.STALE_TOKEN
    with pytest.raises(PermissionDenied):
        mark(current, caller=AGENT)
    marked = mark(current).write
    assert marked is not None
    assert (marked.state, marked.replied_by_hand, marked.sent_message_id, marked.note) == (
        State.REPLIED,
        True,
        "g-1",
        "by phone",
    )
    assert marked.expires_ms == RULES.reply_expiry(NOW)
    replied = Stored(marked, 10, 11)
    retry = mark(replied)
    assert (retry.result, retry.write, retry.end) == (FenceResult.OK, None, None)
    with pytest.raises(FailedPrecondition):
        mark(replied, request_id="m-2")  # another request on an answered subject
    begun = domain.begin_send(RULES, current, HUMAN, _begin(), now_ms=NOW).write
    assert begun is not None
    with pytest.raises(FailedPrecondition, match="ConfirmSent"):
        mark(Stored(begun, 10, 11))
    assert domain.classify_change(current, replied, None) is EventType.MARKED_REPLIED


def test_a_delivery_is_settled_by_an_end_mark_of_a_later_claim_whatever_the_clocks_said() -> None:
    subject = SUBJECT
    other = Caller("agent-b", HolderKind.AGENT)
    # Recorded at revision 50 by a replica whose clock ran 5 minutes fast.
    delivery = domain.new_delivery(
        RULES, AGENT, mailbox="mb", notification_id="n-1", request_id="r-1", now_ms=NOW + 300_000, subject=subject
    )
    released = EndMark(EndReason.RELEASED, "agent-a", 50, "agent-a", "r-2", NOW)  # the claim of revision 50
    older = EndMark(EndReason.RELEASED, "agent-a", 40, "agent-a", "r-0", NOW + 600_000)  # a claim before it
    redelivered = ClaimReply(request_id="r-3", subject=subject, notification_id="n-1")
    assert domain.is_duplicate_delivery(delivery, redelivered, None, released, other, delivery_revision=50)
    assert not domain.is_duplicate_delivery(delivery, redelivered, None, older, other, delivery_revision=50)


def test_a_send_that_did_not_go_out_leaves_its_copy_as_someone_elses_answer() -> None:
    """A message of the thread taken for a send's copy (its echo): when the send is aborted or resolved as not
    sent, that message was a person's answer, so the subject is REPLIED from the mailbox, not free again; and
    when the send is confirmed with another message id, both went out."""
    copy = domain.OutsideReply("ana@shop.example", NOW + 5_000, "gmail-1", "agent-c")
    claimed = _claimed()
    sending = domain.begin_send(RULES, claimed, AGENT, _begin(), now_ms=NOW).write
    assert sending is not None
    with_copy = Stored(replace(sending, echo=copy, received_ms=NOW), token=10, revision=11)
    in_doubt = Stored(replace(with_copy.record, state=State.IN_DOUBT), token=10, revision=12)

    abort = AbortSend(request_id="r-2", subject=SUBJECT, token=10, reason="bounced")
    aborted = domain.abort_send(RULES, with_copy, None, AGENT, abort, now_ms=NOW)
    not_sent = ResolveInDoubt(
        request_id="r-3", subject=SUBJECT, outcome=domain.ResolveOutcome.NOT_SENT, note="not in Sent"
    )
    resolved = domain.resolve_in_doubt(RULES, in_doubt, HUMAN, not_sent, now_ms=NOW)
    for transition in (aborted, resolved):
        assert transition.end is None
        assert transition.write is not None
        assert (transition.write.state, transition.write.replied_outside) == (State.REPLIED, True)
        assert transition.write.outside_reply == replace(copy, stopped_holder="agent-a")
    confirmed = domain.confirm_sent(RULES, with_copy, AGENT, _confirm("sent-1"), now_ms=NOW).write
    assert confirmed is not None
    assert (confirmed.state, confirmed.replied_outside, confirmed.outside_reply) == (State.REPLIED, False, copy)
    itself = domain.confirm_sent(RULES, with_copy, AGENT, _confirm("gmail-1"), now_ms=NOW).write
    assert itself is not None
    assert itself.outside_reply is None  # it was its own copy
    # A copy dated before the message arrived cannot have answered it: the abort frees the subject as before.
    early = Stored(replace(with_copy.record, received_ms=NOW + 10_000), token=10, revision=11)
    freed = domain.abort_send(RULES, early, None, AGENT, replace(abort, request_id="r-4"), now_ms=NOW)
    assert freed.end is not None


# --- Fingerprints recorded by a release before version 1 (coordinator/core/commands.py) --------------------
# Each case writes what an older release wrote for a call (its record, stamp or end mark, with the legacy
# fingerprint), then asks the rule about that very call (a retry crossing the upgrade) and about the same
# request id with another argument (REQUEST_ID_REUSED).

OLD_REQUEST = "r-before-the-upgrade"
Recognises = Callable[[Command], bool]


def _legacy(command: Command) -> str:
    fingerprint = command.legacy_fingerprint()
    assert fingerprint is not None
    assert not fingerprint.startswith("v1:")
    return fingerprint


def _with_legacy_stamp(record: domain.SubjectRecord, command: Command) -> Stored:
    return Stored(replace(record, last_request_id=command.request_id, last_fingerprint=_legacy(command)), 10, 11)


def _legacy_end(reason: EndReason, command: Command, by: Caller = AGENT) -> EndMark:
    return EndMark(reason, by.principal, 10, "agent-a", command.request_id, NOW, fingerprint=_legacy(command))


def _unchanged(transition: domain.Transition) -> bool:
    return transition == domain.Transition(FenceResult.OK)


def _claim_reply_record() -> tuple[Command, Command, Recognises]:
    first = ClaimReply(request_id=OLD_REQUEST, subject=SUBJECT, notification_id="n-1", ttl_seconds=30, note="a")
    record = domain.new_claim(RULES, AGENT, first, now_ms=NOW)
    stored = Stored(replace(record, fingerprint=_legacy(first)), 10, 10)

    def recognises(command: Command) -> bool:
        assert isinstance(command, ClaimReply)
        return domain.claim_conflict(stored, AGENT, command) is domain.ClaimResult.GRANTED

    return first, replace(first, ttl_seconds=60), recognises


def _renew_stamp() -> tuple[Command, Command, Recognises]:
    first = RenewClaim(request_id=OLD_REQUEST, subject=SUBJECT, token=10, ttl_seconds=30)
    stored = _with_legacy_stamp(_claimed().record, first)

    def recognises(command: Command) -> bool:
        assert isinstance(command, RenewClaim)
        return _unchanged(domain.renew(RULES, stored, AGENT, command, now_ms=NOW))

    return first, replace(first, ttl_seconds=60), recognises


def _begin_send_stamp() -> tuple[Command, Command, Recognises]:
    first = BeginSend(request_id=OLD_REQUEST, subject=SUBJECT, token=10)
    sending = domain.begin_send(RULES, _claimed(), AGENT, first, now_ms=NOW).write
    assert sending is not None
    stored = _with_legacy_stamp(sending, first)

    def recognises(command: Command) -> bool:
        assert isinstance(command, BeginSend)
        return _unchanged(domain.begin_send(RULES, stored, AGENT, command, now_ms=NOW))

    return first, replace(first, token=11), recognises


def _mark_replied_stamp() -> tuple[Command, Command, Recognises]:
    first = MarkReplied(request_id=OLD_REQUEST, subject=SUBJECT, token=10, sent_message_id="g-1", note="by phone")
    marked = domain.mark_replied(RULES, _claimed(), AGENT, first, now_ms=NOW).write
    assert marked is not None
    stored = _with_legacy_stamp(marked, first)

    def recognises(command: Command) -> bool:
        assert isinstance(command, MarkReplied)
        return _unchanged(domain.mark_replied(RULES, stored, AGENT, command, now_ms=NOW))

    return first, replace(first, note="by mail"), recognises


def _release_end() -> tuple[Command, Command, Recognises]:
    first = ReleaseClaim(request_id=OLD_REQUEST, subject=SUBJECT, token=10)
    end = _legacy_end(EndReason.RELEASED, first)

    def recognises(command: Command) -> bool:
        assert isinstance(command, ReleaseClaim)
        return _unchanged(domain.release(None, end, AGENT, command, now_ms=NOW))

    return first, replace(first, redeliverable=True), recognises


def _abort_end() -> tuple[Command, Command, Recognises]:
    first = AbortSend(request_id=OLD_REQUEST, subject=SUBJECT, token=10, reason="bounced")
    end = _legacy_end(EndReason.ABORTED, first)

    def recognises(command: Command) -> bool:
        assert isinstance(command, AbortSend)
        return _unchanged(domain.abort_send(RULES, None, end, AGENT, command, now_ms=NOW))

    return first, replace(first, reason="refused"), recognises


def _takeover_record() -> tuple[Command, Command, Recognises]:
    first = Takeover(request_id=OLD_REQUEST, subject=SUBJECT, ttl_seconds=30, note="mine", from_person="bo")
    record = domain.new_claim(RULES, HUMAN, first, now_ms=NOW)
    stored = Stored(replace(record, fingerprint=_legacy(first)), 12, 12)

    def recognises(command: Command) -> bool:
        assert isinstance(command, Takeover)
        return domain.own_takeover(stored, None, HUMAN, command)[0]

    # The old tuple left from_person out when empty: a Takeover without it is still another call.
    return first, replace(first, from_person=""), recognises


def _takeover_end() -> tuple[Command, Command, Recognises]:
    first = Takeover(request_id=OLD_REQUEST, subject=SUBJECT, ttl_seconds=30)
    end = _legacy_end(EndReason.TAKEN_OVER, first, by=HUMAN)

    def recognises(command: Command) -> bool:
        assert isinstance(command, Takeover)
        return domain.own_takeover(None, end, HUMAN, command)[1] is end

    return first, replace(first, note="mine"), recognises


def _resolve_sent_stamp() -> tuple[Command, Command, Recognises]:
    first = ResolveInDoubt(
        request_id=OLD_REQUEST, subject=SUBJECT, outcome=domain.ResolveOutcome.SENT, sent_message_id="s-1"
    )
    sending = domain.begin_send(RULES, _claimed(), AGENT, _begin(), now_ms=NOW).write
    assert sending is not None
    in_doubt = Stored(replace(sending, state=State.IN_DOUBT), 10, 12)
    resolved = domain.resolve_in_doubt(RULES, in_doubt, HUMAN, first, now_ms=NOW).write
    assert resolved is not None
    stored = _with_legacy_stamp(resolved, first)

    def recognises(command: Command) -> bool:
        assert isinstance(command, ResolveInDoubt)
        return _unchanged(domain.resolve_in_doubt(RULES, stored, HUMAN, command, now_ms=NOW))

    return first, replace(first, sent_message_id="s-2"), recognises


def _resolve_not_sent_end() -> tuple[Command, Command, Recognises]:
    first = ResolveInDoubt(request_id=OLD_REQUEST, subject=SUBJECT, outcome=domain.ResolveOutcome.NOT_SENT)
    end = _legacy_end(EndReason.RESOLVED_NOT_SENT, first, by=HUMAN)

    def recognises(command: Command) -> bool:
        assert isinstance(command, ResolveInDoubt)
        return _unchanged(domain.resolve_in_doubt(RULES, None, HUMAN, command, now_ms=NOW, last_end=end))

    return first, replace(first, note="not in Sent"), recognises


def _record_outgoing_delivery() -> tuple[Command, Command, Recognises]:
    first = RecordOutgoing(
        request_id=OLD_REQUEST, mailbox="mb", notification_id="n-9", message_id="gmail-1", thread_id="t-1", sent_ms=NOW
    )
    delivery = domain.new_delivery(
        RULES,
        AGENT,
        mailbox="mb",
        notification_id="n-9",
        request_id=OLD_REQUEST,
        now_ms=NOW,
        subject=None,
        outgoing=domain.OutgoingResult.ANSWERED_OUTSIDE,
        fingerprint=_legacy(first),
    )

    def recognises(command: Command) -> bool:
        return domain.is_retry(delivery.request_id, delivery.fingerprint, command)

    return first, replace(first, sender="ana@shop.example"), recognises


LEGACY_RECORDS: dict[str, Callable[[], tuple[Command, Command, Recognises]]] = {
    "ClaimReply's claim record": _claim_reply_record,
    "RenewClaim's stamp": _renew_stamp,
    "BeginSend's stamp": _begin_send_stamp,
    "MarkReplied's stamp": _mark_replied_stamp,
    "ReleaseClaim's end mark": _release_end,
    "AbortSend's end mark": _abort_end,
    "Takeover's claim record": _takeover_record,
    "Takeover's end mark": _takeover_end,
    "ResolveInDoubt(SENT)'s stamp": _resolve_sent_stamp,
    "ResolveInDoubt(NOT_SENT)'s end mark": _resolve_not_sent_end,
    "RecordOutgoing's delivery record": _record_outgoing_delivery,
}


@pytest.mark.parametrize("case", LEGACY_RECORDS)
def test_a_fingerprint_recorded_before_version_1_still_tells_a_retry_from_a_reuse(case: str) -> None:
    first, other, recognises = LEGACY_RECORDS[case]()
    assert recognises(first), "the same call, retried across the upgrade, is a retry"
    with pytest.raises(InvalidArgument) as refused:
        recognises(other)
    assert refused.value.reason == "REQUEST_ID_REUSED"
