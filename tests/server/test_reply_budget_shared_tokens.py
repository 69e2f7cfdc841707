"""The reply budget counts each agent send once, even when two claims share a fencing token (found by the chaos
run: seed 332 on etcd 3.5.1 let 11 agent replies to one correspondent through a budget of 10). Claims committed
in one group commit share the etcd revision that is their token (tests/server/test_group_commit.py), and a
counted send's key was its token alone: two sends to one correspondent whose claims were granted together were
one key, counted once, and an AbortSend of one gave back the other's unit."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator

import grpc
import pytest

from coordinator.core.storms import Budget, ReplyBudgets
from inbox_wire.v1 import coordinator_pb2 as pb
from tests.conftest import StartCoordinator
from tests.helpers import Actor, message
from tests.server.test_group_commit import BATCHED
from tests.server.test_reply_storms import OK, REFUSED, SPENT, claim

pytestmark = pytest.mark.etcd


class Claims:
    """40 claims of one agent on one correspondent's 40 threads, made together (some granted in one batch)."""

    def __init__(self, agent: Actor, subjects: list[pb.Subject], tokens: list[int]) -> None:
        self.agent = agent
        self.token = dict(zip((s.id for s in subjects), tokens, strict=True))
        groups = collections.defaultdict(list)
        for subject, token in zip(subjects, tokens, strict=True):
            groups[token].append(subject)
        shared = next((group for group in groups.values() if len(group) >= 2), None)
        assert shared is not None, "some claims committed together, at one revision"
        self.shared = shared[:2]
        self.others = [s for s in subjects if s not in self.shared]

    async def begin(self, subject: pb.Subject) -> pb.BeginSendResponse:
        return await self.agent.begin(subject, self.token[subject.id])

    async def reply(self, subject: pb.Subject) -> None:
        assert (await self.begin(subject)).result == OK
        assert (await self.agent.confirm(subject, self.token[subject.id])).result == OK


@pytest.fixture
async def claims(start_coordinator: StartCoordinator, mailbox: str) -> AsyncIterator[Claims]:
    budgets = ReplyBudgets(thread=Budget(3, 3600_000), correspondent=Budget(2, 3600_000))
    server = await start_coordinator(etcd_options=BATCHED, reply_budgets=lambda _mailbox: budgets)
    async with grpc.aio.insecure_channel(server.address) as channel:
        agent = Actor(channel, "agent-a")
        subjects = [message(mailbox, f"m-{n}") for n in range(40)]
        tokens = await asyncio.gather(
            *(claim(agent, s, f"t-{n}", correspondent="ana@example.com") for n, s in enumerate(subjects))
        )
        yield Claims(agent, subjects, list(tokens))


async def test_two_sends_whose_claims_share_a_token_count_twice(claims: Claims) -> None:
    for subject in claims.shared:
        await claims.reply(subject)
    refused = await claims.begin(claims.others[0])
    assert (refused.result, refused.refusal.kind, refused.refusal.counted) == (REFUSED, SPENT, 2), refused


async def test_an_aborted_send_gives_back_only_its_own_unit_when_tokens_are_shared(claims: Claims) -> None:
    first, second = claims.shared
    await claims.reply(first)
    assert (await claims.begin(second)).result == OK
    assert (await claims.agent.abort(second, claims.token[second.id])).result == OK  # not sent: its unit back
    await claims.reply(claims.others[0])
    refused = await claims.begin(claims.others[1])
    assert (refused.result, refused.refusal.counted) == (REFUSED, 2), refused
