"""The only code that knows etcd: transactions, shared leases, watches. etcd errors are translated here.

It speaks etcd's v3 gRPC API through the generated messages and stubs that ``aetcd`` ships: its high-level
client has no nested transactions, no revision in a transaction's answer and no prev_kv watches, and the
raw stubs skip a layer of Python on the hot path.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc
from aetcd import rpc

from . import _codec
from ._keys import Keys, prefix_end
from .domain import DeliveryRecord, EndMark, State, Stored, Subject, SubjectRecord, Transition
from .errors import CoordinatorError, InvalidArgument, StoreConflict, StoreUnavailable
from .etcd_channels import EtcdChannels
from .etcd_channels import open_channel as open_channel  # where tests and tools have always found it
from .store_api import Change, ClaimAttempt, FeedLost, FeedQueue, Listing, decode_cursor, encode_cursor

__all__ = ["Change", "ClaimAttempt", "EtcdSettings", "EtcdStore", "FeedLost", "open_channel"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# A compare-and-swap that loses this many times in a row is reported instead of spinning.
_RECENT_WRITES = 4096  # subjects whose last write by this replica is remembered (~0.5 KiB each)
_CAS_ATTEMPTS = 32
_RANGE_PAGE = 1000


@dataclass(frozen=True)
class EtcdSettings:
    endpoints: Sequence[str]
    prefix: str = "inbox-coordinator/v1/"
    # Deadline of one etcd call: a store slower than this is reported UNAVAILABLE, not waited on forever.
    call_timeout_s: float = 5.0
    # Group commit: transactions that arrive while others are in flight are sent together, each as a
    # nested transaction of one etcd request (one raft entry, one fsync). 1 turns batching off.
    max_batch: int = 64
    # How many batches may be in flight at once. Two: while one is committed the next fills, which is what
    # Batch RPCs from busy clients need (1.04x the raw etcd loop against 0.94x with one); one suits agents
    # that make one call at a time (+15% for them). docs/performance.md, finding 1.
    max_batches_in_flight: int = 2
    # TLS to etcd: the CA that signed etcd's certificate, and a client certificate for --client-cert-auth.
    # Endpoints written https://... use TLS with the system's CAs when no CA file is given.
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    # etcd's own authentication (etcdctl user add; auth enable).
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def uses_tls(self) -> bool:
        return any((self.ca_file, self.cert_file, self.key_file)) or any(
            e.startswith("https://") for e in self.endpoints
        )


def _is_bad_auth_token(error: grpc.aio.AioRpcError) -> bool:
    # etcd's simple tokens lapse after 5 idle minutes and JWTs at their TTL; a new one fixes it.
    return error.code() is grpc.StatusCode.UNAUTHENTICATED and "token" in (error.details() or "")


def _translate(error: grpc.aio.AioRpcError) -> StoreUnavailable:
    code = error.code()
    detail = error.details() or ""
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return StoreUnavailable(
            f"etcd refused the write: {detail}; its storage quota is full (NOSPACE alarm) and every write waits "
            'for an operator to free space (docs/operations.md, "etcd quota full"); reads still answer'
        )
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return StoreUnavailable(f"etcd refused our credentials ({code.name}: {detail}); check the etcd user and role")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return StoreUnavailable(f"etcd is unavailable ({code.name}: {detail}); retry with the same request id")
    return StoreUnavailable(f"etcd failed the request ({code.name}: {detail})")


def _is_quota_full(error: StoreUnavailable) -> bool:
    cause = error.__cause__
    return isinstance(cause, grpc.aio.AioRpcError) and cause.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


def _is_lease_not_found(error: grpc.aio.AioRpcError) -> bool:
    return error.code() is grpc.StatusCode.NOT_FOUND and "lease" in (error.details() or "")


class _LeaseBuckets:
    """One etcd lease per expiry instant, shared by every key that expires then.

    A LeaseGrant costs as much as a transaction; a lease per claim would halve throughput. Keys are put
    with the lease of their (rounded-up) expiry, so the hot path grants at most once per bucket.

    Only the distance from now to an expiry counts, and buckets are kept on the monotonic clock: a step of the
    wall clock (NTP, a VM resumed) must not hand a new claim a lease granted minutes earlier for another instant.
    """

    def __init__(
        self,
        grant: Callable[[int], Awaitable[int]],
        clock: Callable[[], int],
        monotonic_ms: Callable[[], int] = lambda: time.monotonic_ns() // 1_000_000,
    ) -> None:
        self._grant = grant
        self._clock = clock
        self._monotonic_ms = monotonic_ms
        self._leases: dict[int, asyncio.Future[int]] = {}

    async def lease_for(self, expires_ms: int) -> int:
        now = self._monotonic_ms()
        bucket = _round_up(now + expires_ms - self._clock(), 1000)
        future = self._leases.get(bucket)
        if future is None or (future.done() and future.exception() is not None):
            future = asyncio.get_running_loop().create_future()
            self._leases[bucket] = future
            self._forget_past(now)
            try:
                ttl = max(1, math.ceil((bucket - now) / 1000))
                future.set_result(await self._grant(ttl))
            except BaseException as exc:
                del self._leases[bucket]
                future.set_exception(exc)
                future.exception()  # mark retrieved: the other waiters re-raise it themselves
                raise
        return await asyncio.shield(future)

    def _forget_past(self, now: int) -> None:
        for expiry in [e for e in self._leases if e < now]:
            del self._leases[expiry]

    def __len__(self) -> int:
        return len(self._leases)


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


class EtcdObserver(Protocol):
    """Told about every etcd call (for metrics); must not block."""

    def etcd_call(self, method: str, seconds: float, error: str | None) -> None: ...


class _NoObserver:
    def etcd_call(self, method: str, seconds: float, error: str | None) -> None:
        pass


class EtcdStore:
    def __init__(self, settings: EtcdSettings, clock: Callable[[], int], observer: EtcdObserver | None = None) -> None:
        self.settings = settings
        self.observer: EtcdObserver = observer or _NoObserver()
        self.keys = Keys(settings.prefix)
        self._clock = clock
        self._timeout = settings.call_timeout_s
        self._channels = EtcdChannels(settings)
        self._auth_metadata: tuple[tuple[str, str], ...] = ()
        self._auth_lock = asyncio.Lock()
        self._leases = _LeaseBuckets(self._grant_lease, clock)
        self.feeds = _FeedHub(self)
        self._batcher = _TxnBatcher(self._send_txn, settings.max_batch, settings.max_batches_in_flight)
        self._recent: OrderedDict[bytes, Stored] = OrderedDict()

    # The stubs of the endpoint in use, looked up at each call so that a failover takes effect at once.
    @property
    def _kv(self) -> Any:
        return self._channels.current.kv

    @property
    def _watch(self) -> Any:
        return self._channels.current.watch

    @property
    def _maintenance(self) -> Any:
        return self._channels.current.maintenance

    @property
    def _lease_stub(self) -> Any:
        return self._channels.current.lease

    @property
    def _auth(self) -> Any:
        return self._channels.current.auth

    @property
    def lease_buckets(self) -> int:
        """How many bucket leases this replica currently knows."""
        return len(self._leases)

    async def count_keys(self, prefix: bytes) -> int:
        """Keys under ``prefix`` (relative to the deployment prefix), count-only and serializable: etcd walks its
        index and reads no value, on whichever member answers."""
        start = self.keys.prefix.encode() + prefix
        response = await self._call(
            self._kv.Range, rpc.RangeRequest(key=start, range_end=prefix_end(start), count_only=True, serializable=True)
        )
        return int(response.count)

    @property
    def batch_stats(self) -> tuple[int, int]:
        """(etcd requests sent by the group commit, transactions they carried)."""
        return self._batcher.requests, self._batcher.transactions

    async def close(self) -> None:
        await self.feeds.close()
        await self._channels.close()

    async def _call(self, method: Callable[..., Awaitable[T]], request: Any) -> T:
        endpoint = self._channels.current  # the one ``method`` belongs to: the caller has just looked it up
        if self.settings.username and not self._auth_metadata:
            await self._authenticate(stale=())
        for attempt in range(2):
            started = time.perf_counter()
            metadata = self._auth_metadata
            try:
                response = await method(request, timeout=self._timeout, metadata=metadata)
            except grpc.aio.UsageError as error:  # our etcd channel is closed: this coordinator is stopping
                raise StoreUnavailable(
                    "this coordinator is shutting down; retry the call (on another replica)"
                ) from error
            except grpc.aio.AioRpcError as error:
                self.observer.etcd_call(type(request).__name__, time.perf_counter() - started, error.code().name)
                self._channels.failed(endpoint, error.code())
                if attempt == 0 and self.settings.username and _is_bad_auth_token(error):
                    await self._authenticate(stale=metadata)
                    continue
                raise _translate(error) from error
            self.observer.etcd_call(type(request).__name__, time.perf_counter() - started, None)
            return response
        raise AssertionError("unreachable")

    async def _authenticate(self, stale: tuple[tuple[str, str], ...]) -> None:
        async with self._auth_lock:
            if self._auth_metadata != stale:
                return  # another call already fetched a fresh token
            try:
                answer = await self._auth.Authenticate(
                    rpc.AuthenticateRequest(name=self.settings.username, password=self.settings.password or ""),
                    timeout=self._timeout,
                )
            except grpc.aio.AioRpcError as error:
                if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise _translate(error) from error
                raise StoreUnavailable(
                    f"etcd refused our credentials for user {self.settings.username!r} ({error.details()}); "
                    "check the etcd user name and password"
                ) from error
            self._auth_metadata = (("token", answer.token),)

    async def _send_txn(self, request: Any) -> Any:
        return await self._call(self._kv.Txn, request)

    async def _grant_lease(self, ttl: int) -> int:
        response = await self._call(self._lease_stub.LeaseGrant, rpc.LeaseGrantRequest(TTL=ttl))
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
            if isinstance(cause, grpc.aio.AioRpcError) and _is_lease_not_found(cause):
                # The cache outlived a lease (etcd restored from a backup, or a clock jump): grant anew.
                self._leases = _LeaseBuckets(self._grant_lease, self._clock)
                return await build()
            raise

    async def _lease(self, expires_ms: int | None) -> int:
        if expires_ms is None:
            return 0
        return await self._leases.lease_for(expires_ms)

    # --- health --------------------------------------------------------------------------------------------

    async def ping(self) -> str:
        """etcd's version; raises StoreUnavailable when no member answers."""
        response = await self._call(self._maintenance.Status, rpc.StatusRequest())
        return str(response.version)

    async def alarms(self) -> list[str]:
        """etcd's raised alarms (NOSPACE, CORRUPT), by name."""
        response = await self._call(
            self._maintenance.Alarm, rpc.AlarmRequest(action=rpc.AlarmRequest.GET, memberID=0, alarm=rpc.NONE)
        )
        return sorted({rpc.AlarmType.Name(alarm.alarm) for alarm in response.alarms})

    async def current_revision(self) -> int:
        response = await self._call(self._kv.Range, rpc.RangeRequest(key=self.keys.sending_family(), count_only=True))
        return int(response.header.revision)

    # --- claims --------------------------------------------------------------------------------------------

    async def claim(
        self,
        subject: Subject,
        record: SubjectRecord,
        delivery: DeliveryRecord | None,
        delivery_expires_ms: int,
    ) -> ClaimAttempt:
        """Create-if-absent in one transaction; on failure the same round trip reads what is in the way."""
        subject_key = self.keys.subject(subject)
        delivery_key = self.keys.delivery(delivery.mailbox, delivery.notification_id) if delivery is not None else None

        async def attempt() -> Any:
            compare = [_absent(subject_key)]
            success = [_op_put(subject_key, _codec.encode_record(record), await self._lease(record.expires_ms))]
            failure = [_op_get(subject_key)]
            if delivery is not None and delivery_key is not None:
                compare.append(_absent(delivery_key))
                lease = await self._lease(delivery_expires_ms)
                success.append(_op_put(delivery_key, _codec.encode_delivery(delivery), lease))
                failure.append(_op_get(delivery_key))
                failure.append(_op_get(self.keys.end_mark(subject)))
            return await self._txn(compare, success, failure, writes)

        writes = frozenset((subject_key,) if delivery_key is None else (subject_key, delivery_key))
        wrote = True
        try:
            response = await self._with_leases(attempt)
        except StoreUnavailable as error:
            if not _is_quota_full(error):
                raise
            # etcd refuses a transaction that could write, whatever its compare would say. What stands in the
            # way is still readable: a subject that is replied to or held, or a known delivery, is answered.
            reads = [_op_get(subject_key)]
            if delivery_key is not None:
                reads += [_op_get(delivery_key), _op_get(self.keys.end_mark(subject))]
            response, wrote = await self._txn([], reads, [], frozenset()), False
            if _first_kv(response.responses[0]) is None and (
                delivery_key is None or _first_kv(response.responses[1]) is None
            ):
                raise
        if wrote and response.succeeded:
            revision = response.header.revision
            created = Stored(record, token=revision, revision=revision)
            self._remember(subject_key, created)
            return ClaimAttempt(created, None, None)
        subject_kv = _first_kv(response.responses[0])
        delivery_kv = _first_kv(response.responses[1]) if delivery is not None else None
        end_kv = _first_kv(response.responses[2]) if delivery is not None else None
        return ClaimAttempt(
            None,
            _stored(subject_kv) if subject_kv is not None else None,
            _codec.decode_delivery(delivery_kv.value, subject.mailbox, delivery.notification_id)
            if delivery is not None and delivery_kv is not None
            else None,
            _codec.decode_end_mark(end_kv.value) if end_kv is not None else None,
            delivery_kv.mod_revision if delivery_kv is not None else 0,
        )

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
        subject_key = self.keys.subject(subject)
        # The first attempt may start from memory; every later one, and every answer that writes nothing, from etcd.
        known = self._recent.get(subject_key) if from_recent_write else None
        for _ in range(_CAS_ATTEMPTS):
            current: Stored | None
            last_end: EndMark | None
            if known is not None:
                current, last_end, known = known, None, None
                try:
                    transition = decide(current, last_end)
                except CoordinatorError:
                    continue  # decided on what may be stale: decide again on what etcd holds
                if transition.write is None and transition.end is None:
                    continue
            else:
                current, last_end = await self.read(subject)
                transition = decide(current, last_end)
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
                )
            )
            if response.succeeded:
                return transition, self._committed(subject_key, current, transition, response.header.revision)
            log.debug("compare-and-swap on %r lost a race; deciding again", subject_key)
        raise StoreConflict(f"the subject changed {_CAS_ATTEMPTS} times while this call ran; retry it")

    def _committed(self, subject_key: bytes, before: Stored, transition: Transition, revision: int) -> Stored | None:
        after = None if transition.write is None else Stored(transition.write, token=before.token, revision=revision)
        self._remember(subject_key, after)
        return after

    def _remember(self, subject_key: bytes, stored: Stored | None) -> None:
        """What this replica last wrote to a subject (None: it deleted it), for ``apply(from_recent_write=True)``."""
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
            if current.record.send_deadline_ms is not None:
                delete(self.keys.legacy_sending(current.record.send_deadline_ms, subject))
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
        if marker_gone:
            compare.append(_absent(self.keys.send_marker(subject)))
        return await self._txn(compare, ops, [], frozenset(writes))

    async def status(self, subject: Subject) -> Stored | None:
        response = await self._call(self._kv.Range, rpc.RangeRequest(key=self.keys.subject(subject)))
        return _stored(response.kvs[0]) if response.kvs else None

    async def list_subjects(
        self, mailbox: str, *, cursor: str | None, limit: int, revision: int = 0
    ) -> tuple[Listing, str | None, int]:
        """Up to ``limit`` subjects of a mailbox in key order, after the subject ``cursor`` names; a cursor for
        the next page if more follow."""
        after = self.keys.subject(decode_cursor(cursor, mailbox)) if cursor is not None else None
        items, more, revision = await self._range_subjects(mailbox, after=after, limit=limit, revision=revision)
        return items, encode_cursor(items[-1][0]) if more and items else None, revision

    async def _range_subjects(
        self, mailbox: str, *, after: bytes | None, limit: int, revision: int
    ) -> tuple[Listing, bytes | None, int]:
        """Up to ``limit`` subjects after key ``after``; the last key read if more follow."""
        base = self.keys.subjects(mailbox)
        start = after + b"\0" if after is not None else base
        response = await self._call(
            self._kv.Range,
            rpc.RangeRequest(key=start, range_end=prefix_end(base), limit=limit, revision=revision),
        )
        items: Listing = []
        for kv in response.kvs:
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
        except StoreUnavailable as error:
            if "compacted" in str(error):
                return None
            if "future revision" in str(error):
                raise InvalidArgument("after_revision", f"{after_revision} is ahead of etcd's {revision}") from None
            raise
        prefix = self.keys.mailbox(mailbox)
        marks = await self._call(
            self._kv.Range,
            rpc.RangeRequest(key=prefix + b"e/", range_end=prefix_end(prefix + b"e/"), revision=revision),
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

    async def adopt_legacy_sends(self, send_marker_expires_ms: int, limit: int = 256) -> int:
        """Moves SENDING subjects written by replicas that predate the send marker (a key holding a wall-clock
        deadline) to the leased marker, with a full send timeout from now: never earlier than they would have
        been IN_DOUBT, at most one send timeout later. Returns how many it moved."""
        start, end = self.keys.legacy_sending_range()
        response = await self._call(
            self._kv.Range, rpc.RangeRequest(key=start, range_end=end, limit=limit, keys_only=True)
        )
        lease = await self._lease(send_marker_expires_ms)
        for kv in response.kvs:
            subject = self.keys.parse_legacy_sending(kv.key)
            subject_key = self.keys.subject(subject)
            await self._txn(
                [rpc.Compare(key=kv.key, result=rpc.Compare.GREATER, target=rpc.Compare.VERSION, version=0)],
                [
                    _op_delete(kv.key),
                    _op_put(self.keys.sending(subject), subject_key),
                    _op_put(self.keys.send_marker(subject), subject_key, lease),
                ],
                [],
                frozenset((kv.key, self.keys.sending(subject), self.keys.send_marker(subject))),
            )
        return len(response.kvs)

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

        if self.settings.username and not self._auth_metadata:
            await self._authenticate(stale=())
        endpoint = self._channels.current
        call = endpoint.watch.Watch(outgoing(), metadata=self._auth_metadata)
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
            self._channels.failed(endpoint, error.code())
            if self.settings.username and _is_bad_auth_token(error):
                await self._authenticate(stale=self._auth_metadata)
            raise _translate(error) from error
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


@dataclass
class _Pending:
    request: Any
    keys: frozenset[bytes]
    future: asyncio.Future[Any]


class _TxnBatcher:
    """Group commit: many independent transactions in one etcd request, each nested, each with its own
    compare and its own outcome, all committed at one revision.

    A transaction goes out on the event loop's next pass when a batch slot is free, so a lone call waits for
    nothing, and the calls that one Batch RPC (or one wake-up of many callers) starts in one pass go together
    instead of the first alone; under load, what arrives while batches are in flight goes out together.
    etcd refuses one request that writes a key twice, so a transaction touching a key already in the batch
    waits for the next one: semantics stay exactly those of one transaction per call.
    """

    def __init__(self, send: Callable[[Any], Awaitable[Any]], max_batch: int, max_in_flight: int) -> None:
        self._send_one = send
        self._max_batch = max_batch
        self._max_in_flight = max_in_flight
        self._pending: list[_Pending] = []
        self._in_flight = 0
        self._launch_scheduled = False
        self.requests = 0
        self.transactions = 0

    async def submit(self, request: Any, writes: frozenset[bytes]) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(request, writes, future))
        if not self._launch_scheduled:
            self._launch_scheduled = True
            asyncio.get_running_loop().call_soon(self._launch)
        return await future

    def _launch(self) -> None:
        self._launch_scheduled = False
        while self._pending and self._in_flight < self._max_in_flight:
            batch = self._take()
            self._in_flight += 1
            task = asyncio.create_task(self._send(batch))
            task.add_done_callback(self._sent)

    def _take(self) -> list[_Pending]:
        batch: list[_Pending] = []
        written: set[bytes] = set()
        waiting: list[_Pending] = []
        for item in self._pending:
            if len(batch) >= self._max_batch or not written.isdisjoint(item.keys):
                waiting.append(item)
            else:
                batch.append(item)
                written.update(item.keys)
        self._pending = waiting
        return batch

    def _sent(self, _task: asyncio.Task[None]) -> None:
        self._in_flight -= 1
        self._launch()

    async def _send(self, batch: list[_Pending]) -> None:
        live = [item for item in batch if not item.future.cancelled()]
        if not live:
            return
        self.requests += 1
        self.transactions += len(live)
        try:
            if len(live) == 1:
                live[0].future.set_result(await self._send_one(live[0].request))
                return
            outer = rpc.TxnRequest(success=[rpc.RequestOp(request_txn=item.request) for item in live])
            response = await self._send_one(outer)
        except BaseException as error:
            for item in live:
                if not item.future.done():
                    item.future.set_exception(error)
            if not isinstance(error, Exception):
                raise
            return
        for item, answer in zip(live, response.responses, strict=True):
            nested = answer.response_txn
            nested.header.CopyFrom(response.header)
            if not item.future.done():
                item.future.set_result(nested)


def _round_up(ms: int, step: int) -> int:
    return math.ceil(ms / step) * step


@dataclass
class _Feed:
    """One etcd watch of one mailbox, fanned out to every subscriber's queue."""

    mailbox: str
    subscribers: set[FeedQueue] = field(default_factory=set)
    task: asyncio.Task[None] | None = None


# A subscriber this many batches behind is cut off (it re-subscribes and gets a fresh snapshot) rather
# than let one slow reader grow the coordinator's memory without bound. The batches are shared by every
# subscriber of the mailbox, so a queue costs 8 bytes a slot; what a stuck one can pin is at most this many
# batches of the mailbox's changes. The Watch handler's drain timeout usually ends a stuck stream first.
SUBSCRIBER_BACKLOG = 4096
# How long a feed keeps trying to resume its watch while etcd is unreachable before giving up.
FEED_RESUME_SECONDS = 10.0


class _FeedHub:
    """Shares one etcd watch per mailbox among all of its watchers."""

    def __init__(self, store: EtcdStore) -> None:
        self._store = store
        self._feeds: dict[str, _Feed] = {}
        self._lock = asyncio.Lock()

    @property
    def mailboxes(self) -> int:
        return len(self._feeds)

    @property
    def subscribers(self) -> int:
        return sum(len(feed.subscribers) for feed in self._feeds.values())

    @contextlib.asynccontextmanager
    async def subscribe(self, mailbox: str) -> AsyncIterator[FeedQueue]:
        queue: FeedQueue = asyncio.Queue(SUBSCRIBER_BACKLOG)
        async with self._lock:
            feed = self._feeds.get(mailbox)
            if feed is None:
                # Start at the current revision: every later change reaches the queue, and the
                # subscriber's snapshot (read after this) tells it which of them it already knows.
                start = await self._store.current_revision() + 1
                feed = _Feed(mailbox)
                feed.task = asyncio.create_task(self._run(feed, start), name=f"watch {mailbox}")
                self._feeds[mailbox] = feed
            feed.subscribers.add(queue)
        try:
            yield queue
        finally:
            feed.subscribers.discard(queue)
            if not feed.subscribers and self._feeds.get(mailbox) is feed:
                del self._feeds[mailbox]
                if feed.task is not None:
                    feed.task.cancel()

    async def _run(self, feed: _Feed, start_revision: int) -> None:
        next_revision = start_revision
        failing_since: float | None = None
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    async for changes in self._store.watch_stream(feed.mailbox, next_revision):
                        failing_since = None
                        next_revision = changes[-1].revision + 1 if changes else next_revision
                        self._deliver(feed, changes)
                except StoreUnavailable as error:
                    # etcd keeps history: resuming from the next revision loses nothing.
                    failing_since = failing_since or loop.time()
                    if loop.time() - failing_since > FEED_RESUME_SECONDS:
                        raise FeedLost(str(error)) from error
                    await asyncio.sleep(0.2)
        except FeedLost as lost:
            self._end(feed, lost)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # pragma: no cover - defensive: never leave watchers hanging
            log.exception("mailbox watch failed")
            self._end(feed, FeedLost(f"mailbox watch failed: {error}"))

    def _deliver(self, feed: _Feed, changes: list[Change]) -> None:
        if not changes:
            return
        for queue in list(feed.subscribers):
            try:
                queue.put_nowait(changes)
            except asyncio.QueueFull:
                feed.subscribers.discard(queue)
                with contextlib.suppress(asyncio.QueueEmpty):
                    queue.get_nowait()
                queue.put_nowait(
                    FeedLost(
                        f"this watcher fell {SUBSCRIBER_BACKLOG} batches of changes behind; "
                        "watch again for a fresh snapshot",
                        slow_subscriber=True,
                    )
                )

    def _end(self, feed: _Feed, lost: FeedLost) -> None:
        if self._feeds.get(feed.mailbox) is feed:
            del self._feeds[feed.mailbox]
        for queue in list(feed.subscribers):
            with contextlib.suppress(asyncio.QueueEmpty):
                while queue.full():
                    queue.get_nowait()
            queue.put_nowait(lost)

    async def close(self) -> None:
        for feed in list(self._feeds.values()):
            self._end(feed, FeedLost("the coordinator is shutting down"))
            if feed.task is not None:
                feed.task.cancel()
        self._feeds.clear()
