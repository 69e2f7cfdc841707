"""Ports for servers started later and restarted on the same port (coordinator/store/etcd/ports.py): outside the
kernel's ephemeral range, never handed out twice, reserved against other processes picking at the same time."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from coordinator.store.etcd import ports
from coordinator.store.etcd.ports import free_port, free_ports

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_range() -> tuple[int, int]:
    low, high = (int(part) for part in EPHEMERAL_RANGE.read_text().split())
    return low, high


def test_ports_lie_outside_the_range_the_kernel_hands_to_connections() -> None:
    low, high = _ephemeral_range()
    picked = free_ports(200)
    assert all(ports.PICK_FLOOR <= port < 65536 and not low <= port <= high for port in picked), picked
    for port in picked[:20]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_process_never_hands_out_the_same_port_twice() -> None:
    picked = free_ports(300) + [free_port() for _ in range(300)]
    assert len(set(picked)) == len(picked)


def test_a_port_in_use_is_never_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        neighbour = free_port()
        picker = ports._Picker()
        monkeypatch.setattr(ports, "_pool", lambda: [taken, neighbour])
        assert picker.pick(1, "127.0.0.1") == [neighbour]


def test_another_process_picking_at_the_same_time_gets_other_ports(tmp_path: Path) -> None:
    # 400 picks each from some 17,000 ports: without the reservation about nine would collide.
    script = textwrap.dedent(
        """
        import json, sys
        from coordinator.store.etcd.ports import free_ports
        print(json.dumps(free_ports(400)), flush=True)
        sys.stdin.read()  # keep the reservations until the parent has picked its own
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        theirs = set(json.loads(child.stdout.readline()))
        ours = set(free_ports(400))
    finally:
        child.communicate("", timeout=30)
    assert len(theirs) == 400
    assert not theirs & ours, sorted(theirs & ours)


def test_without_a_known_ephemeral_range_the_kernel_picks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(ports, "_EPHEMERAL_RANGE", tmp_path / "absent")
    picked = ports._Picker().pick(3, "127.0.0.1")
    assert len(set(picked)) == 3
    for port in picked:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_an_address_this_machine_lacks_is_an_error_not_an_endless_search() -> None:
    with pytest.raises(OSError, match="assign requested address"):
        ports._Picker().pick(1, "192.0.2.1")  # TEST-NET-1: never assigned to a local interface
