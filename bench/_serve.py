"""The servers the benchmarks measure, each in a process of its own (started by ``bench._common``).

    python -m bench._serve --status-file F --etcd-endpoints E --prefix P [--max-batch N] [--in-flight N]
                           [--rate-limit R] [--uvloop]
    python -m bench._serve --status-file F --empty
    python -m bench._serve --status-file F --proxy --etcd-endpoints E --prefix P

The first builds the same ``CoordinatorServer`` as ``inbox-coordinator serve``, with the group-commit settings
that the CLI does not expose; the second is a grpc.aio server with nothing but the standard health service
(an empty handler: the ceiling of any Python gRPC server on this machine); the third, ``--proxy``, answers
ClaimReply with one etcd transaction and nothing more (the floor of any Python gRPC service in front of etcd:
what the coordinator's own work adds is the distance from it). All write JSON lines to the status
file: ``{"event": "serving", ...}`` once ready, and a ``stats`` line (batch counters, watch feeds, RSS) each
time they get SIGUSR1. They stop on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from coordinator import tracing
from coordinator.api.quotas import QuotaSettings
from coordinator.core.domain import Rules
from coordinator.core.limits import Limits
from coordinator.core.storms import DEFAULT_CORRESPONDENT_BUDGET, DEFAULT_THREAD_BUDGET
from coordinator.ops import logs
from coordinator.ops.budgets import budgets_for, overrides
from coordinator.ops.server import CoordinatorServer, ServerSettings
from coordinator.store.etcd.settings import EtcdSettings
from coordinator.store.etcd.store import EtcdStore


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class _StatusFile:
    def __init__(self, path: Path) -> None:
        self._path = path

    def write(self, **fields: Any) -> None:
        with self._path.open("a") as out:
            out.write(json.dumps(fields) + "\n")


async def _until_stopped(status: _StatusFile, stats: Any) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, lambda: status.write(event="stats", rss=_rss_bytes(), **stats()))
    await stop.wait()


async def _serve_coordinator(options: argparse.Namespace, status: _StatusFile) -> None:
    etcd = EtcdSettings(
        [options.etcd_endpoints],
        prefix=options.prefix,
        max_batch=options.max_batch,
        max_batches_in_flight=options.in_flight,
    )
    quotas = QuotaSettings(
        calls_per_second=options.rate_limit,
        max_watches=options.max_watches,
        work_per_second=options.work_rate,
        work_burst=options.work_burst,
    )
    tracing.start_from_environment()  # as inbox-coordinator serve: traced when OTEL_* say so
    # The reply budgets' defaults, and overrides by mailbox pattern as serve's --reply-budget-overrides.
    budgets = budgets_for(
        DEFAULT_THREAD_BUDGET, DEFAULT_CORRESPONDENT_BUDGET, overrides(options.reply_budget_overrides)
    )
    server = CoordinatorServer(
        ServerSettings(
            etcd,
            listen=options.listen,
            quotas=quotas,
            http_listen=options.http_listen,
            access_log=options.access_log,
            rules=Rules(Limits(), reply_budgets=budgets),
        )
    )
    await server.start()
    http = server.http.address if server.http is not None else ""
    status.write(event="serving", address=server.address, http=http, pid=os.getpid())

    def stats() -> dict[str, Any]:
        assert isinstance(server.store, EtcdStore)
        requests, transactions = server.store.batch_stats
        statistics = server.store.statistics()
        return {
            "batch_requests": requests,
            "batch_transactions": transactions,
            "feeds": statistics.watched_mailboxes,
            "subscribers": statistics.watch_subscribers,
        }

    await _until_stopped(status, stats)
    await server.stop(grace=1.0)
    tracing.close()


async def _serve_empty(options: argparse.Namespace, status: _StatusFile) -> None:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port(options.listen)
    await server.start()
    status.write(event="serving", address=f"{options.listen.rpartition(':')[0]}:{port}", pid=os.getpid())
    await _until_stopped(status, dict)
    await server.stop(1.0)


async def _serve_proxy(options: argparse.Namespace, status: _StatusFile) -> None:
    """The floor of a Python gRPC service in front of etcd: ClaimReply is one put-if-absent transaction on the
    subject's key, answered GRANTED, with no checks, records, leases, metrics or logs."""
    from aetcd import rpc

    from coordinator.ops.server import SERVICE_NAME
    from inbox_wire.v1 import coordinator_pb2 as pb

    from ._load import put_if_absent

    async with grpc.aio.insecure_channel(options.etcd_endpoints) as etcd_channel:
        kv = rpc.KVStub(etcd_channel)

        async def claim_reply(
            request: pb.ClaimReplyRequest, _context: grpc.aio.ServicerContext[Any, Any]
        ) -> pb.ClaimReplyResponse:
            key = f"{options.prefix}{request.subject.mailbox}/{request.subject.id}".encode()
            answer = await kv.Txn(put_if_absent(key))
            return pb.ClaimReplyResponse(
                result=pb.ClaimReplyResponse.GRANTED if answer.succeeded else pb.ClaimReplyResponse.HELD
            )

        handlers = {
            "ClaimReply": grpc.unary_unary_rpc_method_handler(
                claim_reply,
                request_deserializer=pb.ClaimReplyRequest.FromString,
                response_serializer=pb.ClaimReplyResponse.SerializeToString,
            )
        }
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        server.add_registered_method_handlers(SERVICE_NAME, handlers)
        port = server.add_insecure_port(options.listen)
        await server.start()
        status.write(event="serving", address=f"{options.listen.rpartition(':')[0]}:{port}", pid=os.getpid())
        await _until_stopped(status, dict)
        await server.stop(1.0)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench._serve", description=__doc__)
    parser.add_argument("--status-file", type=Path, required=True)
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--empty", action="store_true", help="only the health service (the gRPC ceiling)")
    parser.add_argument(
        "--proxy", action="store_true", help="ClaimReply as one etcd transaction and nothing else (the floor)"
    )
    parser.add_argument("--etcd-endpoints", default="")
    parser.add_argument("--prefix", default="bench/")
    parser.add_argument("--max-batch", type=int, default=EtcdSettings.max_batch)
    parser.add_argument("--in-flight", type=int, default=EtcdSettings.max_batches_in_flight)
    parser.add_argument(
        "--rate-limit",
        type=float,
        default=QuotaSettings.calls_per_second,
        help="calls/s per principal, 0 = off (default %(default)s, as inbox-coordinator serve)",
    )
    parser.add_argument("--max-watches", type=int, default=QuotaSettings.max_watches, help="per principal")
    parser.add_argument(
        "--work-rate",
        type=float,
        default=QuotaSettings.work_per_second,
        help="records read per second per principal, 0 = off (default %(default)s, as serve)",
    )
    parser.add_argument("--work-burst", type=int, default=QuotaSettings.work_burst, help="as serve's")
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop instead of asyncio's own loop")
    parser.add_argument("--http-listen", default="", help="HOST:PORT for the HTTP/JSON face (default: none)")
    parser.add_argument("--log-level", default="info", help="as serve's (default %(default)s, serve's default)")
    parser.add_argument("--access-log", action="store_true", help="a line per call at info, as serve --access-log")
    parser.add_argument("--reply-budget-overrides", default="", help="as serve's (default: none)")
    options = parser.parse_args()
    logs.setup(options.log_level.lower(), "json")  # what serve does: JSON lines on stderr (here the log file)
    status = _StatusFile(options.status_file)
    serve = (
        _serve_empty(options, status)
        if options.empty
        else _serve_proxy(options, status)
        if options.proxy
        else _serve_coordinator(options, status)
    )
    if options.uvloop:
        import uvloop

        uvloop.run(serve)
    else:
        asyncio.run(serve)
    return 0


if __name__ == "__main__":
    sys.exit(main())
