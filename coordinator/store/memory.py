"""An in-memory ``Store`` (coordinator/core/storage.py) for fast tests of the engine and the service: the same
semantics as ``EtcdStore`` where the engine can tell (tests/unit/test_store_contract.py runs the same behaviour
tests against both, and the etcd-backed suite stays the authority).

- Every write is one atomic step that bumps one global revision counter, as an etcd transaction does: a
  subject's fencing token is the revision that created it, and a recreated subject gets a larger one.
- Leases are expiry instants on an injected clock (milliseconds): a key whose instant has passed is deleted, at
  a revision of its own, before the next operation looks, and watchers see the deletion as etcd's would show.
- Watches: every change of a mailbox reaches each subscriber's queue in revision order.

Not modelled: reads at a past revision (a listing's later pages read the current state), history compaction,
etcd's unavailability, group commit and lease buckets.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from coordinator.core import work
from coordinator.core.domain import (
    CursorRange,
    CursorRecord,
    CursorView,
    DeliveryRecord,
    EndMark,
    OutsideReply,
    State,
    Stored,
    Subject,
    SubjectKind,
    SubjectRecord,
    ThreadEntry,
    ThreadLink,
    ThreadView,
    Transition,
)
from coordinator.core.domain import (
    guarded as is_guarded,
)
from coordinator.core.errors import InvalidArgument, StoreConflict
from coordinator.core.storage import (
    Change,
    ClaimAttempt,
    FeedLost,
    FeedQueue,
    GuardedDecide,
    Listing,
    StoreStatistics,
    decode_cursor,
    encode_cursor,
    subject_order,
)
from coordinator.core.storms import Counting, GuardView, Inbound, Send, Stopped

V = TypeVar("V")


@dataclass
class _Leased(Generic[V]):
    value: V
    revision: int
    expires_ms: int | None  # None: no lease

    def expired(self, now_ms: int) -> bool:
        return self.expires_ms is not None and now_ms >= self.expires_ms


@dataclass
class _Thread:
    """One thread's keys: its claimed subjects (their messages' received times) and its latest outside reply.
    ``changed``: the revision of its last write, as the range compare of etcd's RecordOutgoing sees it."""

    entries: dict[Subject, _Leased[ThreadLink]] = field(default_factory=dict)
    mark: _Leased[OutsideReply] | None = None
    changed: int = 0


@dataclass
class _Mailbox:
    history: list[Change] = field(default_factory=list)
    subscribers: set[FeedQueue] = field(default_factory=set)


class MemoryStore:
    def __init__(self, clock: Callable[[], int]) -> None:
        self._clock = clock
        self._revision = 1
        self._subjects: dict[Subject, Stored] = {}
        self._subject_expiry: dict[Subject, int] = {}
        self._ends: dict[Subject, _Leased[EndMark]] = {}
        self._deliveries: dict[tuple[str, str], _Leased[DeliveryRecord]] = {}
        self._sending: set[Subject] = set()
        self._send_markers: dict[Subject, int] = {}
        self._mailboxes: dict[str, _Mailbox] = {}
        self._threads: dict[tuple[str, str], _Thread] = {}
        self._cursors: dict[tuple[str, str], _Leased[CursorRecord]] = {}
        self._ranges: dict[tuple[str, str], _Leased[CursorRange]] = {}
        # Counted sends by (mailbox, "t" or "c", thread or correspondent) and token; each thread's newest inbound.
        self._counted: dict[tuple[str, str, str], dict[int, _Leased[int]]] = {}
        self._inbound: dict[tuple[str, str], _Leased[Inbound]] = {}
        self._automated: dict[Subject, _Leased[str]] = {}
        self._stopped: dict[Subject, _Leased[Stopped]] = {}

    # --- the write path ------------------------------------------------------------------------------------

    def _next_revision(self) -> int:
        self._revision += 1
        return self._revision

    def _expire(self) -> None:
        now = self._clock()
        for subject in sorted((s for s, at in self._subject_expiry.items() if now >= at), key=subject_order):
            previous = self._subjects.pop(subject)
            del self._subject_expiry[subject]
            self._publish(Change(subject, previous, None, None, self._next_revision()))
        for key in [k for k, leased in self._deliveries.items() if leased.expired(now)]:
            del self._deliveries[key]
        for subject in [s for s, leased in self._ends.items() if leased.expired(now)]:
            del self._ends[subject]
        for subject in [s for s, at in self._send_markers.items() if now >= at]:
            del self._send_markers[subject]
        for key in [k for k, leased in self._ranges.items() if leased.expired(now)]:
            del self._ranges[key]
        for sends in self._counted.values():
            for token in [t for t, leased in sends.items() if leased.expired(now)]:
                del sends[token]
        for key in [k for k, leased in self._inbound.items() if leased.expired(now)]:
            del self._inbound[key]
        for thread in self._threads.values():
            for subject in [s for s, leased in thread.entries.items() if leased.expired(now)]:
                del thread.entries[subject]
            if thread.mark is not None and thread.mark.expired(now):
                thread.mark = None

    def _put_subject(self, subject: Subject, stored: Stored) -> None:
        self._subjects[subject] = stored
        if stored.record.expires_ms is None:
            self._subject_expiry.pop(subject, None)
        else:
            self._subject_expiry[subject] = stored.record.expires_ms

    def _publish(self, change: Change) -> None:
        mailbox = self._mailboxes.setdefault(change.subject.mailbox, _Mailbox())
        mailbox.history.append(change)
        for queue in list(mailbox.subscribers):
            try:
                queue.put_nowait([change])
            except asyncio.QueueFull:
                mailbox.subscribers.discard(queue)
                queue.get_nowait()
                queue.put_nowait(FeedLost("this watcher fell behind; watch again", slow_subscriber=True))

    # --- Store ---------------------------------------------------------------------------------------------

    async def read_cursor(self, mailbox: str, name: str) -> CursorView:
        self._expire()
        cursor, taken = self._cursors.get((mailbox, name)), self._ranges.get((mailbox, name))
        return CursorView(
            cursor.value if cursor else None,
            cursor.revision if cursor else 0,
            taken.value if taken else None,
            taken.revision if taken else 0,
        )

    def _cursor_unchanged(self, mailbox: str, name: str, view: CursorView) -> bool:
        cursor, taken = self._cursors.get((mailbox, name)), self._ranges.get((mailbox, name))
        return (cursor.revision if cursor else 0) == view.cursor_revision and (
            taken.revision if taken else 0
        ) == view.range_token

    async def take_cursor_range(
        self, mailbox: str, name: str, view: CursorView, taken: CursorRange, expires_ms: int
    ) -> int | None:
        self._expire()
        if not self._cursor_unchanged(mailbox, name, view) or (mailbox, name) in self._ranges:
            return None
        token = self._next_revision()
        self._ranges[(mailbox, name)] = _Leased(taken, token, expires_ms)
        return token

    async def advance_cursor(self, mailbox: str, name: str, view: CursorView, cursor: CursorRecord) -> bool:
        self._expire()
        if not self._cursor_unchanged(mailbox, name, view):
            return False
        self._cursors[(mailbox, name)] = _Leased(cursor, self._next_revision(), None)
        self._ranges.pop((mailbox, name), None)
        return True

    async def record_delivery(self, delivery: DeliveryRecord, expires_ms: int) -> DeliveryRecord | None:
        self._expire()
        key = (delivery.mailbox, delivery.notification_id)
        earlier = self._deliveries.get(key)
        if earlier is not None:
            return earlier.value
        self._deliveries[key] = _Leased(delivery, self._next_revision(), expires_ms)
        return None

    async def claim(
        self,
        subject: Subject,
        record: SubjectRecord,
        delivery: DeliveryRecord | None,
        delivery_expires_ms: int,
        *,
        thread: ThreadLink | None = None,
        thread_expires_ms: int = 0,
        outside_revision: int = 0,
        inbound: tuple[Inbound, int] | None = None,
    ) -> ClaimAttempt:
        self._expire()
        current = self._subjects.get(subject)
        seen = self._deliveries.get((delivery.mailbox, delivery.notification_id)) if delivery is not None else None
        linked = self._threads.setdefault((subject.mailbox, thread.thread_id), _Thread()) if thread else None
        mark = linked.mark if linked is not None else None
        mark_moved = linked is not None and (mark.revision if mark is not None else 0) != outside_revision
        if current is None and seen is None and not mark_moved:
            revision = self._next_revision()
            created = Stored(record, token=revision, revision=revision)
            self._put_subject(subject, created)
            if delivery is not None:
                self._deliveries[(delivery.mailbox, delivery.notification_id)] = _Leased(
                    delivery, revision, delivery_expires_ms
                )
            if thread is not None and linked is not None:
                linked.entries[subject] = _Leased(thread, revision, thread_expires_ms)
                linked.changed = revision
            self._publish(Change(subject, None, created, None, revision))
            recorded = inbound is not None and thread is not None and not await self.automated(subject)
            if recorded and inbound is not None and thread is not None:
                await self.record_inbound(subject.mailbox, thread.thread_id, *inbound)
            return ClaimAttempt(created, None, None, inbound_recorded=recorded)
        end = self._ends.get(subject) if delivery is not None else None
        return ClaimAttempt(
            None,
            current,
            seen.value if seen is not None else None,
            end.value if end is not None else None,
            seen.revision if seen is not None else 0,
            mark.value if mark is not None else None,
            mark.revision if mark is not None else 0,
        )

    async def read_thread(self, mailbox: str, thread_id: str, notification_id: str | None) -> ThreadView:
        self._expire()
        thread = self._threads.get((mailbox, thread_id), _Thread())
        entries = tuple(
            ThreadEntry(
                subject,
                leased.value.received_ms,
                self._subjects.get(subject),
                leased.value.entered_by,
                leased.value.vouched,
            )
            for subject, leased in sorted(thread.entries.items(), key=lambda item: subject_order(item[0]))
        )
        seen = self._deliveries.get((mailbox, notification_id)) if notification_id else None
        return ThreadView(
            entries,
            thread.mark.value if thread.mark is not None else None,
            self._revision,
            thread.mark.revision if thread.mark is not None else 0,
            seen.value if seen is not None else None,
        )

    async def commit_outgoing(
        self,
        mailbox: str,
        thread_id: str,
        view: ThreadView,
        writes: Sequence[tuple[ThreadEntry, SubjectRecord]],
        mark: OutsideReply | None,
        mark_expires_ms: int,
        delivery: DeliveryRecord | None,
        delivery_expires_ms: int,
    ) -> dict[Subject, Stored] | None:
        self._expire()
        thread = self._threads.setdefault((mailbox, thread_id), _Thread())
        unchanged = all(
            (self._subjects[e.subject].revision if e.subject in self._subjects else None)
            == (e.stored.revision if e.stored is not None else None)
            for e, _ in writes
        )
        if (
            thread.changed > view.revision
            or not unchanged
            or (delivery is not None and (mailbox, delivery.notification_id) in self._deliveries)
        ):
            return None
        revision = self._next_revision()
        written = {}
        for entry, record in writes:
            previous = self._subjects.get(entry.subject)
            after = Stored(record, token=previous.token if previous is not None else revision, revision=revision)
            self._put_subject(entry.subject, after)
            self._publish(Change(entry.subject, previous, after, None, revision))
            written[entry.subject] = after
        if mark is not None:
            thread.mark = _Leased(mark, revision, mark_expires_ms)
            thread.changed = revision
        if delivery is not None:
            self._deliveries[(mailbox, delivery.notification_id)] = _Leased(delivery, revision, delivery_expires_ms)
        return written

    async def apply(
        self,
        subject: Subject,
        decide: Callable[[Stored | None, EndMark | None], Transition],
        end_mark_expires_ms: int,
        *,
        send_marker_expires_ms: int = 0,
        marker_gone: bool = False,
        from_recent_write: bool = False,
    ) -> tuple[Transition, Stored | None]:
        return self._apply(
            subject,
            lambda current, end, _guard: decide(current, end),
            end_mark_expires_ms,
            send_marker_expires_ms=send_marker_expires_ms,
            marker_gone=marker_gone,
        )

    async def apply_guarded(
        self,
        subject: Subject,
        decide: GuardedDecide,
        end_mark_expires_ms: int,
        *,
        send_marker_expires_ms: int = 0,
        from_recent_write: bool = False,
    ) -> tuple[Transition, Stored | None]:
        return self._apply(
            subject, decide, end_mark_expires_ms, send_marker_expires_ms=send_marker_expires_ms, guarded=True
        )

    def _read_guard(self, mailbox: str, thread_id: str, correspondent: str) -> GuardView:
        self._expire()

        def sends(scope: str, name: str) -> tuple[Send, ...]:
            counted = self._counted.get((mailbox, scope, name), {}) if name else {}
            return tuple((leased.value, token) for token, leased in counted.items())

        inbound = self._inbound.get((mailbox, thread_id)) if thread_id else None
        return GuardView(
            thread_id,
            correspondent,
            sends("t", thread_id),
            sends("c", correspondent),
            inbound.value if inbound is not None else None,
            inbound.revision if inbound is not None else 0,
        )

    async def read_guard(self, mailbox: str, thread_id: str, correspondent: str) -> GuardView:
        return self._read_guard(mailbox, thread_id, correspondent)

    async def record_inbound(self, mailbox: str, thread_id: str, inbound: Inbound, expires_ms: int) -> None:
        self._expire()
        known = self._inbound.get((mailbox, thread_id))
        if known is not None and known.value.received_ms >= inbound.received_ms:
            return
        self._inbound[(mailbox, thread_id)] = _Leased(inbound, self._next_revision(), expires_ms)

    def _count(self, mailbox: str, guard: GuardView, counting: Counting, revision: int) -> None:
        for scope, name, expires_ms in (
            ("t", guard.thread_id, counting.thread_expires_ms),
            ("c", guard.correspondent, counting.correspondent_expires_ms),
        ):
            if not name:
                continue
            counted = self._counted.setdefault((mailbox, scope, name), {})
            if counting.give_back:
                counted.pop(counting.give_back, None)
            elif counting.send is not None and expires_ms:
                began, token = counting.send
                counted[token] = _Leased(began, revision, expires_ms)

    def _apply(
        self,
        subject: Subject,
        decide: GuardedDecide,
        end_mark_expires_ms: int,
        *,
        send_marker_expires_ms: int = 0,
        marker_gone: bool = False,
        guarded: bool = False,
    ) -> tuple[Transition, Stored | None]:
        self._expire()
        current = self._subjects.get(subject)
        end = self._ends.get(subject)
        guard = None
        if guarded and current is not None and is_guarded(current.record):
            guard = self._read_guard(subject.mailbox, current.record.thread_id, current.record.correspondent)
        transition = decide(current, end.value if end is not None else None, guard)
        if transition.write is None and transition.end is None:
            return transition, current
        assert current is not None, "a transition always starts from a stored subject"
        if marker_gone and subject in self._send_markers:
            raise StoreConflict("the send marker is still there; retry it")
        revision = self._next_revision()
        if transition.counting is not None and guard is not None:
            self._count(subject.mailbox, guard, transition.counting, revision)
        was_sending = current.record.state is State.SENDING
        will_send = transition.write is not None and transition.write.state is State.SENDING
        if was_sending and not will_send:
            self._sending.discard(subject)
            self._send_markers.pop(subject, None)
        after = None
        if transition.write is not None:
            after = Stored(transition.write, token=current.token, revision=revision)
            self._put_subject(subject, after)
            if will_send and not was_sending:
                self._sending.add(subject)
                self._send_markers[subject] = send_marker_expires_ms
        if transition.end is not None:
            del self._subjects[subject]
            self._subject_expiry.pop(subject, None)
            self._ends[subject] = _Leased(transition.end, revision, end_mark_expires_ms)
        withdraw = transition.withdraw
        thread = self._threads.get((subject.mailbox, withdraw.thread_id)) if withdraw is not None else None
        mark = thread.mark if thread is not None else None
        if (
            withdraw is not None
            and thread is not None
            and mark is not None
            and mark.value.message_id == withdraw.message_id
        ):
            thread.mark, thread.changed = None, revision
        self._publish(Change(subject, current, after, transition.end, revision))
        return transition, after

    async def recent_deliveries(self, mailbox: str, limit: int, *, containing: str = "") -> list[DeliveryRecord]:
        self._expire()
        mine = [leased for (box, _), leased in self._deliveries.items() if box == mailbox]
        found = [leased.value for leased in sorted(mine, key=lambda leased: -leased.revision)[:limit]]
        work.spend(len(found))
        return found

    async def record_automated(self, subject: Subject, reason: str, expires_ms: int) -> None:
        self._automated[subject] = _Leased(reason, self._next_revision(), expires_ms)

    async def automated(self, subject: Subject) -> str:
        known = self._automated.get(subject)
        return known.value if known is not None and not known.expired(self._clock()) else ""

    async def automated_of(self, subjects: Sequence[Subject]) -> dict[Subject, str]:
        return {subject: reason for subject in subjects if (reason := await self.automated(subject))}

    async def record_stopped(self, stopped: Stopped) -> None:
        subject = stopped.subject
        # One per thread (as a thread subject); a message with no thread is its own conversation.
        key = Subject(subject.mailbox, SubjectKind.THREAD, stopped.thread_id) if stopped.thread_id else subject
        self._stopped[key] = _Leased(stopped, self._next_revision(), stopped.refusal.frees_ms)

    async def stopped(self, mailbox: str, limit: int) -> list[Stopped]:
        now = self._clock()
        live = [leased for key, leased in self._stopped.items() if key.mailbox == mailbox and not leased.expired(now)]
        live.sort(key=lambda leased: -leased.revision)
        return [leased.value for leased in live[:limit]]

    async def status(self, subject: Subject) -> Stored | None:
        self._expire()
        work.spend(1)
        return self._subjects.get(subject)

    async def list_subjects(
        self,
        mailbox: str,
        *,
        cursor: str | None,
        limit: int,
        revision: int = 0,
        states: frozenset[State] = frozenset(),
    ) -> tuple[Listing, str | None, int]:
        self._expire()
        after = subject_order(decode_cursor(cursor, mailbox)) if cursor is not None else None
        ordered = sorted(
            ((subject_order(s), s, stored) for s, stored in self._subjects.items() if s.mailbox == mailbox),
            key=lambda item: item[0],
        )
        following = [(s, stored) for key, s, stored in ordered if after is None or key > after]
        page = following[:limit]
        work.spend(len(page))
        more = len(following) > limit
        listed = [item for item in page if not states or item[1].record.state in states]
        return listed, encode_cursor(page[-1][0]) if more and page else None, self._revision

    async def snapshot(self, mailbox: str, revision: int = 0) -> tuple[Listing, int]:
        self._expire()
        subjects = [(s, stored) for s, stored in self._subjects.items() if s.mailbox == mailbox]
        return sorted(subjects, key=lambda item: subject_order(item[0])), self._revision

    async def changes_since(self, mailbox: str, after_revision: int) -> tuple[list[Change], int] | None:
        self._expire()
        if after_revision > self._revision:
            raise InvalidArgument("after_revision", f"{after_revision} is ahead of the store's {self._revision}")
        first: dict[Subject, Change] = {}
        last: dict[Subject, Change] = {}
        for change in self._mailboxes.get(mailbox, _Mailbox()).history:
            if change.revision > after_revision:
                first.setdefault(change.subject, change)
                last[change.subject] = change
        changes = []
        for subject, earliest in first.items():
            latest = last[subject]
            previous, now = earliest.previous, latest.now
            if previous is not None and now is not None and previous.revision == now.revision:
                continue
            end = latest.end if now is None and previous is not None and latest.end is not None else None
            if end is not None and previous is not None and end.token != previous.token:
                end = None
            changes.append(Change(subject, previous, now, end, latest.revision))
        changes.sort(key=lambda change: change.revision)
        return changes, self._revision

    @contextlib.asynccontextmanager
    async def subscribe(self, mailbox: str) -> AsyncIterator[FeedQueue]:
        queue: FeedQueue = asyncio.Queue(4096)
        feed = self._mailboxes.setdefault(mailbox, _Mailbox())
        feed.subscribers.add(queue)
        try:
            yield queue
        finally:
            feed.subscribers.discard(queue)

    async def due_sends(self, limit: int = 256) -> tuple[list[Subject], int]:
        self._expire()
        due = [s for s in sorted(self._sending, key=subject_order) if s not in self._send_markers]
        return due[:limit], self._revision

    # --- health and upkeep ------------------------------------------------------------------------------------

    async def ping(self) -> str:
        return "memory (this process)"

    async def alarms(self) -> list[str]:
        return []

    async def current_revision(self) -> int:
        return self._revision

    def statistics(self) -> StoreStatistics:
        watched = [feed for feed in self._mailboxes.values() if feed.subscribers]
        return StoreStatistics(
            watched_mailboxes=len(watched), watch_subscribers=sum(len(feed.subscribers) for feed in watched)
        )

    async def count_records(self) -> dict[str, int]:
        self._expire()
        return {
            "subjects": len(self._subjects) + len(self._ends),
            "deliveries": len(self._deliveries),
            "sending": len(self._sending),
            "threads": sum(len(thread.entries) + (thread.mark is not None) for thread in self._threads.values()),
        }

    async def end_subscriptions(self) -> None:
        for feed in self._mailboxes.values():
            for queue in list(feed.subscribers):
                queue.put_nowait(FeedLost("the coordinator is shutting down"))

    async def close(self) -> None:
        await self.end_subscriptions()
