"""The store behind the contract suites: the in-memory one (fast loop) and a real etcd (the etcd marker)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from coordinator.core.storage import Store
from coordinator.ops.server import wall_clock_ms
from coordinator.store.etcd.settings import EtcdSettings
from coordinator.store.etcd.store import EtcdStore
from coordinator.store.memory import MemoryStore


@pytest.fixture(params=["memory", pytest.param("etcd", marks=pytest.mark.etcd)])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    if request.param == "memory":
        memory = MemoryStore(wall_clock_ms)
        yield memory
        await memory.close()
        return
    etcd = request.getfixturevalue("etcd")
    real = EtcdStore(EtcdSettings([etcd.endpoint], prefix=f"contract/{uuid.uuid4().hex}/"), wall_clock_ms)
    yield real
    await real.close()
