"""The harness: starts the world, drives the workload and the faults, reads the end state, runs the checker.

The world: a 3-member etcd (real processes; each in its own network namespace when namespaces can be made, so
that one member can really be cut off), the latency proxy in front of it, two coordinators (the real CLI, each
given all three proxied endpoints, in different orders), K agents and a human tool on the real client shim, and
the record-only sink. Every child gets SIGKILL when the harness dies (``setpriv --pdeathsig``) and has a
lifetime of its own, so nothing outlives a run.

Phases: start; main phase (``duration`` seconds: deliveries on the seeded plan, the two fault lanes, the human's
takeovers); settle (every fault healed, then TTL + bound, so lapsed claims are free); final round (every
notification delivered once more); drain (agents idle, no subject left SENDING); final reads; stop; check.
"""

# The docstring is the command's --help. This module is the command line only: the phases are in chaos/run.py,
# the processes in chaos/processes.py, what the faults act on in chaos/targets.py.

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from . import netns
from .common import child_argv
from .config import ALL_KINDS, Config
from .run import run_world

# -------------------------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of main phase (default 180)")
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--messages", type=int, default=0, help="default: 1.5 per second of duration")
    parser.add_argument("--mailboxes", type=int, default=3)
    parser.add_argument("--ttl", type=int, default=5, help="claim TTL of the agents, seconds (default 5)")
    parser.add_argument("--takeovers", type=int, default=-1, help="human takeovers (default: one per 20 s)")
    parser.add_argument("--thread-fraction", type=float, default=0.2)
    parser.add_argument(
        "--faults", default="all", help=f"comma-separated kinds, 'all' or 'none' (kinds: {', '.join(ALL_KINDS)})"
    )
    parser.add_argument("--unfenced", action="store_true", help="NEGATIVE CONTROL: agents send without BeginSend")
    parser.add_argument(
        "--outside-fraction", type=float, default=0.2, help="threads a person answers from Gmail (default 0.2)"
    )
    parser.add_argument(
        "--ignore-outgoing",
        action="store_true",
        help="NEGATIVE CONTROL: agents answer the mailbox's own messages as if customers had written them",
    )
    parser.add_argument("--storms", type=int, default=1, help="how many of each reply-storm actor (default 1; 0: none)")
    parser.add_argument(
        "--ignore-reply-rules",
        action="store_true",
        help="NEGATIVE CONTROL: agents answer automated mail and send when BeginSend refuses (budget, moved on)",
    )
    parser.add_argument(
        "--no-look", action="store_true", help="agents do not look at the thread before their commit point"
    )
    parser.add_argument(
        "--no-agent-retry",
        action="store_true",
        help="agents never retry a notification after the coordinator was unreachable (shows a silent drop)",
    )
    parser.add_argument("--sink-fail-rate", type=float, default=0.02, help="sends with an unknown outcome")
    parser.add_argument("--no-netns", action="store_true", help="loopback only (the partition fault is skipped)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--etcd-bin", type=Path, default=None)
    parser.add_argument("--allow-unsafe-etcd", action="store_true")
    parser.add_argument(
        "--etcd-arg", action="append", default=[], help="an extra etcd flag, e.g. --etcd-arg=--pre-vote (repeatable)"
    )
    parser.add_argument("--json-out", type=Path, default=None, help="also write the summary JSON here")
    parser.add_argument("--inner", default="", help=argparse.SUPPRESS)


def config_from(options: argparse.Namespace) -> Config:
    kinds: tuple[str, ...] = ()
    if options.faults == "all":
        kinds = ALL_KINDS
    elif options.faults == "none":
        kinds = ()
    else:
        kinds = tuple(k.strip() for k in options.faults.split(",") if k.strip())
        unknown = set(kinds) - set(ALL_KINDS)
        if unknown:
            raise SystemExit(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(ALL_KINDS)}")
    return Config(
        seed=options.seed,
        duration=options.duration,
        agents=options.agents,
        messages=options.messages,
        mailboxes=options.mailboxes,
        ttl=options.ttl,
        takeovers=options.takeovers,
        thread_fraction=options.thread_fraction,
        faults=kinds,
        unfenced=options.unfenced,
        outside_fraction=options.outside_fraction,
        ignore_outgoing=options.ignore_outgoing,
        storms=options.storms,
        ignore_reply_rules=options.ignore_reply_rules,
        look=not options.no_look,
        agent_retry=not options.no_agent_retry,
        sink_fail_rate=options.sink_fail_rate,
        workdir=options.workdir,
        etcd_bin=options.etcd_bin,
        allow_unsafe_etcd=options.allow_unsafe_etcd,
        etcd_args=tuple(options.etcd_arg),
        json_out=options.json_out,
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos run", description=__doc__)
    add_arguments(parser)
    options = parser.parse_args(argv)
    config = config_from(options)
    workdir = config.workdir or Path(f"/tmp/chaos-{config.seed}-{int(time.time())}-{secrets.token_hex(2)}")
    if not options.inner and workdir.exists() and any(workdir.iterdir()):
        # The logs are append-only and agents replay unfinished work from theirs: never mix two runs.
        raise SystemExit(f"chaos: --workdir {workdir} is not empty; give a new directory")
    workdir.mkdir(parents=True, exist_ok=True)
    if options.inner:  # inside the world namespace, started by the outer process below
        world_ns, *members = options.inner.split(",")
        spaces = netns.Namespaces(world_ns.removeprefix(netns.PREFIX).removesuffix("-w"), world_ns, tuple(members))
        return asyncio.run(run_world(dataclasses.replace(config, workdir=workdir), workdir, spaces, ""))
    if options.no_netns or "etcd_partition" not in config.faults:
        problem = "--no-netns given" if options.no_netns else "no partition fault asked for"
        return asyncio.run(run_world(dataclasses.replace(config, workdir=workdir), workdir, None, problem))
    netns.reap_stale()
    try:
        spaces = netns.create()
    except netns.NetnsUnavailable as error:
        problem = f"network namespaces unavailable: {error}"
        print(f"chaos: {problem}; the partition fault will be skipped", file=sys.stderr)
        return asyncio.run(run_world(dataclasses.replace(config, workdir=workdir), workdir, None, problem))
    return run_in_namespaces(spaces, argv, workdir, config.duration)


def run_in_namespaces(spaces: netns.Namespaces, argv: list[str], workdir: Path, duration: float) -> int:
    """Re-runs this command inside the world namespace, then removes the namespaces whatever happened."""

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    inner = ",".join((spaces.world, *spaces.members))
    command = netns.exec_argv(
        spaces.world,
        child_argv([sys.executable, "-m", "chaos", "run", *argv, "--workdir", str(workdir), "--inner", inner]),
    )
    try:
        return subprocess.run(command, check=False, timeout=duration + 1200).returncode
    except subprocess.TimeoutExpired:
        print("chaos: the run exceeded its bound and was killed", file=sys.stderr)
        return 2
    finally:
        netns.destroy(spaces)
        signal.signal(signal.SIGTERM, previous)
