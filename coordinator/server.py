"""Wires store, engine and servicer into a running grpc.aio server, with health and reflection."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from inbox_claims._proto import coordinator_pb2 as pb
from inbox_claims._proto import coordinator_pb2_grpc as pb_grpc

from .domain import Rules
from .engine import Engine
from .errors import StoreUnavailable
from .limits import Limits
from .service import CoordinatorServicer
from .store import EtcdSettings, EtcdStore

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True)
class ServerSettings:
    etcd: EtcdSettings
    listen: str = "127.0.0.1:50051"
    rules: Rules = field(default_factory=lambda: Rules(Limits()))
    sweep_interval_s: float = 1.0
    health_interval_s: float = 2.0
    shutdown_grace_s: float = 10.0


class CoordinatorServer:
    """One coordinator replica. Stateless: etcd holds everything, so replicas can come and go."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.store = EtcdStore(settings.etcd, wall_clock_ms)
        self.engine = Engine(self.store, settings.rules, wall_clock_ms)
        self._server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", 1 << 20),
            ]
        )
        self._health = health.aio.HealthServicer()
        pb_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(self.engine), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self._server,
        )
        self.port = self._server.add_insecure_port(settings.listen)
        if self.port == 0:
            raise OSError(f"cannot listen on {settings.listen}: the address is taken or not local")
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def address(self) -> str:
        host = self.settings.listen.rpartition(":")[0]
        return f"{host}:{self.port}"

    async def start(self) -> None:
        await self._set_serving(await self._etcd_reachable())
        await self._server.start()
        self._tasks = [
            asyncio.create_task(self.engine.run_sweeper(self.settings.sweep_interval_s), name="in-doubt sweeper"),
            asyncio.create_task(self._watch_health(), name="etcd health"),
        ]

    async def _etcd_reachable(self) -> bool:
        try:
            await self.store.ping()
            return True
        except StoreUnavailable as error:
            log.warning("etcd is not reachable: %s", error)
            return False

    async def _set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self._health.set("", status)
        await self._health.set(SERVICE_NAME, status)

    async def _watch_health(self) -> None:
        serving: bool | None = None
        while True:
            now_serving = await self._etcd_reachable()
            if now_serving != serving:
                serving = now_serving
                await self._set_serving(serving)
                log.info("health: %s", "SERVING" if serving else "NOT_SERVING (etcd unreachable)")
            await asyncio.sleep(self.settings.health_interval_s)

    async def stop(self, grace: float | None = None) -> None:
        """NOT_SERVING first, then stop taking calls, let in-flight ones finish, then close etcd."""
        await self._health.enter_graceful_shutdown()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # Watches would hold the grace period open; they end first, with UNAVAILABLE, and clients re-watch.
        await self.store.feeds.close()
        await self._server.stop(self.settings.shutdown_grace_s if grace is None else grace)
        await self.store.close()

    async def wait(self) -> None:
        await self._server.wait_for_termination()
