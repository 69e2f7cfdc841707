"""How the coordinator reaches etcd: endpoints, key prefix, deadlines, group commit, TLS and etcd's own users.
Its own module because the client and the channels both read it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["EtcdSettings"]


@dataclass(frozen=True)
class EtcdSettings:
    endpoints: Sequence[str]
    prefix: str = "inbox-coordinator/v1/"
    # Deadline of one etcd call: a store slower than this is reported UNAVAILABLE, not waited on forever.
    call_timeout_s: float = 5.0
    # Group commit: transactions that arrive while others are in flight are sent together, each as a
    # nested transaction of one etcd request (one raft entry, one fsync). 1 turns batching off.
    max_batch: int = 64
    # How many batches may be in flight at once. Two: while one is committed the next fills, which is what
    # Batch RPCs from busy clients need (1.04x the raw etcd loop against 0.94x with one); one suits agents
    # that make one call at a time (+15% for them). docs/performance.md, finding 1.
    max_batches_in_flight: int = 2
    # TLS to etcd: the CA that signed etcd's certificate, and a client certificate for --client-cert-auth.
    # Endpoints written https://... use TLS with the system's CAs when no CA file is given.
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    # etcd's own authentication (etcdctl user add; auth enable).
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def uses_tls(self) -> bool:
        return any((self.ca_file, self.cert_file, self.key_file)) or any(
            e.startswith("https://") for e in self.endpoints
        )
