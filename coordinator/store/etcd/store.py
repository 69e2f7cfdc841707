"""The only code that knows etcd's data: the key layout's records, transactions and watches. ``EtcdStore``
implements coordinator/core/storage.py's ``Store`` on the modules beside it: etcd_client.py (calls, auth, error
translation), group_commit.py, lease_buckets.py and feeds.py.

It speaks etcd's v3 gRPC API through the generated messages and stubs that ``aetcd`` ships: its high-level
client has no nested transactions, no revision in a transaction's answer and no prev_kv watches, and the
raw stubs skip a layer of Python on the hot path.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
from aetcd import rpc

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
    SubjectRecord,
    ThreadEntry,
    ThreadLink,
    ThreadView,
    Transition,
)
from coordinator.core.domain import guarded as _guarded
from coordinator.core.errors import InvalidArgument, StoreConflict, StoreUnavailable
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
)
from coordinator.core.storms import Counting, GuardView, Inbound, Stopped
from coordinator.store.etcd import codec as _codec
from coordinator.store.etcd.client import (
    EtcdClient,
    EtcdObserver,
    FutureRevision,
    RevisionCompacted,
    is_lease_not_found,
    is_quota_full,
)
from coordinator.store.etcd.feeds import FeedHub
from coordinator.store.etcd.group_commit import TxnBatcher
from coordinator.store.etcd.guards import GuardMemory
from coordinator.store.etcd.keys import Keys, prefix_end
from coordinator.store.etcd.lapses import LapseKeeper
from coordinator.store.etcd.lease_buckets import SHARED_WITHIN_MS, LeaseBuckets
from coordinator.store.etcd.settings import EtcdSettings

__all__ = ["EtcdStore"]

log = logging.getLogger(__name__)

# A compare-and-swap that loses this many times in a row is reported instead of spinning.
_RECENT_WRITES = 4096  # subjects whose last write by this replica is remembered (~0.5 KiB each)
_CAS_ATTEMPTS = 32
_RANGE_PAGE = 1000
_THREAD_READS = 100  # subjects read per transaction (etcd takes at most 128 operations in one)
# Records decoded between two turns of other calls, when a read brings many (about 1 ms of work).
_DECODED_PER_TURN = 128


class _NoObserver:
    def etcd_call(self, method: str, seconds: float, error: str | None) -> None:
        pass


def _stored(kv: Any) -> Stored:
    return Stored(_codec.decode_record(kv.value), token=kv.create_revision, revision=kv.mod_revision)


def _op_put(key: bytes, value: bytes, lease: int = 0) -> Any:
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease))


def _op_get(key: bytes) -> Any:
    return rpc.RequestOp(request_range=rpc.RangeRequest(key=key))


def _op_delete(key: bytes) -> Any:
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))


def _absent(key: bytes) -> Any:
    return rpc.Compare(key=key, result=rpc.Compare.EQUAL, target=rpc.Compare.VERSION, version=0)


def _unchanged_since(key: bytes, revision: int) -> Any:
    return rpc.Compare(key=key, result=rpc.Compare.EQUAL, target=rpc.Compare.MOD, mod_revision=revision)


def _first_kv(response: Any) -> Any | None:
    kvs = response.response_range.kvs
    return kvs[0] if kvs else None


class EtcdStore:
    def __init__(
        self,
        settings: EtcdSettings,
        clock: Callable[[], int],
        observer: EtcdObserver | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.observer: EtcdObserver = observer or _NoObserver()
        self.keys = Keys(settings.prefix)
        self.etcd = EtcdClient(settings, self.observer)
        self._clock = clock
        self._leases = self._new_leases()
        self.feeds = FeedHub(self.current_revision, self.watch_stream)
        self._batcher = TxnBatcher(self._send_txn, settings.max_batch, settings.max_batches_in_flight)
        self._recent: OrderedDict[bytes, Stored] = OrderedDict()
        self._guards = GuardMemory(monotonic)
        # The claims this replica wrote, ended when their time has passed should etcd restart their lease.
        self.lapses = LapseKeeper(monotonic)

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(
            watched_mailboxes=self.feeds.mailboxes,
            watch_subscribers=self.feeds.subscribers,
            shared_leases=len(self._leases),
        )

    async def count_records(self) -> dict[str, int]:
        """Keys of each family, count-only and serializable: etcd walks its index and reads no value, on
        whichever member answers."""
        counts = {}
        for family, start in self.keys.counted_families().items():
            response = await self.etcd.call(
                self.etcd.kv.Range,
                rpc.RangeRequest(key=start, range_end=prefix_end(start), count_only=True, serializable=True),
            )
            counts[family] = int(response.count)
        return counts

    @property
    def batch_stats(self) -> tuple[int, int]:
        """(etcd requests sent by the group commit, transactions they carried)."""
        return self._batcher.requests, self._batcher.transactions

    async def end_subscriptions(self) -> None:
        await self.feeds.close()

    async def close(self) -> None:
        await self.feeds.close()
        await self.etcd.close()

    async def _send_txn(self, request: Any) -> Any:
        return await self.etcd.call(self.etcd.kv.Txn, request)

    def _new_leases(self) -> LeaseBuckets:
        return LeaseBuckets(self._grant_lease, self._clock, term=lambda: self.etcd.raft_term)

    async def _grant_lease(self, ttl: int) -> int:
        response = await self.etcd.call(self.etcd.lease.LeaseGrant, rpc.LeaseGrantRequest(TTL=ttl))
        return int(response.ID)

    async def _txn(self, compare: list[Any], success: list[Any], failure: list[Any], writes: frozenset[bytes]) -> Any:
        """One transaction; ``writes``: the keys it may write (single keys only: a range write or a nested
        transaction is never sent through here), which decide what it may share a group commit with."""
        request = rpc.TxnRequest(compare=compare, success=success, failure=failure)
        if self.settings.max_batch <= 1:
            return await self._send_txn(request)
        return await self._batcher.submit(request, writes)

    async def _with_leases(self, build: Callable[[], Awaitable[Any]]) -> Any:
        """Runs a transaction built with bucket leases, once more if etcd no longer knows one of them."""
        try:
            return await build()
        except StoreUnavailable as error:
            cause = error.__cause__
            if isinstance(cause, grpc.aio.AioRpcError) and is_lease_not_found(cause):
                # The cache outlived a lease (etcd restored from a backup, or a clock jump): grant anew.
                self._leases = self._new_leases()
                return await build()
            raise

    async def _lease(self, expires_ms: int | None) -> int:
        if expires_ms is None:
            return 0
        return await self._leases.lease_for(expires_ms)

    # --- health --------------------------------------------------------------------------------------------

    async def ping(self) -> str:
        """etcd's version; raises StoreUnavailable when no member answers."""
        response = await self.etcd.call(self.etcd.maintenance.Status, rpc.StatusRequest())
        return str(response.version)

    async def alarms(self) -> list[str]:
        """etcd's raised alarms (NOSPACE, CORRUPT), by name."""
        response = await self.etcd.call(
            self.etcd.maintenance.Alarm, rpc.AlarmRequest(action=rpc.AlarmRequest.GET, memberID=0, alarm=rpc.NONE)
        )
        return sorted({rpc.AlarmType.Name(alarm.alarm) for alarm in response.alarms})

    async def current_revision(self) -> int:
        response = await self.etcd.call(
            self.etcd.kv.Range, rpc.RangeRequest(key=self.keys.sending_family(), count_only=True)
        )
        return int(response.header.revision)

    # --- claims --------------------------------------------------------------------------------------------

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
        """Create-if-absent in one transaction; on failure the same round trip reads what is in the way. The
        thread's newest inbound message is written by a transaction nested in it, compared with what this replica
        last knew of it (none: a new thread); when that guess was wrong the nested one fails alone."""
        subject_key = self.keys.subject(subject)
        delivery_key = self.keys.delivery(delivery.mailbox, delivery.notification_id) if delivery is not None else None
        mark_key = self.keys.thread_mark(subject.mailbox, thread.thread_id) if thread is not None else None
        reads = [subject_key]
        if delivery_key is not None:
            reads += [delivery_key, self.keys.end_mark(subject)]
        if mark_key is not None:
            reads.append(mark_key)
        writes = {subject_key}
        if delivery_key is not None:
            writes.add(delivery_key)
        entry_key = self.keys.thread_entry(thread.thread_id, subject) if thread is not None else None
        if entry_key is not None and mark_key is not None:
            # The mark too, though only compared: a RecordOutgoing writing it must not share this group commit,
            # where both compares would see the state before either write.
            writes |= {entry_key, mark_key}
        inbound_key = self.keys.thread_inbound(subject.mailbox, thread.thread_id) if thread is not None else None
        inbound_guess: int | None = None  # the revision the nested transaction compares with (0: absent)
        if inbound is not None and inbound_key is not None:
            known, known_revision = self._guards.inbound(inbound_key)
            if known is None or known.received_ms < inbound[0].received_ms:
                inbound_guess = known_revision
                writes.add(inbound_key)

        async def attempt() -> Any:
            compare = [_absent(subject_key)]
            success = [_op_put(subject_key, _codec.encode_record(record), await self._lease(record.expires_ms))]
            if delivery is not None and delivery_key is not None:
                compare.append(_absent(delivery_key))
                lease = await self._lease(delivery_expires_ms)
                success.append(_op_put(delivery_key, _codec.encode_delivery(delivery), lease))
            if thread is not None and mark_key is not None and entry_key is not None:
                # Granted only while the thread's latest outside reply is the one the caller decided on: a reply
                # recorded meanwhile may answer this message (docs/design.md#replies-written-outside).
                compare.append(
                    _absent(mark_key) if outside_revision == 0 else _unchanged_since(mark_key, outside_revision)
                )
                entry = _codec.encode_thread_entry(thread)
                success.append(_op_put(entry_key, entry, await self._lease(thread_expires_ms)))
            if inbound is not None and inbound_key is not None and inbound_guess is not None:
                guessed = _unchanged_since(inbound_key, inbound_guess) if inbound_guess else _absent(inbound_key)
                # Automated mail (RecordIncoming said so) is no inbound message of the conversation: when it is,
                # the nested transaction fails and the engine decides apart (docs/design.md#reply-storms).
                compares = [guessed, _absent(self.keys.automated(subject))]
                put = _op_put(inbound_key, _codec.encode_inbound(inbound[0]), await self._lease(inbound[1]))
                success.append(rpc.RequestOp(request_txn=rpc.TxnRequest(compare=compares, success=[put])))
            return await self._txn(compare, success, [_op_get(key) for key in reads], frozenset(writes))

        wrote = True
        try:
            response = await self._with_leases(attempt)
        except StoreUnavailable as error:
            if not is_quota_full(error):
                raise
            # etcd refuses a transaction that could write, whatever its compare would say. What stands in the
            # way is still readable: a subject that is replied to or held, or a known delivery, is answered.
            response, wrote = await self._read_at_one_revision(reads), False
            if _first_kv(response.responses[0]) is None and (
                delivery_key is None or _first_kv(response.responses[1]) is None
            ):
                raise
        if wrote and response.succeeded:
            revision = response.header.revision
            created = Stored(record, token=revision, revision=revision)
            self._remember(subject_key, created)
            recorded = inbound_guess is not None and bool(response.responses[-1].response_txn.succeeded)
            if recorded and inbound is not None and inbound_key is not None:
                self._guards.saw_inbound(inbound_key, inbound[0], int(revision))
            return ClaimAttempt(created, None, None, inbound_recorded=recorded)
        found = dict(zip(reads, (_first_kv(answer) for answer in response.responses), strict=True))
        subject_kv = found[subject_key]
        delivery_kv = found[delivery_key] if delivery_key is not None else None
        end_kv = found[self.keys.end_mark(subject)] if delivery_key is not None else None
        mark_kv = found[mark_key] if mark_key is not None else None
        return ClaimAttempt(
            None,
            _stored(subject_kv) if subject_kv is not None else None,
            _codec.decode_delivery(delivery_kv.value, subject.mailbox, delivery.notification_id)
            if delivery is not None and delivery_kv is not None
            else None,
            _codec.decode_end_mark(end_kv.value) if end_kv is not None else None,
            delivery_kv.mod_revision if delivery_kv is not None else 0,
            _codec.decode_outside_reply(mark_kv.value) if mark_kv is not None else None,
            mark_kv.mod_revision if mark_kv is not None else 0,
        )

    async def _read_at_one_revision(self, keys: Sequence[bytes]) -> Any:
        """What a read-only transaction of ``keys`` answers, made of plain ranges read at one revision: etcd 3.5
        refuses even a read-only transaction while its NOSPACE alarm is raised, but still serves ranges."""
        responses = []
        revision = 0
        for key in keys:
            answer = await self.etcd.call(self.etcd.kv.Range, rpc.RangeRequest(key=key, revision=revision))
            revision = revision or int(answer.header.revision)
            responses.append(rpc.ResponseOp(response_range=answer))
        return rpc.TxnResponse(succeeded=False, responses=responses)

    async def record_delivery(self, delivery: DeliveryRecord, expires_ms: int) -> DeliveryRecord | None:
        """Records a notification id; returns the earlier record instead when it was seen before."""
        key = self.keys.delivery(delivery.mailbox, delivery.notification_id)

        async def attempt() -> Any:
            lease = await self._lease(expires_ms)
            return await self._txn(
                [_absent(key)],
                [_op_put(key, _codec.encode_delivery(delivery), lease)],
                [_op_get(key)],
                frozenset((key,)),
            )

        response = await self._with_leases(attempt)
        if response.succeeded:
            return None
        kv = _first_kv(response.responses[0])
        # The record can expire between the compare and the read of the same transaction? No: both see one
        # revision. It is absent only if it was deleted by hand; treat that as a fresh sighting.
        return _codec.decode_delivery(kv.value, delivery.mailbox, delivery.notification_id) if kv is not None else None

    # --- threads (replies written outside the coordinator) ------------------------------------------------

    async def read_thread(self, mailbox: str, thread_id: str, notification_id: str | None) -> ThreadView:
        """The thread's keys in one range (and the delivery record) at one revision, then its subjects."""
        prefix = self.keys.thread(mailbox, thread_id)
        ops = [rpc.RequestOp(request_range=rpc.RangeRequest(key=prefix, range_end=prefix_end(prefix)))]
        if notification_id:
            ops.append(_op_get(self.keys.delivery(mailbox, notification_id)))
        response = await self._txn([], ops, [], frozenset())
        linked: list[tuple[Subject, ThreadLink]] = []
        mark: OutsideReply | None = None
        mark_revision = 0
        for kv in response.responses[0].response_range.kvs:
            subject = self.keys.parse_thread_entry(mailbox, thread_id, kv.key)
            if subject is None:
                mark, mark_revision = _codec.decode_outside_reply(kv.value), int(kv.mod_revision)
            else:
                linked.append((subject, _codec.decode_thread_entry(kv.value, thread_id)))
        delivery = None
        if notification_id:
            delivery_kv = _first_kv(response.responses[1])
            if delivery_kv is not None:
                delivery = _codec.decode_delivery(delivery_kv.value, mailbox, notification_id)
        # Read after the range, not at its revision: commit_outgoing compares each subject it writes with what is
        # read here, and the thread's range with the range's revision.
        entries = []
        work.spend(len(response.responses[0].response_range.kvs))
        for start in range(0, len(linked), _THREAD_READS):
            chunk = linked[start : start + _THREAD_READS]
            subjects = await self._txn([], [_op_get(self.keys.subject(s)) for s, _ in chunk], [], frozenset())
            for (subject, link), answer in zip(chunk, subjects.responses, strict=True):
                kv = _first_kv(answer)
                stored = _stored(kv) if kv is not None else None
                entries.append(ThreadEntry(subject, link.received_ms, stored, link.entered_by, link.vouched))
        # What commit_outgoing compares the thread's range with: the newest revision among the keys read, not the
        # read's header revision, which in a group commit is the revision after the batch's writes, some of which
        # (a claim entering the thread) this read, placed before them, did not see.
        thread_kvs = response.responses[0].response_range.kvs
        newest = max((int(kv.mod_revision) for kv in thread_kvs), default=0)
        return ThreadView(tuple(entries), mark, newest, mark_revision, delivery)

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
        """RecordOutgoing's writes in one transaction, compared with what ``read_thread`` saw (see Store)."""
        prefix = self.keys.thread(mailbox, thread_id)
        mark_key = self.keys.thread_mark(mailbox, thread_id)
        keys = {mark_key}

        async def attempt() -> Any:
            # No key of the thread written since the view: no subject entered, no other outside reply recorded.
            compare = [
                rpc.Compare(
                    key=prefix,
                    range_end=prefix_end(prefix),
                    result=rpc.Compare.LESS,
                    target=rpc.Compare.MOD,
                    mod_revision=view.revision + 1,
                )
            ]
            ops = []
            for entry, record in writes:
                key = self.keys.subject(entry.subject)
                compare.append(_absent(key) if entry.stored is None else _unchanged_since(key, entry.stored.revision))
                ops.append(_op_put(key, _codec.encode_record(record), await self._lease(record.expires_ms)))
                keys.add(key)
            if mark is not None:
                ops.append(_op_put(mark_key, _codec.encode_outside_reply(mark), await self._lease(mark_expires_ms)))
            if delivery is not None:
                delivery_key = self.keys.delivery(mailbox, delivery.notification_id)
                compare.append(_absent(delivery_key))
                lease = await self._lease(delivery_expires_ms)
                ops.append(_op_put(delivery_key, _codec.encode_delivery(delivery), lease))
                keys.add(delivery_key)
            return await self._txn(compare, ops, [], frozenset(keys))

        response = await self._with_leases(attempt)
        if not response.succeeded:
            return None
        revision = int(response.header.revision)
        written = {}
        for entry, record in writes:
            after = Stored(
                record, token=entry.stored.token if entry.stored is not None else revision, revision=revision
            )
            self._remember(self.keys.subject(entry.subject), after)
            written[entry.subject] = after
        return written

    # --- cursors (docs/design.md#cursors) ---------------------------------------------------------------------

    async def read_cursor(self, mailbox: str, name: str) -> CursorView:
        cursor_key, range_key = self.keys.cursor(mailbox, name), self.keys.cursor_range(mailbox, name)
        response = await self._txn([], [_op_get(cursor_key), _op_get(range_key)], [], frozenset())
        cursor_kv, range_kv = _first_kv(response.responses[0]), _first_kv(response.responses[1])
        return CursorView(
            _codec.decode_cursor(cursor_kv.value) if cursor_kv is not None else None,
            int(cursor_kv.mod_revision) if cursor_kv is not None else 0,
            _codec.decode_cursor_range(range_kv.value) if range_kv is not None else None,
            int(range_kv.create_revision) if range_kv is not None else 0,
        )

    def _cursor_as_read(self, cursor_key: bytes, view: CursorView) -> Any:
        return _unchanged_since(cursor_key, view.cursor_revision) if view.cursor_revision else _absent(cursor_key)

    async def take_cursor_range(
        self, mailbox: str, name: str, view: CursorView, taken: CursorRange, expires_ms: int
    ) -> int | None:
        cursor_key, range_key = self.keys.cursor(mailbox, name), self.keys.cursor_range(mailbox, name)

        async def attempt() -> Any:
            lease = await self._lease(expires_ms)
            return await self._txn(
                [self._cursor_as_read(cursor_key, view), _absent(range_key)],
                [_op_put(range_key, _codec.encode_cursor_range(taken), lease)],
                [],
                frozenset((cursor_key, range_key)),
            )

        response = await self._with_leases(attempt)
        return int(response.header.revision) if response.succeeded else None

    async def advance_cursor(self, mailbox: str, name: str, view: CursorView, cursor: CursorRecord) -> bool:
        cursor_key, range_key = self.keys.cursor(mailbox, name), self.keys.cursor_range(mailbox, name)
        range_as_read = (
            rpc.Compare(
                key=range_key, result=rpc.Compare.EQUAL, target=rpc.Compare.CREATE, create_revision=view.range_token
            )
            if view.range_token
            else _absent(range_key)
        )
        response = await self._txn(
            [self._cursor_as_read(cursor_key, view), range_as_read],
            [_op_put(cursor_key, _codec.encode_cursor(cursor)), _op_delete(range_key)],
            [],
            frozenset((cursor_key, range_key)),
        )
        return bool(response.succeeded)

    async def read(self, subject: Subject) -> tuple[Stored | None, EndMark | None]:
        reads = [_op_get(self.keys.subject(subject)), _op_get(self.keys.end_mark(subject))]
        response = await self._txn([], reads, [], frozenset())
        subject_kv = _first_kv(response.responses[0])
        end_kv = _first_kv(response.responses[1])
        return (
            _stored(subject_kv) if subject_kv is not None else None,
            _codec.decode_end_mark(end_kv.value) if end_kv is not None else None,
        )

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
        """Reads, decides, and writes only if nothing changed in between; decides again if something did.
        A deletion leaves an EndMark that lives until ``end_mark_expires_ms``; a move to SENDING writes a send
        marker on the lease of ``send_marker_expires_ms``. ``marker_gone``: write only while the subject's send
        marker is absent (the IN_DOUBT sweep: etcd has expired it).

        ``from_recent_write``: for a ``decide`` that does not look at the EndMark, first try the subject as
        this replica last wrote it, without reading: the write's compare on the key's revision proves it
        still current, so the send sequence (claim, BeginSend, ConfirmSent) costs three etcd requests instead
        of five. A decision that would not write, or fails, is never answered from memory: it is made again
        on what etcd holds."""
        return await self._apply(
            subject,
            lambda current, end, _guard: decide(current, end),
            end_mark_expires_ms,
            send_marker_expires_ms=send_marker_expires_ms,
            marker_gone=marker_gone,
            from_recent_write=from_recent_write,
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
        """``apply``, deciding also on the subject's guard records (an agent's claim with a thread or a
        correspondent, docs/design.md#reply-storms), read after the subject; a transition's ``counting`` is
        written in the same transaction, only while no send was counted and no newer inbound message recorded
        since they were read."""
        return await self._apply(
            subject,
            decide,
            end_mark_expires_ms,
            send_marker_expires_ms=send_marker_expires_ms,
            from_recent_write=from_recent_write,
            guarded=True,
        )

    async def read_guard(self, mailbox: str, thread_id: str, correspondent: str) -> GuardView:
        """One read-only transaction: each window's live send keys (etcd has ended those whose window passed,
        by their leases) and the thread's newest inbound message."""
        ranges = []
        if thread_id:
            ranges += [self.keys.thread_sends(mailbox, thread_id), self.keys.thread_inbound(mailbox, thread_id)]
        if correspondent:
            ranges.append(self.keys.correspondent_sends(mailbox, correspondent))
        ops = [
            rpc.RequestOp(request_range=rpc.RangeRequest(key=key, range_end=prefix_end(key)))
            if key.endswith(b"/")
            else _op_get(key)
            for key in ranges
        ]
        response = await self._txn([], ops, [], frozenset())
        found = dict(zip(ranges, (answer.response_range.kvs for answer in response.responses), strict=True))

        def sends(prefix: bytes) -> tuple[tuple[int, int], ...]:
            return tuple(
                (_codec.decode_send(kv.value), self.keys.counted_token(prefix, kv.key)) for kv in found.get(prefix, ())
            )

        def created(prefix: bytes) -> int:
            # Not the read's header revision: in a group commit that is the revision after the batch's writes,
            # which a read placed before them did not see. A send key not read has a later create revision.
            return max((int(kv.create_revision) for kv in found.get(prefix, ())), default=0)

        inbound_kvs = found.get(self.keys.thread_inbound(mailbox, thread_id), ()) if thread_id else ()
        view = GuardView(
            thread_id,
            correspondent,
            sends(self.keys.thread_sends(mailbox, thread_id)) if thread_id else (),
            sends(self.keys.correspondent_sends(mailbox, correspondent)) if correspondent else (),
            _codec.decode_inbound(inbound_kvs[0].value) if inbound_kvs else None,
            int(inbound_kvs[0].mod_revision) if inbound_kvs else 0,
            created(self.keys.thread_sends(mailbox, thread_id)) if thread_id else 0,
            created(self.keys.correspondent_sends(mailbox, correspondent)) if correspondent else 0,
        )
        if thread_id:
            self._guards.saw_window(self.keys.thread_sends(mailbox, thread_id), view.thread_sends, view.thread_created)
            self._guards.saw_inbound(self.keys.thread_inbound(mailbox, thread_id), view.latest, view.latest_revision)
        if correspondent:
            prefix = self.keys.correspondent_sends(mailbox, correspondent)
            self._guards.saw_window(prefix, view.correspondent_sends, view.correspondent_created)
        return view

    def _guessed_guard(self, mailbox: str, thread_id: str, correspondent: str) -> GuardView:
        """The guard records as this replica last knew them (coordinator/store/etcd/guards.py): a guess the
        commit's compares check."""
        thread_sends, thread_created = self._guards.window(self.keys.thread_sends(mailbox, thread_id))
        latest, latest_revision = self._guards.inbound(self.keys.thread_inbound(mailbox, thread_id))
        correspondent_sends, correspondent_created = self._guards.window(
            self.keys.correspondent_sends(mailbox, correspondent)
        )
        return GuardView(
            thread_id,
            correspondent,
            thread_sends if thread_id else (),
            correspondent_sends if correspondent else (),
            latest if thread_id else None,
            latest_revision if thread_id else 0,
            thread_created if thread_id else 0,
            correspondent_created if correspondent else 0,
        )

    async def record_inbound(self, mailbox: str, thread_id: str, inbound: Inbound, expires_ms: int) -> None:
        """The thread's newest inbound message becomes ``inbound`` unless a later one is recorded: read, then
        written only while unchanged."""
        key = self.keys.thread_inbound(mailbox, thread_id)
        # First on what this replica last knew (none: a new thread), then on what etcd holds.
        known, revision = self._guards.inbound(key)
        guessed = known is None or known.received_ms < inbound.received_ms
        for _ in range(_CAS_ATTEMPTS):
            if not guessed:
                kv = _first_kv((await self._txn([], [_op_get(key)], [], frozenset())).responses[0])
                known = _codec.decode_inbound(kv.value) if kv is not None else None
                revision = int(kv.mod_revision) if kv is not None else 0
                self._guards.saw_inbound(key, known, revision)
                if known is not None and known.received_ms >= inbound.received_ms:
                    return
            guessed = False

            async def attempt(revision: int = revision) -> Any:
                compare = _unchanged_since(key, revision) if revision else _absent(key)
                put = _op_put(key, _codec.encode_inbound(inbound), await self._lease(expires_ms))
                return await self._txn([compare], [put], [], frozenset((key,)))

            response = await self._with_leases(attempt)
            if response.succeeded:
                self._guards.saw_inbound(key, inbound, int(response.header.revision))
                return
        raise StoreConflict(f"the thread {thread_id!r} of {mailbox!r} kept changing; retry")

    async def _apply(
        self,
        subject: Subject,
        decide: GuardedDecide,
        end_mark_expires_ms: int,
        *,
        send_marker_expires_ms: int = 0,
        marker_gone: bool = False,
        from_recent_write: bool = False,
        guarded: bool = False,
    ) -> tuple[Transition, Stored | None]:
        subject_key = self.keys.subject(subject)
        # The first attempt may start from memory; every later one, and every answer that writes nothing, from etcd.
        known = self._recent.get(subject_key) if from_recent_write else None
        for _ in range(_CAS_ATTEMPTS):
            current: Stored | None
            last_end: EndMark | None
            guard: GuardView | None = None
            if known is not None:
                current, last_end, known = known, None, None
                if guarded and _guarded(current.record):
                    guard = self._guessed_guard(subject.mailbox, current.record.thread_id, current.record.correspondent)
                try:
                    transition = decide(current, last_end, guard)
                except Exception:
                    # Decided on what may be stale: a refusal is answered only from etcd's copy (and a refusal
                    # that stands is raised again, from there).
                    continue
                if (transition.write is None and transition.end is None) or transition.refusal is not None:
                    continue
            else:
                current, last_end = await self.read(subject)
                if guarded and current is not None and _guarded(current.record):
                    guard = await self.read_guard(
                        subject.mailbox, current.record.thread_id, current.record.correspondent
                    )
                transition = decide(current, last_end, guard)
                if transition.write is None and transition.end is None:
                    return transition, current
            assert current is not None, "a transition always starts from a stored subject"
            response = await self._with_leases(
                functools.partial(
                    self._commit,
                    subject,
                    current,
                    transition,
                    end_mark_expires_ms,
                    send_marker_expires_ms,
                    marker_gone,
                    guard,
                )
            )
            if response.succeeded:
                if transition.counting is not None and guard is not None:
                    self._counted(subject.mailbox, guard, transition.counting, int(response.header.revision))
                return transition, self._committed(subject_key, current, transition, response.header.revision)
            log.debug("compare-and-swap on %r lost a race; deciding again", subject_key)
        raise StoreConflict(f"the subject changed {_CAS_ATTEMPTS} times while this call ran; retry it")

    def _committed(self, subject_key: bytes, before: Stored, transition: Transition, revision: int) -> Stored | None:
        after = None if transition.write is None else Stored(transition.write, token=before.token, revision=revision)
        self._remember(subject_key, after)
        return after

    def _remember(self, subject_key: bytes, stored: Stored | None) -> None:
        """What this replica last wrote to a subject (None: it deleted it), for ``apply(from_recent_write=True)``
        and for ending its claims on time across a lease restart (``end_lapsed_claims``)."""
        self.lapses.wrote(
            subject_key,
            stored.record if stored is not None else None,
            stored.revision if stored is not None else 0,
            self.etcd.raft_term,
            self._clock(),
        )
        if stored is None:
            self._recent.pop(subject_key, None)
            return
        self._recent[subject_key] = stored
        self._recent.move_to_end(subject_key)
        if len(self._recent) > _RECENT_WRITES:
            self._recent.popitem(last=False)

    async def _commit(
        self,
        subject: Subject,
        current: Stored,
        transition: Transition,
        end_mark_expires_ms: int,
        send_marker_expires_ms: int,
        marker_gone: bool,
        guard: GuardView | None = None,
    ) -> Any:
        subject_key = self.keys.subject(subject)
        ops: list[Any] = []
        writes: set[bytes] = set()

        def put(key: bytes, value: bytes, lease: int = 0) -> None:
            ops.append(_op_put(key, value, lease))
            writes.add(key)

        def delete(key: bytes) -> None:
            ops.append(_op_delete(key))
            writes.add(key)

        was_sending = current.record.state is State.SENDING
        will_send = transition.write is not None and transition.write.state is State.SENDING
        if was_sending and not will_send:
            delete(self.keys.sending(subject))
            delete(self.keys.send_marker(subject))
        if transition.write is not None:
            record = transition.write
            put(subject_key, _codec.encode_record(record), await self._lease(record.expires_ms))
            if will_send and not was_sending:
                # The send deadline is this lease: etcd, not any replica's clock, decides when it has passed.
                put(self.keys.sending(subject), subject_key)
                put(self.keys.send_marker(subject), subject_key, await self._lease(send_marker_expires_ms))
        if transition.end is not None:
            delete(subject_key)
            put(
                self.keys.end_mark(subject),
                _codec.encode_end_mark(transition.end),
                await self._lease(end_mark_expires_ms),
            )
        compare = [_unchanged_since(subject_key, current.revision)]
        counting = transition.counting
        if counting is not None and guard is not None:
            await self._count(subject, guard, counting, compare, put, delete, writes)
        if marker_gone:
            compare.append(_absent(self.keys.send_marker(subject)))
        withdraw = transition.withdraw
        if withdraw is not None and withdraw.thread_id:
            # The thread's latest outside reply is deleted only while it is still this one, as read here.
            mark_key = self.keys.thread_mark(subject.mailbox, withdraw.thread_id)
            mark = (await self.etcd.call(self.etcd.kv.Range, rpc.RangeRequest(key=mark_key))).kvs
            if mark and _codec.decode_outside_reply(mark[0].value).message_id == withdraw.message_id:
                compare.append(_unchanged_since(mark_key, mark[0].mod_revision))
                delete(mark_key)
        return await self._txn(compare, ops, [], frozenset(writes))

    def _counted(self, mailbox: str, guard: GuardView, counting: Counting, revision: int) -> None:
        """What this replica now knows of the windows it counted a send in (or gave one back from)."""
        windows = []
        if guard.thread_id:
            windows.append((self.keys.thread_sends(mailbox, guard.thread_id), counting.thread_expires_ms))
        if guard.correspondent:
            windows.append(
                (self.keys.correspondent_sends(mailbox, guard.correspondent), counting.correspondent_expires_ms)
            )
        for prefix, expires_ms in windows:
            if counting.give_back:
                self._guards.gave_back(prefix, counting.give_back)
            elif counting.send is not None and expires_ms:
                self._guards.counted(prefix, counting.send, revision)

    async def _count(
        self,
        subject: Subject,
        guard: GuardView,
        counting: Counting,
        compare: list[Any],
        put: Callable[[bytes, bytes, int], None],
        delete: Callable[[bytes], None],
        writes: set[bytes],
    ) -> None:
        """A send counted (or given back) with its subject's write (docs/design.md#reply-storms). Counted only
        while no send key of either window was created since the guard was read, and the thread's newest inbound
        message is the one read: two replicas racing for a budget's last unit compare the same range, and one
        loses. Each window's range is named among the writes, so that two of them never share a group commit,
        whose compares would all see the state before any of its writes."""
        mailbox = subject.mailbox
        windows = []
        if guard.thread_id:
            thread = self.keys.thread_sends(mailbox, guard.thread_id)
            windows.append((thread, counting.thread_expires_ms, guard.thread_created))
        if guard.correspondent:
            correspondent = self.keys.correspondent_sends(mailbox, guard.correspondent)
            windows.append((correspondent, counting.correspondent_expires_ms, guard.correspondent_created))
        for prefix, expires_ms, newest in windows:
            writes.add(prefix)
            if counting.give_back:
                delete(self.keys.counted_send(prefix, counting.give_back, subject))
                continue
            compare.append(
                rpc.Compare(
                    key=prefix,
                    range_end=prefix_end(prefix),
                    result=rpc.Compare.LESS,
                    target=rpc.Compare.CREATE,
                    create_revision=newest + 1,
                )
            )
            if counting.send is not None and expires_ms:
                began, token = counting.send
                put(
                    self.keys.counted_send(prefix, token, subject),
                    _codec.encode_send(began),
                    await self._lease(expires_ms),
                )
        if guard.thread_id and not counting.give_back:
            inbound = self.keys.thread_inbound(mailbox, guard.thread_id)
            writes.add(inbound)
            compare.append(
                _unchanged_since(inbound, guard.latest_revision) if guard.latest_revision else _absent(inbound)
            )

    async def record_automated(self, subject: Subject, reason: str, expires_ms: int) -> None:
        key = self.keys.automated(subject)

        async def attempt() -> Any:
            return await self._txn(
                [], [_op_put(key, reason.encode(), await self._lease(expires_ms))], [], frozenset((key,))
            )

        await self._with_leases(attempt)

    async def automated(self, subject: Subject) -> str:
        work.spend(1)
        response = await self.etcd.call(self.etcd.kv.Range, rpc.RangeRequest(key=self.keys.automated(subject)))
        return response.kvs[0].value.decode() if response.kvs else ""

    async def automated_of(self, subjects: Sequence[Subject]) -> dict[Subject, str]:
        if not subjects:
            return {}
        keys = [self.keys.automated(subject) for subject in subjects]
        work.spend(len(keys))
        response = await self._read_at_one_revision(keys)
        found = (_first_kv(answer) for answer in response.responses)
        return {subject: kv.value.decode() for subject, kv in zip(subjects, found, strict=True) if kv is not None}

    async def record_stopped(self, stopped: Stopped) -> None:
        key = self.keys.stopped(stopped.subject, stopped.thread_id)

        async def attempt() -> Any:
            # A lease ends less than SHARED_WITHIN_MS after the time it is asked for: the counted send that frees
            # the budget may end that late, so the record asks for that much later and never ends before it.
            lease = await self._lease(stopped.refusal.frees_ms + SHARED_WITHIN_MS)
            return await self._txn([], [_op_put(key, _codec.encode_stopped(stopped), lease)], [], frozenset((key,)))

        await self._with_leases(attempt)

    async def stopped(self, mailbox: str, limit: int) -> list[Stopped]:
        response = await self._newest(self.keys.stopped_all(mailbox), limit, rpc.RangeRequest.MOD)
        return [_codec.decode_stopped(kv.value, mailbox) for kv in response.kvs]

    async def _newest(self, base: bytes, limit: int, sort_target: Any) -> Any:
        """A prefix's newest ``limit`` keys: etcd sorts the range and cuts it at the limit itself."""
        async with work.turn() as read:
            response = await self.etcd.call(
                self.etcd.kv.Range,
                rpc.RangeRequest(
                    key=base,
                    range_end=prefix_end(base),
                    limit=limit,
                    sort_order=rpc.RangeRequest.DESCEND,
                    sort_target=sort_target,
                ),
            )
            # etcd reads and sorts every key of the prefix to find the newest, at once: that is the work, not
            # the limit, and one sort of it all costs the others more than reads of its size in slices (twice).
            read(2 * max(int(response.count), len(response.kvs)))
        return response

    async def status(self, subject: Subject) -> Stored | None:
        work.spend(1)
        response = await self.etcd.call(self.etcd.kv.Range, rpc.RangeRequest(key=self.keys.subject(subject)))
        return _stored(response.kvs[0]) if response.kvs else None

    async def recent_deliveries(self, mailbox: str, limit: int, *, containing: str = "") -> list[DeliveryRecord]:
        response = await self._newest(self.keys.deliveries(mailbox), limit, rpc.RangeRequest.CREATE)
        deliveries = []
        for index, kv in enumerate(response.kvs):
            if index % _DECODED_PER_TURN == _DECODED_PER_TURN - 1:
                await asyncio.sleep(0)  # other calls' turn: a long read is decoded in slices
            if containing and not _codec.may_contain(kv.value, containing):
                continue  # not decoded: the text is nowhere in the record
            notification_id = self.keys.delivery_notification_id(mailbox, kv.key)
            deliveries.append(_codec.decode_delivery(kv.value, mailbox, notification_id))
        return deliveries

    async def list_subjects(
        self,
        mailbox: str,
        *,
        cursor: str | None,
        limit: int,
        revision: int = 0,
        states: frozenset[State] = frozenset(),
    ) -> tuple[Listing, str | None, int]:
        """Up to ``limit`` subjects of a mailbox in key order, after the subject ``cursor`` names (only those in
        ``states``, when given: the others are read but not decoded); a cursor for the next page if more follow."""
        after = self.keys.subject(decode_cursor(cursor, mailbox)) if cursor is not None else None
        items, last, revision = await self._range_subjects(
            mailbox, after=after, limit=limit, revision=revision, states=states
        )
        parsed = self.keys.parse_mailbox_key(mailbox, last) if last is not None else None
        return items, encode_cursor(parsed[1]) if parsed is not None else None, revision

    async def _range_subjects(
        self, mailbox: str, *, after: bytes | None, limit: int, revision: int, states: frozenset[State] = frozenset()
    ) -> tuple[Listing, bytes | None, int]:
        """Up to ``limit`` subjects after key ``after`` (only those in ``states``, when given); the last key read
        if more follow."""
        base = self.keys.subjects(mailbox)
        start = after + b"\0" if after is not None else base
        async with work.turn() as read:
            response = await self.etcd.call(
                self.etcd.kv.Range,
                rpc.RangeRequest(key=start, range_end=prefix_end(base), limit=limit, revision=revision),
            )
            read(len(response.kvs))
        items: Listing = []
        for index, kv in enumerate(response.kvs):
            if index % _DECODED_PER_TURN == _DECODED_PER_TURN - 1:
                await asyncio.sleep(0)  # other calls' turn: a long read is decoded in slices
            if states and _codec.state_of(kv.value) not in states:
                continue
            parsed = self.keys.parse_mailbox_key(mailbox, kv.key)
            if parsed is not None:
                items.append((parsed[1], _stored(kv)))
        last = response.kvs[-1].key if response.more and response.kvs else None
        return items, last, int(response.header.revision)

    async def snapshot(self, mailbox: str, revision: int = 0) -> tuple[list[tuple[Subject, Stored]], int]:
        """Every subject of a mailbox, all read at one revision (``revision``, or the current one)."""
        items, last, revision = await self._range_subjects(mailbox, after=None, limit=_RANGE_PAGE, revision=revision)
        while last is not None:
            more, last, _ = await self._range_subjects(mailbox, after=last, limit=_RANGE_PAGE, revision=revision)
            items.extend(more)
        return items, revision

    async def changes_since(self, mailbox: str, after_revision: int) -> tuple[list[Change], int] | None:
        """What changed in a mailbox after ``after_revision``, one Change per subject whose record differs now
        (the two states compared, not every step between), in revision order, and the revision read; None
        when etcd no longer has the mailbox as of ``after_revision`` (compacted)."""
        now, revision = await self.snapshot(mailbox)
        try:
            before, _ = await self.snapshot(mailbox, after_revision)
        except RevisionCompacted:
            return None
        except FutureRevision:
            raise InvalidArgument("after_revision", f"{after_revision} is ahead of etcd's {revision}") from None
        marks_prefix = self.keys.end_marks(mailbox)
        marks = await self.etcd.call(
            self.etcd.kv.Range,
            rpc.RangeRequest(key=marks_prefix, range_end=prefix_end(marks_prefix), revision=revision),
        )
        ends: dict[Subject, tuple[EndMark, int]] = {}
        for kv in marks.kvs:
            parsed = self.keys.parse_mailbox_key(mailbox, kv.key)
            if parsed is not None:
                ends[parsed[1]] = (_codec.decode_end_mark(kv.value), int(kv.mod_revision))
        then, current = dict(before), dict(now)
        changes = []
        for subject in then.keys() | current.keys():
            previous, present = then.get(subject), current.get(subject)
            if previous is not None and present is not None and previous.revision == present.revision:
                continue
            end, at = ends.get(subject, (None, revision))
            if present is not None or end is None or previous is None or end.token != previous.token:
                end, at = None, present.revision if present is not None else revision
            changes.append(Change(subject=subject, previous=previous, now=present, end=end, revision=at))
        changes.sort(key=lambda change: change.revision)
        return changes, revision

    async def due_sends(self, limit: int = 256) -> tuple[list[Subject], int]:
        """SENDING subjects whose send marker etcd has expired (candidates for IN_DOUBT), both read at one
        revision, and that revision. No clock is read: the marker's lease is the send deadline."""
        index, markers = self.keys.sending_index(), self.keys.send_markers()
        response = await self._txn(
            [],
            [
                rpc.RequestOp(request_range=rpc.RangeRequest(key=index, range_end=prefix_end(index), keys_only=True)),
                rpc.RequestOp(
                    request_range=rpc.RangeRequest(key=markers, range_end=prefix_end(markers), keys_only=True)
                ),
            ],
            [],
            frozenset(),
        )
        sending = [self.keys.parse_sending(index, kv.key) for kv in response.responses[0].response_range.kvs]
        marked = {self.keys.parse_sending(markers, kv.key) for kv in response.responses[1].response_range.kvs}
        return [subject for subject in sending if subject not in marked][:limit], int(response.header.revision)

    # --- claims whose lease etcd restarted (coordinator/store/etcd/lapses.py) ----------------------------

    async def end_lapsed_claims(self) -> int:
        """Deletes the claims this replica wrote whose time has passed by its monotonic clock and whose lease etcd
        may have restarted since (a new raft term), each only while its key is still as written; returns how
        many. Asks etcd nothing while no remembered claim's time has passed. StoreUnavailable: try again."""
        if not self.lapses.overdue():
            return 0
        await self.current_revision()  # a read through the leader: the raft term as of now
        ended = 0
        for lapsed in self.lapses.due(self.etcd.raft_term):
            key = lapsed.key
            response = await self._txn(
                [_unchanged_since(key, lapsed.revision)], [_op_delete(key)], [], frozenset((key,))
            )
            self.lapses.forget(key)
            if response.succeeded:
                self._recent.pop(key, None)
                ended += 1
                log.warning(
                    "ended a claim whose TTL had passed while etcd restarted its lease (%s)",
                    key.decode(errors="replace"),
                    extra={"fields": {"event": "claim_lapsed", "key": key.decode(errors="replace")}},
                )
        return ended

    async def adopt_claims(self, left_s: Callable[[SubjectRecord, int], float | None], revision: int) -> int:
        """Remembers every claim etcd held at ``revision`` (of any replica), to be ended ``left_s(record, its mod
        revision)`` seconds from now (None: not this one): after etcd restarted, which started all their leases
        again. Returns how many."""
        start, end = self.keys.mailboxes(), prefix_end(self.keys.mailboxes())
        adopted, after = 0, start
        while True:
            response = await self.etcd.call(
                self.etcd.kv.Range, rpc.RangeRequest(key=after, range_end=end, limit=_RANGE_PAGE, revision=revision)
            )
            for kv in response.kvs:
                if not self.keys.is_subject(kv.key):
                    continue
                record = _codec.decode_record(kv.value)
                claimed = record.state is State.CLAIMED and record.expires_ms is not None
                left = left_s(record, int(kv.mod_revision)) if claimed else None
                if left is not None:
                    self.lapses.adopt(kv.key, int(kv.mod_revision), left)
                    adopted += 1
            if not response.more or not response.kvs:
                return adopted
            after = response.kvs[-1].key + b"\0"

    # --- watches -------------------------------------------------------------------------------------------

    def subscribe(self, mailbox: str) -> contextlib.AbstractAsyncContextManager[FeedQueue]:
        return self.feeds.subscribe(mailbox)

    def watch_stream(self, mailbox: str, start_revision: int) -> AsyncIterator[list[Change]]:
        return self._watch_mailbox(mailbox, start_revision)

    async def _watch_mailbox(self, mailbox: str, start_revision: int) -> AsyncIterator[list[Change]]:
        prefix = self.keys.mailbox(mailbox)
        create = rpc.WatchRequest(
            create_request=rpc.WatchCreateRequest(
                key=prefix, range_end=prefix_end(prefix), start_revision=start_revision, prev_kv=True
            )
        )
        requests: asyncio.Queue[Any] = asyncio.Queue()
        requests.put_nowait(create)

        async def outgoing() -> AsyncIterator[Any]:
            while True:
                yield await requests.get()

        endpoint, call = await self.etcd.open_watch(outgoing())
        try:
            async for response in call:
                if response.canceled:
                    raise FeedLost(
                        f"etcd cancelled the watch of mailbox {mailbox!r}: {response.cancel_reason or 'no reason'}"
                        + (f" (history compacted at {response.compact_revision})" if response.compact_revision else "")
                    )
                if response.events:
                    yield self._changes(mailbox, response.events)
        except grpc.aio.AioRpcError as error:
            raise await self.etcd.watch_failed(endpoint, error) from error
        finally:
            call.cancel()

    def _changes(self, mailbox: str, events: Sequence[Any]) -> list[Change]:
        ends: dict[tuple[int, Subject], EndMark] = {}
        subject_events: list[tuple[Subject, Any]] = []
        for event in events:
            parsed = self.keys.parse_mailbox_key(mailbox, event.kv.key)
            if parsed is None:
                continue
            kind, subject = parsed
            if kind == "e":
                if event.type == rpc.Event.PUT:
                    ends[(event.kv.mod_revision, subject)] = _codec.decode_end_mark(event.kv.value)
            else:
                subject_events.append((subject, event))
        changes = []
        for subject, event in subject_events:
            deleted = event.type == rpc.Event.DELETE
            previous = _stored(event.prev_kv) if event.HasField("prev_kv") else None
            revision = event.kv.mod_revision
            changes.append(
                Change(
                    subject=subject,
                    previous=previous,
                    now=None if deleted else _stored(event.kv),
                    end=ends.get((revision, subject)) if deleted else None,
                    revision=revision,
                )
            )
        return changes
