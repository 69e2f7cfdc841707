"""Multi-member etcd clusters for the tests and the fault harness (chaos/): start, stop a member, find the leader
that a quorum agrees on. Members run on loopback with free ports unless each is given a :class:`MemberPlacement`.
``serve`` runs one etcd (coordinator/store/etcd/process.py) and never this."""

from __future__ import annotations

import contextlib
import secrets
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from coordinator.store.etcd.process import (
    _HTTP,
    _POLL_INTERVAL,
    _PROBE_TIMEOUT,
    EtcdMemberSpec,
    EtcdServer,
    EtcdStartError,
    _http_json,
    _reap,
    _send_term,
    find_etcd_binary,
    free_ports,
)

__all__ = ["EtcdCluster", "MemberPlacement"]


@dataclass(frozen=True)
class MemberPlacement:
    """Where one member runs when loopback will not do: an address of its own (in a network namespace, say, so
    that it can be cut off alone) on fixed ports, started by ``binary`` (a wrapper that enters that place)."""

    host: str
    binary: Path
    client_port: int = 2379
    peer_port: int = 2380


class EtcdCluster:
    """N members (default 3) sharing one initial cluster string; members[i] are EtcdServer.

    Without ``placements`` every member runs ``binary`` on loopback with free ports; with them, member i runs
    ``placements[i].binary`` on ``placements[i]``'s address and ports.
    """

    def __init__(
        self,
        base_dir: Path,
        size: int = 3,
        *,
        binary: Path | None = None,
        extra_args: Sequence[str] = (),
        placements: Sequence[MemberPlacement] | None = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"cluster size must be at least 1, got {size}")
        if placements is not None and len(placements) != size:
            raise ValueError(f"{len(placements)} member placements for a cluster of {size}")
        self._base_dir = Path(base_dir)
        self._size = size
        self._placements = tuple(placements) if placements is not None else None
        self._binary = binary
        self._extra_args = tuple(extra_args)
        self.members: list[EtcdServer] = []
        self._build_members()

    def _layout(self) -> Sequence[MemberPlacement]:
        if self._placements is not None:
            return self._placements
        if self._binary is None:  # looked up once, here: placed members bring their own binaries
            self._binary = find_etcd_binary()
        ports = free_ports(2 * self._size)
        return [MemberPlacement("127.0.0.1", self._binary, ports[2 * i], ports[2 * i + 1]) for i in range(self._size)]

    def _build_members(self) -> None:
        layout = self._layout()
        specs = [
            EtcdMemberSpec(name=f"etcd{i}", client_port=place.client_port, peer_port=place.peer_port, host=place.host)
            for i, place in enumerate(layout)
        ]
        initial_cluster = ",".join(f"{s.name}={s.peer_url}" for s in specs)
        # A token unique to this cluster: members of two clusters started by concurrent
        # test runs then refuse each other's peer traffic instead of merging.
        token = f"inbox-coordinator-{secrets.token_hex(6)}"
        self.members = [
            EtcdServer(
                self._base_dir / spec.name,
                spec=spec,
                binary=place.binary,
                log_path=self._base_dir / f"{spec.name}.log",
                initial_cluster=initial_cluster,
                cluster_token=token,
                extra_args=self._extra_args,
            )
            for spec, place in zip(specs, layout, strict=True)
        ]

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def start(self, timeout: float = 60.0) -> None:
        """Start every member without waiting, then wait until each is healthy."""
        fresh = not any(m.data_dir.exists() for m in self.members)
        try:
            self._start_once(timeout)
        except EtcdStartError:
            # Same port race as EtcdServer.start, but the members that did start have
            # already recorded the old peer URLs, so the whole cluster is rebuilt, which
            # is only safe when every data dir was created by this very attempt.
            in_use = any(m._lost_port_race() for m in self.members)
            self.stop()
            if not (fresh and in_use) or self._placements is not None:  # placed ports are fixed: no others to try
                raise
            for member in self.members:
                shutil.rmtree(member.data_dir, ignore_errors=True)
            self._build_members()
            self._start_once(timeout)

    def _start_once(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for member in self.members:
            if not member.is_running:
                member.start(wait=False)
        try:
            for member in self.members:
                member.wait_healthy(max(deadline - time.monotonic(), 0.0))
        except EtcdStartError as exc:
            tails = self.log_tails()
            self.stop()
            raise EtcdStartError(f"{exc}\n\nAll members:\n{tails}") from exc

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every member: the followers together, then the leader."""
        # On SIGTERM an etcd leader first hands leadership to the peer it has been
        # connected to longest and waits for that up to the request timeout (5 s + 2
        # election timeouts: 7 s by default). If that peer is going away too, as when
        # everything is stopped at once, the leader sits out the whole 7 s; it even does
        # so a few milliseconds after the followers have exited, before it has noticed.
        # It skips the handover once it sees no active peer, or once it has stepped down
        # for lack of quorum, so the followers go first and the leader is stopped when
        # either shows.
        deadline = time.monotonic() + timeout
        statuses = self.member_statuses()
        leader = _agreed_leader(statuses, quorum=self._size // 2 + 1)
        followers = [m for i, m in enumerate(self.members) if i != leader]
        _stop_together(followers, deadline)
        if leader is not None:
            status = statuses[leader]
            assert status is not None  # _agreed_leader only names members that answered
            self._await_step_down(leader, str(status["header"]["member_id"]), deadline)
            _stop_together([self.members[leader]], deadline)

    def _await_step_down(self, index: int, member_id: str, deadline: float) -> None:
        # Bounded to half the remaining budget so that a leader that never steps down
        # (a changed election timeout, say) still gets its SIGTERM and a fair wait.
        until = time.monotonic() + (deadline - time.monotonic()) / 2
        member = self.members[index]
        while time.monotonic() < until and member.is_running:
            try:
                if _active_peers(member.client_url) == 0:
                    return
                status = _http_json(f"{member.client_url}/v3/maintenance/status", {})
            except (OSError, ValueError):
                return
            if not isinstance(status, dict) or str(status.get("leader", "0")) != member_id:
                return
            time.sleep(_POLL_INTERVAL)

    def member_statuses(self, timeout: float = _PROBE_TIMEOUT) -> list[dict[str, Any] | None]:
        """``/v3/maintenance/status`` of each member; None for one that did not answer."""
        statuses: list[dict[str, Any] | None] = []
        for member in self.members:
            status: dict[str, Any] | None = None
            if member.is_running and not member.is_paused:
                with contextlib.suppress(OSError, ValueError):
                    answer = _http_json(f"{member.client_url}/v3/maintenance/status", {}, timeout)
                    if isinstance(answer, dict) and "header" in answer:
                        status = answer
            statuses.append(status)
        return statuses

    def leader_index(self, timeout: float = 10.0) -> int:
        """Index in :attr:`members` of the current leader; retries until ``timeout``."""
        deadline = time.monotonic() + timeout
        seen: list[dict[str, Any] | None] = []
        while True:
            seen = self.member_statuses()
            found = _agreed_leader(seen, quorum=self._size // 2 + 1)
            if found is not None:
                return found
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"no leader agreed on by a quorum of {self._size // 2 + 1} within {timeout:g}s; "
                    f"statuses: {seen!r}\n{self.log_tails()}"
                )
            time.sleep(_POLL_INTERVAL)

    def move_leader(self, to: int, timeout: float = 10.0) -> None:
        """Hands leadership to member ``to`` (etcd's MoveLeader, as ``etcdctl move-leader``): a leader change
        within a heartbeat or two, where a killed leader's takes an election timeout or more."""
        leader = self.leader_index(timeout)
        if leader == to:
            raise ValueError(f"members[{to}] already leads")
        target = self.member_statuses()[to]
        if target is None:
            raise RuntimeError(f"members[{to}] does not answer")
        answer = _http_json(
            f"{self.members[leader].client_url}/v3/maintenance/transfer-leadership",
            {"targetID": str(target["header"]["member_id"])},
            timeout,
        )
        if not isinstance(answer, dict) or "error" in answer or "code" in answer:
            raise RuntimeError(f"etcd refused to move the leader to members[{to}]: {answer!r}")
        if self.leader_index(timeout) != to:
            raise RuntimeError(f"members[{to}] does not lead after the move")

    def log_tails(self, lines: int = 40) -> str:
        parts = []
        for i, member in enumerate(self.members):
            state = f"pid {member.pid}" if member.is_running else "not running"
            parts.append(f"=== members[{i}] {member.spec.name} {member.endpoint} ({state}) ===")
            parts.append(member.log_tail(lines))
        return "\n".join(parts)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<EtcdCluster {self._base_dir} {self.members!r}>"


def _active_peers(client_url: str) -> int | None:
    """The peers this member's raft transport counts as active, from its Prometheus metrics."""
    with _HTTP.open(f"{client_url}/metrics", timeout=_PROBE_TIMEOUT) as response:
        text = response.read().decode("utf-8", errors="replace")
    values = [
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("etcd_network_active_peers{")
    ]
    return round(sum(values)) if values else None


def _stop_together(members: Sequence[EtcdServer], deadline: float) -> None:
    # Signalled together, then reaped: a follower's shutdown waits ~1 s for its peer
    # listener to drain, which would otherwise add up member after member.
    procs = [m._proc for m in members]
    for proc in procs:
        if proc is not None:
            _send_term(proc)
    for member, proc in zip(members, procs, strict=True):
        if proc is not None:
            _reap(proc, deadline - time.monotonic())
        member._forget()


def _agreed_leader(statuses: Sequence[dict[str, Any] | None], quorum: int) -> int | None:
    # A member that was paused or cut off still believes it leads an old term until it
    # hears of a newer one, so "member_id == leader" alone can name a stale leader. Take
    # the claim from the highest term and require a quorum to agree with it.
    parsed: list[tuple[int, str, str] | None] = []
    for status in statuses:
        if status is None:
            parsed.append(None)
            continue
        header = status.get("header", {})
        # The grpc-gateway renders uint64 as JSON strings and omits zero values: a
        # member without a leader has no "leader" key at all.
        parsed.append(
            (
                int(status.get("raftTerm", header.get("raft_term", 0))),
                str(header.get("member_id", "")),
                str(status.get("leader", "0")),
            )
        )
    answered = [p for p in parsed if p is not None]
    if not answered:
        return None
    top_term = max(term for term, _, _ in answered)
    for index, entry in enumerate(parsed):
        if entry is None:
            continue
        term, member_id, leader = entry
        if term == top_term and member_id == leader and leader != "0":
            agreeing = sum(1 for t, _, lead in answered if t == top_term and lead == leader)
            if agreeing >= quorum:
                return index
    return None
