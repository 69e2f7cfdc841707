"""The checker: what really went out (the sink's log) against what the coordinator recorded and acknowledged.

Pure: it reads a :class:`RunRecord` (made by the harness from the logs and the final reads) and returns a
:class:`Report`. The invariants, after docs/design.md#invariants:

* ``double_send``: at most one send went out per subject (a message; for thread-scoped claims, the thread).
* ``lost_ack``: every send whose ConfirmSent answered OK has a REPLIED record at the end, with its token.
* ``notification_multi_effect``: at most one send is attributable to each notification id.
* ``stale_commit``: every send that went out carries the token of the subject's final REPLIED (or IN_DOUBT)
  record; ``unrecorded_send``: a send went out and the coordinator ended up knowing of no reply at all.
* ``slow_free`` / ``early_free``: a killed holder's claim freed no later than its expiry (last renewal + TTL)
  plus the stated bound (1 s lease bucket + 1 s etcd expiry check), and never before its expiry; a later free
  is excused only when an etcd leader change restarted the claim's own lease (chaos/leases.py).
* ``dropped``: every message ends REPLIED or IN_DOUBT.
* ``wrong_idempotency_key``: every send carried the subject's deterministic idempotency key.
* ``commit_after_outside_reply``: a person answered a subject from Gmail (straight to the sink) and an agent's
  send on it went out too, though the coordinator had recorded the person's reply first (the final record is
  REPLIED ``replied_outside``: the claim had ended), or without the coordinator ever learning that both went out
  (an agent's REPLIED record that names no outside reply). Both replies going out is allowed only in the window
  docs/design.md#replies-written-outside states: the agent passed its commit point before the person's reply was
  recorded, and the record says so.
* ``reply_to_outgoing``: a send answered a message the mailbox sent (a person's reply).
* The reply-storm invariants (``over_budget``, ``reply_to_automated``, ``reply_after_moved_on``,
  ``unmarked_reply``): :mod:`chaos.storms`. Agents leave some messages unanswered on purpose, so ``dropped``
  excuses a message recorded as automated mail (in its final record, or the RecordIncoming an agent logged),
  one whose conversation agents were stopped on (the final record's ``agents_stopped``, or a BeginSend an agent
  saw refused on it: the refusal is the decision, the claim is released), and one with a newer inbound message
  in its thread (one reply answers the burst; the newest message is judged itself).

Every reply to a customer message counts, the people's too: the stats say how many replies each answered subject
got, and measure the window (how late the people's notifications were recorded, and how many agent commits fell
inside it).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from inbox_claims.types import SubjectKind, idempotency_key

from .config import ALL_KINDS, ETCD_EXPIRY_CHECK_S, LEASE_BUCKET_S
from .leases import LateFree, LeaderChange, LeaseGrant, TermSeen, judge_late_free
from .storms import judge as judge_storms
from .workload import SubjectKey, Workload

FREE_BOUND_S = LEASE_BUCKET_S + ETCD_EXPIRY_CHECK_S
EARLY_SLACK_S = 0.1
ENDED_STATES = ("replied", "in_doubt")


@dataclass(frozen=True)
class FinalState:
    state: str
    """A ``inbox_claims.SubjectState`` value: free, claimed, sending, replied, in_doubt; ``unknown`` if unread."""
    token: int
    holder: str
    replied_outside: bool = False
    """REPLIED because a person answered outside the coordinator (the claim it ended keeps its token)."""
    knows_outside: bool = False
    """The record names a reply written outside (``outside_reply``): on an agent's reply, both went out."""
    automated: str = ""
    """Why agents leave the message (automated mail), as recorded."""
    agents_stopped: str = ""
    """The refusal's reason while agents are stopped on the subject's conversation."""


@dataclass
class RunRecord:
    config: dict[str, Any]
    workload: Workload
    sends: list[dict[str, Any]]
    """The sink's log records."""
    events: list[dict[str, Any]]
    """Every agent's and the human's log records."""
    final: dict[SubjectKey, FinalState]
    faults: list[dict[str, Any]]
    deliveries: list[dict[str, Any]]
    watch_events: dict[str, int] = field(default_factory=dict)
    early_expiries: list[dict[str, Any]] = field(default_factory=list)
    """Claims whose EXPIRED event the harness's watch saw before the expiry their last grant or renewal stated."""
    leader_changes: list[LeaderChange] = field(default_factory=list)
    """When an etcd member became leader, of which term (from the members' logs)."""
    lease_grants: list[LeaseGrant] = field(default_factory=list)
    terms_seen: list[TermSeen] = field(default_factory=list)
    """From the coordinators' logs: each lease they were granted, and when each first saw each raft term."""
    errors: list[str] = field(default_factory=list)


@dataclass
class Violation:
    kind: str
    detail: str


@dataclass
class Report:
    violations: list[Violation]
    errors: list[str]
    stats: dict[str, Any]
    table: str

    @property
    def ok(self) -> bool:
        return not self.violations and not self.errors

    def counts(self) -> dict[str, int]:
        return dict(Counter(v.kind for v in self.violations))

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "violations": self.counts(),
            "violation_details": [{"kind": v.kind, "detail": v.detail} for v in self.violations[:200]],
            "errors": self.errors,
            "stats": self.stats,
        }


def _send_key(send: dict[str, Any]) -> SubjectKey:
    return SubjectKey(str(send["grant"]), str(send["subject_kind"]), str(send["subject_id"]))


def check(record: RunRecord) -> Report:
    violations: list[Violation] = []
    went_out = [s for s in record.sends if s.get("ev") == "send" and s.get("sent")]
    outside = [s for s in went_out if s.get("mode") == "outside"]
    out = [s for s in went_out if s.get("mode") != "outside"]  # through the coordinator: agents and the human

    # -- at most one send per subject; at most one per notification --------------------------------------------
    by_subject: dict[SubjectKey, list[dict[str, Any]]] = defaultdict(list)
    by_notification: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for send in out:
        by_subject[_send_key(send)].append(send)
        if send.get("notification_id"):
            by_notification[str(send["notification_id"])].append(send)
    for key, sends in sorted(by_subject.items()):
        if len(sends) > 1:
            who = ", ".join(f"{s['sender']}(token {s['token']}, {s.get('mode', '')})" for s in sends)
            violations.append(Violation("double_send", f"{key}: {len(sends)} sends went out: {who}"))
    for nid, sends in sorted(by_notification.items()):
        if len(sends) > 1:
            violations.append(Violation("notification_multi_effect", f"{nid}: {len(sends)} sends"))

    # -- every send carries the final record's token -----------------------------------------------------------
    for send in out:
        key = _send_key(send)
        final = record.final.get(key)
        expected_key = idempotency_key(key.mailbox, SubjectKind(key.kind), key.id)
        if send.get("idempotency_key") != expected_key:
            violations.append(Violation("wrong_idempotency_key", f"{key}: {send.get('idempotency_key')!r}"))
        if final is None or final.state not in ENDED_STATES:
            state = final.state if final else "not a workload subject"
            violations.append(
                Violation("unrecorded_send", f"{key}: {send['sender']} sent (token {send['token']}), final {state}")
            )
        elif final.token != send["token"]:
            violations.append(
                Violation(
                    "stale_commit",
                    f"{key}: {send['sender']} sent with token {send['token']}, the {final.state} record has "
                    f"token {final.token} ({final.holder})",
                )
            )

    # -- a person's reply from Gmail ends what it answered --------------------------------------------------------
    outside_ids = {str(s.get("sent_id")) for s in outside}
    for send in out:
        if str(send.get("reply_to")) in outside_ids:
            violations.append(
                Violation("reply_to_outgoing", f"{send['sender']} answered {send['reply_to']}, a person's reply")
            )
    for key in sorted({_send_key(s) for s in outside}):
        final = record.final.get(key)
        for send in by_subject.get(key, []):
            why = _outside_violation(final, int(send["token"]))
            if why:
                violations.append(
                    Violation(
                        "commit_after_outside_reply",
                        f"{key}: {send['sender']} sent (token {send['token']}) and a person answered from Gmail; {why}",
                    )
                )

    # -- acknowledged replies are never lost ---------------------------------------------------------------------
    # (Tokens are unique per subject, not across subjects: claims committed together share one revision.)
    acknowledged = [e for e in record.events if e.get("ev") == "confirmed"]
    for event in acknowledged:
        token = int(event["token"])
        claimed = SubjectKey(event["mailbox"], event["kind"], event["id"])
        final = record.final.get(claimed)
        if final is None or final.state != "replied" or final.token != token:
            state = f"{final.state} token {final.token}" if final else "unknown"
            violations.append(Violation("lost_ack", f"{claimed}: ConfirmSent OK for token {token}; final {state}"))

    # -- every message ends REPLIED or IN_DOUBT, or is left to people on purpose -----------------------------------
    left = _left_on_purpose(record)
    for key in record.workload.subjects():
        final = record.final.get(key)
        if final is None or final.state not in ENDED_STATES:
            if final is not None and (final.automated or final.agents_stopped or key in left):
                continue
            state = f"{final.state} ({final.holder})" if final else "never read"
            violations.append(Violation("dropped", f"{key}: ends {state}"))
    storm_violations, storm_stats = judge_storms(record, out, Violation)
    violations += storm_violations

    # -- a killed holder's claim frees within TTL + bound, never before its TTL ----------------------------------
    measures = [m for f in record.faults if f["kind"] == "agent_kill" for m in f["details"].get("measures", [])]
    ttl = float(record.config.get("ttl", 5))
    # A coordinator with a skewed clock states expires_at off by its skew (the lease, not that stamp, decides:
    # tests/server/test_clock_skew.py checks expiry under skew). Stamps from inside a clock_skew fault are not
    # judged: a claim's latest stamp was written inside one when its holder was killed, or its EXPIRED seen, no
    # later than a TTL and a lease bucket after the fault (the EXPIRED up to the free bound after that).
    skewed = [
        (float(f["started"]), float(f["ended"] or f["started"]) + ttl + LEASE_BUCKET_S)
        for f in record.faults
        if f["kind"] == "clock_skew"
    ]
    free_stats = _free_stats(record, measures, violations, skewed, ttl)
    for early in record.early_expiries:
        if any(start <= float(early["seen_at"]) <= end + FREE_BOUND_S for start, end in skewed):
            continue
        violations.append(
            Violation(
                "early_free",
                f"{early['subject']} token {early['token']}: EXPIRED seen {early['expires'] - early['seen_at']:.2f} s "
                "before the expiry its last renewal stated",
            )
        )

    stats = _stats(record, out, acknowledged, free_stats)
    stats["outside"] = _outside_stats(record, outside, by_subject)
    stats["storms"] = storm_stats
    errors = list(record.errors)
    crashes = [e for e in record.events if e.get("ev") == "crash"]
    errors += [f"{e.get('agent')}: {e.get('error')}" for e in crashes[:20]]
    report = Report(violations, errors, stats, "")
    report.table = render(record, report)
    return report


def _left_on_purpose(record: RunRecord) -> set[SubjectKey]:
    """Subjects agents leave unanswered on purpose: message subjects with a newer inbound message in their thread
    (arrived a second or more later, so that its date, in whole seconds, is later too), messages an agent recorded
    as automated mail, and subjects whose BeginSend was refused."""
    workload = record.workload
    latest: dict[tuple[str, str], float] = {}
    for message in workload.messages:
        thread = (message.mailbox, message.thread_id)
        latest[thread] = max(latest.get(thread, 0.0), message.arrives_at)
    left = {
        m.subject_key
        for m in workload.messages
        if m.scope == "message" and latest[(m.mailbox, m.thread_id)] >= m.arrives_at + 1.0
    }
    automated = {str(e.get("msg")) for e in record.events if e.get("ev") == "automated" and e.get("recorded")}
    left |= {m.subject_key for m in workload.messages if m.message_id in automated}
    left |= {
        SubjectKey(str(e["mailbox"]), str(e["kind"]), str(e["id"]))
        for e in record.events
        if e.get("ev") == "send_refused" and "mailbox" in e
    }
    return left


def _outside_violation(final: FinalState | None, token: int) -> str:
    """Why a send that went out beside a person's reply on its subject breaks the rule; empty when it does not."""
    if final is None:
        return ""  # judged as unrecorded_send
    if final.replied_outside:
        return "the person's reply had ended the claim (the final record is REPLIED from the mailbox)"
    if final.token != token:
        return ""  # judged as stale_commit
    if final.knows_outside or final.state == "in_doubt":
        return ""  # committed before the person's reply was recorded: the window, and the record says so
    return "the coordinator never learned that a person answered too"


def _outside_stats(
    record: RunRecord, outside: list[dict[str, Any]], by_subject: dict[SubjectKey, list[dict[str, Any]]]
) -> dict[str, Any]:
    """The people's replies from Gmail: how late their notifications were recorded (the window), and what the
    agents did meanwhile."""
    recorded: dict[str, float] = {}
    for event in record.events:
        if event.get("ev") == "outgoing" and event.get("outcome") in ("answered_outside", "own_reply"):
            message_id = str(event.get("id"))
            recorded[message_id] = min(recorded.get(message_id, float("inf")), float(event["t"]))
    # A token alone names no subject (claims committed together share one revision): with who and for what.
    granted: dict[tuple[str, str, int], SubjectKey] = {}
    for event in record.events:
        if event.get("ev") == "granted":
            key = SubjectKey(str(event["mailbox"]), str(event["kind"]), str(event["id"]))
            granted[(str(event.get("agent")), str(event.get("nid")), int(event["token"]))] = key
    commits: dict[SubjectKey, list[float]] = defaultdict(list)
    for event in record.events:
        if event.get("ev") == "sending" and event.get("token"):
            committed = granted.get((str(event.get("agent")), str(event.get("nid")), int(event["token"])))
            if committed is not None:
                commits[committed].append(float(event["t"]))
    delays: list[float] = []
    # By the agents' own log times, which are when a BeginSend's answer was logged, not when etcd committed it: an
    # agent paused (or slow) between its BeginSend and its log line logs a commit of the window after the record.
    # Whether a commit really came after the record is judged from the final records (commit_after_outside_reply).
    in_window = logged_after = 0
    for send in outside:
        key, sent_at = _send_key(send), float(send["t"])
        seen = recorded.get(str(send.get("sent_id")))
        if seen is None:
            continue
        delays.append(seen - sent_at)
        in_window += sum(1 for t in commits.get(key, []) if sent_at <= t <= seen)
        logged_after += sum(1 for t in commits.get(key, []) if t > seen)
    delays.sort()
    stopped = Counter(
        str(e.get("where")) for e in record.events if e.get("ev") == "lost" and e.get("reason") == "answered_outside"
    )
    answered = {_send_key(s) for s in outside}
    replies = Counter(
        len(by_subject.get(key, [])) + sum(1 for s in outside if _send_key(s) == key)
        for key in set(by_subject) | answered
    )
    return {
        "replies": len(outside),
        "recorded": len(delays),
        "delay_median_s": round(delays[len(delays) // 2], 3) if delays else None,
        "delay_p95_s": round(delays[int(len(delays) * 0.95)], 3) if delays else None,
        "delay_max_s": round(delays[-1], 3) if delays else None,
        "agent_commits_in_window": in_window,
        "agent_commits_logged_after_record": logged_after,
        "agents_stopped": dict(stopped),
        "replies_per_answered_subject": dict(sorted(replies.items())),
    }


def _free_stats(
    record: RunRecord,
    measures: list[dict[str, Any]],
    violations: list[Violation],
    skewed: list[tuple[float, float]],
    ttl: float,
) -> dict[str, Any]:
    latencies: list[float] = []
    late_frees: list[LateFree] = []
    excused_skew = 0
    skipped: Counter[str] = Counter()
    grants = {grant.lease: grant for grant in record.lease_grants}
    election_timeout_s = float(record.config.get("etcd_election_timeout_ms", 1000)) / 1000
    for m in measures:
        if m.get("result") != "measured":
            skipped[str(m.get("result"))] += 1
            continue
        expires = float(m["expires"])
        last_held = m.get("last_held")
        end_type = m.get("end_type") or ""
        if end_type and end_type != "expired":
            skipped[f"ended by {end_type}"] += 1
            continue
        freed_at = m.get("freed_at")
        if any(start <= float(m["killed_at"]) <= end for start, end in skewed):
            excused_skew += 1
            continue
        if freed_at is None or (last_held is not None and float(last_held) > expires + FREE_BOUND_S):
            late = judge_late_free(m, ttl, grants, record.terms_seen, record.leader_changes, election_timeout_s)
            late_frees.append(late)
            if late.excused_by_term is not None:
                continue
            held = (
                "never freed"
                if freed_at is None or last_held is None
                else f"still held {float(last_held) - expires:.2f} s after its expiry (bound {FREE_BOUND_S:.1f} s)"
            )
            violations.append(Violation("slow_free", f"{m['subject']} token {m['token']}: {held}; {late.detail}"))
        if freed_at is not None:
            latencies.append(float(freed_at) - expires)
        end_seen = m.get("end_seen_at")
        if end_type == "expired" and end_seen is not None and float(end_seen) < expires - EARLY_SLACK_S:
            violations.append(
                Violation(
                    "early_free",
                    f"{m['subject']} token {m['token']}: expired {expires - float(end_seen):.2f} s before its TTL",
                )
            )
    excused = [late for late in late_frees if late.excused_by_term is not None]
    excused_late = [late.late_s for late in excused if late.late_s is not None]
    return {
        "measured": len(latencies),
        "max_latency_s": round(max(latencies), 3) if latencies else None,
        "mean_latency_s": round(sum(latencies) / len(latencies), 3) if latencies else None,
        "excused_leader_change": len(excused),
        "excused_max_latency_s": round(max(excused_late), 3) if excused_late else None,
        "excused_clock_skew": excused_skew,
        "late_frees": [late.as_dict() for late in late_frees],
        "not_measured": dict(skipped),
        "bound_s": FREE_BOUND_S,
    }


def _stats(
    record: RunRecord, out: list[dict[str, Any]], acknowledged: list[dict[str, Any]], free: dict[str, Any]
) -> dict[str, Any]:
    workload = record.workload
    agent_events = Counter(str(e.get("ev")) for e in record.events if str(e.get("agent", "")).startswith("agent"))
    refusals = Counter(str(e.get("why")) for e in record.events if e.get("ev") == "refused")
    losses = Counter(f"{e.get('where')}:{e.get('reason')}" for e in record.events if e.get("ev") == "lost")
    human = Counter(str(e.get("ev")) for e in record.events if not str(e.get("agent", "")).startswith("agent"))
    takeovers = Counter(str(e.get("outcome")) for e in record.events if e.get("ev") == "takeover")
    faults: dict[str, int] = {kind: 0 for kind in ALL_KINDS}
    skipped: dict[str, str] = {}
    fault_errors = 0
    for fault in record.faults:
        if fault["details"].get("skipped"):
            skipped[fault["kind"]] = str(fault["details"]["skipped"])
            continue
        if fault.get("error"):
            fault_errors += 1
            continue
        faults[fault["kind"]] = faults.get(fault["kind"], 0) + 1
    return {
        "messages": len(workload.messages),
        "thread_scoped_messages": sum(1 for m in workload.messages if m.scope == "thread"),
        "subjects": len(workload.subjects()),
        "mailboxes": len({m.mailbox for m in workload.messages}),
        "notifications": len(workload.notifications),
        "deliveries": len(record.deliveries),
        "deliveries_failed": sum(1 for d in record.deliveries if not d["ok"]),
        "deliveries_by_phase": dict(Counter(str(d["phase"]) for d in record.deliveries)),
        "agent_events": dict(agent_events),
        "refusals": dict(refusals),
        "losses": dict(losses),
        "human_events": dict(human),
        "takeovers": dict(takeovers),
        "faults": faults,
        "faults_skipped": skipped,
        "fault_errors": fault_errors,
        "sends_out": len(out),
        "sends_by_agents": sum(1 for s in out if s.get("sender_kind") == "agent"),
        "sends_by_humans": sum(1 for s in out if s.get("sender_kind") == "human"),
        "send_requests": sum(1 for s in record.sends if s.get("ev") == "send"),
        "send_unknown_outcomes": sum(1 for s in record.sends if s.get("outcome") not in (None, "sent")),
        "acknowledged_replies": len(acknowledged),
        "final_states": dict(Counter(f.state for f in record.final.values())),
        "claim_free_after_kill": free,
        "watch_events": record.watch_events,
    }


def _row(name: str, value: object) -> str:
    return f"  {name:<40} {value}"


def _late_free_line(late: dict[str, Any]) -> str:
    when = "never freed" if late["late_s"] is None else f"held {late['late_s']:.2f} s after its expiry"
    verdict = "excused" if late["excused_by_term"] is not None else "NOT excused"
    return f"    - late free: {late['subject']} token {late['token']}: {when}; {verdict}: {late['detail']}"


def render(record: RunRecord, report: Report) -> str:
    s = report.stats
    c = record.config
    lines = [
        f"chaos run: seed {c['seed']}, {c['duration']:g} s, {c['mode']} agents, etcd {c['etcd_version']} "
        f"({c['etcd_binary']}), network: {c['network']}",
        "",
        "workload",
        _row("messages", f"{s['messages']} ({s['thread_scoped_messages']} in thread-scoped conversations)"),
        _row("subjects (messages + threads)", s["subjects"]),
        _row("mailboxes", s["mailboxes"]),
        _row("notifications", s["notifications"]),
        _row("deliveries", f"{s['deliveries']} ({s['deliveries_failed']} failed) {s['deliveries_by_phase']}"),
        _row("claims refused", s["refusals"]),
        _row("claims lost / fenced", s["losses"]),
        _row("human takeovers", s["takeovers"]),
        "",
        "faults injected",
    ]
    for kind in ALL_KINDS:
        note = f"  (skipped: {s['faults_skipped'][kind]})" if kind in s["faults_skipped"] else ""
        lines.append(_row(kind, f"{s['faults'].get(kind, 0)}{note}"))
    if s["fault_errors"]:
        lines.append(_row("faults that failed", s["fault_errors"]))
    free = s["claim_free_after_kill"]
    o = s["outside"]
    st = s["storms"]
    lines += [
        "",
        "outcomes",
        _row("sends that went out", f"{s['sends_out']} (agents {s['sends_by_agents']}, humans {s['sends_by_humans']})"),
        _row("send requests (incl. unknown outcome)", f"{s['send_requests']} ({s['send_unknown_outcomes']} unknown)"),
        _row("acknowledged replies (ConfirmSent OK)", s["acknowledged_replies"]),
        _row("final states", s["final_states"]),
        _row(
            "replies from Gmail (outside the coordinator)",
            f"{o['replies']}, recorded {o['recorded']}: notification to record median {o['delay_median_s']} s, "
            f"p95 {o['delay_p95_s']} s, max {o['delay_max_s']} s; agent commits in that window "
            f"{o['agent_commits_in_window']} (both went out), logged after it "
            f"{o['agent_commits_logged_after_record']}; "
            f"agents stopped {o['agents_stopped']}",
        ),
        _row("replies per answered subject", o["replies_per_answered_subject"]),
        _row(
            "claim freed after holder SIGKILL",
            f"{free['measured']} measured, max {free['max_latency_s']} s after expiry (bound {free['bound_s']} s), "
            f"{free['excused_leader_change']} late ones excused by an etcd leader change that restarted their lease "
            f"(max {free['excused_max_latency_s']} s), {free['excused_clock_skew']} not timed (clock_skew fault), "
            f"not measured {free['not_measured']}",
        ),
        *(_late_free_line(late) for late in free["late_frees"]),
        "",
        "reply storms",
        _row("agent replies per thread (by writer)", st["agent_replies_per_thread"]),
        _row("most agent replies to a correspondent", st["max_agent_replies_per_correspondent"]),
        _row("BeginSend refusals by reason", st["send_refusals"]),
        _row("answers by the correspondents", st["answers_by_correspondents"]),
        _row("automated messages / left to people", f"{st['automated_messages']} / {st['automated_left_to_people']}"),
        _row(
            "commits begun before a newer message's record",
            f"{st['commits_after_a_newer_message_logged_before_its_record']} (in the notification delay's window)",
        ),
        _row("headers read before a claim", st["header_reads"]),
        _row("looks before a send (found: messages)", st["looks_before_send"]),
        "",
        "violations",
    ]
    counts = report.counts()
    for kind in (
        "double_send",
        "notification_multi_effect",
        "stale_commit",
        "unrecorded_send",
        "lost_ack",
        "slow_free",
        "early_free",
        "dropped",
        "wrong_idempotency_key",
        "commit_after_outside_reply",
        "reply_to_outgoing",
        "over_budget",
        "reply_to_automated",
        "reply_after_moved_on",
        "unmarked_reply",
    ):
        lines.append(_row(kind, counts.get(kind, 0)))
    for violation in report.violations[:15]:
        lines.append(f"    - {violation.kind}: {violation.detail}")
    if len(report.violations) > 15:
        lines.append(f"    ... and {len(report.violations) - 15} more (summary.json)")
    for error in report.errors[:10]:
        lines.append(f"  HARNESS ERROR: {error}")
    lines.append("")
    verdict = "PASS" if report.ok else "FAIL"
    lines.append(f"{verdict}: seed {c['seed']}; replay with: {c['replay']}")
    return "\n".join(lines)
