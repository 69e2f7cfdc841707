"""Wires store, engine and servicer into a running grpc.aio server, with health, reflection and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from coordinator import tracing
from coordinator.api.auth import Authenticator, TlsSettings, server_credentials
from coordinator.api.http import BOARD_DIR, HttpFace, build_app
from coordinator.api.interceptor import RpcObserver
from coordinator.api.quotas import QuotaSettings
from coordinator.api.service import SERVICE_NAME as SERVICE_NAME  # the health name readiness probes ask for
from coordinator.api.service import CoordinatorServicer
from coordinator.core.domain import Rules
from coordinator.core.engine import Engine
from coordinator.core.errors import StoreUnavailable
from coordinator.core.limits import Limits
from coordinator.core.storage import Store
from coordinator.ops.metrics import Metrics, MetricsServer, refresh_gauges
from coordinator.store.etcd.settings import EtcdSettings
from coordinator.store.etcd.store import EtcdStore
from inbox_wire.http_guard import HostPolicy, HttpGuardSettings, Reporter
from inbox_wire.v1 import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# A health "service" that is SERVING for as long as the process serves, whatever etcd does: for liveness
# probes, which must not restart every replica while etcd is down (readiness uses SERVICE_NAME or "").
LIVENESS_SERVICE = "liveness"
# A health "service" that is NOT_SERVING while etcd's NOSPACE alarm is raised (its storage quota is full): every
# write is refused then, but reads, ALREADY_REPLIED and DUPLICATE_DELIVERY still answer, so "" and SERVICE_NAME
# stay SERVING rather than take every replica out of rotation (docs/operations.md, "etcd quota full").
WRITES_HEALTH_SERVICE = "writes"


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True)
class ServerSettings:
    # The etcd store's settings; None only for a server given its store (CoordinatorServer's ``store``).
    etcd: EtcdSettings | None
    listen: str = "127.0.0.1:50051"
    rules: Rules = field(default_factory=lambda: Rules(Limits()))
    sweep_interval_s: float = 1.0
    health_interval_s: float = 2.0
    shutdown_grace_s: float = 10.0
    # HOST:PORT for Prometheus' /metrics; empty serves none. When optional, a taken port is only a warning.
    metrics_listen: str = ""
    metrics_optional: bool = False
    gauge_interval_s: float = 1.0
    key_count_interval_s: float = 15.0
    # Who may call: None is development mode (the caller's metadata names it). See docs/security.md.
    authenticator: Authenticator | None = None
    tls: TlsSettings | None = None
    quotas: QuotaSettings = field(default_factory=QuotaSettings)
    max_message_bytes: int = 1 << 20
    # A call whose request message has not arrived this long after it opened is answered DEADLINE_EXCEEDED.
    request_timeout_s: float = 10.0
    access_log: bool = False  # every call at info; else answered and cancelled calls at debug
    # HTTP/2 streams (calls) one client connection may have open at once; a client queues those beyond it.
    max_streams_per_connection: int = 1000
    # HOST:PORT for the HTTP/JSON face (Connect protocol) and the claims board; empty serves none.
    http_listen: str = ""
    http_optional: bool = False
    # The HTTP face's deadlines (its body's is request_timeout_s, as for gRPC) and its connection cap (lowered
    # to the descriptor limit less http_guard.DESCRIPTOR_RESERVE), and the Host names it answers to besides
    # those it listens on.
    http_header_timeout_s: float = 10.0
    http_idle_timeout_s: float = 30.0
    http_max_connections: int = 1000
    http_allowed_hosts: tuple[str, ...] = ()


_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthService(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """grpc.health.v1, whose Watch streams also end at shutdown (after telling NOT_SERVING), so that they do
    not hold the drain open for the whole grace period as grpc_health's own servicer would."""

    def __init__(self) -> None:
        self._status: dict[str, health_pb2.HealthCheckResponse.ServingStatus] = {}
        self._change = asyncio.Event()
        self._closing = False

    def set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        if not self._closing:
            self._status[service] = status
            self._notify()

    def status(self, service: str) -> health_pb2.HealthCheckResponse.ServingStatus | None:
        return self._status.get(service)

    def shut_down(self) -> None:
        """NOT_SERVING for every service, for good."""
        self._closing = True
        for service in self._status:
            self._status[service] = _NOT_SERVING
        self._notify()

    def _notify(self) -> None:
        self._change.set()
        self._change = asyncio.Event()

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no health status for service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        last = None
        while True:
            change = self._change
            status = self._status.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            if self._closing:
                return
            await change.wait()


# Keepalive, both ways (docs/operations.md, "Connections"). The server pings a connection that has been quiet
# this long and closes it when the ping is not answered in time, so that a vanished client's calls and watches
# do not outlive it. A client may ping as often as every 10 s, also without calls; one that pings more often
# is sent GOAWAY (too_many_pings) after two strikes.
KEEPALIVE_TIME_MS = 60_000
KEEPALIVE_TIMEOUT_MS = 20_000
MIN_CLIENT_PING_INTERVAL_MS = 10_000
MAX_PING_STRIKES = 2


def grpc_options(settings: ServerSettings) -> list[tuple[str, int]]:
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_concurrent_streams", settings.max_streams_per_connection),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # gRPC 1.85 waits for its own ping timeout (60 s) and ignores keepalive_timeout_ms without this.
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
    ]


def _check_free(listen: str, setting: str) -> None:
    """OSError, in a line naming ``setting``, when another process listens on ``listen`` (gRPC would say only
    "Failed to bind", after logging its own lines)."""
    host, _, port = listen.rpartition(":")
    if port in ("", "0"):
        return
    try:
        addresses = socket.getaddrinfo(
            host.strip("[]") or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (OSError, ValueError):
        return  # gRPC says what it makes of the address
    for family, kind, proto, _name, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: a TIME_WAIT is no owner
            try:
                probe.bind(address)
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    raise OSError(
                        f"cannot serve on {listen} ({setting}): the port is taken, another process listens on it; "
                        f"stop that process or choose another port with {setting}"
                    ) from None


async def end_lapsed_claims(store: EtcdStore, interval_s: float) -> None:
    """Ends the claims etcd would keep past their time because it restarted their lease (a new leader, a cluster
    started again): docs/design.md#leases-and-expiry, "Across an outage or a restart". Every ``interval_s``; while
    etcd cannot be reached, it tries again at the next one."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            ended = await store.end_lapsed_claims()
        except StoreUnavailable as error:
            log.debug("lapsed claims not ended yet: %s", error)
            continue
        if ended:
            log.warning(
                "ended %d claim(s) whose time had passed while etcd restarted their lease (a leader change, or etcd "
                "stopped and started again)",
                ended,
            )


def _count(metrics: Metrics, reason: str) -> None:
    metrics.http_refusals.labels(reason).inc()


class CoordinatorServer:
    """One coordinator replica. Stateless: the store holds everything, so replicas can come and go.

    The store is etcd, as ``settings.etcd`` says, unless one is given (``store``: the memory store of the fast
    tests, say); the server reads its health, alarms and statistics through the Store protocol either way."""

    def __init__(self, settings: ServerSettings, metrics: Metrics | None = None, store: Store | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        if store is None:
            if settings.etcd is None:
                raise ValueError("ServerSettings.etcd is required unless the server is given its store")
            traces = tracing.active
            etcd_observer = traces.observe_etcd(self.metrics) if traces is not None else self.metrics
            store = EtcdStore(settings.etcd, wall_clock_ms, observer=etcd_observer)
        self.store: Store = store
        self.engine = Engine(self.store, settings.rules, wall_clock_ms)
        observer = RpcObserver(self.metrics, settings.request_timeout_s, access_log=settings.access_log)
        self._server = grpc.aio.server(options=grpc_options(settings))
        registry = observer.register_on(self._server)
        self.health = HealthService()
        self.servicer = CoordinatorServicer(
            self.engine, settings.authenticator, settings.quotas, batch_observer=observer
        )
        pb_grpc.add_CoordinatorServicer_to_server(self.servicer, registry)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, registry)
        reflection.enable_server_reflection((SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), registry)
        _check_free(settings.listen, "--listen")
        try:
            self.port = (
                self._server.add_secure_port(settings.listen, server_credentials(settings.tls))
                if settings.tls is not None
                else self._server.add_insecure_port(settings.listen)
            )
        except RuntimeError:  # grpc's "Failed to bind", with no more said
            self.port = 0
        if self.port == 0:
            raise OSError(f"cannot serve gRPC on {settings.listen} (--listen): the address is taken or not local")
        self.http: HttpFace | None = None
        # Why an optional HTTP face is not served (its default port and the fallbacks all failed), for the banner.
        self.http_problem = ""
        if settings.http_listen:
            reporter = Reporter(self.metrics.http_connections.set, lambda reason: _count(self.metrics, reason))
            app = build_app(
                self.servicer,
                observer,
                max_message_bytes=settings.max_message_bytes,
                board_dir=BOARD_DIR,
                hosts=HostPolicy.for_listen(settings.http_listen.rpartition(":")[0], settings.http_allowed_hosts),
                reporter=reporter,
            )
            tls = settings.tls
            self.http = HttpFace(
                app,
                settings.http_listen,
                ssl_certfile=str(tls.cert_file) if tls is not None else None,
                ssl_keyfile=str(tls.key_file) if tls is not None else None,
                ssl_client_ca=str(tls.client_ca_file) if tls is not None and tls.client_ca_file is not None else None,
                guard=HttpGuardSettings(
                    header_timeout_s=settings.http_header_timeout_s,
                    body_timeout_s=settings.request_timeout_s,
                    idle_timeout_s=settings.http_idle_timeout_s,
                    max_connections=settings.http_max_connections,
                ),
                reporter=reporter,
            )
        self.metrics_server: MetricsServer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped: asyncio.Event | None = None

    @property
    def address(self) -> str:
        host = self.settings.listen.rpartition(":")[0]
        return f"{host}:{self.port}"

    async def start(self) -> None:
        self._start_metrics_server()
        self.health.set(LIVENESS_SERVICE, _SERVING)
        self._set_serving(await self._store_reachable())
        await self._start_http()  # before gRPC: a port that was asked for and is taken stops the start
        await self._check_alarms()
        await self._server.start()
        settings = self.settings
        self._tasks = [
            asyncio.create_task(self.engine.run_sweeper(settings.sweep_interval_s), name="in-doubt sweeper"),
            asyncio.create_task(self._watch_health(), name="etcd health"),
            asyncio.create_task(
                refresh_gauges(self.metrics, self.store, settings.gauge_interval_s, settings.key_count_interval_s),
                name="metrics gauges",
            ),
        ]
        if isinstance(self.store, EtcdStore):
            self._tasks.append(
                asyncio.create_task(end_lapsed_claims(self.store, settings.sweep_interval_s), name="lapsed claims")
            )

    async def _start_http(self) -> None:
        if self.http is None:
            return
        try:
            # The default address (development mode) moves to a free port when taken; one asked for does not.
            await self.http.start(fall_back=self.settings.http_optional)
        except OSError as error:
            self.http = None
            why = (
                "the port is taken, another process listens on it; stop that process or choose another port with "
                "--http-listen"
                if error.errno == errno.EADDRINUSE
                else str(error)
            )
            if not self.settings.http_optional:
                raise OSError(f"cannot serve HTTP on {self.settings.http_listen} (--http-listen): {why}") from None
            self.http_problem = f"cannot serve HTTP on {self.settings.http_listen} ({why})"
            log.warning("%s; going on without it", self.http_problem)

    def _start_metrics_server(self) -> None:
        if not self.settings.metrics_listen:
            return
        try:
            self.metrics_server = MetricsServer(self.metrics, self.settings.metrics_listen)
        except OSError as error:
            if not self.settings.metrics_optional:
                raise
            log.warning("%s; going on without metrics", error)

    async def _store_reachable(self) -> bool:
        try:
            await self.store.ping()
            return True
        except StoreUnavailable as error:
            log.warning("the store is not reachable: %s", error)
            return False

    async def _check_alarms(self) -> None:
        """Reports etcd's NOSPACE alarm: the health service WRITES_HEALTH_SERVICE and the etcd_alarm gauge."""
        try:
            alarms = await self.store.alarms()
        except StoreUnavailable as error:
            log.warning("the store's alarms not read: %s", error)
            return
        nospace = "NOSPACE" in alarms
        if self.health.status(WRITES_HEALTH_SERVICE) != (_NOT_SERVING if nospace else _SERVING):
            log.log(
                logging.ERROR if nospace else logging.INFO,
                "health: writes %s",
                "NOT_SERVING: etcd's storage quota is full (NOSPACE alarm); reads still answer, every write is "
                'refused until an operator frees space (docs/operations.md, "etcd quota full")'
                if nospace
                else "SERVING",
            )
        self.health.set(WRITES_HEALTH_SERVICE, _NOT_SERVING if nospace else _SERVING)
        for alarm in ("NOSPACE", "CORRUPT"):
            self.metrics.etcd_alarm.labels(alarm).set(1 if alarm in alarms else 0)

    def _set_serving(self, serving: bool) -> None:
        status = _SERVING if serving else _NOT_SERVING
        self.health.set("", status)
        self.health.set(SERVICE_NAME, status)
        self.metrics.serving.set(1 if serving else 0)

    async def _watch_health(self) -> None:
        serving: bool | None = None
        while True:
            now_serving = await self._store_reachable()
            if now_serving:
                await self._check_alarms()
            if now_serving != serving:
                serving = now_serving
                self._set_serving(serving)
                log.info("health: %s", "SERVING" if serving else "NOT_SERVING (the store is unreachable)")
            await asyncio.sleep(self.settings.health_interval_s)

    async def stop(self, grace: float | None = None) -> None:
        """NOT_SERVING first; then refuse new calls, end watches with UNAVAILABLE (clients watch again
        elsewhere), let the calls in flight finish within ``grace`` seconds (cancel what is left), close etcd."""
        if self._stopped is not None:
            await self._stopped.wait()
            return
        self._stopped = asyncio.Event()
        try:
            self.health.shut_down()
            self.metrics.serving.set(0)
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            grace = self.settings.shutdown_grace_s if grace is None else grace
            if self.http is not None:
                # Its Watch streams end with the feeds closed below; uvicorn then waits for nothing.
                http_stopping = asyncio.create_task(self.http.stop(), name="http stop")
            draining = asyncio.create_task(self._server.stop(grace), name="drain")
            await asyncio.sleep(0)  # the server refuses new calls before any watcher is told to come back
            while not draining.done():
                # Watches would hold the grace period open. Closing again ends those that were subscribing.
                await self.store.end_subscriptions()
                await asyncio.wait({draining}, timeout=0.05)
            await draining
            if self.http is not None:
                await http_stopping
            await self.store.close()
            if self.metrics_server is not None:
                await asyncio.to_thread(self.metrics_server.close)
        finally:
            self._stopped.set()

    async def wait(self) -> None:
        await self._server.wait_for_termination()
