"""The state machine's rules alone: pure functions, clock passed in, no etcd."""

from __future__ import annotations

from dataclasses import replace

import pytest

from coordinator.core import domain
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
from coordinator.core.errors import FailedPrecondition, PermissionDenied
from coordinator.core.limits import Limits

RULES = Rules(Limits(), claim_bucket_ms=1_000, send_timeout_ms=60_000)
AGENT = Caller("agent-a", HolderKind.AGENT)
OTHER = Caller("agent-b", HolderKind.AGENT)
HUMAN = Caller("ana", HolderKind.HUMAN)
NOW = 1_800_000_000_000


def _claimed(token: int = 10, caller: Caller = AGENT, now: int = NOW) -> Stored:
    record = domain.new_claim(RULES, caller, ttl_seconds=30, note="", request_id="r-1", now_ms=now)
    return Stored(record, token=token, revision=token)


def test_claim_expiry_rounds_up_to_the_bucket_never_down() -> None:
    assert RULES.claim_expiry(NOW, 30) == NOW + 30_000
    assert RULES.claim_expiry(NOW + 1, 30) == NOW + 31_000
    assert RULES.claim_expiry(NOW + 999, 30) == NOW + 31_000
    for offset in range(0, 2000, 7):
        expiry = RULES.claim_expiry(NOW + offset, 30)
        assert NOW + offset + 30_000 <= expiry < NOW + offset + 31_000


def test_renew_needs_the_current_token_and_the_holder() -> None:
    current = _claimed()
    assert domain.renew(RULES, current, AGENT, token=9, ttl_seconds=30, now_ms=NOW).result is FenceResult.STALE_TOKEN
    assert domain.renew(RULES, None, AGENT, token=10, ttl_seconds=30, now_ms=NOW).result is FenceResult.STALE_TOKEN
    with pytest.raises(PermissionDenied):
        domain.renew(RULES, current, OTHER, token=10, ttl_seconds=30, now_ms=NOW)
    renewed = domain.renew(RULES, current, AGENT, token=10, ttl_seconds=90, now_ms=NOW + 5_000)
    assert renewed.write is not None
    assert renewed.write.expires_ms == NOW + 95_000
    assert renewed.write.acquired_ms == NOW


def test_begin_send_is_the_fenced_commit_point() -> None:
    current = _claimed()
    begun = domain.begin_send(RULES, current, AGENT, token=10, now_ms=NOW)
    assert begun.write is not None
    assert begun.write.state is State.SENDING
    assert begun.write.expires_ms is None, "a SENDING subject must never expire by itself"
    assert begun.write.send_deadline_ms == NOW + 60_000
    assert domain.begin_send(RULES, current, AGENT, token=9, now_ms=NOW).write is None
    sending = Stored(begun.write, token=10, revision=11)
    again = domain.begin_send(RULES, sending, AGENT, token=10, now_ms=NOW)
    assert (again.result, again.write) == (FenceResult.OK, None)


def test_in_doubt_only_on_what_the_sweep_saw_and_never_from_a_clock() -> None:
    begun = domain.begin_send(RULES, _claimed(), AGENT, token=10, now_ms=NOW).write
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
    begun = domain.begin_send(RULES, _claimed(), AGENT, token=10, now_ms=NOW).write
    assert begun is not None
    with pytest.raises(FailedPrecondition, match="AbortSend"):
        domain.release(Stored(begun, 10, 11), None, AGENT, token=10, request_id="r", now_ms=NOW)


def test_takeover_only_by_humans_from_agents_or_from_the_colleague_named() -> None:
    with pytest.raises(PermissionDenied):
        domain.takeover_release(_claimed(), AGENT, request_id="r", now_ms=NOW)
    taken = domain.takeover_release(_claimed(), HUMAN, request_id="r", now_ms=NOW)
    assert taken.end is not None
    assert (taken.end.reason, taken.end.previous_holder, taken.end.token) == (EndReason.TAKEN_OVER, "agent-a", 10)
    bo = Caller("bo", HolderKind.HUMAN)
    # A colleague's claim: only when the caller names that very colleague (having confirmed it on screen).
    assert domain.takeover_release(_claimed(caller=bo), HUMAN, request_id="r", now_ms=NOW).end is None
    assert domain.takeover_refusal(_claimed(caller=bo), HUMAN) is domain.TakeoverResult.HELD
    assert domain.takeover_refusal(_claimed(caller=bo), HUMAN, "carla") is domain.TakeoverResult.HELD
    from_bo = domain.takeover_release(_claimed(caller=bo), HUMAN, request_id="r", now_ms=NOW, from_person="bo")
    assert from_bo.end is not None
    assert (from_bo.end.reason, from_bo.end.previous_holder, from_bo.end.by) == (EndReason.TAKEN_OVER, "bo", "ana")
    # Never from oneself, named or not; an agent's claim whatever person is named.
    assert domain.takeover_refusal(_claimed(caller=HUMAN), HUMAN, "ana") is domain.TakeoverResult.HELD
    assert domain.takeover_refusal(_claimed(), HUMAN, "bo") is None


def test_a_send_settled_as_sent_credits_the_person_who_settled_it() -> None:
    begun = domain.begin_send(RULES, _claimed(), AGENT, token=10, now_ms=NOW).write
    assert begun is not None
    in_doubt = domain.mark_in_doubt(Stored(begun, 10, 11), swept_revision=11).write
    assert in_doubt is not None
    settled = domain.resolve_in_doubt(
        RULES,
        Stored(in_doubt, 10, 12),
        HUMAN,
        outcome=domain.ResolveOutcome.SENT,
        sent_message_id="",
        note="found it in Sent",
        request_id="q",
        now_ms=NOW,
    ).write
    assert settled is not None
    assert (settled.state, settled.holder, settled.settled_by) == (domain.State.REPLIED, "agent-a", "ana")


def test_classify_change_names_every_transition() -> None:
    claimed = _claimed()
    begun = domain.begin_send(RULES, claimed, AGENT, token=10, now_ms=NOW).write
    assert begun is not None
    sending = Stored(begun, 10, 11)
    replied_record = domain.confirm_sent(RULES, sending, AGENT, token=10, sent_message_id="s", now_ms=NOW).write
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
            token=token,
            sent_message_id="g-1",
            note="by phone",
            request_id=request_id,
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
    begun = domain.begin_send(RULES, current, HUMAN, token=10, now_ms=NOW).write
    assert begun is not None
    with pytest.raises(FailedPrecondition, match="ConfirmSent"):
        mark(Stored(begun, 10, 11))
    assert domain.classify_change(current, replied, None) is EventType.MARKED_REPLIED


def test_a_delivery_is_settled_by_an_end_mark_of_a_later_claim_whatever_the_clocks_said() -> None:
    subject = Subject("mb", SubjectKind.MESSAGE, "m-1")
    other = Caller("agent-b", HolderKind.AGENT)
    # Recorded at revision 50 by a replica whose clock ran 5 minutes fast.
    delivery = domain.new_delivery(
        RULES, AGENT, mailbox="mb", notification_id="n-1", request_id="r-1", now_ms=NOW + 300_000, subject=subject
    )
    released = EndMark(EndReason.RELEASED, "agent-a", 50, "agent-a", "r-2", NOW)  # the claim of revision 50
    older = EndMark(EndReason.RELEASED, "agent-a", 40, "agent-a", "r-0", NOW + 600_000)  # a claim before it
    assert domain.is_duplicate_delivery(delivery, subject, None, released, other, "r-3", delivery_revision=50)
    assert not domain.is_duplicate_delivery(delivery, subject, None, older, other, "r-3", delivery_revision=50)


def test_a_send_that_did_not_go_out_leaves_its_copy_as_someone_elses_answer() -> None:
    """A message of the thread taken for a send's copy (its echo): when the send is aborted or resolved as not
    sent, that message was a person's answer, so the subject is REPLIED from the mailbox, not free again; and
    when the send is confirmed with another message id, both went out."""
    copy = domain.OutsideReply("ana@shop.example", NOW + 5_000, "gmail-1", "agent-c")
    claimed = _claimed()
    sending = domain.begin_send(RULES, claimed, AGENT, token=10, now_ms=NOW).write
    assert sending is not None
    with_copy = Stored(replace(sending, echo=copy, received_ms=NOW), token=10, revision=11)
    in_doubt = Stored(replace(with_copy.record, state=State.IN_DOUBT), token=10, revision=12)

    aborted = domain.abort_send(RULES, with_copy, None, AGENT, token=10, reason="bounced", request_id="r-2", now_ms=NOW)
    resolved = domain.resolve_in_doubt(
        RULES, in_doubt, HUMAN, outcome=domain.ResolveOutcome.NOT_SENT, sent_message_id="", note="not in Sent",
        request_id="r-3", now_ms=NOW,
    )  # fmt: skip
    for transition in (aborted, resolved):
        assert transition.end is None
        assert transition.write is not None
        assert (transition.write.state, transition.write.replied_outside) == (State.REPLIED, True)
        assert transition.write.outside_reply == replace(copy, stopped_holder="agent-a")
    confirmed = domain.confirm_sent(RULES, with_copy, AGENT, token=10, sent_message_id="sent-1", now_ms=NOW).write
    assert confirmed is not None
    assert (confirmed.state, confirmed.replied_outside, confirmed.outside_reply) == (State.REPLIED, False, copy)
    itself = domain.confirm_sent(RULES, with_copy, AGENT, token=10, sent_message_id="gmail-1", now_ms=NOW).write
    assert itself is not None
    assert itself.outside_reply is None  # it was its own copy
    # A copy dated before the message arrived cannot have answered it: the abort frees the subject as before.
    early = Stored(replace(with_copy.record, received_ms=NOW + 10_000), token=10, revision=11)
    freed = domain.abort_send(RULES, early, None, AGENT, token=10, reason="bounced", request_id="r-4", now_ms=NOW)
    assert freed.end is not None
