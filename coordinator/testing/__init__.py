"""A real coordinator in this process, for tests: the documented entry point of the server for code that is not
the server (``inbox_claims.testing`` starts its coordinators here, never through the server's modules).

::

    from coordinator.testing import etcd_for_tests, serve_in_thread

    with etcd_for_tests(data_dir) as endpoint, serve_in_thread(etcd_endpoint=endpoint) as served:
        ...  # a client on served.address

The coordinator runs on an event loop of its own in a daemon thread, so blocking and asyncio clients both work
against it. Each one gets a fresh key prefix unless given one, so coordinators sharing an etcd never see each
other's data. Multi-member clusters and fault injection: ``coordinator.store.etcd.cluster``.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from coordinator.api.auth import TokenAuthenticator
from coordinator.core.domain import Rules
from coordinator.core.limits import Limits
from coordinator.ops.server import CoordinatorServer, ServerSettings
from coordinator.store.etcd.process import EtcdServer
from coordinator.store.etcd.settings import EtcdSettings

__all__ = ["ServedCoordinator", "etcd_for_tests", "serve_in_thread"]


@dataclass(frozen=True)
class ServedCoordinator:
    address: str
    """Where it serves gRPC (``127.0.0.1:<port>``)."""
    etcd_endpoint: str
    prefix: str
    """Its key prefix in etcd."""


@contextlib.contextmanager
def etcd_for_tests(data_dir: str | Path | None = None) -> Iterator[str]:
    """A single-member etcd on a free loopback port (its endpoint); its data in ``data_dir`` (default: a temporary
    directory, removed afterwards) and its log beside the data."""
    with contextlib.ExitStack() as stack:
        root = Path(data_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="inbox-etcd-")))
        etcd = EtcdServer(root / "etcd", log_path=root / "etcd.log")
        etcd.start()
        stack.callback(etcd.stop)
        yield etcd.endpoint


@contextlib.contextmanager
def serve_in_thread(
    *,
    etcd_endpoint: str,
    prefix: str = "",
    listen: str = "127.0.0.1:0",
    min_ttl: int = 5,
    default_ttl: int = 60,
    send_timeout: float = 120.0,
    token_file: str | Path | None = None,
) -> Iterator[ServedCoordinator]:
    """A coordinator on ``etcd_endpoint`` until the block ends. ``min_ttl``/``default_ttl`` in seconds (a default
    below the minimum is raised to it); ``send_timeout``: seconds from BeginSend to IN_DOUBT; ``token_file``: bearer
    tokens as in production (docs/security.md) instead of development mode. Quick upkeep (the IN_DOUBT sweep every
    0.2 s, health every 0.5 s), so that tests need not wait for production's intervals."""
    prefix = prefix or f"inbox-claims-test/{uuid.uuid4().hex}/"
    rules = Rules(
        Limits(ttl_min_seconds=min_ttl, ttl_default_seconds=max(default_ttl, min_ttl)),
        send_timeout_ms=int(send_timeout * 1000),
    )
    settings = ServerSettings(
        EtcdSettings([etcd_endpoint], prefix=prefix, call_timeout_s=2.0),
        listen=listen,
        rules=rules,
        sweep_interval_s=0.2,
        health_interval_s=0.5,
        shutdown_grace_s=1.0,
        authenticator=TokenAuthenticator(Path(token_file)) if token_file is not None else None,
    )
    thread = _ServerThread(settings)
    thread.start()
    try:
        yield ServedCoordinator(thread.address, etcd_endpoint, prefix)
    finally:
        thread.stop()


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
        try:
            server = CoordinatorServer(self._settings)
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
