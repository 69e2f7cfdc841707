"""One etcd client for the store: the stubs of the endpoint in use (coordinator/store/etcd/channels.py), etcd's
authentication token (fetched again when it lapses), a deadline on every call, and etcd's errors translated
into StoreUnavailable with a message a person can act on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

import grpc
from aetcd import rpc

from coordinator.core.errors import StoreUnavailable
from coordinator.store.etcd.channels import EtcdChannels, EtcdEndpoint
from coordinator.store.etcd.settings import EtcdSettings

T = TypeVar("T")

log = logging.getLogger(__name__)

# Answers that only etcd's leader of the moment can give: writes and linearizable reads (a read-only
# transaction is linearizable too). A serializable read or a member's status answers with that member's own
# term, which a member cut off from the others raises at every campaign it starts.
_THROUGH_THE_LEADER = (rpc.TxnRequest, rpc.RangeRequest, rpc.LeaseGrantRequest)


def is_bad_auth_token(error: grpc.aio.AioRpcError) -> bool:
    # etcd's simple tokens lapse after 5 idle minutes and JWTs at their TTL; a new one fixes it.
    return error.code() is grpc.StatusCode.UNAUTHENTICATED and "token" in (error.details() or "")


class RevisionCompacted(StoreUnavailable):
    """A read at a revision etcd has compacted away: the history asked for is gone."""


class FutureRevision(StoreUnavailable):
    """A read at a revision etcd has not reached."""


def translate(error: grpc.aio.AioRpcError) -> StoreUnavailable:
    """etcd's failure as the coordinator's error, decided here once (etcd tells some only in its message)."""
    code = error.code()
    detail = error.details() or ""
    if code is grpc.StatusCode.OUT_OF_RANGE and "compacted" in detail:
        return RevisionCompacted(f"etcd has compacted that revision away ({detail})")
    if code is grpc.StatusCode.OUT_OF_RANGE and "future revision" in detail:
        return FutureRevision(f"etcd has not reached that revision ({detail})")
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


def is_quota_full(error: StoreUnavailable) -> bool:
    cause = error.__cause__
    return isinstance(cause, grpc.aio.AioRpcError) and cause.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


def is_lease_not_found(error: grpc.aio.AioRpcError) -> bool:
    return error.code() is grpc.StatusCode.NOT_FOUND and "lease" in (error.details() or "")


def _raft_term(response: Any) -> int:
    return int(response.header.raft_term)


class EtcdObserver(Protocol):
    """Told about every etcd call (for metrics); must not block."""

    def etcd_call(self, method: str, seconds: float, error: str | None) -> None: ...


class _NoObserver:
    def etcd_call(self, method: str, seconds: float, error: str | None) -> None:
        pass


class EtcdClient:
    def __init__(self, settings: EtcdSettings, observer: EtcdObserver) -> None:
        self.settings = settings
        self.observer = observer
        self.channels = EtcdChannels(settings)
        self._timeout = settings.call_timeout_s
        self._auth_metadata: tuple[tuple[str, str], ...] = ()
        self._auth_lock = asyncio.Lock()
        self.raft_term = 0
        """The latest raft term an answer through etcd's leader carried (docs/design.md#leases-and-expiry)."""

    # The stubs of the endpoint in use, looked up at each call so that a failover takes effect at once.
    @property
    def kv(self) -> Any:
        return self.channels.current.kv

    @property
    def maintenance(self) -> Any:
        return self.channels.current.maintenance

    @property
    def lease(self) -> Any:
        return self.channels.current.lease

    async def close(self) -> None:
        await self.channels.close()

    async def call(self, method: Callable[..., Awaitable[T]], request: Any) -> T:
        endpoint = self.channels.current  # the one ``method`` belongs to: the caller has just looked it up
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
                self.channels.failed(endpoint, error.code())
                if attempt == 0 and self.settings.username and is_bad_auth_token(error):
                    await self._authenticate(stale=metadata)
                    continue
                raise translate(error) from error
            self.observer.etcd_call(type(request).__name__, time.perf_counter() - started, None)
            if isinstance(request, _THROUGH_THE_LEADER) and not getattr(request, "serializable", False):
                self._saw_term(_raft_term(response))
            return response
        raise AssertionError("unreachable")

    def _saw_term(self, term: int) -> None:
        if term <= self.raft_term:
            return
        previous, self.raft_term = self.raft_term, term
        if previous == 0:
            log.info("etcd raft term %d", term, extra={"fields": {"event": "etcd_term", "term": term, "previous": 0}})
            return
        log.info(
            "etcd has a new leader (raft term %d, was %d): it restarts the TTL of every lease, so claims made "
            "before now may free up to the election timeout plus their TTL late; new claims go on leases "
            "granted from now on (docs/design.md#leases-and-expiry)",
            term,
            previous,
            extra={"fields": {"event": "etcd_term", "term": term, "previous": previous}},
        )

    async def open_watch(self, requests: AsyncIterator[Any]) -> tuple[EtcdEndpoint, Any]:
        """A Watch stream on the endpoint in use, and that endpoint (for ``watch_failed``)."""
        if self.settings.username and not self._auth_metadata:
            await self._authenticate(stale=())
        endpoint = self.channels.current
        return endpoint, endpoint.watch.Watch(requests, metadata=self._auth_metadata)

    async def watch_failed(self, endpoint: EtcdEndpoint, error: grpc.aio.AioRpcError) -> StoreUnavailable:
        """Notes a broken Watch stream (failover, a lapsed token) and returns the error to raise."""
        self.channels.failed(endpoint, error.code())
        if self.settings.username and is_bad_auth_token(error):
            await self._authenticate(stale=self._auth_metadata)
        return translate(error)

    async def _authenticate(self, stale: tuple[tuple[str, str], ...]) -> None:
        async with self._auth_lock:
            if self._auth_metadata != stale:
                return  # another call already fetched a fresh token
            try:
                answer = await self.channels.current.auth.Authenticate(
                    rpc.AuthenticateRequest(name=self.settings.username, password=self.settings.password or ""),
                    timeout=self._timeout,
                )
            except grpc.aio.AioRpcError as error:
                if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise translate(error) from error
                raise StoreUnavailable(
                    f"etcd refused our credentials for user {self.settings.username!r} ({error.details()}); "
                    "check the etcd user name and password"
                ) from error
            self._auth_metadata = (("token", answer.token),)
