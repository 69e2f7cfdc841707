"""The checker's reply-storm invariants (issue 33, docs/design.md#reply-storms), over what really went out:

* ``over_budget``: in no rolling window did the agents send more replies in one thread than the thread budget
  (3 an hour by default), or to one correspondent than the correspondent budget (10 a day). Only agents' replies
  count (a person's, through the coordinator or from Gmail, never does).
* ``reply_to_automated``: no agent reply answered automated mail (a message whose headers mark it: an
  out-of-office's ``Auto-Submitted: auto-replied``, a list's ``List-Id`` / ``Precedence: bulk`` /
  ``List-Unsubscribe``).
* ``reply_after_moved_on``: no agent reply was committed after a newer inbound message of its thread (received
  after the message the claim was made for, by the dates Nylas gives, in whole seconds) had been recorded. By the
  logs: the agent wrote ``begin`` right before calling BeginSend, and the record of the newer message was logged
  after the coordinator answered it (a ClaimReply granted or refused, or the automated mail recorded), so a
  ``begin`` logged after that record is a BeginSend that reached etcd after it. A commit whose BeginSend started
  before the record is in the window the notification's delay leaves: counted in the stats, not a violation.
* ``unmarked_reply``: every agent reply carried ``Auto-Submitted: auto-replied`` (RFC 3834); a person's never.

The stats: agent replies per thread (by who wrote the thread), the refusals by reason, the automated messages
left to people, and the commits in the moved-on window.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .workload import Message

if TYPE_CHECKING:
    from .checker import RunRecord, Violation

AUTO_SUBMITTED = "auto-replied"


@dataclass(frozen=True)
class Budget:
    """One reply budget: at most ``limit`` agent replies per ``window_s`` seconds (rolling)."""

    limit: int
    window_s: float


THREAD_BUDGET = Budget(3, 3600.0)
CORRESPONDENT_BUDGET = Budget(10, 86400.0)
"""The coordinator's defaults (docs/design.md#reply-storms); a run's config may name others (``budgets``)."""


def budgets(config: dict[str, Any]) -> tuple[Budget, Budget]:
    """The thread's and the correspondent's budget the run's coordinators were given."""
    given = config.get("budgets") or {}
    thread = given.get("thread") or [THREAD_BUDGET.limit, THREAD_BUDGET.window_s]
    correspondent = given.get("correspondent") or [CORRESPONDENT_BUDGET.limit, CORRESPONDENT_BUDGET.window_s]
    return Budget(int(thread[0]), float(thread[1])), Budget(int(correspondent[0]), float(correspondent[1]))


def over_budget(times: list[float], budget: Budget) -> tuple[int, float] | None:
    """The most replies in one rolling window and when that window ended, if over the budget."""
    times = sorted(times)
    worst: tuple[int, float] | None = None
    start = 0
    for end, at in enumerate(times):
        while times[start] <= at - budget.window_s:
            start += 1
        inside = end - start + 1
        if inside > budget.limit and (worst is None or inside > worst[0]):
            worst = (inside, at)
    return worst


def judge(
    record: RunRecord, out: list[dict[str, Any]], violation: type[Violation]
) -> tuple[list[Violation], dict[str, Any]]:
    messages = {m.message_id: m for m in record.workload.messages}
    by_notification = {n.notification_id: n.message for n in record.workload.notifications}
    t0 = float(record.config.get("t0") or 0.0)
    agents = [s for s in out if s.get("sender_kind") == "agent"]
    found: list[Violation] = []

    def answered(send: dict[str, Any]) -> Message | None:
        """The message a send answers: its notification's (the claim's message), else the one it replied to."""
        return by_notification.get(str(send.get("notification_id"))) or messages.get(str(send.get("reply_to")))

    # -- the budgets ------------------------------------------------------------------------------------------
    thread_budget, correspondent_budget = budgets(record.config)
    per_thread: dict[tuple[str, str], list[float]] = defaultdict(list)
    per_correspondent: dict[tuple[str, str], list[float]] = defaultdict(list)
    for send in agents:
        message = answered(send)
        if message is None:
            continue
        per_thread[(message.mailbox, message.thread_id)].append(float(send["t"]))
        per_correspondent[(message.mailbox, message.correspondent.lower())].append(float(send["t"]))
    for scope, budget, counted in (
        ("thread", thread_budget, per_thread),
        ("correspondent", correspondent_budget, per_correspondent),
    ):
        for (mailbox, name), times in sorted(counted.items()):
            worst = over_budget(times, budget)
            if worst is not None:
                found.append(
                    violation(
                        "over_budget",
                        f"{mailbox} {scope} {name}: {worst[0]} agent replies in {budget.window_s:g} s "
                        f"(budget {budget.limit})",
                    )
                )

    # -- never to automated mail; every agent reply marked, a person's never -----------------------------------
    for send in agents:
        message = answered(send)
        if message is not None and message.automated:
            marks = ", ".join(f"{k}: {v}" for k, v in message.headers)
            found.append(violation("reply_to_automated", f"{send['sender']} answered {message.message_id} ({marks})"))
    for send in out:
        marked = str(send.get("auto_submitted", "")) == AUTO_SUBMITTED
        if (send.get("sender_kind") == "agent") != marked:
            who = "an agent's reply without" if not marked else "a person's reply with"
            found.append(
                violation(
                    "unmarked_reply", f"{send['sender']} on {send['subject_id']}: {who} Auto-Submitted: auto-replied"
                )
            )

    # -- never to a conversation that moved on ---------------------------------------------------------------
    recorded = _recorded_at(record.events)
    # The date a claim was made with: its message's, or the newest one's when the agent drafted again.
    dates = {
        (str(e.get("agent")), str(e.get("nid")), int(e["token"])): int(e["date"])
        for e in record.events
        if e.get("ev") == "granted" and e.get("date")
    }
    begins = {
        (str(e.get("agent")), str(e.get("nid")), int(e["token"])): float(e["t"])
        for e in record.events
        if e.get("ev") == "begin" and e.get("token")
    }
    threads: dict[tuple[str, str], list[Message]] = defaultdict(list)
    for message in record.workload.messages:
        threads[(message.mailbox, message.thread_id)].append(message)
    in_window = 0
    for send in agents:
        message = answered(send)
        claim = (str(send["sender"]), str(send.get("notification_id")), int(send["token"]))
        begin = begins.get(claim)
        if message is None or begin is None:
            continue
        date = dates.get(claim, _date(message, t0))
        newer = [
            (recorded[m.message_id], m)
            for m in threads[(message.mailbox, message.thread_id)]
            if _date(m, t0) > date and m.message_id in recorded
        ]
        if not newer:
            continue
        seen, first = min(newer, key=lambda pair: pair[0])
        if begin > seen:  # (the record came after the newer message arrived: no need to compare with that)
            found.append(
                violation(
                    "reply_after_moved_on",
                    f"{send['sender']} answered {message.message_id} (BeginSend at {begin:.3f}) after "
                    f"{first.message_id}, newer in {message.thread_id}, was recorded at {seen:.3f}",
                )
            )
        elif t0 + first.arrives_at <= begin:  # it had arrived, its notification not yet recorded: the window
            in_window += 1

    # -- stats -------------------------------------------------------------------------------------------------
    kinds: dict[str, str] = {}
    for message in record.workload.messages:
        kinds.setdefault(message.thread_id, "customer")
        if message.actor in ("twice", "list"):
            kinds[message.thread_id] = "customer writing twice" if message.actor == "twice" else "mailing list"
    kinds.update(record.workload.responders)
    replies: dict[str, Counter[int]] = defaultdict(Counter)
    answered_threads = {thread: len(times) for (_, thread), times in per_thread.items()}
    for thread, kind in kinds.items():
        replies[kind][answered_threads.get(thread, 0)] += 1
    refusals = Counter(
        f"{e.get('refusal')}:{e.get('scope')}" if e.get("scope") else str(e.get("refusal"))
        for e in record.events
        if e.get("ev") == "send_refused"
    )
    automated = [m for m in record.workload.messages if m.automated]
    reads = sorted(float(e["ms"]) for e in record.events if e.get("ev") == "headers_read" and "ms" in e)
    looks = [e for e in record.events if e.get("ev") == "looked"]
    look_ms = sorted(float(e["ms"]) for e in looks)
    stats = {
        "agent_replies_per_thread": {kind: dict(sorted(c.items())) for kind, c in sorted(replies.items())},
        "max_agent_replies_per_correspondent": max((len(t) for t in per_correspondent.values()), default=0),
        "send_refusals": dict(sorted(refusals.items())),
        "automated_messages": len(automated),
        "automated_left_to_people": sum(1 for e in record.events if e.get("ev") == "automated"),
        "automated_shown_in_final_state": sum(
            1 for m in automated if (final := record.final.get(m.subject_key)) is not None and final.automated
        ),
        "commits_after_a_newer_message_logged_before_its_record": in_window,
        "header_reads": {
            "count": len(reads),
            "median_ms": reads[len(reads) // 2] if reads else None,
            "p99_ms": reads[min(int(len(reads) * 0.99), len(reads) - 1)] if reads else None,
        },
        "looks_before_send": {
            "count": len(looks),
            "found": sum(len(e.get("found") or ()) for e in looks),
            "median_ms": look_ms[len(look_ms) // 2] if look_ms else None,
            "p99_ms": look_ms[min(int(len(look_ms) * 0.99), len(look_ms) - 1)] if look_ms else None,
        },
        "answers_by_correspondents": dict(
            Counter(m.actor for m in record.workload.messages if m.message_id.startswith("auto-"))
        ),
    }
    return found, stats


def _date(message: Message, t0: float) -> int:
    """The message's date as its notification gave it: whole seconds."""
    return int(t0 + message.arrives_at)


def _recorded_at(events: list[dict[str, Any]]) -> dict[str, float]:
    """When the coordinator had certainly recorded each inbound message: the earliest log line written after a
    call that records it answered (ClaimReply granted or refused, the automated mail recorded)."""
    recorded: dict[str, float] = {}
    for event in events:
        if event.get("ev") in ("granted", "refused", "automated", "send_refused") and event.get("msg"):
            message_id = str(event["msg"])
            recorded[message_id] = min(recorded.get(message_id, float("inf")), float(event["t"]))
    return recorded
