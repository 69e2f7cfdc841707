"""How EtcdCluster lays its members out (no etcd is started): on loopback with free ports by default, or where
each member's placement says, with that placement's binary (the fault harness puts each member in a network
namespace of its own this way)."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.store.etcd.cluster import EtcdCluster, MemberPlacement


def test_placed_members_listen_where_their_placement_says_and_run_its_binary(tmp_path: Path) -> None:
    placements = [MemberPlacement(f"10.231.0.{10 + i}", tmp_path / f"etcd-in-ns{i}.sh") for i in range(3)]

    cluster = EtcdCluster(tmp_path / "etcd", 3, extra_args=("--pre-vote",), placements=placements)

    assert [m.spec.name for m in cluster.members] == ["etcd0", "etcd1", "etcd2"]
    assert cluster.endpoints == ["10.231.0.10:2379", "10.231.0.11:2379", "10.231.0.12:2379"]
    assert [m.spec.peer_url for m in cluster.members] == [f"http://10.231.0.{10 + i}:2380" for i in range(3)]
    assert [m.binary for m in cluster.members] == [p.binary for p in placements]
    assert [m.log_path for m in cluster.members] == [tmp_path / "etcd" / f"etcd{i}.log" for i in range(3)]


def test_unplaced_members_share_the_binary_on_loopback_with_distinct_ports(tmp_path: Path) -> None:
    binary = tmp_path / "etcd"

    cluster = EtcdCluster(tmp_path / "cluster", 3, binary=binary)

    assert {m.spec.host for m in cluster.members} == {"127.0.0.1"}
    assert {m.binary for m in cluster.members} == {binary}
    ports = [port for m in cluster.members for port in (m.spec.client_port, m.spec.peer_port)]
    assert len(set(ports)) == 6


def test_a_placement_per_member_is_required(tmp_path: Path) -> None:
    placements = [MemberPlacement("10.231.0.10", tmp_path / "etcd")]

    with pytest.raises(ValueError, match="1 member placements for a cluster of 3"):
        EtcdCluster(tmp_path / "etcd", 3, placements=placements)
