"""ClaimReply through the coordinator against the floor: a raw etcd put-if-absent transaction per claim.

Both loops run from this process with the same number of concurrent clients, alternating, against one
etcd; each claim is on a fresh subject (uncontended). The coordinator runs in its own process.
"""

from __future__ import annotations

import argparse
import tempfile
import uuid
from pathlib import Path

import grpc
from aetcd import rpc

from coordinator.etcd_process import EtcdServer, etcd_version
from inbox_claims._proto import coordinator_pb2 as pb
from inbox_claims._proto import coordinator_pb2_grpc as pb_grpc

from ._common import HEADER, CoordinatorProcess, Result, closed_loop


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0, help="per round and workload")
    parser.add_argument("--rounds", type=int, default=3)


async def raw_etcd_round(endpoint: str, clients: int, seconds: float) -> Result:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        kv = rpc.KVStub(channel)
        run = uuid.uuid4().hex

        async def claim(client: int, n: int) -> None:
            key = f"bench-raw/{run}/{client}/{n}".encode()
            response = await kv.Txn(
                rpc.TxnRequest(
                    compare=[rpc.Compare(key=key, result=rpc.Compare.EQUAL, target=rpc.Compare.VERSION, version=0)],
                    success=[rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=b"holder"))],
                    failure=[rpc.RequestOp(request_range=rpc.RangeRequest(key=key))],
                )
            )
            assert response.succeeded

        return await closed_loop("raw etcd txn (put-if-absent)", clients, seconds, claim)


async def coordinator_round(coordinator: CoordinatorProcess, clients: int, seconds: float) -> Result:
    async with grpc.aio.insecure_channel(coordinator.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        run = uuid.uuid4().hex
        metadata = (("x-inbox-principal", "bench"),)

        async def claim(client: int, n: int) -> None:
            response = await stub.ClaimReply(
                pb.ClaimReplyRequest(
                    request_id=f"{client}-{n}",
                    subject=pb.Subject(mailbox=f"bench-{run}", kind=pb.SUBJECT_KIND_MESSAGE, id=f"{client}-{n}"),
                    ttl_seconds=60,
                ),
                metadata=metadata,
            )
            assert response.result == pb.ClaimReplyResponse.GRANTED

        cpu_before = coordinator.cpu_seconds()
        result = await closed_loop("coordinator ClaimReply", clients, seconds, claim)
        return Result(
            result.name, result.ops, result.seconds, result.latencies_ms, coordinator.cpu_seconds() - cpu_before
        )


async def run(options: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        etcd = EtcdServer(Path(tmp) / "etcd", extra_args=["--quota-backend-bytes", str(8 << 30)])
        etcd.start()
        coordinator = CoordinatorProcess(etcd.endpoint, f"bench/{uuid.uuid4().hex}/")
        try:
            print(
                f"etcd {etcd_version(etcd.binary)}, {options.clients} concurrent clients, "
                f"{options.seconds:.0f} s rounds"
            )
            # Warm both paths (connections, lease buckets) before measuring.
            await raw_etcd_round(etcd.endpoint, options.clients, 1.0)
            await coordinator_round(coordinator, options.clients, 1.0)
            raw: list[Result] = []
            coord: list[Result] = []
            print(HEADER)
            for _ in range(options.rounds):
                raw.append(await raw_etcd_round(etcd.endpoint, options.clients, options.seconds))
                print(raw[-1].row())
                coord.append(await coordinator_round(coordinator, options.clients, options.seconds))
                print(coord[-1].row())
            raw_rate = sum(r.ops for r in raw) / sum(r.seconds for r in raw)
            coord_rate = sum(r.ops for r in coord) / sum(r.seconds for r in coord)
            raw_p99 = sorted(r.percentile(99) for r in raw)[len(raw) // 2]
            coord_p99 = sorted(r.percentile(99) for r in coord)[len(coord) // 2]
            print(
                f"throughput ratio coordinator/raw: {coord_rate / raw_rate:.2f}x "
                f"({coord_rate:.0f} vs {raw_rate:.0f} ops/s)"
            )
            print(
                f"p99 ratio coordinator/raw (median round): {coord_p99 / raw_p99:.2f}x "
                f"({coord_p99:.2f} vs {raw_p99:.2f} ms)"
            )
        finally:
            coordinator.stop()
            etcd.stop()
    return 0
