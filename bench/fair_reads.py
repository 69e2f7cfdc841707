"""Fair reads: can one principal's costly reads slow another principal's calls?

A mailbox of --subjects claimed subjects (default 10,000), each with its notification and summary (so the mailbox
has as many recent deliveries). A quiet principal calls GetStatus at a steady --quiet-rate (default 50/s, a
helpdesk sidebar) and its latency is measured, alone and while another principal, with --attackers concurrent
callers as fast as the coordinator lets it (honouring RESOURCE_EXHAUSTED's retry delay), reads in one of the two
ways that cost the coordinator the most work for one call:

- ListClaims filtered by a state no subject is in, page_size 1: each call reads 5,000 subjects and lists none;
- ListRecentMessages with a query that matches nothing: each call reads 2,000 deliveries and searches them.

Against two coordinators in the same run, on the same etcd and mailbox: "before", the code of an earlier commit
(``--before-code DIR``: ``git archive REV | tar -x -C DIR``), or this code with the per-principal work budget off
(``--work-rate 0``: calls counted, not their work); and "after", this code as ``serve`` runs by default.
Printed: the quiet principal's p50 and p99 in each case and their ratio to its p50/p99 alone on the same
coordinator (the rounds alternate), and the attacker's calls/s and how many were refused.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from inbox_wire.v1 import coordinator_pb2 as pb
from inbox_wire.v1 import coordinator_pb2_grpc as pb_grpc

from ._common import CoordinatorProcess, Environment, percentile, run_id
from ._load import subject

QUIET = (("x-inbox-principal", "quiet-sidebar"),)
ATTACKER = (("x-inbox-principal", "heavy-reader"),)
BATCH = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--subjects", type=int, default=10_000, help="claimed subjects in the mailbox")
    parser.add_argument("--quiet-rate", type=float, default=100.0, help="the quiet principal's calls/s")
    parser.add_argument(
        "--quiet-call",
        choices=("GetStatus", "GetCaller"),
        default="GetStatus",
        help="what the quiet principal calls: GetStatus (one etcd read) or GetCaller (none: the coordinator alone)",
    )
    parser.add_argument("--attackers", type=int, default=4, help="the heavy reader's concurrent callers")
    parser.add_argument("--seconds", type=float, default=5.0, help="per round and case (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default %(default)s)")
    parser.add_argument(
        "--before-code",
        type=Path,
        default=None,
        help="run the 'before' coordinator from this checkout of an earlier commit (git archive REV | tar -x -C DIR) "
        "instead of this code with --work-rate 0",
    )
    parser.add_argument(
        "--after-args", default="", help="more arguments of the 'after' coordinator (bench._serve's), to try settings"
    )
    parser.add_argument(
        "--configs",
        default="before,after",
        help="coordinators to compare: before (--work-rate 0), after (serve's defaults); default %(default)s",
    )


@dataclass
class _Case:
    config: str
    attack: str
    latencies: list[list[float]] = field(default_factory=list)  # per round, ms
    attacker_calls: int = 0
    refused: int = 0
    seconds: float = 0.0

    def p(self, q: float) -> float:
        return statistics.median(percentile(sorted(round_), q) for round_ in self.latencies)


async def _fill(stub: pb_grpc.CoordinatorAsyncStub, mailbox: str, subjects: int) -> None:
    for start in range(0, subjects, BATCH):
        calls = [
            pb.BatchCall(
                claim_reply=pb.ClaimReplyRequest(
                    request_id=run_id(),
                    subject=subject(mailbox, f"m{index:06d}"),
                    notification_id=f"n{index:06d}",
                    ttl_seconds=3600,
                    summary=pb.MessageSummary(
                        subject_line=f"Refund for order {index}", sender=f"Customer {index} <c{index}@example.org>"
                    ),
                )
            )
            for index in range(start, min(start + BATCH, subjects))
        ]
        # A principal per batch: the fill is no principal's flood (each batch counts its calls against the rate).
        filler = (("x-inbox-principal", f"bench-filler-{start}"),)
        await stub.Batch(pb.BatchRequest(calls=calls), metadata=filler, timeout=60)


async def _quiet(stub: pb_grpc.CoordinatorAsyncStub, mailbox: str, rate: float, until: float, call: str) -> list[float]:
    """The quiet principal's calls at a steady rate (an open loop: a slow answer does not delay the next call)."""
    latencies: list[float] = []

    async def one(index: int) -> None:
        started = time.perf_counter()
        if call == "GetCaller":
            await stub.GetCaller(pb.GetCallerRequest(), metadata=QUIET, timeout=30)
        else:
            request = pb.GetStatusRequest(subject=subject(mailbox, f"m{index % 1000:06d}"))
            await stub.GetStatus(request, metadata=QUIET, timeout=30)
        latencies.append((time.perf_counter() - started) * 1000)

    tasks = []
    index = 0
    next_at = time.perf_counter()
    while next_at < until:
        await asyncio.sleep(max(next_at - time.perf_counter(), 0))
        tasks.append(asyncio.create_task(one(index)))
        index += 1
        next_at += 1 / rate
    await asyncio.gather(*tasks)
    return latencies


async def _attack(stub: pb_grpc.CoordinatorAsyncStub, mailbox: str, case: _Case, callers: int, until: float) -> None:
    attack = case.attack

    async def caller() -> None:
        while time.perf_counter() < until:
            try:
                if attack == "list-claims":
                    await stub.ListClaims(
                        pb.ListClaimsRequest(mailbox=mailbox, states=[pb.SUBJECT_STATE_IN_DOUBT], page_size=1),
                        metadata=ATTACKER,
                        timeout=60,
                    )
                else:
                    await stub.ListRecentMessages(
                        pb.ListRecentMessagesRequest(mailbox=mailbox, query="no such text anywhere"),
                        metadata=ATTACKER,
                        timeout=60,
                    )
                if time.perf_counter() <= until:  # a call answered after the round counts in none
                    case.attacker_calls += 1
            except grpc.aio.AioRpcError as error:
                if error.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                case.refused += 1
                delay = dict(error.trailing_metadata() or ()).get("retry-after-ms", "10")
                await asyncio.sleep(min(float(str(delay)), 1000.0) / 1000)

    await asyncio.gather(*(caller() for _ in range(callers)))


async def _round(stub: pb_grpc.CoordinatorAsyncStub, mailbox: str, case: _Case, options: argparse.Namespace) -> None:
    until = time.perf_counter() + options.seconds
    quiet = asyncio.create_task(_quiet(stub, mailbox, options.quiet_rate, until, options.quiet_call))
    if case.attack != "alone":
        await _attack(stub, mailbox, case, options.attackers, until)
    case.latencies.append(await quiet)
    case.seconds += options.seconds


async def run(options: argparse.Namespace, env: Environment) -> int:
    configs = [name.strip() for name in options.configs.split(",") if name.strip()]
    print(
        f"== fair reads: a quiet principal's {options.quiet_call} at {options.quiet_rate:g}/s, alone and beside "
        f"a heavy reader ({options.attackers} callers) on a mailbox of {options.subjects:,} subjects; "
        f"{options.rounds} rounds of {options.seconds:g} s"
    )
    print(env.describe())
    prefix = f"bench/{run_id()}/"
    before = options.before_code
    arguments = {"before": [] if before else ["--work-rate", "0"], "after": options.after_args.split()}
    code = {"before": before, "after": None}
    coordinators = {
        name: CoordinatorProcess(env.tmp, env.etcd.endpoint, prefix, serve_args=arguments[name], code=code[name])
        for name in configs
    }
    try:
        mailbox = f"fair-{run_id()}"
        channels = {name: grpc.aio.insecure_channel(process.address) for name, process in coordinators.items()}
        stubs = {name: pb_grpc.CoordinatorStub(channel) for name, channel in channels.items()}
        started = time.perf_counter()
        await _fill(stubs[configs[0]], mailbox, options.subjects)
        print(f"filled in {time.perf_counter() - started:.1f} s")
        cases = [_Case(config, attack) for config in configs for attack in ("alone", "list-claims", "recent-messages")]
        for index in range(options.rounds):
            shift = index % len(cases)
            for case in [*cases[shift:], *cases[:shift]]:
                await _round(stubs[case.config], mailbox, case, options)
        for channel in channels.values():
            await channel.close()
        print(
            f"{'coordinator':<12} {'beside':<16} {'p50 ms':>8} {'x alone':>8} {'p99 ms':>8} {'x alone':>8} "
            f"{'heavy calls/s':>14} {'refused/s':>10}"
        )
        for case in cases:
            alone = next(c for c in cases if c.config == case.config and c.attack == "alone")
            print(
                f"{case.config:<12} {case.attack:<16} {case.p(50):>8.2f} {case.p(50) / alone.p(50):>7.2f}x "
                f"{case.p(99):>8.2f} {case.p(99) / alone.p(99):>7.2f}x "
                f"{case.attacker_calls / case.seconds:>14.1f} {case.refused / case.seconds:>10.1f}"
            )
        print(
            f"(p50, p99: the quiet principal's {options.quiet_call}, the median round's; x alone: against its rounds "
            "alone)"
        )
    finally:
        for process in coordinators.values():
            process.stop()
    return 0
