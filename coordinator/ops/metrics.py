"""Prometheus metrics of one coordinator: its own registry (several coordinators can share a process), the
observer the etcd store reports every call to, gauges refreshed off the hot path from the store's statistics
(any store: coordinator.core.storage.Store), and the /metrics server. The metric names are the operators'
(dashboards and alerts use them): the store's are named after etcd, its production store."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from coordinator.api.addresses import parse_host_port
from coordinator.core.errors import StoreUnavailable
from coordinator.core.storage import Store
from coordinator.ops import logs
from inbox_wire import VERSION

log = logging.getLogger(__name__)

# No *_created series: they double what every scrape carries and no alert here uses them.
disable_created_metrics()  # type: ignore[no-untyped-call]

NAMESPACE = "inbox_coordinator"
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """Every metric of one coordinator; also the etcd store's observer (``etcd_call``)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        counter = functools.partial(Counter, namespace=NAMESPACE, registry=r)
        gauge = functools.partial(Gauge, namespace=NAMESPACE, registry=r)
        histogram = functools.partial(Histogram, namespace=NAMESPACE, registry=r, buckets=_LATENCY_BUCKETS)
        self.rpcs = counter(
            "rpcs",
            "Finished calls by method and result: the response's result value (granted, held, ok, stale_token, ...) "
            "or, for an error, the lower-case gRPC status code (unavailable, invalid_argument, ...)",
            ["service", "method", "result"],
        )
        self.rpc_seconds = histogram(
            "rpc_duration_seconds",
            "Time to answer a unary call, by method (streams are not timed)",
            ["service", "method"],
        )
        self.rpcs_in_flight = gauge(
            "rpcs_in_flight", "Calls being served now (Watch streams included)", ["service", "method"]
        )
        self.etcd_seconds = histogram(
            "etcd_request_duration_seconds",
            "Time of one etcd call, by etcd method (Txn, Range, LeaseGrant)",
            ["method"],
        )
        self.etcd_errors = counter(
            "etcd_errors", "etcd calls that failed, by etcd method and gRPC status code", ["method", "code"]
        )
        self.watch_subscribers = gauge("watch_subscribers", "Open Watch streams (subscribers of mailbox feeds)")
        self.watched_mailboxes = gauge("watched_mailboxes", "Mailboxes with an etcd watch open (one per mailbox)")
        self.lease_buckets = gauge("lease_buckets", "Shared etcd leases (expiry buckets) in this replica's cache")
        self.etcd_keys = gauge(
            "etcd_keys",
            "Keys under the prefix by family, from a periodic count-only read: subjects (claims, sends, reply "
            "records and the short-lived end marks beside them), deliveries (delivery records), sending (SENDING "
            "deadlines not yet confirmed, aborted or marked IN_DOUBT)",
            ["family"],
        )
        self.etcd_alarm = gauge(
            "etcd_alarm",
            "1 while etcd has this alarm raised (NOSPACE: the storage quota is full and every write is refused)",
            ["alarm"],
        )
        self.serving = gauge("serving", "1 while the health service says SERVING (etcd reachable), else 0")
        self.http_connections = gauge(
            "http_connections", "Open connections to the HTTP face (from accept to close, TLS handshakes included)"
        )
        self.http_refusals = counter(
            "http_refusals",
            "Requests and connections the HTTP face refused before the API saw them, by reason (over_capacity, "
            "header_too_long, header_timeout, body_timeout, body_too_large, host_not_allowed, cross_origin, ...)",
            ["reason"],
        )
        self.build_info = gauge("build_info", "The version running", ["version"])
        self.build_info.labels(VERSION).set(1)
        r.register(_LogDrops())
        self._etcd_children: dict[str, Any] = {}

    # EtcdObserver: called on every etcd call, so it stays a dictionary lookup and an observe.
    def etcd_call(self, method: str, seconds: float, error: str | None) -> None:
        name = method.removesuffix("Request")
        histogram = self._etcd_children.get(name)
        if histogram is None:
            histogram = self._etcd_children[name] = self.etcd_seconds.labels(name)
        histogram.observe(seconds)
        if error is not None:
            self.etcd_errors.labels(name, error).inc()

    def value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """One sample's value (for tests and the check command)."""
        return self.registry.get_sample_value(name, labels or {})


class _LogDrops(Collector):
    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            f"{NAMESPACE}_log_records_dropped",
            "Log records dropped because the log sink (stderr) did not keep up",
            value=logs.dropped(),
        )


async def refresh_gauges(metrics: Metrics, store: Store, interval_s: float, key_count_interval_s: float) -> None:
    """Sets the gauges every ``interval_s``, and counts records in the store every ``key_count_interval_s`` (0:
    never)."""
    loop = asyncio.get_running_loop()
    next_count = loop.time()
    while True:
        statistics = store.statistics()
        metrics.watch_subscribers.set(statistics.watch_subscribers)
        metrics.watched_mailboxes.set(statistics.watched_mailboxes)
        metrics.lease_buckets.set(statistics.shared_leases)
        if key_count_interval_s > 0 and loop.time() >= next_count:
            next_count = loop.time() + key_count_interval_s
            try:
                for family, count in (await store.count_records()).items():
                    metrics.etcd_keys.labels(family).set(count)
            except StoreUnavailable as error:
                log.debug("key count skipped: %s", error)
        await asyncio.sleep(interval_s)


class MetricsServer:
    """``/metrics`` over HTTP on a thread of its own (prometheus_client's server)."""

    def __init__(self, metrics: Metrics, listen: str) -> None:
        host, port = parse_host_port(listen)
        self._host = host.strip("[]")
        try:
            self._httpd, self._thread = start_http_server(port, addr=self._host, registry=metrics.registry)
        except OSError as error:
            raise OSError(f"cannot serve metrics on {listen}: {error.strerror or error}") from error
        self.port = int(self._httpd.server_port)

    @property
    def address(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{host}:{self.port}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        thread: threading.Thread = self._thread
        with contextlib.suppress(RuntimeError):
            thread.join(5)
