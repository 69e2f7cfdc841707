"""The seeded workload: messages in mailboxes, their notifications, and when each is delivered to which agent.

Pure (no I/O, no clock): the same seed and sizes give the same plan. A message belongs to a thread; in a
fraction of the threads (conversations of 2-3 messages) the agents claim the whole thread (``scope="thread"``:
one reply per conversation), elsewhere each message on its own. Every message has a ``message.created``
notification and often a ``message.updated`` one, each with its own notification id (the envelope's top-level
``id``). During the main phase each notification is delivered once or twice, at jittered times, so updates can
arrive before creations and redeliveries land on other agents; the final round (planned by the harness once the
faults have stopped) delivers every notification once more, as Nylas's last attempt 10-20 minutes after the
first would.

People answer too, without our tools: in a fraction of the threads (``outside_fraction``) a person replies
"from Gmail" straight to the mail API (the sink) a few seconds after the thread's last message, often while an
agent drafts; its ``message.created`` notification (in SENT, from the person) comes late, is often redelivered,
and so arrives out of order with the others. In half of the message-scoped ones the customer then writes again
(a new question, in the same thread, for an agent to answer).

Reply storms (docs/design.md#reply-storms, issue 33), planned from their own seeded stream so that the rest of the
plan stays as it was: correspondents whose mail answers every reply (an out-of-office auto-responder that marks its
answers ``Auto-Submitted: auto-replied``, one that marks nothing, and another company's agent that writes in
several threads and marks nothing), a mailing list's posts (``List-Id``, ``Precedence: bulk``,
``List-Unsubscribe``), and customers who write twice quickly in one thread. The answers to replies cannot be
planned (they depend on what the agents send): :mod:`chaos.correspondents` makes them during the run.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Literal

Scope = Literal["message", "thread"]

SCOPE_FIELD = "x_chaos_scope"
"""Where the envelope tells the agent how to claim (a harness convention, standing in for an agent's policy)."""
OUTSIDE_SENDER = "ana@shop.example"
"""The person who answers from Gmail (never through the coordinator)."""
OTHER_COMPANY_AGENT = "agent@othercorp.example"
"""Another company's agent: writes in several threads, answers every reply, marks nothing."""
LIST_SENDER = "news@lists.example"

Actor = Literal["", "twice", "ooo", "responder", "other_agent", "list"]
"""Who wrote a message. ``""``: a customer. ``twice``: a customer's second message of a quick burst. ``ooo``:
an auto-responder's answer marked ``Auto-Submitted: auto-replied``; ``responder``: one that marks nothing;
``other_agent``: another company's agent (marks nothing); ``list``: a mailing list's post."""
LIST_HEADERS = (
    {"List-Id": "<news.lists.example>"},
    {"Precedence": "bulk"},
    {"List-Unsubscribe": "<mailto:leave@lists.example>"},
)


@dataclass(frozen=True)
class Message:
    mailbox: str
    message_id: str
    thread_id: str
    scope: Scope
    arrives_at: float
    """Seconds after the start of the run."""
    sender: str = ""
    """The correspondent's address; empty: the thread's customer, ``customer-<thread>@example.com``."""
    actor: Actor = ""
    headers: tuple[tuple[str, str], ...] = ()
    """The message's own headers that say it is automated (none for a person's, or for an unmarked robot's)."""

    @property
    def correspondent(self) -> str:
        return self.sender or f"customer-{self.thread_id}@example.com"

    @property
    def automated(self) -> bool:
        """Marked as automated mail (the client's rules must leave it to people)."""
        return bool(self.headers)

    @property
    def subject_key(self) -> SubjectKey:
        """What is claimed for this message: the message, or its thread."""
        if self.scope == "thread":
            return SubjectKey(self.mailbox, "thread", self.thread_id)
        return SubjectKey(self.mailbox, "message", self.message_id)


@dataclass(frozen=True, order=True)
class SubjectKey:
    mailbox: str
    kind: str
    """``message`` or ``thread`` (the values of ``inbox_claims.SubjectKind``)."""
    id: str

    def __str__(self) -> str:
        return f"{self.mailbox}/{self.kind}/{self.id}"


@dataclass(frozen=True)
class OutsideReply:
    """A person's reply "from Gmail": sent straight to the sink at ``at``, answering ``answers``."""

    message_id: str
    mailbox: str
    thread_id: str
    scope: Scope
    at: float
    answers: SubjectKey

    @property
    def message(self) -> Message:
        """The reply as a message of its thread (what its notification is about)."""
        return Message(self.mailbox, self.message_id, self.thread_id, self.scope, self.at)


@dataclass(frozen=True)
class Notification:
    notification_id: str
    type: str
    message: Message
    created_at: float
    outgoing: bool = False
    """A notification of a message the mailbox sent (a person's reply from Gmail): in SENT, from the person."""


@dataclass(frozen=True)
class Delivery:
    at: float
    notification_id: str
    attempt: int
    agent: int


@dataclass(frozen=True)
class Workload:
    messages: tuple[Message, ...]
    notifications: tuple[Notification, ...]
    deliveries: tuple[Delivery, ...]
    """The main phase, sorted by time."""
    outside: tuple[OutsideReply, ...] = ()
    responders: tuple[tuple[str, Actor], ...] = ()
    """Threads whose correspondent answers every reply: (thread id, kind: ``ooo``, ``responder`` or ``other_agent``)."""

    def subjects(self) -> list[SubjectKey]:
        return sorted({m.subject_key for m in self.messages})


def plan(
    seed: int,
    *,
    duration: float,
    messages: int,
    mailboxes: int,
    agents: int,
    thread_fraction: float = 0.2,
    update_fraction: float = 0.5,
    outside_fraction: float = 0.0,
    storms: int = 0,
) -> Workload:
    """Messages arrive over the first 70 % of ``duration``; deliveries end before ``duration``."""
    rng = random.Random(f"workload/{seed}")
    outside_rng = random.Random(f"workload/{seed}/outside")  # its own stream: the rest of the plan stays as it was
    boxes = [f"grant-{seed}-{n}" for n in range(mailboxes)]
    arrival_end = max(duration * 0.7, 1.0)
    result: list[Message] = []
    count = 0
    thread_number = 0
    while count < messages:
        mailbox = rng.choice(boxes)
        thread_number += 1
        thread_id = f"thr-{thread_number:05d}"
        in_conversation = rng.random() < thread_fraction
        size = min(rng.choice((2, 3)), messages - count) if in_conversation else 1
        start = rng.uniform(0.5, arrival_end)
        for position in range(size):
            count += 1
            result.append(
                Message(
                    mailbox=mailbox,
                    message_id=f"msg-{count:05d}",
                    thread_id=thread_id,
                    scope="thread" if in_conversation else "message",
                    arrives_at=min(start + position * rng.uniform(0.0, 3.0), arrival_end),
                )
            )
    responders, count, thread_number = _storm_actors(seed, storms, boxes, arrival_end, result, count, thread_number)
    outside: list[OutsideReply] = []
    threads: dict[str, list[Message]] = {}
    for message in result:
        threads.setdefault(message.thread_id, []).append(message)
    for thread_id, members in sorted(threads.items()):
        if outside_rng.random() >= outside_fraction or members[0].sender:
            continue  # (a storm actor's thread is left to its actor)
        latest = max(members, key=lambda m: m.arrives_at)
        # Seconds after the thread's last message, so that its date (whole seconds, as Nylas gives them) is
        # never that of a message it did not see; an agent is often drafting then.
        at = latest.arrives_at + outside_rng.uniform(1.1, 4.0)
        if at > duration * 0.85:
            continue  # too late to be delivered, redelivered and answered before the main phase ends
        outside.append(
            OutsideReply(
                f"gmail-{len(outside) + 1:05d}", latest.mailbox, thread_id, latest.scope, at, latest.subject_key
            )
        )
        if latest.scope == "message" and outside_rng.random() < 0.5:  # the customer writes again: a new question
            count += 1
            follow_up = Message(
                latest.mailbox, f"msg-{count:05d}", thread_id, "message", at + outside_rng.uniform(2.1, 6.0)
            )
            result.append(follow_up)
    notifications: list[Notification] = []
    for message in result:
        notifications.append(
            Notification(f"ntf-{len(notifications) + 1:06d}", "message.created", message, message.arrives_at)
        )
        if rng.random() < update_fraction:
            created = min(message.arrives_at + rng.uniform(0.0, 4.0), arrival_end)
            notifications.append(Notification(f"ntf-{len(notifications) + 1:06d}", "message.updated", message, created))
    deliveries: list[Delivery] = []
    last = max(duration - 1.0, 1.0)
    for notification in notifications:
        times = [notification.created_at + rng.expovariate(2.0)]
        if rng.random() < 0.45:  # a redelivery: Nylas did not see the 200 in time, or the first attempt failed
            times.append(notification.created_at + rng.uniform(0.2, 15.0))
        for attempt, at in enumerate(sorted(times), start=1):
            deliveries.append(Delivery(min(at, last), notification.notification_id, attempt, rng.randrange(agents)))
    for reply in outside:
        notification = Notification(
            f"ntf-{len(notifications) + 1:06d}", "message.created", reply.message, reply.at, True
        )
        notifications.append(notification)
        times = [reply.at + outside_rng.uniform(0.5, 8.0)]  # late
        if outside_rng.random() < 0.5:
            times.append(reply.at + outside_rng.uniform(1.0, 15.0))  # and again
        for attempt, at in enumerate(sorted(times), start=1):
            deliveries.append(
                Delivery(min(at, last), notification.notification_id, attempt, outside_rng.randrange(agents))
            )
    deliveries.sort(key=lambda d: (d.at, d.notification_id, d.attempt))
    return Workload(tuple(result), tuple(notifications), tuple(deliveries), tuple(outside), tuple(responders))


def _storm_actors(
    seed: int, storms: int, boxes: list[str], arrival_end: float, result: list[Message], count: int, threads: int
) -> tuple[list[tuple[str, Actor]], int, int]:
    """``storms`` of each actor: threads opened by a correspondent that answers every reply (an out-of-office
    that marks its answers, an auto-responder that does not; another company's agent writes in ``storms + 3``
    threads, so that its correspondent budget (10) is spent before its threads' (3 each)), a mailing list's posts,
    and customers who write twice quickly. Appends their first messages to ``result``; returns the responding
    threads and the new counts."""
    rng = random.Random(f"workload/{seed}/storms")
    responders: list[tuple[str, Actor]] = []
    # Early in the run, so that a storm has time to grow before the main phase ends.
    storm_end = max(arrival_end * 0.5, 1.0)

    def message(
        thread_id: str, at: float, sender: str = "", actor: Actor = "", mailbox: str = "", **headers: str
    ) -> None:
        nonlocal count
        count += 1
        mailbox = mailbox or rng.choice(boxes)
        if any(m.thread_id == thread_id for m in result):
            mailbox = next(m.mailbox for m in result if m.thread_id == thread_id)
        headers_ = tuple(sorted(headers.items()))
        result.append(Message(mailbox, f"msg-{count:05d}", thread_id, "message", at, sender, actor, headers_))

    def thread() -> str:
        nonlocal threads
        threads += 1
        return f"thr-{threads:05d}"

    for index in range(storms):
        pairs: tuple[tuple[Actor, str], ...] = (
            ("ooo", f"ooo-{index}@corp.example"),
            ("responder", f"helpdesk-{index}@vendor.example"),
        )
        for kind, sender in pairs:
            thread_id = thread()
            message(thread_id, rng.uniform(0.5, storm_end), sender)
            responders.append((thread_id, kind))
        first = thread()
        at = rng.uniform(0.5, arrival_end)
        message(first, at)
        message(first, at + rng.uniform(1.1, 3.0), actor="twice")  # whole seconds later: a newer message
        message(thread(), rng.uniform(0.5, arrival_end), LIST_SENDER, "list", **LIST_HEADERS[index % 3])
    # All in one mailbox: a correspondent's budget is the mailbox's (another mailbox is another company's inbox).
    other_mailbox = boxes[0]
    for _ in range(storms + 3 if storms else 0):
        thread_id = thread()
        message(thread_id, rng.uniform(0.5, storm_end), OTHER_COMPANY_AGENT, "other_agent", other_mailbox)
        responders.append((thread_id, "other_agent"))
    return responders, count, threads


def message_object(notification: Notification, t0: float) -> dict[str, Any]:
    """The Nylas message object of a notification's message, with its ``headers`` as
    ``GET /v3/grants/{grant}/messages/{id}?fields=include_headers`` gives them (a webhook's has none). ``t0``: the
    run's start (epoch seconds): a message's ``date`` is when it arrived (or was sent), in whole seconds."""
    message = notification.message
    sender = OUTSIDE_SENDER if notification.outgoing else message.correspondent
    return {
        "id": message.message_id,
        "grant_id": message.mailbox,
        "thread_id": message.thread_id,
        "object": "message",
        "subject": f"Question {message.message_id}",
        "from": [{"email": sender}],
        "folders": ["SENT"] if notification.outgoing else ["INBOX", "UNREAD"],
        "date": int(t0 + message.arrives_at),
        "headers": [{"name": name, "value": value} for name, value in message.headers],
        SCOPE_FIELD: message.scope,
    }


def envelope(notification: Notification, attempt: int, *, sent_at: int, t0: float) -> bytes:
    """The Nylas v3 webhook body for one delivery attempt (the raw bytes that get signed): the message without its
    headers, as Nylas sends it."""
    data = message_object(notification, t0)
    data.pop("headers")
    document = {
        "specversion": "1.0",
        "type": notification.type,
        "source": "/google/emails/realtime",
        "id": notification.notification_id,
        "time": sent_at,
        "webhook_delivery_attempt": attempt,
        "data": {"application_id": "chaos-app", "object": data},
    }
    return json.dumps(document, separators=(",", ":")).encode()
