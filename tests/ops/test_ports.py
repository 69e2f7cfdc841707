"""Ports for servers started later and restarted on the same port (coordinator/store/etcd/ports.py): outside the
kernel's ephemeral range, never handed out twice, reserved against other processes picking at the same time."""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from coordinator.store.etcd import ports
from coordinator.store.etcd.ports import free_port, free_ports
from tests.helpers import missing_on_this_machine

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


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary directory as /tmp is (world-writable, sticky), which ``tempfile.gettempdir()`` answers."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


def _lock_file(tmp: Path) -> Path:
    return tmp / f"inbox-coordinator-{os.getuid()}" / "ports.lock"


def _picks_still_work(picker: ports._Picker) -> None:
    picked = picker.pick(3, "127.0.0.1")
    assert len(set(picked)) == 3


def test_the_lock_file_lives_in_a_directory_only_this_user_can_write(private_tmp: Path) -> None:
    _picks_still_work(ports._Picker())
    path = _lock_file(private_tmp)
    assert ports.lock_file_path() == path
    directory, lock_file = path.parent.lstat(), path.lstat()
    assert stat.S_ISDIR(directory.st_mode)
    assert directory.st_uid == os.getuid()
    assert stat.S_IMODE(directory.st_mode) == 0o700
    assert stat.S_ISREG(lock_file.st_mode)
    assert stat.S_IMODE(lock_file.st_mode) == 0o600


def test_a_link_planted_where_the_lock_file_goes_is_not_followed(private_tmp: Path, tmp_path: Path) -> None:
    """With fs.protected_symlinks=0 an open that follows a link another user planted in /tmp creates (or opens) a
    file wherever it points. Links are planted at every name a release used: the file of the release before,
    and the per-user directory."""
    victims = [tmp_path / "victim-file", tmp_path / "victim-dir"]
    victims[1].mkdir()
    (private_tmp / f"inbox-coordinator-ports-{os.getuid()}.lock").symlink_to(victims[0])
    _lock_file(private_tmp).parent.symlink_to(victims[1], target_is_directory=True)
    _picks_still_work(ports._Picker())
    assert not victims[0].exists()
    assert list(victims[1].iterdir()) == []


def test_a_link_planted_inside_the_directory_is_not_followed(private_tmp: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim-file"
    path = _lock_file(private_tmp)
    path.parent.mkdir(0o777)  # as an older release or a loose umask left it: a window for a planted link
    path.parent.chmod(0o777)
    path.symlink_to(victim)
    _picks_still_work(ports._Picker())
    assert not victim.exists()
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700  # ours, so it was closed


def test_a_directory_another_user_owns_is_not_used(private_tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    if os.geteuid() != 0:
        missing_on_this_machine("root, to give a directory to another user")
    path = _lock_file(private_tmp)
    path.parent.mkdir(0o777)
    path.parent.chmod(0o777)
    os.chown(path.parent, 65534, 65534)  # nobody: a directory another user made before us, open to all
    with caplog.at_level(logging.WARNING, logger=ports.__name__):
        _picks_still_work(ports._Picker())
    assert not path.exists()
    assert "not shared with other processes" in caplog.text
    assert "uid 65534" in caplog.text
