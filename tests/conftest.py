"""Fixtures: a real etcd (free loopback ports, a temp data dir, its log shown when a test fails) and real
coordinators serving gRPC on loopback."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from coordinator.api.auth import Authenticator
from coordinator.api.quotas import QuotaSettings
from coordinator.core.domain import Rules
from coordinator.core.limits import Limits
from coordinator.ops.server import CoordinatorServer, ServerSettings
from coordinator.store.etcd.process import EtcdServer, free_port
from coordinator.store.etcd.settings import EtcdSettings
from inbox_claims import RetryPolicy

from .helpers import Actor

# Short enough that expiry tests take seconds, long enough to sit above etcd's minimum lease TTL (2 s).
TEST_LIMITS = Limits(ttl_min_seconds=2, ttl_max_seconds=3600, ttl_default_seconds=60)

StartCoordinator = Callable[..., Awaitable[CoordinatorServer]]


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


# The fixtures that start an etcd; a test that uses one (directly or through another fixture) is marked
# ``etcd``. Modules that start etcd or a coordinator process themselves say so with ``pytestmark``.
ETCD_FIXTURES = frozenset({"shared_etcd", "private_etcd"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if ETCD_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.etcd)


def _failed(request: pytest.FixtureRequest) -> bool:
    return any(
        getattr(request.node, f"report_{when}", None) is not None and getattr(request.node, f"report_{when}").failed
        for when in ("setup", "call")
    )


@pytest.fixture(scope="session")
def shared_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd for the session; tests keep apart by each using its own key prefix."""
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def etcd(shared_etcd: EtcdServer, request: pytest.FixtureRequest) -> Iterator[EtcdServer]:
    yield shared_etcd
    if _failed(request):
        print(f"\n----- etcd log ({shared_etcd.log_path}), last lines -----\n{shared_etcd.log_tail(60)}")


@pytest.fixture
def private_etcd(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[EtcdServer]:
    """An etcd of this test's own, for tests that stop or kill it."""
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    yield server
    if _failed(request):
        print(f"\n----- private etcd log ({server.log_path}), last lines -----\n{server.log_tail(60)}")
    server.stop()


@pytest.fixture
def prefix() -> str:
    return f"test/{uuid.uuid4().hex}/"


def test_rules(**overrides: Any) -> Rules:
    return Rules(TEST_LIMITS, **overrides)


test_rules.__test__ = False  # type: ignore[attr-defined]


@pytest.fixture
async def start_coordinator(etcd: EtcdServer, prefix: str) -> AsyncIterator[StartCoordinator]:
    """Starts coordinators on the test's prefix (on the shared etcd unless ``endpoint`` is given)."""
    servers: list[CoordinatorServer] = []

    async def start(
        *,
        endpoint: str | None = None,
        sweep_interval_s: float = 0.2,
        etcd_options: dict[str, Any] | None = None,
        quotas: QuotaSettings | None = None,
        authenticator: Authenticator | None = None,
        **rules: Any,
    ) -> CoordinatorServer:
        etcd_settings = EtcdSettings([endpoint or etcd.endpoint], prefix=prefix, call_timeout_s=2.0)
        settings = ServerSettings(
            dataclasses.replace(etcd_settings, **(etcd_options or {})),
            listen="127.0.0.1:0",
            rules=test_rules(**rules),
            sweep_interval_s=sweep_interval_s,
            health_interval_s=0.3,
            shutdown_grace_s=1.0,
            quotas=quotas or QuotaSettings(),
            authenticator=authenticator,
        )
        server = CoordinatorServer(settings)
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop(grace=0.5)


@pytest.fixture
async def coordinator(start_coordinator: StartCoordinator) -> CoordinatorServer:
    return await start_coordinator()


@pytest.fixture
async def channel(coordinator: CoordinatorServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(coordinator.address) as chan:
        yield chan


@pytest.fixture
def agent(channel: grpc.aio.Channel) -> Actor:
    return Actor(channel, "agent-a")


@pytest.fixture
def other_agent(channel: grpc.aio.Channel) -> Actor:
    return Actor(channel, "agent-b")


@pytest.fixture
def human(channel: grpc.aio.Channel) -> Actor:
    return Actor(channel, "ana@example.com", kind="human")


@pytest.fixture
def mailbox() -> str:
    return f"grant-{uuid.uuid4().hex[:8]}"


PATIENT = RetryPolicy(attempts=12, initial_backoff=0.1, max_backoff=0.5)
"""Retries long enough to wait out a coordinator that is restarted."""


class LateCoordinator:
    """A coordinator at an address chosen now and started (or restarted) later."""

    def __init__(self, etcd: EtcdServer, prefix: str) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        self._settings = ServerSettings(
            EtcdSettings([etcd.endpoint], prefix=prefix), listen=self.address, rules=test_rules(), shutdown_grace_s=0.5
        )
        self.server: CoordinatorServer | None = None

    async def start(self) -> None:
        self.server = CoordinatorServer(self._settings)
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=0)
            self.server = None
