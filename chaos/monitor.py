"""The harness's own client of the coordinators (principal ``chaos-monitor``, kind human): it follows every
mailbox's Watch (why and when each claim ended; leases that ended before their stated expiry), measures how long
a dead holder's claims take to free (and reads from etcd which lease holds each), counts subjects left SENDING
and reads the final states."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any

from coordinator.core import domain
from coordinator.core.errors import StoreUnavailable
from coordinator.store.etcd.peek import EtcdPeek
from inbox_claims import AsyncCoordinator, InboxClaimsError, RetryPolicy, Subject, SubjectState
from inbox_claims.types import EventType, SubjectKind, WatchEvent, WatchSnapshot

from .checker import FinalState
from .processes import OpenClaim
from .workload import SubjectKey


class Monitor:
    def __init__(self, coordinator_targets: str, etcd_endpoints: Sequence[str], prefix: str) -> None:
        self.client = AsyncCoordinator(
            "ipv4:" + coordinator_targets,
            principal="chaos-monitor",
            kind="human",
            timeout=3.0,
            retry=RetryPolicy(attempts=4, initial_backoff=0.1, max_backoff=1.0),
            channel_options=[("grpc.lb_policy_name", "round_robin")],
        )
        self.ended: dict[tuple[str, int], tuple[str, float]] = {}
        """(subject, token) -> the Watch event type that ended the claim and when it was seen."""
        self.watch_counts: dict[str, int] = {}
        self.expiry: dict[tuple[str, int], float] = {}
        self.early_expiries: list[dict[str, Any]] = []
        self._watches: list[asyncio.Task[None]] = []
        self.etcd = EtcdPeek(etcd_endpoints, prefix)
        """Reads beside the coordinators: the lease of a dead holder's claim (evidence for the checker)."""

    def watch_all(self, mailboxes: Sequence[str]) -> None:
        self._watches += [asyncio.create_task(self.watch(mailbox)) for mailbox in mailboxes]

    async def watch(self, mailbox: str) -> None:
        """Follows one mailbox: why and when each claim ended, and whether any lease ended before its expiry."""
        while True:
            try:
                async for item in self.client.watch(mailbox):
                    now = time.time()
                    statuses = item.subjects if isinstance(item, WatchSnapshot) else (item.status,)
                    for status in statuses:
                        if status.state is SubjectState.CLAIMED and status.expires_at is not None:
                            claim = (str(_key(status.subject)), status.fencing_token)
                            # The latest stamp, not the largest: one from a replica with a skewed clock can be
                            # minutes off (the checker does not judge those), and a later renewal supersedes it.
                            self.expiry[claim] = status.expires_at.timestamp()
                    if not isinstance(item, WatchEvent):
                        continue
                    name = item.type.value
                    self.watch_counts[name] = self.watch_counts.get(name, 0) + 1
                    if item.previous_token:
                        claim = (str(_key(item.status.subject)), item.previous_token)
                        self.ended.setdefault(claim, (name, now))
                        expires = self.expiry.pop(claim, None)
                        if item.type is EventType.EXPIRED and expires is not None and now < expires - 0.1:
                            self.early_expiries.append(
                                {"subject": claim[0], "token": claim[1], "seen_at": now, "expires": expires}
                            )
            except InboxClaimsError:
                await asyncio.sleep(0.5)

    async def measure_free(self, claim: OpenClaim, killed_at: float, ttl: float) -> dict[str, Any]:
        """Polls the subject until the dead holder's claim is gone: when was it last seen held, when free."""
        subject = Subject(claim.key.mailbox, SubjectKind(claim.key.kind), claim.key.id)
        result: dict[str, Any] = {"subject": str(claim.key), "token": claim.token, "killed_at": killed_at}
        expires = claim.expires
        last_held: float | None = None
        freed_at: float | None = None
        first = True
        evidence: asyncio.Task[dict[str, Any]] | None = None
        deadline = killed_at + ttl + 20
        while time.time() < deadline:
            asked = time.time()
            try:
                status = await self.client.status(subject)
            except InboxClaimsError:
                await asyncio.sleep(0.1)
                continue
            held = status.state is SubjectState.CLAIMED and status.fencing_token == claim.token
            if first and not held:
                result.update(result="not_held", state=status.state.value)
                return result
            if first:  # beside the polls: a slow read (a member just back) must not leave gaps in them
                evidence = asyncio.create_task(self._lease_evidence(claim))
            first = False
            if held:
                last_held = asked
                if status.expires_at is not None:
                    expires = status.expires_at.timestamp()  # the record's own: the dead holder renews no more
            else:
                freed_at = time.time()
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # let the watch report why it ended
        if evidence is not None:
            result.update(await evidence)
        end = self.ended.get((str(claim.key), claim.token))
        result.update(
            result="measured",
            expires=expires,
            last_held=last_held,
            freed_at=freed_at,
            end_type=end[0] if end else None,
            end_seen_at=end[1] if end else None,
            latency_s=None if freed_at is None else round(freed_at - expires, 3),
        )
        return result

    async def _lease_evidence(self, claim: OpenClaim) -> dict[str, Any]:
        """Which lease holds the claim's key, and what etcd's leader says is left of it, read once at the start."""
        subject = domain.Subject(claim.key.mailbox, domain.SubjectKind[claim.key.kind.upper()], claim.key.id)
        try:
            found = await self.etcd.subject_lease(subject, attempts=3)
            if found is None or found.create_revision != claim.token:
                return {"lease_error": "the claim's key was gone or recreated before its lease was read"}
            left = await self.etcd.lease_left(found.lease, attempts=3)
        except StoreUnavailable as error:
            return {"lease_error": str(error)}
        evidence: dict[str, Any] = {"lease": found.lease}
        if left is not None:
            evidence.update(
                lease_read_at=left.read_at, lease_ttl_left_s=left.ttl_left_s, lease_ttl_s=left.granted_ttl_s
            )
        return evidence

    async def count_sending(self, mailboxes: Sequence[str]) -> int:
        """How many subjects are SENDING across ``mailboxes``; -1 when the coordinators could not say."""
        sending = 0
        try:
            for mailbox in mailboxes:
                page = await self.client.list_claims(mailbox, states=[SubjectState.SENDING], page_size=1000)
                sending += len(page.subjects)
        except InboxClaimsError:
            return -1
        return sending

    async def final_state(self, key: SubjectKey, attempts: int = 5) -> FinalState | None:
        subject = Subject(key.mailbox, SubjectKind(key.kind), key.id)
        for _ in range(attempts):
            try:
                status = await self.client.status(subject)
            except InboxClaimsError:
                await asyncio.sleep(0.5)
                continue
            return FinalState(
                status.state.value,
                status.fencing_token,
                status.holder,
                replied_outside=status.replied_outside,
                knows_outside=status.outside_reply is not None,
                automated=status.automated,
                agents_stopped=status.agents_stopped.reason if status.agents_stopped else "",
            )
        return None

    async def close(self) -> None:
        for task in self._watches:
            task.cancel()
        for task in self._watches:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.client.close()
        await self.etcd.close()


def _key(subject: Subject) -> SubjectKey:
    return SubjectKey(subject.mailbox, subject.kind.value, subject.id)
