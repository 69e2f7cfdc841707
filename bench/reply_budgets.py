"""What the agents' reply rules cost on the BeginSend path (docs/design.md#reply-storms), on one coordinator,
alternating in the same run. Each operation claims a message of a thread of its own from a correspondent of its
own (so no budget is ever spent and nothing is refused: the cost measured is the rules' reads and writes, not a
refusal), then calls BeginSend:

- ``claim+BeginSend, no rules (baseline)``: no thread, no correspondent, the send path as before the rules:
  BeginSend reads and writes the subject alone (from the replica's memory of its last write: one etcd request).
- ``budgets off``: the mailbox's budgets are off (the moved-on check only): BeginSend still reads the thread's
  newest inbound message (one more etcd request) and compares it in its transaction.
- ``budgets on``: the default budgets, thread and correspondent: BeginSend reads both windows and the newest
  inbound message (one more etcd request), and writes two more keys on their leases.

and the ClaimReply alone, without and with a thread and correspondent (a claim with a thread records the thread's
newest inbound message: one more read and write), so that BeginSend's own cost is a row less its claim's.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from inbox_wire.v1 import coordinator_pb2 as pb

from ._common import CoordinatorProcess, Environment, add_common_arguments, alternate, run_id
from ._load import Operation, channel, coordinator_stub, coordinator_workload, metadata, subject

TTL_SECONDS = 3600  # no claim expires during a run (see bench/calls.py)
GRANTED = pb.ClaimReplyResponse.GRANTED
OK = pb.FENCE_RESULT_OK
ASKED = Timestamp(seconds=1_700_000_000)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, seconds=4.0)


class _Operations:
    def __init__(self, stub: Any, run: str) -> None:
        self.stub = stub
        self.run = run

    async def claim(self, index: int, n: int, mailbox: str, tag: str, *, ruled: bool) -> int:
        ruled_fields: dict[str, Any] = (
            {"thread_id": f"t-{tag}-{n}", "received_at": ASKED, "correspondent": f"c-{tag}-{n}@shop.example"}
            if ruled
            else {}
        )
        request = pb.ClaimReplyRequest(
            request_id=f"c{tag}{n}", subject=subject(mailbox, f"{tag}-{n}"), ttl_seconds=TTL_SECONDS, **ruled_fields
        )
        response = await self.stub.ClaimReply(request, metadata=metadata(index))
        assert response.result == GRANTED, response
        return int(response.status.fencing_token)

    async def send(self, index: int, n: int, mailbox: str, tag: str, *, ruled: bool) -> None:
        token = await self.claim(index, n, mailbox, tag, ruled=ruled)
        begun = await self.stub.BeginSend(
            pb.BeginSendRequest(request_id=f"b{tag}{n}", subject=subject(mailbox, f"{tag}-{n}"), fencing_token=token),
            metadata=metadata(index),
        )
        assert begun.result == OK, begun

    def operations(self) -> list[tuple[str, Operation]]:
        on, off = f"bench-{self.run}-on", f"bench-{self.run}-off"

        async def claim_plain(index: int, n: int) -> None:
            await self.claim(index, n, on, "claim-plain", ruled=False)

        async def claim_ruled(index: int, n: int) -> None:
            await self.claim(index, n, on, "claim-ruled", ruled=True)

        async def send_plain(index: int, n: int) -> None:
            await self.send(index, n, on, "plain", ruled=False)

        async def send_budgets_off(index: int, n: int) -> None:
            await self.send(index, n, off, "off", ruled=True)

        async def send_budgets_on(index: int, n: int) -> None:
            await self.send(index, n, on, "on", ruled=True)

        return [
            ("claim+BeginSend, no rules (baseline)", send_plain),
            ("claim+BeginSend, budgets off", send_budgets_off),
            ("claim+BeginSend, budgets on", send_budgets_on),
            ("claim alone, no rules", claim_plain),
            ("claim alone, thread+correspondent", claim_ruled),
        ]


async def run(options: argparse.Namespace, env: Environment) -> int:
    print(
        f"== reply-budgets: the reply rules' cost on the BeginSend path; {options.clients} concurrent clients, "
        f"{options.seconds:g} s"
    )
    print(env.describe())
    name = run_id()
    async with contextlib.AsyncExitStack() as stack:
        process = CoordinatorProcess(
            env.tmp,
            env.etcd.endpoint,
            f"bench/{name}/",
            max_batch=64,
            in_flight=2,
            rate_limit=0,
            serve_args=("--reply-budget-overrides", f"bench-{name}-off=off,off"),
        )
        stack.callback(process.stop)
        stub = coordinator_stub(await stack.enter_async_context(channel(process.address)))
        operations = _Operations(stub, name).operations()
        workloads = [
            coordinator_workload(env, process, label, options.clients, operation) for label, operation in operations
        ]
        await alternate(workloads, options.rounds, options.seconds)
    return 0
