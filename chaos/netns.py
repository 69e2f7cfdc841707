"""Network namespaces for a real partition of one etcd member (Linux, root).

Topology: a *world* namespace holds a bridge (10.231.0.1/24) and everything but etcd (harness, proxy,
coordinators, agents, sink, human, all on the world's own loopback); each etcd member runs in a namespace of its
own, joined to the bridge by a veth pair (member *i* at 10.231.0.(10+i)). Partitioning member *i* sets its veth's
bridge end down: the member can reach no peer and no client, and nobody can reach it, until the link comes back.
Nothing is added to the machine's own network namespace; ``destroy`` removes every namespace (which removes
their links), and ``reap_stale`` removes those left by a run that was killed.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .common import child_argv

PREFIX = "chaos-"
SUBNET = "10.231.0"
BRIDGE = "chaosbr0"


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here; the message says why (the partition fault is then skipped)."""


@dataclass(frozen=True)
class Namespaces:
    tag: str
    world: str
    members: tuple[str, ...]

    def member_ip(self, index: int) -> str:
        return f"{SUBNET}.{10 + index}"

    @staticmethod
    def link(index: int) -> str:
        """The bridge end of member ``index``'s veth, as seen in the world namespace."""
        return f"chaosv{index}"


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=False)
    if result.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed ({result.returncode}): {result.stderr.strip()}")


def create(size: int = 3) -> Namespaces:
    if os.geteuid() != 0:
        raise NetnsUnavailable("not running as root (network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN)")
    tag = f"{int(time.time()):x}{secrets.token_hex(2)}"
    spaces = Namespaces(tag, f"{PREFIX}{tag}-w", tuple(f"{PREFIX}{tag}-e{i}" for i in range(size)))
    try:
        _ip("netns", "add", spaces.world)
        _ip("-n", spaces.world, "link", "set", "lo", "up")
        _ip("-n", spaces.world, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", spaces.world, "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
        _ip("-n", spaces.world, "link", "set", BRIDGE, "up")
        for index, member in enumerate(spaces.members):
            link = spaces.link(index)
            _ip("netns", "add", member)
            _ip("-n", member, "link", "set", "lo", "up")
            _ip("-n", spaces.world, "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", member)
            _ip("-n", spaces.world, "link", "set", link, "master", BRIDGE)
            _ip("-n", spaces.world, "link", "set", link, "up")
            _ip("-n", member, "addr", "add", f"{spaces.member_ip(index)}/24", "dev", "eth0")
            _ip("-n", member, "link", "set", "eth0", "up")
    except (NetnsUnavailable, OSError, subprocess.TimeoutExpired) as error:
        destroy(spaces)
        raise NetnsUnavailable(str(error)) from None
    return spaces


def destroy(spaces: Namespaces) -> None:
    for name in (*spaces.members, spaces.world):
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20, check=False)


def reap_stale(max_age_s: float = 3600.0) -> list[str]:
    """Deletes ``chaos-*`` namespaces older than ``max_age_s`` in which no process runs any more."""
    try:
        listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    removed = []
    for line in listing.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX):
            continue
        try:
            created = int(name[len(PREFIX) :].split("-")[0][:-4], 16)
        except ValueError:
            continue
        if time.time() - created < max_age_s:
            continue
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=20, check=False)
        if pids.stdout.strip():
            continue
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20, check=False)
        removed.append(name)
    return removed


def set_link(index: int, up: bool) -> None:
    """From inside the world namespace: connect (``up``) or cut member ``index``."""
    _ip("link", "set", Namespaces.link(index), "up" if up else "down")


def exec_argv(namespace: str, argv: Sequence[str]) -> list[str]:
    """``argv`` run inside ``namespace`` (``ip netns exec`` execs it: the pid stays the program's)."""
    return ["ip", "netns", "exec", namespace, *argv]


def etcd_wrapper(directory: Path, namespace: str, binary: Path) -> Path:
    """A script that runs ``binary`` in ``namespace``, to hand to ``EtcdServer(binary=...)``.

    ``setpriv --pdeathsig KILL`` first, so the member dies with the harness thread that spawned it.
    """
    return _script(directory / f"etcd-in-{namespace}.sh", ["ip", "netns", "exec", namespace, str(binary)])


def plain_wrapper(directory: Path, binary: Path) -> Path:
    """The same without a namespace (loopback mode)."""
    return _script(directory / "etcd-pdeathsig.sh", [str(binary)])


def _script(path: Path, argv: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexec " + " ".join(shlex.quote(a) for a in child_argv(argv)) + ' "$@"\n')
    path.chmod(0o755)
    return path
