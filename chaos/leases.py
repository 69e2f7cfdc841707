"""The evidence behind the checker's excuse for a late free, and the excuse itself.

A new etcd leader restarts every lease it inherits: from when it takes over, the election timeout plus the
lease's full TTL (etcd's lessor, ``Promote``; 3.4 and 3.5 keep no remaining-TTL checkpoints by default). A claim
whose lease lived through a leader change can therefore free late, by etcd's design. The coordinator puts no key
on a lease granted in an earlier raft term than its latest answer from etcd carried
(docs/design.md#leases-and-expiry), so such a claim is excused only when:

* its actual lease (the monitor reads it from etcd when the holder dies) was granted, by the coordinator's log, in
  an earlier term than a leader who took over while the lease lived (etcd members' logs);
* that coordinator could not yet have known of the new term when it last put the claim on the lease (its log
  says when it first saw each term; it decided the claim's last expiry no earlier than expiry - TTL - 1 s);
* and the claim was freed by the end the new leader gave the lease, plus etcd's expiry check.

Any other late free is a violation. Parsing the logs is I/O (run.py calls it); :func:`judge_late_free` is pure.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from .config import ETCD_EXPIRY_CHECK_S, LEASE_BUCKET_S

PROMOTE_WITHIN_S = 0.5
"""How long after logging "became leader" a member takes to restart the leases (``Promote`` runs once it has
applied the first entry of its term: one round of appends and fsyncs)."""
LOG_PRECISION_S = 0.05
"""Timestamps of different processes' logs, on one clock, compared: the coordinator's have milliseconds."""


@dataclass(frozen=True)
class LeaseGrant:
    lease: int
    replica: str
    """Which coordinator process asked for it: ``coordinator-0#2`` is coordinator-0's second incarnation."""
    term: int
    """The raft term the coordinator knew when it asked."""
    ttl_s: int
    requested: float
    answered: float
    current: bool
    """No later term was seen while it was granted (the coordinator shares and uses only such leases)."""


@dataclass(frozen=True)
class TermSeen:
    replica: str
    term: int
    at: float


@dataclass(frozen=True)
class LeaderChange:
    member: str
    term: int
    at: float


@dataclass(frozen=True)
class Refresh:
    term: int
    at: float
    """When the new leader took over (its log)."""
    ends: float
    """The latest the lease can end after this leader restarted it."""


@dataclass(frozen=True)
class LateFree:
    subject: str
    token: int
    late_s: float | None
    """How long after its expiry the claim was last seen held; None if it was never seen free."""
    lease: int | None
    lease_term: int | None
    excused_by_term: int | None
    """The term of the leader change that restarted the claim's lease, if that excuses it."""
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _timestamp(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


# ------------------------------------------------------------------------------------------- the logs (I/O)

_BECAME_LEADER = re.compile(r"became leader at term (\d+)")


def leader_changes(member_logs: Sequence[tuple[str, Path]]) -> list[LeaderChange]:
    """When each member became leader, and of which term (etcd 3.4+ logs JSON lines with an ISO ``ts``)."""
    changes = []
    for member, path in member_logs:
        with contextlib.suppress(OSError):
            for line in path.read_text(errors="replace").splitlines():
                found = _BECAME_LEADER.search(line)
                if found is None or not line.startswith("{"):
                    continue
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    changes.append(LeaderChange(member, int(found.group(1)), _timestamp(json.loads(line)["ts"])))
    return sorted(changes, key=lambda change: change.at)


def coordinator_evidence(name: str, path: Path) -> tuple[list[LeaseGrant], list[TermSeen]]:
    """The lease grants and the first sighting of each raft term in one coordinator's log (JSON, debug level).
    Each process's first ``etcd_term`` record (``previous`` 0) begins a new incarnation."""
    grants: list[LeaseGrant] = []
    seen: list[TermSeen] = []
    incarnation = 0
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return grants, seen
    for line in lines:
        if not line.startswith("{"):
            continue
        with contextlib.suppress(ValueError, KeyError, TypeError):
            record = json.loads(line)
            event = record.get("event")
            if event == "etcd_term":
                if int(record["previous"]) == 0:
                    incarnation += 1
                seen.append(TermSeen(f"{name}#{incarnation}", int(record["term"]), _timestamp(record["ts"])))
            elif event == "lease_granted":
                answered = _timestamp(record["ts"])
                grants.append(
                    LeaseGrant(
                        lease=int(record["lease"]),
                        replica=f"{name}#{incarnation}",
                        term=int(record["term"]),
                        ttl_s=int(record["ttl_s"]),
                        requested=answered - int(record["took_ms"]) / 1000,
                        answered=answered,
                        current=bool(record["current"]),
                    )
                )
    return grants, seen


# ------------------------------------------------------------------------------------------- the excuse (pure)


def refreshes(grant: LeaseGrant, changes: Sequence[LeaderChange], election_timeout_s: float) -> list[Refresh]:
    """Each leader change that restarted ``grant``'s lease, with the lease's latest end after it. A change counts
    if its term is later than the grant's and it came after the grant was asked for and before the lease was
    revoked (a lease past its end is revoked at etcd's next expiry check; until then a new leader restarts it)."""
    ends = grant.answered + grant.ttl_s
    found = []
    for change in sorted(changes, key=lambda c: c.at):
        if change.term <= grant.term or change.at < grant.requested - LOG_PRECISION_S:
            continue
        if change.at >= ends + ETCD_EXPIRY_CHECK_S:
            break
        ends = change.at + PROMOTE_WITHIN_S + election_timeout_s + grant.ttl_s
        found.append(Refresh(change.term, change.at, ends))
    return found


def judge_late_free(
    measure: Mapping[str, Any],
    ttl_s: float,
    grants: Mapping[int, LeaseGrant],
    seen: Sequence[TermSeen],
    changes: Sequence[LeaderChange],
    election_timeout_s: float,
) -> LateFree:
    """Whether a claim seen held past its bound (expiry + lease bucket + etcd's expiry check) is excused by a
    leader change that restarted its lease (see the module's note); ``excused_by_term`` is None when it is not."""
    expires = float(measure["expires"])
    last_held = measure.get("last_held")
    freed = measure.get("freed_at") is not None
    late = round(float(last_held) - expires, 3) if last_held is not None and freed else None
    lease = measure.get("lease")

    def verdict(detail: str, grant: LeaseGrant | None = None, by: int | None = None) -> LateFree:
        return LateFree(
            str(measure["subject"]),
            int(measure["token"]),
            late,
            int(lease) if lease is not None else None,
            grant.term if grant is not None else None,
            by,
            detail,
        )

    if lease is None:
        return verdict(f"its lease could not be read from etcd ({measure.get('lease_error', 'no read')})")
    grant = grants.get(int(lease))
    if grant is None:
        return verdict(f"its lease {int(lease):x} is in no coordinator's log of lease grants")
    on = f"on lease {grant.lease:x} (raft term {grant.term}, {grant.ttl_s} s, granted by {grant.replica})"
    if not grant.current:
        return verdict(f"{on}: a lease granted across a change of raft term, which the coordinator must not use", grant)
    restarted = refreshes(grant, changes, election_timeout_s)
    if not restarted:
        return verdict(f"{on}: no etcd leader took over while that lease lived", grant)
    first = restarted[0]
    decided_after = expires - ttl_s - LEASE_BUCKET_S  # the claim's last expiry was stated after this moment
    known = [s.at for s in seen if s.replica == grant.replica and s.term >= first.term]
    if known and min(known) + LOG_PRECISION_S < decided_after:
        return verdict(
            f"{on}: put there after {grant.replica} had seen raft term {first.term} "
            f"({decided_after - min(known):.2f} s before it last stated the claim's expiry)",
            grant,
        )
    last = restarted[-1]
    if not freed or last_held is None or float(last_held) > last.ends + ETCD_EXPIRY_CHECK_S:
        return verdict(
            f"{on}: restarted by the leader of raft term {last.term} to end by {last.ends - expires:.2f} s after "
            f"the claim's expiry, yet {'never freed' if not freed else 'still held later'}",
            grant,
        )
    return verdict(f"{on}: restarted by the leader of raft term {first.term}", grant, first.term)
