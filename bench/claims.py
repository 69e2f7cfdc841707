"""Uncontended ClaimReply through the coordinator, against baselines measured in the same run:

- raw etcd: one put-if-absent transaction per claim from this process (the floor the coordinator sits on; the
  baseline every ratio is against);
- the ceiling of a Python gRPC server here: an empty health-check handler in its own process;
- the floor of a Python gRPC service in front of etcd: ``ClaimReply`` answered by one put-if-absent transaction
  and nothing else (no checks, records, leases, metrics or logs), one RPC per claim as the unary rows;
- Redis ``SET key 1 NX EX ttl`` (AOF off, and optionally AOF with appendfsync everysec / always);
- PostgreSQL ``INSERT ... ON CONFLICT DO NOTHING`` with a row-count check (fsync and synchronous_commit on);
- the coordinator with group commit (default settings) and unbatched (max_batch=1), each in its own process,
  called by one raw gRPC stub call per claim, each client a principal of its own;
- the same default coordinator called through the Python client (``inbox_claims.AsyncCoordinator``.claim), the
  clients shared among ``--shims`` client objects (agent processes' worth; each a principal): the client sends
  the calls its tasks make at the same time together, in one Batch RPC;
- and through the Node client (``--node``, clients/node): the same number of concurrent claims through one
  ``inbox-claims`` Coordinator object, in a node process (bench/node.py).

Every claim is on a fresh subject. Every client library runs in this one process, with the same number of
concurrent clients, one connection per server for gRPC (HTTP/2 multiplexes) and one per client for Redis and
PostgreSQL (their protocols answer one request at a time per connection).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import shutil
from collections.abc import Awaitable, Callable
from typing import Any

from grpc_health.v1 import health_pb2, health_pb2_grpc

from inbox_claims import Subject
from inbox_wire.v1 import coordinator_pb2 as pb

from ._common import (
    CoordinatorProcess,
    CpuMeter,
    Environment,
    PostgresProcess,
    RedisProcess,
    Result,
    SetupError,
    Workload,
    add_common_arguments,
    alternate,
    closed_loop,
    postgres_bindir,
    run_id,
)
from ._load import (
    COORDINATORS_HELP,
    ETCD_DURABILITY,
    NO_DURABILITY,
    Coordinators,
    Variant,
    add_shim_arguments,
    channel,
    client_objects,
    coordinator_stub,
    coordinator_workload,
    etcd_workload,
    metadata,
    parse_coordinators,
    put_if_absent,
    shim_counts,
    start_coordinator,
    subject,
)
from .node import node_claims_workload, node_problem

BASELINES = ("grpc", "proxy", "redis", "redis-everysec", "redis-always", "postgres")
# Long enough that no claim expires during a run: etcd revoking the leases of an earlier round's claims would
# charge its CPU to whichever workload runs at that moment (the raw loop, whose keys never expire, most of all).
TTL_SECONDS = 3600


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, seconds=3.0)
    parser.add_argument(
        "--baselines",
        default=",".join(BASELINES),
        help="comma-separated, besides raw etcd (always run): %(default)s; empty for none",
    )
    parser.add_argument(
        "--coordinators",
        default="64x2,1",
        help=COORDINATORS_HELP,
    )
    add_shim_arguments(parser)
    parser.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="also a row of one ClaimReply RPC per claim spread over this many coordinator processes (the first "
        "variant's settings, one key prefix, as replicas behind a load balancer); 0: none (default)",
    )
    parser.add_argument(
        "--tracing",
        default="",
        help="also rows of the first variant's coordinator with traces off, and on (OTLP/HTTP to a receiver in this "
        "process) with these sampling ratios: comma-separated, e.g. off,0,1; with their ratios against 'off' "
        "(docs/performance.md#traces); default none",
    )
    parser.add_argument(
        "--node",
        choices=("auto", "yes", "no"),
        default="auto",
        help="the Node client's row (one inbox-claims object in a node process): auto runs it when Node and "
        "clients/node are installed; default %(default)s",
    )


def available_baselines() -> tuple[list[str], list[str]]:
    """The baselines whose servers and client libraries are installed here, and why the others are not."""
    found, missing = ["grpc", "proxy"], []
    redis_problem = (
        "redis-server not installed"
        if shutil.which("redis-server") is None
        else "Python package redis not installed"
        if importlib.util.find_spec("redis") is None
        else None
    )
    if redis_problem is None:
        found += ["redis", "redis-everysec", "redis-always"]
    else:
        missing.append(f"redis: {redis_problem}")
    try:
        postgres_bindir()
        postgres_problem = None if importlib.util.find_spec("asyncpg") else "Python package asyncpg not installed"
    except SetupError:
        postgres_problem = "PostgreSQL server binaries not found"
    if postgres_problem is None:
        found.append("postgres")
    else:
        missing.append(f"postgres: {postgres_problem}")
    return found, missing


def _redis_workload(server: RedisProcess, name: str, clients: int) -> tuple[Workload, Any]:
    try:
        import redis.asyncio
    except ImportError:
        raise SetupError("the redis baseline needs the Python package redis (pip install redis)") from None
    client = redis.asyncio.Redis(host="127.0.0.1", port=server.port, max_connections=clients)
    run = run_id()

    async def claim(index: int, n: int) -> None:
        created = await client.set(f"bench:{run}:{index}:{n}", "1", nx=True, ex=TTL_SECONDS)
        assert created, "SET NX found the key already there"

    async def measure(seconds: float) -> Result:
        meter = CpuMeter(server.cpu_seconds, None)
        return meter.stamp(await closed_loop(name, clients, seconds, claim))

    return Workload(name, measure, RedisProcess.DURABILITY[name.rsplit(" ", 1)[-1]]), client


async def _postgres_workload(server: PostgresProcess, clients: int, stack: contextlib.AsyncExitStack) -> Workload:
    try:
        import asyncpg  # type: ignore[import-untyped]
    except ImportError:
        raise SetupError("the postgres baseline needs the Python package asyncpg (pip install asyncpg)") from None
    setup = await asyncpg.connect(server.dsn)
    await setup.execute(
        "CREATE TABLE claims (subject text PRIMARY KEY, holder text NOT NULL, expires_at timestamptz NOT NULL)"
    )
    await setup.close()
    connections = [await asyncpg.connect(server.dsn) for _ in range(clients)]
    for connection in connections:
        stack.push_async_callback(connection.close)
    run = run_id()
    insert = (
        "INSERT INTO claims (subject, holder, expires_at) VALUES ($1, $2, now() + interval '60 seconds') "
        "ON CONFLICT DO NOTHING"
    )
    name = "postgres INSERT ON CONFLICT"

    async def claim(index: int, n: int) -> None:
        status = await connections[index].execute(insert, f"{run}/{index}/{n}", "bench")
        assert status == "INSERT 0 1", f"the claim did not insert a row: {status}"

    async def measure(seconds: float) -> Result:
        meter = CpuMeter(server.cpu_seconds, None)
        return meter.stamp(await closed_loop(name, clients, seconds, claim))

    return Workload(name, measure, "WAL fsync on commit (synchronous_commit on)")


async def replicas_workload(
    env: Environment,
    stack: contextlib.AsyncExitStack,
    variant: Variant,
    count: int,
    clients: int,
    run: str,
    rate_limit: float | None,
) -> Workload:
    """One ClaimReply RPC per claim, client ``i`` calling replica ``i % count``; the CPU column is all replicas'."""
    processes = []
    for _ in range(count):
        process = start_coordinator(env, f"bench/{run}/replicas/", variant, rate_limit)
        stack.callback(process.stop)
        processes.append(process)
    operations = [
        claim_operation(coordinator_stub(await stack.enter_async_context(channel(p.address))), f"replicas-{run}")
        for p in processes
    ]

    async def claim(index: int, n: int) -> None:
        await operations[index % count](index, n)

    name = f"coordinator ClaimReply, {count} replicas, {variant.label}"

    async def measure(seconds: float) -> Result:
        meter = CpuMeter(lambda: sum(p.cpu_seconds() for p in processes), env.etcd)
        return meter.stamp(await closed_loop(name, clients, seconds, claim))

    return Workload(name, measure, ETCD_DURABILITY)


def claim_operation(stub: Any, mailbox: str) -> Any:
    async def claim(index: int, n: int) -> None:
        response = await stub.ClaimReply(
            pb.ClaimReplyRequest(
                request_id=f"{index}-{n}", subject=subject(mailbox, f"{index}-{n}"), ttl_seconds=TTL_SECONDS
            ),
            metadata=metadata(index),
        )
        assert response.result == pb.ClaimReplyResponse.GRANTED, response

    return claim


async def shim_claim_operation(
    stack: contextlib.AsyncExitStack, address: str, shims: int, mailbox: str
) -> Callable[[int, int], Awaitable[None]]:
    """Claims through ``shims`` AsyncCoordinator objects, client ``i`` using object ``i % shims``."""
    objects = client_objects(stack, address, shims)

    async def claim(index: int, n: int) -> None:
        result = await objects[index % shims].claim(Subject.message(mailbox, f"{index}-{n}"), ttl=TTL_SECONDS)
        assert result.granted, result

    return claim


async def run(options: argparse.Namespace, env: Environment) -> int:
    baselines = [b.strip() for b in options.baselines.split(",") if b.strip()]
    unknown = set(baselines) - set(BASELINES)
    if unknown:
        raise SetupError(f"unknown baseline(s) {', '.join(sorted(unknown))}; choose from {', '.join(BASELINES)}")
    clients = options.clients
    print(f"== claims: uncontended ClaimReply, {clients} concurrent clients, {options.seconds:g} s rounds")
    print(env.describe())
    async with contextlib.AsyncExitStack() as stack:
        run = run_id()
        etcd_channel = await stack.enter_async_context(channel(env.etcd.endpoint))
        from aetcd import rpc

        kv = rpc.KVStub(etcd_channel)

        async def raw_claim(index: int, n: int) -> None:
            response = await kv.Txn(put_if_absent(f"bench-raw/{run}/{index}/{n}".encode()))
            assert response.succeeded

        workloads = [etcd_workload(env, "raw etcd txn (put-if-absent)", clients, raw_claim)]

        variants = parse_coordinators(options.coordinators)
        coordinators = stack.enter_context(Coordinators(env, variants, run, rate_limit=options.rate_limit))
        for label, process in coordinators.processes:
            stub = coordinator_stub(await stack.enter_async_context(channel(process.address)))
            workloads.append(
                coordinator_workload(
                    env, process, f"coordinator ClaimReply, {label}", clients, claim_operation(stub, f"bench-{run}")
                )
            )
        for shims in shim_counts(options):
            label, process = coordinators.processes[0]
            operation = await shim_claim_operation(stack, process.address, shims, f"bench-{run}-shim{shims}")
            name = f"coordinator via inbox_claims, {shims} client object(s), {label}"
            workloads.append(coordinator_workload(env, process, name, clients, operation))

        tracing_rows = await _tracing_workloads(options, env, stack, variants[0], clients, run)
        workloads += tracing_rows

        if options.replicas > 1:
            workloads.append(
                await replicas_workload(env, stack, variants[0], options.replicas, clients, run, options.rate_limit)
            )

        if options.node == "yes" or (options.node == "auto" and node_problem() is None):
            label, process = coordinators.processes[0]
            name = f"coordinator via Node inbox-claims, 1 client object, {label}"
            workloads.append(node_claims_workload(env, process, name, clients, f"bench-{run}-node"))
        elif options.node == "auto":
            print(f"claims: skipping the Node client row ({node_problem()})")

        if "grpc" in baselines:
            empty = CoordinatorProcess(env.tmp, empty=True)
            stack.callback(empty.stop)
            health = health_pb2_grpc.HealthStub(await stack.enter_async_context(channel(empty.address)))

            async def check(index: int, n: int) -> None:
                await health.Check(health_pb2.HealthCheckRequest())

            async def measure_empty(seconds: float) -> Result:
                meter = CpuMeter(empty.cpu_seconds, None)
                return meter.stamp(await closed_loop("empty Python gRPC handler", clients, seconds, check))

            workloads.append(Workload("empty Python gRPC handler", measure_empty, NO_DURABILITY))

        if "proxy" in baselines:
            proxy = CoordinatorProcess(env.tmp, env.etcd.endpoint, f"bench-proxy/{run}/", serve_args=("--proxy",))
            stack.callback(proxy.stop)
            stub = coordinator_stub(await stack.enter_async_context(channel(proxy.address)))
            name = "Python gRPC proxy: one etcd txn per ClaimReply, no logic"
            workloads.append(coordinator_workload(env, proxy, name, clients, claim_operation(stub, f"proxy-{run}")))

        for mode in ("off", "everysec", "always"):
            key = "redis" if mode == "off" else f"redis-{mode}"
            if key in baselines:
                server = RedisProcess(env.tmp, mode)
                stack.callback(server.stop)
                workload, client = _redis_workload(server, f"redis SET NX EX, AOF {mode}", clients)
                stack.push_async_callback(client.aclose)
                workloads.append(workload)

        if "postgres" in baselines:
            postgres = PostgresProcess(env.tmp)
            stack.callback(postgres.stop)
            workloads.append(await _postgres_workload(postgres, clients, stack))

        await alternate(workloads, options.rounds, options.seconds)
        coordinator_rows = [w for w in workloads if w.name.startswith("coordinator")]
        for workload in coordinator_rows:
            base = workloads[0]
            print(
                f"{workload.name}: {workload.rate() / base.rate():.2f}x the raw etcd loop's throughput "
                f"(target >= 1.0x), p99 {workload.p99() / base.p99():.2f}x (target <= 1.5x)"
            )
        if tracing_rows:
            off = next((w for w in tracing_rows if w.name.endswith(TRACES_OFF)), tracing_rows[0])
            for workload in tracing_rows:
                spent, spent_off = workload.cpu_per_10k("cpu_seconds"), off.cpu_per_10k("cpu_seconds")
                cpu = f", coordinator CPU per claim {spent / spent_off:.2f}x" if spent and spent_off else ""
                print(
                    f"{workload.name}: {workload.rate() / off.rate():.2f}x the throughput with traces off, "
                    f"p99 {workload.p99() / off.p99():.2f}x{cpu}"
                )
    return 0


TRACES_OFF = "traces off"


async def _tracing_workloads(
    options: argparse.Namespace,
    env: Environment,
    stack: contextlib.AsyncExitStack,
    variant: Variant,
    clients: int,
    run: str,
) -> list[Workload]:
    """``--tracing off,0,1``: the coordinator with traces off, and on with each sampling ratio, each in its own
    process exporting OTLP/HTTP to a receiver in this process; every ClaimReply comes without a caller's trace,
    so the sampler alone decides (parentbased_traceidratio)."""
    settings = [part.strip() for part in options.tracing.split(",") if part.strip()]
    if not settings:
        return []
    from coordinator.testing.otlp import OtlpReceiver

    receiver = stack.enter_context(OtlpReceiver())
    workloads = []
    for index, setting in enumerate(settings):
        environment = {"OTEL_SDK_DISABLED": "true"}
        name = TRACES_OFF
        if setting != "off":
            ratio = float(setting)
            environment = {
                "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.http_endpoint,
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                "OTEL_TRACES_SAMPLER_ARG": f"{ratio:g}",
            }
            name = f"traces on, sampled {ratio:g}"
        process = CoordinatorProcess(
            env.tmp,
            env.etcd.endpoint,
            f"bench/{run}/tracing-{index}/",
            max_batch=variant.max_batch,
            in_flight=variant.in_flight,
            uvloop=variant.uvloop,
            rate_limit=options.rate_limit,
            extra_env=environment,
        )
        stack.callback(process.stop)
        stub = coordinator_stub(await stack.enter_async_context(channel(process.address)))
        operation = claim_operation(stub, f"bench-{run}-tracing-{index}")
        workloads.append(coordinator_workload(env, process, f"coordinator ClaimReply, {name}", clients, operation))
    return workloads
