"""The checker's reply-storm invariants (chaos/storms.py) on made-up records: each can fail, and a storm the
coordinator stopped passes. The whole harness with the storm actors runs in tests/chaos/test_storms.py."""

from __future__ import annotations

from typing import Any

from chaos import checker
from chaos.storms import Budget, over_budget
from chaos.workload import Message, Notification, Workload
from inbox_claims.types import SubjectKind, idempotency_key

MAILBOX = "grant-1-0"
T0 = 1_000_000.0


def _message(number: int, thread: str, at: float, sender: str = "", actor: Any = "", **headers: str) -> Message:
    return Message(MAILBOX, f"msg-{number:05d}", thread, "message", at, sender, actor, tuple(headers.items()))


def _record(messages: list[Message], sends: list[dict[str, Any]], events: list[dict[str, Any]]) -> checker.RunRecord:
    notifications = tuple(Notification(f"ntf-{m.message_id}", "message.created", m, m.arrives_at) for m in messages)
    workload = Workload(tuple(messages), notifications, ())
    config = {"seed": 1, "duration": 10, "mode": "fenced", "etcd_version": "3.4.23", "etcd_binary": "etcd"}
    config |= {"network": "loopback", "replay": "python -m chaos run --seed 1", "t0": T0}
    # What the coordinator ends with: each answered message REPLIED with its send's token, the others free.
    final = {m.subject_key: checker.FinalState("free", 0, "") for m in messages}
    for send in sends:
        answered = next(m for m in messages if m.message_id == send["subject_id"])
        final[answered.subject_key] = checker.FinalState("replied", send["token"], send["sender"])
    return checker.RunRecord(config, workload, sends, events, final, [], [])


def _send(
    message: Message, t: float, *, token: int = 10, agent: str = "agent-1", marked: bool = True
) -> dict[str, Any]:
    return {
        "ev": "send", "t": T0 + t, "sent": True, "outcome": "sent", "grant": MAILBOX, "subject_kind": "message",
        "subject_id": message.message_id, "token": token, "sender": agent, "sender_kind": "agent",
        "notification_id": f"ntf-{message.message_id}", "reply_to": message.message_id, "mode": "fenced",
        "idempotency_key": idempotency_key(MAILBOX, SubjectKind.MESSAGE, message.message_id),
        "auto_submitted": "auto-replied" if marked else "",
    }  # fmt: skip


def _event(ev: str, t: float, message: Message, token: int = 10, agent: str = "agent-1") -> dict[str, Any]:
    return {"ev": ev, "t": T0 + t, "agent": agent, "nid": f"ntf-{message.message_id}", "msg": message.message_id,
            "token": token, "mailbox": MAILBOX, "kind": "message", "id": message.message_id}  # fmt: skip


def test_rolling_window() -> None:
    hour = Budget(3, 3600.0)
    assert over_budget([0.0, 10.0, 20.0], hour) is None
    assert over_budget([0.0, 10.0, 20.0, 30.0], hour) == (4, 30.0)
    assert over_budget([0.0, 10.0, 20.0, 3600.0], hour) is None  # the first left the window as the fourth came


def test_a_storm_the_budget_stopped_passes() -> None:
    """An unmarked auto-responder answered three times (the thread's budget), its fourth answer refused and left
    unanswered (agents stopped): no violation."""
    thread = [_message(n, "thr-1", 10.0 * n, "helpdesk@vendor.example") for n in range(1, 5)]
    sends = [_send(m, 10.0 * n + 2, token=n) for n, m in enumerate(thread[:3], start=1)]
    events = [_event("begin", 10.0 * n + 1.5, m, token=n) for n, m in enumerate(thread[:3], start=1)]
    events += [_event("granted", 10.0 * n + 0.5, m, token=n) for n, m in enumerate(thread, start=1)]
    record = _record(thread, sends, events)
    key = thread[3].subject_key
    record.final[key] = checker.FinalState("free", 0, "", agents_stopped="agents stopped: 3 agent replies …")
    report = checker.check(record)
    assert report.ok, report.table
    assert report.stats["storms"]["agent_replies_per_thread"] == {"customer": {3: 1}}


def test_over_budget_per_thread_and_per_correspondent() -> None:
    thread = [_message(n, "thr-1", 10.0 * n) for n in range(1, 5)]
    other = "agent@othercorp.example"
    spread = [_message(10 + n, f"thr-{10 + n}", 5.0 * n, other) for n in range(11)]
    sends = [_send(m, 10.0 * n + 2, token=n) for n, m in enumerate(thread, start=1)]
    sends += [_send(m, 5.0 * n + 1, token=n) for n, m in enumerate(spread, start=1)]
    report = checker.check(_record(thread + spread, sends, []))
    assert report.counts() == {"over_budget": 2}, report.table
    details = " ".join(v.detail for v in report.violations)
    assert "thread thr-1: 4 agent replies in 3600 s (budget 3)" in details
    assert f"correspondent {other}: 11 agent replies in 86400 s (budget 10)" in details


def test_a_reply_to_automated_mail_and_unmarked_replies() -> None:
    ooo = _message(1, "thr-1", 1.0, "ooo@corp.example", "ooo", **{"Auto-Submitted": "auto-replied"})
    listed = _message(2, "thr-2", 1.0, "news@lists.example", "list", **{"List-Id": "<news.lists.example>"})
    person = _message(3, "thr-3", 1.0)
    unmarked = _send(person, 3.0, marked=False)
    report = checker.check(_record([ooo, listed, person], [_send(ooo, 3.0), _send(listed, 3.0), unmarked], []))
    assert report.counts() == {"reply_to_automated": 2, "unmarked_reply": 1}, report.table
    assert "Auto-Submitted: auto-replied" in report.table


def test_a_reply_after_the_conversation_moved_on() -> None:
    """The customer wrote again (two seconds later); its message was recorded at t=4. A BeginSend begun after
    that is a violation; one begun before it is the window, counted."""
    first, second = _message(1, "thr-1", 1.0), _message(2, "thr-1", 3.0, actor="twice")
    granted = [_event("granted", 1.5, first), _event("granted", 4.0, second, token=11)]
    late = _record([first, second], [_send(first, 6.0), _send(second, 7.0, token=11)],
                   [*granted, _event("begin", 5.0, first), _event("begin", 6.5, second, token=11)])  # fmt: skip
    report = checker.check(late)
    assert report.counts() == {"reply_after_moved_on": 1}, report.table
    assert "after msg-00002, newer in thr-1, was recorded" in report.table

    early = _record([first, second], [_send(first, 6.0), _send(second, 7.0, token=11)],
                    [*granted, _event("begin", 3.9, first), _event("begin", 6.5, second, token=11)])  # fmt: skip
    report = checker.check(early)
    assert report.ok, report.table
    assert report.stats["storms"]["commits_after_a_newer_message_logged_before_its_record"] == 1


def test_messages_left_to_people_on_purpose_are_not_dropped() -> None:
    """Automated mail (recorded as such), a message whose conversation moved on, a conversation agents were
    stopped on: none is dropped. The same unanswered message without those reasons is."""
    ooo = _message(1, "thr-1", 1.0, "ooo@corp.example", "ooo", **{"Auto-Submitted": "auto-replied"})
    first, second = _message(2, "thr-2", 1.0), _message(3, "thr-2", 3.0, actor="twice")
    stopped = _message(4, "thr-3", 1.0)
    record = _record([ooo, first, second, stopped], [_send(second, 5.0)], [])
    record.final[ooo.subject_key] = checker.FinalState("free", 0, "", automated="Auto-Submitted: auto-replied")
    record.final[first.subject_key] = checker.FinalState("free", 0, "")
    record.final[stopped.subject_key] = checker.FinalState("free", 0, "", agents_stopped="agents stopped")
    report = checker.check(record)
    assert report.ok, report.table
    record.final[ooo.subject_key] = checker.FinalState("free", 0, "")
    record.final[stopped.subject_key] = checker.FinalState("free", 0, "")
    assert checker.check(record).counts() == {"dropped": 2}
