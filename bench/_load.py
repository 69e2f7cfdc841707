"""Client side of the benchmarks: channels, request builders and the workloads that several benchmarks share."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from aetcd import rpc

from inbox_claims import AsyncCoordinator
from inbox_wire.v1 import coordinator_pb2 as pb
from inbox_wire.v1 import coordinator_pb2_grpc as pb_grpc

from ._common import CoordinatorProcess, CpuMeter, Environment, Result, Workload, closed_loop

# Each simulated agent is a principal of its own, as in production: the coordinator's per-principal rate
# limit (500 calls/s by default) and watch slots (64) then apply per client, not to the whole benchmark.
_METADATA: dict[int, tuple[tuple[str, str], ...]] = {}


def metadata(client: int) -> tuple[tuple[str, str], ...]:
    found = _METADATA.get(client)
    if found is None:
        found = _METADATA[client] = (("x-inbox-principal", f"bench-agent-{client}"),)
    return found


ETCD_DURABILITY = "etcd: raft log + WAL fsync per batch"
NO_DURABILITY = "n/a (no state)"

Operation = Callable[[int, int], Awaitable[None]]


def channel(address: str) -> grpc.aio.Channel:
    # One HTTP/2 connection per target, as the coordinator's own etcd client has; 64 clients share it.
    return grpc.aio.insecure_channel(address)


def subject(mailbox: str, subject_id: str) -> pb.Subject:
    return pb.Subject(mailbox=mailbox, kind=pb.SUBJECT_KIND_MESSAGE, id=subject_id)


def put_if_absent(key: bytes, value: bytes = b"holder", *more: bytes) -> Any:
    """The raw claim: one transaction, create-if-absent on ``key`` (and on each of ``more``), reading the
    keys in its failure branch, the way the coordinator's claim does."""
    keys = (key, *more)
    return rpc.TxnRequest(
        compare=[rpc.Compare(key=k, result=rpc.Compare.EQUAL, target=rpc.Compare.VERSION, version=0) for k in keys],
        success=[rpc.RequestOp(request_put=rpc.PutRequest(key=k, value=value)) for k in keys],
        failure=[rpc.RequestOp(request_range=rpc.RangeRequest(key=k)) for k in keys],
    )


def etcd_workload(env: Environment, name: str, clients: int, operation: Operation) -> Workload:
    async def run(seconds: float) -> Result:
        meter = CpuMeter(None, env.etcd)
        return meter.stamp(await closed_loop(name, clients, seconds, operation))

    return Workload(name, run, ETCD_DURABILITY)


def group_commit_note(before: dict[str, Any], after: dict[str, Any]) -> str:
    """How many transactions each etcd request of the coordinator's group commit carried between two stats()."""
    if "batch_requests" not in after:
        return "no group commit"
    requests = after["batch_requests"] - before["batch_requests"]
    transactions = after["batch_transactions"] - before["batch_transactions"]
    return f"{transactions / requests:.1f} txn per etcd request" if requests else "unbatched"


def coordinator_workload(
    env: Environment, coordinator: CoordinatorProcess, name: str, clients: int, operation: Operation
) -> Workload:
    """Measures ``operation`` against ``coordinator``: its CPU, etcd's, and how many transactions each etcd
    request of the group commit carried."""

    async def run(seconds: float) -> Result:
        before = coordinator.stats()
        meter = CpuMeter(coordinator.cpu_seconds, env.etcd)
        result = meter.stamp(await closed_loop(name, clients, seconds, operation))
        note = group_commit_note(before, coordinator.stats())
        return Result(
            result.name,
            result.ops,
            result.seconds,
            result.latencies_ms,
            result.cpu_seconds,
            result.etcd_cpu_seconds,
            result.load_cpu_seconds,
            note,
        )

    return Workload(name, run, ETCD_DURABILITY)


@dataclass(frozen=True)
class Variant:
    """How a coordinator under test is run: group-commit settings, and which event loop."""

    max_batch: int
    in_flight: int
    uvloop: bool = False
    access_log: bool = False

    @property
    def label(self) -> str:
        batching = "unbatched" if self.max_batch <= 1 else f"group commit {self.max_batch}x{self.in_flight}"
        return batching + (", uvloop" if self.uvloop else "") + (", access log" if self.access_log else "")


def parse_coordinators(text: str) -> list[Variant]:
    """'64x2,1,64x2u,64x2a' -> group commit max_batch x batches in flight (1 = unbatched); a trailing u runs
    that coordinator on uvloop, a trailing a with serve's --access-log (a line per call)."""
    variants = []
    for part in text.split(","):
        spec = part.strip()
        flags = spec[len(spec.rstrip("ua")) :]
        batch, _, in_flight = spec.rstrip("ua").partition("x")
        variants.append(Variant(int(batch), int(in_flight or 1), "u" in flags, "a" in flags))
    return variants


def client_objects(stack: contextlib.AsyncExitStack, address: str, count: int) -> list[AsyncCoordinator]:
    """``count`` inbox_claims client objects (agent processes' worth), each a principal, closed with ``stack``."""
    objects = [AsyncCoordinator(address, principal=f"bench-agent-{k}") for k in range(count)]
    for client in objects:
        stack.push_async_callback(client.close)
    return objects


def shim_counts(options: argparse.Namespace) -> list[int]:
    """--shims 1,8 -> [1, 8]: one row per count of client objects."""
    return [int(part) for part in options.shims.split(",") if part.strip()]


def add_shim_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shims",
        default="1,8",
        help="rows through inbox_claims.AsyncCoordinator on the first coordinator: how many client objects "
        "share the clients (each one's concurrent calls go together in Batch RPCs); empty for none; "
        "default %(default)s",
    )
    parser.add_argument(
        "--rate-limit",
        type=float,
        default=0.0,
        help="the coordinators' calls/s per principal (0 = off, the default here: one client object can "
        "carry thousands of calls/s; serve's default is 500)",
    )


COORDINATORS_HELP = (
    "coordinators to compare: max_batch x batches in flight (1 = unbatched), a trailing u for uvloop, a for "
    "serve's --access-log; "
    "default %(default)s"
)


def start_coordinator(env: Environment, prefix: str, variant: Variant, rate_limit: float | None) -> CoordinatorProcess:
    """A coordinator process run as ``variant`` says, on the benchmark's etcd under ``prefix``."""
    return CoordinatorProcess(
        env.tmp,
        env.etcd.endpoint,
        prefix,
        max_batch=variant.max_batch,
        in_flight=variant.in_flight,
        uvloop=variant.uvloop,
        rate_limit=rate_limit,
        serve_args=("--access-log",) if variant.access_log else (),
    )


class Coordinators(contextlib.ExitStack):
    """One coordinator process per variant, all on one etcd, each with its own key prefix."""

    def __init__(self, env: Environment, variants: list[Variant], run: str, rate_limit: float | None = None) -> None:
        super().__init__()
        self.processes: list[tuple[str, CoordinatorProcess]] = []
        try:
            for index, variant in enumerate(variants):
                process = start_coordinator(env, f"bench/{run}/{index}/", variant, rate_limit)
                self.callback(process.stop)
                self.processes.append((variant.label, process))
        except BaseException:
            self.close()
            raise


def coordinator_stub(ch: grpc.aio.Channel) -> pb_grpc.CoordinatorStub:
    return pb_grpc.CoordinatorStub(ch)
