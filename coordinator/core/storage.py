"""What the coordinator needs from a store, and the values it answers with: the engine's reads and writes, and
the health, alarms and statistics the server and its metrics read. Defined here, in the core, so that the engine
depends on no store; the implementations live in coordinator.store (``etcd``, which keeps the rules of
docs/design.md#key-layout, and ``memory``).

A page cursor is opaque to the engine and to clients: ``v1:`` and the last listed subject (mailbox, kind, id),
never a key of the store, so that the key layout can change without breaking a client that holds a cursor.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import re
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import quote

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
from coordinator.core.errors import InvalidArgument
from coordinator.core.limits import PAGE_TOKEN_MAX_BYTES
from coordinator.core.storms import GuardView, Inbound, Stopped

# A decision on a subject, its last end mark and its guard records (None: not an agent's guarded claim).
GuardedDecide = Callable[[Stored | None, EndMark | None, GuardView | None], Transition]


@dataclass(frozen=True)
class ClaimAttempt:
    """The answer of the one-transaction claim: either ``created`` or what stood in the way."""

    created: Stored | None
    current: Stored | None
    delivery: DeliveryRecord | None
    # Why the subject was last freed by a call, when it is free (read only when a delivery was given).
    end: EndMark | None = None
    # The store revision at which ``delivery`` was recorded.
    delivery_revision: int = 0
    # With a thread link: the thread's latest reply written outside, and the revision it was written at (0: none).
    outside: OutsideReply | None = None
    outside_revision: int = 0
    # With ``inbound``: whether the claim's transaction recorded it as the thread's newest inbound message (False:
    # not tried, or another was there; the caller records it on its own).
    inbound_recorded: bool = False


@dataclass(frozen=True)
class Change:
    """One subject changed at ``revision``; ``end`` is the reason written beside a deletion."""

    subject: Subject
    previous: Stored | None
    now: Stored | None
    end: EndMark | None
    revision: int


class FeedLost(Exception):
    """A mailbox watch ended (the store unreachable too long, history compacted, or a slow subscriber)."""

    def __init__(self, message: str, *, slow_subscriber: bool = False) -> None:
        super().__init__(message)
        self.slow_subscriber = slow_subscriber


# What a mailbox subscription delivers: batches of changes in revision order, or why it ended.
FeedQueue = asyncio.Queue[list[Change] | FeedLost]
Listing = list[tuple[Subject, Stored]]

_CURSOR_VERSION = "v1:"
_BAD_CURSOR = "is not a token this service issued; start without one"
# What encode_cursor writes: a flat JSON array of three strings, no space. Only that is handed to the JSON
# parser, whose recursion (one level per nested array) a crafted token could otherwise drive to RecursionError.
_CURSOR_BODY = re.compile(rb'\[(?:"(?:[^"\\]|\\.)*",){2}"(?:[^"\\]|\\.)*"\]')


def subject_order(subject: Subject) -> bytes:
    """The order every store lists subjects in, and a page cursor resumes in: by mailbox, kind and id, each
    percent-encoded (only ``[A-Za-z0-9_.~-]`` kept as it is) and compared as bytes. etcd's keys are built from
    the same encoding, so its key order is this order."""
    return f"{quote(subject.mailbox, safe='')}/{subject.kind.value}/{quote(subject.id, safe='')}".encode()


@dataclass(frozen=True)
class StoreStatistics:
    """What a store reports for the metrics, from this process's memory (no round trip)."""

    watched_mailboxes: int
    """Mailboxes with a feed open (etcd: one watch each)."""
    watch_subscribers: int
    """Watch streams subscribed to those feeds."""
    shared_leases: int = 0
    """Leases shared between keys by their end (etcd's lease buckets); 0 for a store without leases."""


def encode_cursor(subject: Subject) -> str:
    """The page cursor that resumes a listing after ``subject``."""
    body = json.dumps([subject.mailbox, subject.kind.value, subject.id], separators=(",", ":")).encode()
    return _CURSOR_VERSION + base64.urlsafe_b64encode(body).decode().rstrip("=")


def decode_cursor(cursor: str, mailbox: str) -> Subject:
    """The subject a cursor resumes after; INVALID_ARGUMENT for a cursor that is not ours or not this mailbox's."""
    if len(cursor) > PAGE_TOKEN_MAX_BYTES:
        raise InvalidArgument(
            "page_token", f"is {len(cursor)} characters; the limit is {PAGE_TOKEN_MAX_BYTES}: start without one"
        )
    if not cursor.startswith(_CURSOR_VERSION):
        raise InvalidArgument("page_token", _BAD_CURSOR)
    body = cursor[len(_CURSOR_VERSION) :]
    try:
        document = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        if _CURSOR_BODY.fullmatch(document) is None:
            raise ValueError("not a cursor's body")
        owner, kind, subject_id = json.loads(document)
        subject = Subject(str(owner), SubjectKind(kind), str(subject_id))
        (subject.mailbox + subject.id).encode()  # a lone surrogate (JSON can spell one) was never issued
    except (binascii.Error, ValueError, TypeError):
        raise InvalidArgument("page_token", _BAD_CURSOR) from None
    if subject.mailbox != mailbox:
        raise InvalidArgument("page_token", "does not belong to this mailbox's listing; start without one")
    return subject


class Store(Protocol):
    """The engine's view of the store. Every write is a compare-and-swap on what was read; a subject's fencing
    token is the store revision that created it (docs/design.md#fencing), and revisions grow across the store."""

    async def record_delivery(self, delivery: DeliveryRecord, expires_ms: int) -> DeliveryRecord | None:
        """Records a notification id; returns the earlier record instead when it was seen before."""

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
        """Create-if-absent (with the delivery record, if given, in the same transaction). With ``thread``: only
        while the thread's latest outside reply is the one written at ``outside_revision`` (0: none), and the
        subject is entered in the thread (until ``thread_expires_ms``) in the same transaction. With ``inbound``
        (the message, and when its record expires), a store may record it as the thread's newest inbound message
        in the same transaction, when it can tell cheaply that no later one is recorded."""

    async def read_thread(self, mailbox: str, thread_id: str, notification_id: str | None) -> ThreadView:
        """The thread's claimed subjects (each as it is now), its latest outside reply and, with
        ``notification_id``, that notification's delivery record."""

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
        """Writes RecordOutgoing's decision in one transaction: each subject as its entry read it, the thread's
        new latest outside reply (None: unchanged) and the delivery record; only if the thread gained no subject
        or outside reply, no written subject changed and the notification is still unseen since ``view`` was
        read. Returns the written subjects, or None when something changed (read again, decide again)."""

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
        """Reads, decides, and writes only if nothing changed in between; decides again if something did."""

    async def apply_guarded(
        self,
        subject: Subject,
        decide: GuardedDecide,
        end_mark_expires_ms: int,
        *,
        send_marker_expires_ms: int = 0,
        from_recent_write: bool = False,
    ) -> tuple[Transition, Stored | None]:
        """``apply``, deciding also on the guard records of an agent's claim (docs/design.md#reply-storms); the
        transition's ``counting`` is written with it, only while the guard records are as read."""

    async def read_guard(self, mailbox: str, thread_id: str, correspondent: str) -> GuardView:
        """A thread's and a correspondent's sends still in their windows, and the thread's newest inbound message
        (a name empty: not read), at one revision."""

    async def record_inbound(self, mailbox: str, thread_id: str, inbound: Inbound, expires_ms: int) -> None:
        """The thread's newest inbound message becomes ``inbound``, unless one received later is recorded."""

    async def status(self, subject: Subject) -> Stored | None: ...

    async def record_automated(self, subject: Subject, reason: str, expires_ms: int) -> None:
        """Why agents leave this message (RecordIncoming's ``automated``), until ``expires_ms``."""

    async def automated(self, subject: Subject) -> str:
        """What ``record_automated`` recorded for the message, while it lives; empty: nothing."""

    async def automated_of(self, subjects: Sequence[Subject]) -> dict[Subject, str]:
        """``automated`` of each of ``subjects`` (those with a reason only), read together."""

    async def record_stopped(self, stopped: Stopped) -> None:
        """A conversation where agents are stopped, until its refusal's ``frees_ms`` (one per thread, or per
        message when it has no thread: a later refusal replaces it)."""

    async def stopped(self, mailbox: str, limit: int) -> list[Stopped]:
        """The mailbox's conversations where agents are stopped, at most ``limit``, newest refusal first."""

    async def read_cursor(self, mailbox: str, name: str) -> CursorView:
        """A mailbox's cursor and its range in progress, read together (docs/design.md#cursors)."""

    async def take_cursor_range(
        self, mailbox: str, name: str, view: CursorView, taken: CursorRange, expires_ms: int
    ) -> int | None:
        """Writes the range on a lease ending at ``expires_ms``, only if the cursor is as ``view`` read it and no
        range exists; its token (the revision that wrote it), or None when something changed."""

    async def advance_cursor(self, mailbox: str, name: str, view: CursorView, cursor: CursorRecord) -> bool:
        """Writes the cursor and deletes its range in one step, only if both are as ``view`` read them; False when
        something changed."""

    async def recent_deliveries(self, mailbox: str, limit: int, *, containing: str = "") -> list[DeliveryRecord]:
        """Of the mailbox's ``limit`` newest delivery records (by the revision that wrote them), newest first, those
        that may contain ``containing`` (casefolded) in their summary or subject id: a cheap test a store may make
        on what it reads before decoding it, which lets through every record that does (the caller checks each
        it gets). Empty: all of them."""

    async def list_subjects(
        self,
        mailbox: str,
        *,
        cursor: str | None,
        limit: int,
        revision: int = 0,
        states: frozenset[State] = frozenset(),
    ) -> tuple[Listing, str | None, int]:
        """Of the next ``limit`` subjects of a mailbox in a stable order after ``cursor``, those in ``states``
        (all when empty); a cursor after the last one read if more follow (a filtered read may list none and
        still have one); the revision read (pass it back to read the next page at the same revision). Reads
        count as work (coordinator/core/work.py), as every read of the store does."""

    async def snapshot(self, mailbox: str, revision: int = 0) -> tuple[Listing, int]:
        """Every subject of a mailbox, all read at one revision."""

    async def changes_since(self, mailbox: str, after_revision: int) -> tuple[list[Change], int] | None:
        """What changed in a mailbox after ``after_revision``, and the revision read; None when the store no
        longer has that history."""

    def subscribe(self, mailbox: str) -> AbstractAsyncContextManager[FeedQueue]:
        """Every change of the mailbox after the moment of subscribing, until the context ends."""

    async def due_sends(self, limit: int = 256) -> tuple[list[Subject], int]:
        """SENDING subjects whose send deadline passed, and the revision they were read at."""

    # --- health and upkeep ------------------------------------------------------------------------------------

    async def ping(self) -> str:
        """A read only an answering store can serve: what the store is (etcd: its version). StoreUnavailable
        when it does not answer."""

    async def alarms(self) -> list[str]:
        """The store's raised alarms by name (etcd: NOSPACE when its storage quota is full, CORRUPT); [] when
        none."""

    async def current_revision(self) -> int:
        """The store's revision, by a read that a majority must answer (proof that the store serves writes)."""

    def statistics(self) -> StoreStatistics: ...

    async def count_records(self) -> dict[str, int]:
        """Records by family, for operators (docs/operations.md, the etcd_keys metric): ``subjects`` (claims,
        sends, reply records and the short-lived end marks beside them), ``deliveries``, ``sending`` (sends not
        yet settled), ``threads`` (entries of threads and their outside replies). A count-only read."""

    async def end_subscriptions(self) -> None:
        """Ends every mailbox subscription (each gets FeedLost): the first step of a shutdown, so that Watch
        streams end while other calls drain."""

    async def close(self) -> None:
        """Ends the subscriptions and releases the store's connections."""
