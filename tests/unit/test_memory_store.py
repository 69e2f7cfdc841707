"""What only the in-memory store can show in milliseconds: leases on an injected clock. The same behaviour on
etcd is tested in tests/server/test_transitions.py (test_ttl_running_out_frees_the_subject_and_stales_the_token,
test_unconfirmed_send_becomes_in_doubt_and_a_human_resolves_it), with etcd's real leases."""

from __future__ import annotations

import asyncio
import uuid

from coordinator.core.commands import BeginSend, ClaimReply, RenewClaim
from coordinator.core.domain import Caller, ClaimResult, EventType, FenceResult, HolderKind, State, Subject, SubjectKind
from coordinator.core.engine import Engine, Event, Snapshot
from coordinator.store.memory import MemoryStore
from tests.conftest import test_rules

AGENT = Caller("agent-a", HolderKind.AGENT)
OTHER = Caller("agent-b", HolderKind.AGENT)


class Clock:
    def __init__(self) -> None:
        self.ms = 1_700_000_000_000

    def __call__(self) -> int:
        return self.ms


def _engine() -> tuple[Engine, Clock]:
    clock = Clock()
    return Engine(MemoryStore(clock), test_rules(), clock), clock


async def test_a_claim_expires_at_its_ttl_and_its_token_goes_stale() -> None:
    engine, clock = _engine()
    subject = Subject("box", SubjectKind.MESSAGE, "m")
    stream = engine.watch(AGENT, "box")
    assert isinstance(await anext(stream), Snapshot)
    granted = await engine.claim_reply(
        AGENT, ClaimReply(request_id=uuid.uuid4().hex, subject=subject, notification_id="", ttl_seconds=5, note="")
    )
    assert granted.stored is not None
    clock.ms += 4_999
    assert await engine.status(AGENT, subject) is not None
    clock.ms += 1
    assert await engine.status(AGENT, subject) is None
    renewed = await engine.renew(
        AGENT, RenewClaim(request_id=uuid.uuid4().hex, subject=subject, token=granted.stored.token, ttl_seconds=5)
    )
    assert renewed[0] is FenceResult.STALE_TOKEN
    again = await engine.claim_reply(
        OTHER, ClaimReply(request_id=uuid.uuid4().hex, subject=subject, notification_id="", ttl_seconds=5, note="")
    )
    assert again.result is ClaimResult.GRANTED
    assert again.stored is not None
    assert again.stored.token > granted.stored.token
    events = [await asyncio.wait_for(anext(stream), 1) for _ in range(3)]
    assert [e.type for e in events if isinstance(e, Event)] == [EventType.CLAIMED, EventType.EXPIRED, EventType.CLAIMED]
    await stream.aclose()


async def test_a_send_not_confirmed_by_its_deadline_becomes_in_doubt() -> None:
    engine, clock = _engine()
    subject = Subject("box", SubjectKind.MESSAGE, "m")
    granted = await engine.claim_reply(
        AGENT, ClaimReply(request_id=uuid.uuid4().hex, subject=subject, notification_id="", ttl_seconds=60, note="")
    )
    assert granted.stored is not None
    await engine.begin_send(AGENT, BeginSend(request_id=uuid.uuid4().hex, subject=subject, token=granted.stored.token))
    assert await engine.sweep_in_doubt() == 0
    clock.ms = engine.rules.send_marker_expiry(clock.ms)
    assert await engine.sweep_in_doubt() == 1
    status = await engine.status(AGENT, subject)
    assert status is not None
    assert status.record.state is State.IN_DOUBT
    assert await engine.sweep_in_doubt() == 0
