"""What a chaos run is asked to do: its settings, the etcd it may run, and the command that replays it."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

from coordinator.store.etcd.process import EtcdNotFound, etcd_version, find_etcd_binary, is_broken_version

CLUSTER_LANE = ("etcd_kill", "etcd_leader_kill", "etcd_slow", "etcd_partition", "agent_kill", "clock_skew")
PROCESS_LANE = ("coordinator_kill", "agent_pause")
ALL_KINDS = CLUSTER_LANE + PROCESS_LANE
"""The fault kinds a run can ask for, by the lane that injects them (chaos/faults.py says what each does)."""
CRASH_KINDS = {"etcd_kill", "etcd_leader_kill"}

LEASE_BUCKET_S = 1.0
"""The coordinator's --claim-lease-bucket (its default)."""
ETCD_EXPIRY_CHECK_S = 1.0
"""etcd checks for expired leases about every 0.5 s; the stated bound rounds it up to 1 s."""


@dataclass
class Config:
    seed: int
    duration: float
    agents: int = 4
    messages: int = 0
    mailboxes: int = 3
    ttl: int = 5
    takeovers: int = -1
    thread_fraction: float = 0.2
    outside_fraction: float = 0.2
    """Threads a person answers from Gmail, without the coordinator (chaos/workload.py)."""
    faults: tuple[str, ...] = ALL_KINDS
    unfenced: bool = False
    ignore_outgoing: bool = False
    """NEGATIVE CONTROL: agents treat the mailbox's own messages as incoming (chaos/agent.py)."""
    storms: int = 1
    """How many of each reply-storm actor (chaos/workload.py); 0: none."""
    ignore_reply_rules: bool = False
    look: bool = True
    """Agents look at the thread right before their commit point (the Nylas provider's look, chaos/agent.py)."""
    """NEGATIVE CONTROL: agents answer automated mail and send when BeginSend refuses (chaos/agent.py)."""
    agent_retry: bool = True
    sink_fail_rate: float = 0.02
    draft_median: float = 1.2
    draft_sigma: float = 1.0
    send_timeout: float = 8.0
    workdir: Path | None = None
    etcd_bin: Path | None = None
    etcd_args: tuple[str, ...] = ()
    allow_unsafe_etcd: bool = False
    json_out: Path | None = None

    def __post_init__(self) -> None:
        if self.messages <= 0:
            self.messages = max(20, int(self.duration * 1.5))
        if self.takeovers < 0:
            self.takeovers = max(2, int(self.duration / 20))

    @property
    def lifetime(self) -> float:
        """Seconds every child process lives at most (each exits by itself then, whatever the harness does)."""
        return self.duration + 900


def choose_etcd(config: Config) -> tuple[Path, str]:
    """An etcd that survives SIGKILL under load when crash faults are on: 3.4.x or 3.5.3+ (never 3.5.0-3.5.2)."""
    crash = bool(CRASH_KINDS & set(config.faults))
    candidates: list[Path] = []
    if config.etcd_bin is not None:
        candidates.append(config.etcd_bin)
    else:
        with contextlib.suppress(EtcdNotFound):
            candidates.append(find_etcd_binary())
        candidates += [Path(p) for p in ("/usr/bin/etcd", "/usr/local/bin/etcd") if Path(p).exists()]
    refused = []
    for binary in candidates:
        version = etcd_version(binary)
        if crash and is_broken_version(version) and not config.allow_unsafe_etcd:
            refused.append(f"{binary} is {version}")
            continue
        if refused:  # never silently: the run's figures are for this etcd, not the one asked for first
            print(
                f"chaos: {', '.join(refused)}, unsafe under SIGKILL faults; running {binary} ({version}) instead",
                file=sys.stderr,
            )
        return binary, version
    raise SystemExit(
        "no etcd safe for SIGKILL faults (3.4.x or 3.5.3+) found"
        + (f"; refused: {', '.join(refused)}" if refused else "")
        + ". Pass --etcd-bin, or --allow-unsafe-etcd to run etcd 3.5.0-3.5.2 anyway (results then mean little)."
    )


def replay_command(config: Config) -> str:
    parts = [
        "python -m chaos run",
        f"--seed {config.seed}",
        f"--duration {config.duration:g}",
        f"--agents {config.agents}",
        f"--messages {config.messages}",
        f"--mailboxes {config.mailboxes}",
        f"--ttl {config.ttl}",
        f"--takeovers {config.takeovers}",
    ]
    if tuple(config.faults) != ALL_KINDS:
        parts.append(f"--faults {','.join(config.faults) or 'none'}")
    if config.outside_fraction != Config.outside_fraction:
        parts.append(f"--outside-fraction {config.outside_fraction:g}")
    if config.storms != Config.storms:
        parts.append(f"--storms {config.storms}")
    if config.ignore_reply_rules:
        parts.append("--ignore-reply-rules")
    if not config.look:
        parts.append("--no-look")
    if config.unfenced:
        parts.append("--unfenced")
    if config.ignore_outgoing:
        parts.append("--ignore-outgoing")
    if not config.agent_retry:
        parts.append("--no-agent-retry")
    parts += [f"--etcd-arg={arg}" for arg in config.etcd_args]
    return " ".join(parts)
