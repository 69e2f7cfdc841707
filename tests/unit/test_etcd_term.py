"""The raft term the store goes by: taken from answers only etcd's leader gives (writes, linearizable reads),
never from a serializable read or a member's own status, which a member cut off from the others raises at each
campaign it starts (docs/design.md#leases-and-expiry)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from aetcd import rpc

from coordinator.store.etcd.client import EtcdClient
from coordinator.store.etcd.settings import EtcdSettings


class _Observer:
    def etcd_call(self, method: str, seconds: float, error: str | None) -> None:
        pass


def _answering(kind: Any, term: int) -> Any:
    async def method(request: Any, **_: Any) -> Any:
        return kind(header=rpc.ResponseHeader(raft_term=term))

    return method


async def test_the_term_moves_with_the_leaders_answers_only(caplog: pytest.LogCaptureFixture) -> None:
    client = EtcdClient(EtcdSettings(["127.0.0.1:9"]), _Observer())
    try:
        caplog.set_level(logging.INFO, logger="coordinator.store.etcd.client")
        await client.call(_answering(rpc.TxnResponse, 4), rpc.TxnRequest())
        assert client.raft_term == 4
        await client.call(_answering(rpc.RangeResponse, 9), rpc.RangeRequest(key=b"k", serializable=True))
        await client.call(_answering(rpc.StatusResponse, 9), rpc.StatusRequest())
        assert client.raft_term == 4
        await client.call(_answering(rpc.LeaseGrantResponse, 5), rpc.LeaseGrantRequest(TTL=5))
        await client.call(_answering(rpc.TxnResponse, 3), rpc.TxnRequest())  # a late answer from before
        assert client.raft_term == 5
        await client.call(_answering(rpc.RangeResponse, 6), rpc.RangeRequest(key=b"k"))
        assert client.raft_term == 6
        terms = [(r.fields["term"], r.fields["previous"]) for r in caplog.records if hasattr(r, "fields")]
        assert terms == [(4, 0), (5, 4), (6, 5)]
        assert "etcd has a new leader (raft term 6, was 5)" in caplog.records[-1].getMessage()
    finally:
        await client.close()
