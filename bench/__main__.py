"""python -m bench {claims,contended,dedup,cycle,outgoing,reply-budgets,watch,slow-watchers,http,http-attacks,
list-claims,fair-reads,memory,embedded-db,mcp,mcp-faults,providers,profile,all} [options]; each --help says more.

Every benchmark starts the servers it needs (etcd, coordinators, redis-server, postgres) on loopback in a
temporary directory, measures a baseline in the same run, and prints ratios against it.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
from collections.abc import Awaitable, Callable

from . import (
    calls,
    claims,
    embedded_db,
    fair_reads,
    http,
    http_attacks,
    listing,
    mcp,
    mcp_faults,
    memory,
    outgoing,
    profile,
    providers,
    reply_budgets,
    slow_watchers,
    watch,
)
from ._common import Environment, SetupError, environment

Runner = Callable[[argparse.Namespace, Environment], Awaitable[int]]

BENCHMARKS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Runner]] = {
    "claims": (
        "uncontended ClaimReply vs raw etcd, the empty gRPC ceiling, Redis, PostgreSQL; batched vs unbatched",
        claims.add_arguments,
        claims.run,
    ),
    "contended": (
        "ClaimReply on a few hot subjects vs the same raw etcd transactions",
        functools.partial(calls.add_arguments, command="contended"),
        calls.runner("contended"),
    ),
    "dedup": (
        "ClaimReply with notification_id (delivery dedup), some redelivered, vs a raw 2-key etcd transaction",
        functools.partial(calls.add_arguments, command="dedup"),
        calls.runner("dedup"),
    ),
    "cycle": (
        "the full reply cycle (ClaimReply, BeginSend, ConfirmSent) vs the 3 raw etcd transactions it needs",
        functools.partial(calls.add_arguments, command="cycle"),
        calls.runner("cycle"),
    ),
    "outgoing": (
        "what replies written outside cost: ClaimReply with a thread, RecordOutgoing, vs ClaimReply as before",
        outgoing.add_arguments,
        outgoing.run,
    ),
    "reply-budgets": (
        "the agents' reply rules on the BeginSend path: budgets on, off, and no thread (the path as before)",
        reply_budgets.add_arguments,
        reply_budgets.run,
    ),
    "watch": (
        "Watch fan-out: delay from a claim to each of 1,000 watchers of its mailbox, vs raw etcd watches",
        watch.add_arguments,
        watch.run,
    ),
    "http": (
        "the HTTP/JSON face: Watch fan-out to 200 browser-style streams vs gRPC; coordinator CPU per call vs gRPC",
        http.add_arguments,
        http.run,
    ),
    "http-attacks": (
        "the HTTP face under attack: RSS under endless headers, connections held, gRPC health at a descriptor limit",
        http_attacks.add_arguments,
        http_attacks.run,
    ),
    "list-claims": (
        "ListClaims filtered by state on a 10,000-subject mailbox vs the unfiltered listing of it",
        listing.add_arguments,
        listing.run,
    ),
    "fair-reads": (
        "a quiet principal's GetStatus p50/p99 alone and beside another's costly reads, work budget off vs on",
        fair_reads.add_arguments,
        fair_reads.run,
    ),
    "slow-watchers": (
        "other callers' p99 and coordinator RSS while 200 Watch streams of one principal never read",
        slow_watchers.add_arguments,
        slow_watchers.run,
    ),
    "memory": (
        "coordinator RSS with 100,000 live claims and 1,000 watchers; claim cost as claims pile up",
        memory.add_arguments,
        memory.run,
    ),
    "embedded-db": (
        "the embedded etcd's database size over 200,000 claim cycles: levelled off by auto-compaction",
        embedded_db.add_arguments,
        embedded_db.run,
    ),
    "mcp": (
        "a send tool called through the MCP guard (claim, BeginSend, the call, ConfirmSent) vs called directly",
        mcp.add_arguments,
        mcp.run,
    ),
    "mcp-faults": (
        "the MCP guard and server under faults: a killed upstream, idle connections, a 64 MiB answer, made-up sessions",
        mcp_faults.add_arguments,
        mcp_faults.run,
    ),
    "providers": (
        "one customer message on each provider's path (Nylas, Graph, Gmail): calls per message, CPU per 1,000",
        providers.add_arguments,
        providers.run,
    ),
    "profile": (
        "py-spy profile of the coordinator under ClaimReply load: where its CPU goes",
        profile.add_arguments,
        profile.run,
    ),
}


# `all --quick`: every benchmark for about a second, small sizes (the smoke test runs this).
QUICK: dict[str, list[str]] = {
    "claims": ["--seconds", "0.25", "--rounds", "1"],
    "contended": ["--seconds", "0.25", "--rounds", "1", "--coordinators", "64x2"],
    "dedup": ["--seconds", "0.25", "--rounds", "1", "--coordinators", "64x2"],
    "cycle": ["--seconds", "0.25", "--rounds", "1", "--coordinators", "64x2"],
    "outgoing": ["--seconds", "0.25", "--rounds", "1"],
    "reply-budgets": ["--seconds", "0.25", "--rounds", "1"],
    "watch": ["--watchers", "50", "--events", "5", "--rounds", "1"],
    "slow-watchers": ["--hanging", "20", "--clients", "4", "--seconds", "0.5", "--rounds", "1", "--settle", "1"],
    "memory": ["--claims", "1000", "--mailboxes", "20", "--watchers", "50"],
    "embedded-db": ["--cycles", "2000", "--subjects", "500"],
    "http": ["--watchers", "20", "--events", "3", "--calls", "100", "--rounds", "1"],
    "http-attacks": [
        *("--line-mib", "2", "--lines-mib", "1", "--idle", "20", "--slowloris", "10", "--bodies", "10"),
        *("--hold", "1", "--held", "20"),
    ],
    "list-claims": ["--subjects", "300", "--sending", "3", "--rounds", "1"],
    "fair-reads": ["--subjects", "500", "--seconds", "0.5", "--rounds", "1", "--quiet-rate", "20"],
    "mcp": ["--sends", "20", "--rounds", "1"],
    "mcp-faults": [
        "--sends",
        "2",
        "--idle",
        "5",
        "--slowloris",
        "5",
        "--hold",
        "1",
        "--answer-mib",
        "1",
        "--sessions",
        "3",
    ],
    "providers": ["--messages", "5", "--lanes", "2", "--rounds", "1"],
    "profile": ["--seconds", "1", "--clients", "16", "--top", "5"],
}


async def _main(options: argparse.Namespace, parsers: dict[str, argparse.ArgumentParser]) -> int:
    async with environment() as env:
        if options.command != "all":
            return await BENCHMARKS[options.command][2](options, env)
        for name, (_, _, run) in BENCHMARKS.items():
            arguments = QUICK[name] if options.quick else []
            if name == "claims" and options.quick:
                found, missing = claims.available_baselines()
                # One Redis mode is enough to show the baseline works.
                arguments += ["--baselines", ",".join(b for b in found if b not in ("redis-everysec", "redis-always"))]
                for reason in missing:
                    print(f"bench all: skipping the {reason}")
            status = await run(parsers[name].parse_args(arguments), env)
            if status:
                return status
            print(flush=True)
        return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    parsers = {}
    for name, (help_text, add_arguments, _) in BENCHMARKS.items():
        parsers[name] = commands.add_parser(name, help=help_text, description=help_text)
        add_arguments(parsers[name])
    every = commands.add_parser("all", help="every benchmark in turn, with its defaults, on one etcd")
    every.add_argument("--quick", action="store_true", help="about a second each, small sizes (the smoke test)")
    options = parser.parse_args()
    try:
        return asyncio.run(_main(options, parsers))
    except SetupError as error:
        print(f"bench: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
