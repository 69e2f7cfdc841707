"""A real coordinator on an embedded etcd, for your own tests. Needs the ``[server]`` extra.

::

    from inbox_claims.testing import running_coordinator

    def test_my_agent_replies_once() -> None:
        with running_coordinator() as running, running.client("agent-1") as coord:
            ...

    # or, in an async test:
    async with async_running_coordinator() as running:
        async with running.async_client("agent-1") as coord:
            ...

As a pytest plugin (in your ``conftest.py``: ``pytest_plugins = ["inbox_claims.testing"]``) it provides the
``inbox_coordinator`` fixture: a fresh coordinator (on one etcd for the whole session, each test on its own key
prefix), with options from ``@pytest.mark.inbox_coordinator(send_timeout=0.5, min_ttl=2)``.

The coordinator runs in a background thread with its own event loop, so both the blocking and the asyncio
client work against it, from sync or async tests. Importing ``inbox_claims`` never imports the server; this
module imports it only when a coordinator is started.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Literal, TypedDict, Unpack

from ._async import AsyncCoordinator
from ._sync import Coordinator
from ._types import HolderKind, RetryPolicy
from ._webhooks import sign_nylas, sign_standard_webhook

__all__ = [
    "CoordinatorOptions",
    "RunningCoordinator",
    "async_running_coordinator",
    "running_coordinator",
    "sign_nylas",
    "sign_standard_webhook",
]


class CoordinatorOptions(TypedDict, total=False):
    """Options of :func:`running_coordinator` (all optional)."""

    etcd_endpoint: str
    """Use this etcd (HOST:PORT) instead of starting one: much faster when many tests start coordinators."""
    data_dir: str | Path
    """Where the started etcd keeps its data; default: a temporary directory, removed afterwards."""
    prefix: str
    """The etcd key prefix; default: a fresh one, so coordinators on one etcd never see each other's data."""
    listen: str
    """HOST:PORT to serve gRPC on; default ``127.0.0.1:0`` (a free port; see ``RunningCoordinator.target``)."""
    min_ttl: int
    """The smallest claim TTL accepted, seconds (production: 5; etcd's own minimum is 2)."""
    default_ttl: int
    """The TTL of claims that ask for none (production: 60)."""
    send_timeout: float
    """Seconds from BeginSend until an unconfirmed send is reported IN_DOUBT (production: 120)."""
    token_file: str | Path
    """A token file (docs/security.md): the coordinator then authenticates callers by bearer token, as in
    production, instead of believing the principal a client names."""


@dataclass(frozen=True)
class RunningCoordinator:
    """A coordinator started by :func:`running_coordinator`."""

    target: str
    """Where it serves gRPC (``127.0.0.1:<port>``): pass it to ``Coordinator``/``AsyncCoordinator``."""
    etcd_endpoint: str
    prefix: str

    def client(
        self,
        principal: str = "test-agent",
        *,
        kind: HolderKind | Literal["agent", "human"] = "agent",
        timeout: float = 5.0,
        retry: RetryPolicy | None = None,
    ) -> Coordinator:
        """A blocking client acting as ``principal``; close it (or use ``with``)."""
        return Coordinator(self.target, principal=principal, kind=kind, timeout=timeout, retry=retry)

    def async_client(
        self,
        principal: str = "test-agent",
        *,
        kind: HolderKind | Literal["agent", "human"] = "agent",
        timeout: float = 5.0,
        retry: RetryPolicy | None = None,
    ) -> AsyncCoordinator:
        """An asyncio client acting as ``principal``; close it (or use ``async with``)."""
        return AsyncCoordinator(self.target, principal=principal, kind=kind, timeout=timeout, retry=retry)


def _server() -> ModuleType:
    """The server's entry point for tests (``coordinator.testing``), imported only when a coordinator starts."""
    try:
        import coordinator.testing
    except ImportError as error:
        raise ImportError(
            "inbox_claims.testing starts a real coordinator, which needs the server: "
            "pip install 'inbox-coordinator[server]'"
        ) from error
    return coordinator.testing


@contextlib.contextmanager
def _etcd(options: CoordinatorOptions) -> Iterator[str]:
    if "etcd_endpoint" in options:
        yield options["etcd_endpoint"]
        return
    with _server().etcd_for_tests(options.get("data_dir")) as endpoint:
        yield endpoint


@contextlib.contextmanager
def running_coordinator(**options: Unpack[CoordinatorOptions]) -> Iterator[RunningCoordinator]:
    """Starts etcd (unless ``etcd_endpoint`` is given) and a coordinator; stops both on exit.

    Options: see :class:`CoordinatorOptions`. Yields a :class:`RunningCoordinator` (``.target``,
    ``.client(principal)``, ``.async_client(principal)``).
    """
    with (
        _etcd(options) as endpoint,
        _server().serve_in_thread(
            etcd_endpoint=endpoint,
            prefix=options.get("prefix", ""),
            listen=options.get("listen", "127.0.0.1:0"),
            min_ttl=options.get("min_ttl", 5),
            default_ttl=options.get("default_ttl", 60),
            send_timeout=options.get("send_timeout", 120.0),
            token_file=options.get("token_file"),
        ) as served,
    ):
        yield RunningCoordinator(target=served.address, etcd_endpoint=endpoint, prefix=served.prefix)


@contextlib.asynccontextmanager
async def async_running_coordinator(**options: Unpack[CoordinatorOptions]) -> AsyncIterator[RunningCoordinator]:
    """:func:`running_coordinator` for async code: starts and stops without blocking the event loop."""
    manager = running_coordinator(**options)
    running = await asyncio.to_thread(manager.__enter__)
    try:
        yield running
    finally:
        await asyncio.to_thread(manager.__exit__, None, None, None)


try:
    import pytest
except ImportError:  # the fixtures need pytest; running_coordinator does not
    pass
else:

    def pytest_configure(config: pytest.Config) -> None:
        config.addinivalue_line(
            "markers",
            "inbox_coordinator(**options): options of the inbox_coordinator fixture "
            "(min_ttl, default_ttl, send_timeout; see inbox_claims.testing.CoordinatorOptions)",
        )

    @pytest.fixture(scope="session")
    def inbox_coordinator_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
        """One etcd for the test session (its endpoint); each ``inbox_coordinator`` uses its own prefix."""
        with _etcd({"data_dir": tmp_path_factory.mktemp("inbox-etcd")}) as endpoint:
            yield endpoint

    @pytest.fixture
    def inbox_coordinator(inbox_coordinator_etcd: str, request: pytest.FixtureRequest) -> Iterator[RunningCoordinator]:
        """A real coordinator for this test (options from ``@pytest.mark.inbox_coordinator(...)``)."""
        marker = request.node.get_closest_marker("inbox_coordinator")
        options: CoordinatorOptions = {**(marker.kwargs if marker else {}), "etcd_endpoint": inbox_coordinator_etcd}
        with running_coordinator(**options) as running:
            yield running
