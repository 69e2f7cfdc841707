"""ListClaims filtered by state on a big mailbox: what a support person's "show me what is stuck" costs.

A mailbox of --subjects claimed subjects (default 10,000), --sending of them (default 10, spread evenly) in
SENDING. Measured, in alternating rounds against the same coordinator and etcd:

- the baseline: the whole mailbox listed unfiltered, in pages of 1,000 (every subject read once);
- ``SENDING``, page_size 1: every SENDING subject found, page after page, to the end of the listing;
- ``IN_DOUBT`` (a state no subject is in), page_size 1: the same walk, which finds nothing.

For each: the time of the walk, the calls it took (pages) and the slowest single call, and the walk's time as
a ratio of the baseline's. Each filtered walk reads every subject of the mailbox once, as the baseline does, so
the ratio says what the filter adds to reading them.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import grpc

from inbox_wire.v1 import coordinator_pb2 as pb
from inbox_wire.v1 import coordinator_pb2_grpc as pb_grpc

from ._common import CoordinatorProcess, Environment, run_id
from ._load import subject

AGENT = (("x-inbox-principal", "bench-lister"),)
BATCH = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--subjects", type=int, default=10_000, help="claimed subjects in the mailbox")
    parser.add_argument("--sending", type=int, default=10, help="of them in SENDING, spread evenly")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default %(default)s)")


@dataclass
class _Walk:
    name: str
    seconds: list[float] = field(default_factory=list)
    calls: int = 0
    found: int = 0
    slowest_call: float = 0.0

    def row(self, baseline: float | None) -> str:
        best = min(self.seconds)
        ratio = f"{best / baseline:8.2f}x" if baseline else f"{'1.00x':>9}"
        per_walk = self.calls // len(self.seconds)
        return (
            f"{self.name:<36} {best * 1000:>10.1f} {per_walk:>7} {self.slowest_call * 1000:>12.1f} "
            f"{self.found // len(self.seconds):>6} {ratio}"
        )


HEADER = f"{'walk (best of rounds)':<36} {'ms':>10} {'calls':>7} {'slowest ms':>12} {'found':>6} {'vs base':>9}"


async def _fill(stub: pb_grpc.CoordinatorAsyncStub, mailbox: str, subjects: int, sending: int) -> None:
    every = subjects // sending if sending else 0
    tokens: dict[str, int] = {}
    for start in range(0, subjects, BATCH):
        ids = [f"m{index:06d}" for index in range(start, min(start + BATCH, subjects))]
        calls = [
            pb.BatchCall(
                claim_reply=pb.ClaimReplyRequest(request_id=run_id(), subject=subject(mailbox, i), ttl_seconds=3600)
            )
            for i in ids
        ]
        response = await stub.Batch(pb.BatchRequest(calls=calls), metadata=AGENT, timeout=60)
        for subject_id, result in zip(ids, response.results, strict=True):
            if every and int(subject_id[1:]) % every == every // 2:
                tokens[subject_id] = result.claim_reply.status.fencing_token
    for subject_id, token in tokens.items():
        await stub.BeginSend(
            pb.BeginSendRequest(request_id=run_id(), subject=subject(mailbox, subject_id), fencing_token=token),
            metadata=AGENT,
        )


async def _walk(
    stub: pb_grpc.CoordinatorAsyncStub,
    mailbox: str,
    states: list[pb.SubjectState.ValueType],
    page_size: int,
    walk: _Walk,
) -> None:
    token = ""
    started = time.perf_counter()
    while True:
        call_started = time.perf_counter()
        page = await stub.ListClaims(
            pb.ListClaimsRequest(mailbox=mailbox, states=states, page_size=page_size, page_token=token),
            metadata=AGENT,
            timeout=120,
        )
        walk.slowest_call = max(walk.slowest_call, time.perf_counter() - call_started)
        walk.calls += 1
        walk.found += len(page.subjects)
        token = page.next_page_token
        if not token:
            break
    walk.seconds.append(time.perf_counter() - started)


async def run(options: argparse.Namespace, env: Environment) -> int:
    print(
        f"== ListClaims by state: a mailbox of {options.subjects:,} claimed subjects, {options.sending} of them "
        f"SENDING; {options.rounds} rounds"
    )
    print(env.describe())
    coordinator = CoordinatorProcess(env.tmp, env.etcd.endpoint, f"bench/{run_id()}/", rate_limit=0)
    try:
        mailbox = f"list-{run_id()}"
        async with grpc.aio.insecure_channel(coordinator.address) as channel:
            stub: pb_grpc.CoordinatorAsyncStub = pb_grpc.CoordinatorStub(channel)
            started = time.perf_counter()
            await _fill(stub, mailbox, options.subjects, options.sending)
            print(f"filled in {time.perf_counter() - started:.1f} s")
            walks = [
                (_Walk("unfiltered, pages of 1,000 (baseline)"), [], 1000),
                (_Walk("SENDING, page_size 1"), [pb.SUBJECT_STATE_SENDING], 1),
                (_Walk("IN_DOUBT (none), page_size 1"), [pb.SUBJECT_STATE_IN_DOUBT], 1),
            ]
            for index in range(options.rounds):
                for walk, states, size in walks if index % 2 == 0 else walks[::-1]:
                    await _walk(stub, mailbox, states, size, walk)
        print(HEADER)
        baseline = min(walks[0][0].seconds)
        for walk, _states, _size in walks:
            print(walk.row(None if walk is walks[0][0] else baseline))
        print("(ms: the whole walk, first page to last; calls: pages it took; found: subjects listed)")
    finally:
        coordinator.stop()
    return 0
