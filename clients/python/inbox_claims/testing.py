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
import tempfile
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict, Unpack

from ._async import AsyncCoordinator
from ._sync import Coordinator
from ._types import HolderKind, RetryPolicy
from ._webhooks import sign_nylas, sign_standard_webhook

if TYPE_CHECKING:
    from coordinator.server import ServerSettings

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


def _server_modules() -> Any:
    try:
        from coordinator import auth, domain, etcd_process, limits, server, store
    except ImportError as error:
        raise ImportError(
            "inbox_claims.testing starts a real coordinator, which needs the server: "
            "pip install 'inbox-coordinator[server]'"
        ) from error
    return auth, domain, etcd_process, limits, server, store


@contextlib.contextmanager
def _etcd(options: CoordinatorOptions) -> Iterator[str]:
    if "etcd_endpoint" in options:
        yield options["etcd_endpoint"]
        return
    _, _, etcd_process, _, _, _ = _server_modules()
    with contextlib.ExitStack() as stack:
        data_dir = options.get("data_dir") or stack.enter_context(tempfile.TemporaryDirectory(prefix="inbox-etcd-"))
        etcd = etcd_process.EtcdServer(Path(data_dir) / "etcd", log_path=Path(data_dir) / "etcd.log")
        etcd.start()
        stack.callback(etcd.stop)
        yield etcd.endpoint


class _ServerThread:
    """A CoordinatorServer on an event loop of its own, in a daemon thread."""

    def __init__(self, settings: ServerSettings) -> None:
        self._settings = settings
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.address = ""
        self._thread = threading.Thread(target=self._main, name="inbox-coordinator", daemon=True)

    def start(self, timeout: float = 30.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the coordinator did not start within {timeout} s")
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        _, _, _, _, server_module, _ = _server_modules()
        try:
            server = server_module.CoordinatorServer(self._settings)
            await server.start()
        except BaseException as error:
            self._error = error
            self._ready.set()
            return
        self._loop, self._stop, self.address = asyncio.get_running_loop(), asyncio.Event(), server.address
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await server.stop(grace=0.5)

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)


@contextlib.contextmanager
def running_coordinator(**options: Unpack[CoordinatorOptions]) -> Iterator[RunningCoordinator]:
    """Starts etcd (unless ``etcd_endpoint`` is given) and a coordinator; stops both on exit.

    Options: see :class:`CoordinatorOptions`. Yields a :class:`RunningCoordinator` (``.target``,
    ``.client(principal)``, ``.async_client(principal)``).
    """
    auth, domain, _, limits, server_module, store = _server_modules()
    prefix = options.get("prefix") or f"inbox-claims-test/{uuid.uuid4().hex}/"
    min_ttl = options.get("min_ttl", 5)
    rules = domain.Rules(
        limits.Limits(ttl_min_seconds=min_ttl, ttl_default_seconds=max(options.get("default_ttl", 60), min_ttl)),
        send_timeout_ms=int(options.get("send_timeout", 120.0) * 1000),
    )
    with _etcd(options) as endpoint:
        settings = server_module.ServerSettings(
            store.EtcdSettings([endpoint], prefix=prefix, call_timeout_s=2.0),
            listen=options.get("listen", "127.0.0.1:0"),
            rules=rules,
            sweep_interval_s=0.2,
            health_interval_s=0.5,
            shutdown_grace_s=1.0,
            authenticator=auth.TokenAuthenticator(Path(options["token_file"])) if "token_file" in options else None,
        )
        thread = _ServerThread(settings)
        thread.start()
        try:
            yield RunningCoordinator(target=thread.address, etcd_endpoint=endpoint, prefix=prefix)
        finally:
            thread.stop()


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
