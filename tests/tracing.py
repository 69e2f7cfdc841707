"""Shared by the traces tests: a traced coordinator process exporting to a real OTLP receiver, W3C trace ids, and
walking a received trace (docs/operations.md#traces)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

from coordinator.store.etcd.process import EtcdServer, free_ports
from coordinator.testing.otlp import ReceivedSpan
from tests.helpers import serve_process

SERVICE = "inbox.coordinator.v1.Coordinator"
COORDINATOR_SERVICE = "coordinator-under-test"


def traceparent(trace_id: str, span_id: str, sampled: bool = True) -> str:
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}"


def new_ids() -> tuple[str, str]:
    """A new trace id and span id, in hex."""
    return os.urandom(16).hex(), os.urandom(8).hex()


@contextlib.contextmanager
def serve_traced(etcd: EtcdServer, prefix: str, env: dict[str, str], *flags: str) -> Iterator[tuple[str, str]]:
    """``inbox-coordinator serve`` with ``env`` (its OTEL_* variables), spans sent every 50 ms: its gRPC and
    HTTP addresses."""
    port, http_port = free_ports(2)
    with serve_process(
        f"--listen=127.0.0.1:{port}",
        f"--http-listen=127.0.0.1:{http_port}",
        f"--etcd-endpoints={etcd.endpoint}",
        f"--etcd-prefix={prefix}",
        "--rate-limit=0",
        "--log-level=warning",
        *flags,  # after the defaults: the last of a flag wins
        env={"OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_SERVICE_NAME": COORDINATOR_SERVICE, **env},
    ):
        yield f"127.0.0.1:{port}", f"127.0.0.1:{http_port}"


def links_arrived(spans: list[ReceivedSpan]) -> bool:
    """Whether every span a received transaction links to (its group commit) has arrived too."""
    received = {span.span_id for span in spans}
    return all(span_id in received for span in spans if span.name == "etcd transaction" for _, span_id in span.links)


def under(spans: list[ReceivedSpan], parent: ReceivedSpan) -> list[ReceivedSpan]:
    """Every span below ``parent`` (children, their children, ...)."""
    found, frontier = [], [parent.span_id]
    while frontier:
        children = [span for span in spans if span.parent_span_id in frontier]
        found += children
        frontier = [span.span_id for span in children]
    return found


def calls_traced(trace_id: str, calls: int) -> Callable[[list[ReceivedSpan]], bool]:
    """Whether ``calls`` coordinator calls of the trace have arrived, each with an etcd request."""

    def enough(spans: list[ReceivedSpan]) -> bool:
        mine = [span for span in spans if span.trace_id == trace_id]
        servers = [span for span in mine if span.kind == "SERVER"]
        return len(servers) >= calls and sum(span.name.startswith("etcd ") for span in mine) >= calls

    return enough


def assert_store_beneath(spans: list[ReceivedSpan], server: ReceivedSpan) -> None:
    """The call's store work is beneath its span, within its time: its etcd transaction, and the etcd Txn that
    carried it, beneath the transaction or (for all but the first of a group commit's) in the ``etcd group
    commit`` span the transaction is linked to. ``spans``: every span received (a group commit's may be another
    trace's)."""
    below = under(spans, server)
    for child in below:
        assert child.start_ns >= server.start_ns, f"{child.name} starts before {server.name}"
        assert child.end_ns <= server.end_ns, f"{child.name} outlives {server.name}"
    transactions = [child for child in below if child.name == "etcd transaction"]
    assert transactions, f"{server.name} has no etcd transaction beneath it: {[child.name for child in below]}"
    by_id = {span.span_id: span for span in spans}
    for transaction in transactions:
        shared = [by_id[span_id] for _, span_id in transaction.links if span_id in by_id]
        carriers = [transaction] + [span for span in shared if span.name == "etcd group commit"]
        requests = [span for carrier in carriers for span in under(spans, carrier) if span.name == "etcd Txn"]
        assert requests, f"no etcd Txn carried {server.name}'s transaction"
        assert {request.kind for request in requests} == {"CLIENT"}
        assert {request.attributes["db.system.name"] for request in requests} == {"etcd"}
