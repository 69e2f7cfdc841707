"""Reads of etcd beside a coordinator, for the tests and the fault harness: which lease holds a subject's key,
and how long etcd's leader says that lease has left. It has a client of its own, so a coordinator learns
nothing from these reads (not even etcd's raft term)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from aetcd import rpc

from coordinator.core.domain import Subject
from coordinator.core.errors import StoreUnavailable
from coordinator.store.etcd.client import EtcdClient, is_lease_not_found
from coordinator.store.etcd.keys import Keys
from coordinator.store.etcd.settings import EtcdSettings

__all__ = ["EtcdPeek", "KeyLease", "LeaseLeft"]


class _NoObserver:
    def etcd_call(self, method: str, seconds: float, error: str | None) -> None:
        pass


def _lease_gone(error: StoreUnavailable) -> bool:
    cause = error.__cause__
    return isinstance(cause, grpc.aio.AioRpcError) and is_lease_not_found(cause)


@dataclass(frozen=True)
class KeyLease:
    lease: int
    create_revision: int
    """The key's fencing token."""


@dataclass(frozen=True)
class LeaseLeft:
    read_at: float
    """Wall-clock time of the answer."""
    ttl_left_s: int
    """Whole seconds left, rounded down: etcd's leader will not expire the lease before ``read_at`` + this."""
    granted_ttl_s: int


class EtcdPeek:
    def __init__(self, endpoints: Sequence[str], prefix: str, *, call_timeout_s: float = 2.0) -> None:
        self.client = EtcdClient(EtcdSettings(endpoints, prefix=prefix, call_timeout_s=call_timeout_s), _NoObserver())
        self.keys = Keys(prefix)

    async def subject_lease(self, subject: Subject, *, attempts: int = 20) -> KeyLease | None:
        """The lease of ``subject``'s key (0: none), and the key's create revision; None when there is no key."""
        request = rpc.RangeRequest(key=self.keys.subject(subject))
        response = await self._call("kv", "Range", request, attempts)
        if not response.kvs:
            return None
        return KeyLease(int(response.kvs[0].lease), int(response.kvs[0].create_revision))

    async def lease_left(self, lease: int, *, attempts: int = 20) -> LeaseLeft | None:
        """What etcd's leader says is left of ``lease``; None once it has expired."""
        try:
            response = await self._call("lease", "LeaseTimeToLive", rpc.LeaseTimeToLiveRequest(ID=lease), attempts)
        except StoreUnavailable as error:
            if _lease_gone(error):
                return None
            raise
        if int(response.TTL) < 0:
            return None
        return LeaseLeft(time.time(), int(response.TTL), int(response.grantedTTL))

    async def _call(self, stubs: str, method: str, request: Any, attempts: int) -> Any:
        for attempt in range(attempts):  # a call to a member that has just died fails; the next one fails over
            try:
                return await self.client.call(getattr(getattr(self.client, stubs), method), request)
            except StoreUnavailable as error:
                if attempt == attempts - 1 or _lease_gone(error):
                    raise
                await asyncio.sleep(0.1)
        raise AssertionError("unreachable")

    async def close(self) -> None:
        await self.client.close()
