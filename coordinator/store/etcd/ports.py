"""Free TCP ports for servers that are started later, and restarted on the same port.

A port found by binding port 0 comes from the kernel's ephemeral range, the range every outgoing connection and
every other ``bind(port 0)`` draws from too. Released, it can be handed to someone else before our server binds it,
or while that server is down between a kill and its restart: a CI run of the fault harness lost an agent that way
(`address already in use` on a port picked a few seconds earlier). So ports are picked outside that range, where
the kernel never hands any out, and reserved against every other process that picks them here: a one-byte
``lockf`` lock per port on one shared file, held until this process ends or has picked many more.

The shared file lives in a directory only this user can write (``<tmp>/inbox-coordinator-<uid>``, mode 0700, owned
by the user, checked on the open directory), and is opened without following a symbolic link: in a world-writable
``/tmp`` another user could otherwise plant a link there (with ``fs.protected_symlinks=0`` opening it would create
a file wherever it points) or a file of their own, whose every byte they could lock. A directory that is not ours
is not used: the picks are then unshared (still outside the ephemeral range), with one warning.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import logging
import os
import random
import socket
import stat
import tempfile
import threading
from pathlib import Path

__all__ = ["free_port", "free_ports", "lock_file_path"]

log = logging.getLogger(__name__)

PICK_FLOOR = 20000
"""The lowest port picked: below it live the ports people configure by hand (2379, 8080, 9090, 50051...)."""

RESERVATIONS_KEPT = 512
"""How many of this process's latest picks stay reserved; an older pick has long been bound by its server, or
abandoned."""

_MIN_POOL = 2000
_DRAWS_PER_PORT = 200
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, outside the kernel's ephemeral range, and reserved for this process: the
    kernel never hands it out to a connection or to a ``bind(port 0)``, no other process picks it here, and this
    process picks it again only after handing out half the range. Where the range is unknown, the kernel picks."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` different ports as :func:`free_port` picks them."""
    return _PICKER.pick(count, host)


LOCK_FILE_NAME = "ports.lock"


def lock_file_path() -> Path:
    """Where the shared reservations live: in a per-user directory of the temporary directory."""
    return Path(tempfile.gettempdir()) / f"inbox-coordinator-{os.getuid()}" / LOCK_FILE_NAME


class _NotOurs(OSError):
    """The lock file's directory, or the file, is not this user's alone."""


def _open_lock_file(path: Path) -> int:
    """``path`` opened for locking: its directory made (0700) or checked to be a directory of this user's that
    nobody else can write, the file opened relative to that open directory without following a link, and
    checked to be a regular file of this user's. Raises OSError otherwise."""
    uid = os.getuid()
    with contextlib.suppress(FileExistsError):
        os.mkdir(path.parent, 0o700)
    nofollow = os.O_NOFOLLOW | os.O_CLOEXEC
    # O_NOFOLLOW | O_DIRECTORY: a link planted in place of the directory is refused (ELOOP or ENOTDIR).
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | nofollow)
    try:
        info = os.fstat(directory)
        if info.st_uid != uid:
            raise _NotOurs(f"{path.parent} belongs to uid {info.st_uid}, not to this user (uid {uid})")
        if info.st_mode & 0o022:
            # Ours, so we may close it: made by an older release or by hand with a looser umask.
            os.fchmod(directory, 0o700)
        descriptor = os.open(path.name, os.O_RDWR | os.O_CREAT | nofollow, 0o600, dir_fd=directory)
    finally:
        os.close(directory)
    info = os.fstat(descriptor)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != uid:
        os.close(descriptor)
        raise _NotOurs(f"{path} is not a regular file of this user's")
    return descriptor


def _pool() -> list[int]:
    """The ports outside the ephemeral range, or none where the range cannot be read or leaves too few."""
    try:
        low, high = (int(part) for part in _EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return []
    pool = [*range(PICK_FLOOR, low), *range(max(high + 1, PICK_FLOOR), 65536)]
    return pool if len(pool) >= _MIN_POOL else []


def _bindable(host: str, port: int) -> bool:
    """Whether ``port`` is free on ``host``; an address this machine does not have raises, as binding it would."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as error:
            if error.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


class _Picker:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: list[int] | None = None
        self._lock_file: int | None = None
        self._lock_file_pid = 0
        self._handed_out: set[int] = set()
        self._reserved: collections.deque[int] = collections.deque()

    def pick(self, count: int, host: str) -> list[int]:
        with self._lock:
            if self._pool is None:
                self._pool = _pool()
            picked: list[int] = []
            if self._pool:
                if len(self._handed_out) > len(self._pool) // 2:
                    self._handed_out.clear()  # the oldest picks were bound, or abandoned, long ago
                lock_file = self._shared_lock_file()
                for _ in range(_DRAWS_PER_PORT * count):
                    if len(picked) == count:
                        break
                    port = random.choice(self._pool)
                    if port in self._handed_out:
                        continue
                    if lock_file is not None and not self._reserve(lock_file, port):
                        continue  # another process picked it
                    self._handed_out.add(port)
                    if _bindable(host, port):
                        picked.append(port)
            return picked + _kernel_picked(count - len(picked), host)

    def _reserve(self, lock_file: int, port: int) -> bool:
        try:
            fcntl.lockf(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port)
        except OSError:
            return False
        self._reserved.append(port)
        while len(self._reserved) > RESERVATIONS_KEPT:
            fcntl.lockf(lock_file, fcntl.LOCK_UN, 1, self._reserved.popleft())
        return True

    def _shared_lock_file(self) -> int | None:
        """This process's descriptor of the shared file; a forked child opens its own (locks are not inherited)."""
        if self._lock_file is not None and self._lock_file_pid == os.getpid():
            return self._lock_file
        self._reserved.clear()
        self._handed_out.clear()
        path = lock_file_path()
        try:
            self._lock_file = _open_lock_file(path)
        except OSError as error:
            # Unshared: still outside the ephemeral range, only not reserved against other processes.
            log.warning("port reservations not shared with other processes: cannot use %s: %s", path, error)
            self._lock_file = None
        self._lock_file_pid = os.getpid()
        return self._lock_file


def _kernel_picked(count: int, host: str) -> list[int]:
    """``count`` ports from the kernel (bind to port 0), where no range outside the ephemeral one is known."""
    # All sockets stay open until every port is picked, so one batch never repeats a port.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(family, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


_PICKER = _Picker()
