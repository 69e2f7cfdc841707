"""gRPC channels to etcd: one per endpoint, each endpoint an IP address or a DNS name, with failover.

Why one channel per endpoint rather than one channel over a list of addresses: gRPC's multi-address targets
(``ipv4:a,b``) take IP literals only, resolve nothing, and check TLS against one name for the whole channel,
while operators address etcd members by name (a StatefulSet's ``etcd-0.etcd-headless...``) and each member's
certificate carries its own name. A channel per endpoint resolves its name through gRPC's DNS resolver (and
again after a failure, so a member that comes back on a new address is found) and verifies that member's
certificate against that endpoint's host, as etcd's own Go client does. One name that resolves to every
member still works too: its channel connects to one address and moves on when it fails (pick_first).

The store uses the current endpoint until its connection drops (a stopped or restarted member: the next
call goes to a connected endpoint, as gRPC's pick_first would) or a call on it fails as a connection would
(UNAVAILABLE or DEADLINE_EXCEEDED: a frozen member, one cut off from its leader); then later calls go to the
next endpoint whose channel is connected (else the next one not known to be failing). A failed call is not
retried here: its caller sees UNAVAILABLE, which is safe to retry with the same request id. Every channel
connects at start, so failover finds a live connection instead of opening one.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from aetcd import rpc

from coordinator.store.etcd.settings import EtcdSettings

log = logging.getLogger(__name__)

_HOST_NAME = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)
_READY = grpc.ChannelConnectivity.READY
_FAILOVER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def endpoint_address(endpoint: str) -> str:
    """``HOST:PORT`` of an endpoint written ``HOST:PORT``, ``http://HOST:PORT`` or ``https://HOST:PORT``;
    ValueError names what is wrong with it. HOST is an IP address ([v6] in brackets) or a DNS name."""
    address = endpoint.removeprefix("http://").removeprefix("https://").rstrip("/")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"etcd endpoint {endpoint!r}: not HOST:PORT (a port from 1 to 65535)")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"etcd endpoint {endpoint!r}: {host} is not an IPv6 address") from None
        return address
    if ":" in host:
        raise ValueError(f"etcd endpoint {endpoint!r}: an IPv6 address needs brackets: [::1]:2379")
    if not _HOST_NAME.fullmatch(host):
        raise ValueError(f"etcd endpoint {endpoint!r}: {host!r} is neither an IP address nor a DNS name")
    return address


def check_endpoints(endpoints: Sequence[str]) -> None:
    """ValueError for an empty list, a malformed endpoint or one given twice."""
    if not endpoints:
        raise ValueError("no etcd endpoint given")
    seen: set[str] = set()
    for endpoint in endpoints:
        address = endpoint_address(endpoint)
        if address.lower() in seen:
            raise ValueError(f"etcd endpoint {endpoint!r} is given twice")
        seen.add(address.lower())


def _read_file(path: Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as error:
        raise ValueError(f"etcd {what} {path}: cannot read: {error.strerror}") from None


_OPTIONS = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # gRPC 1.85 waits for its own 60 s ping timeout and ignores keepalive_timeout_ms; without this a frozen
    # member (SIGSTOP, a stuck disk) stalled every call for about a minute (measured: 5.4 s with it).
    ("grpc.http2.ping_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.lb_policy_name", "pick_first"),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
)


def open_channel(settings: EtcdSettings, endpoint: str | None = None) -> grpc.aio.Channel:
    """A channel to ``endpoint`` (default: the first of ``settings.endpoints``); with TLS, the server's
    certificate must carry that endpoint's host."""
    address = endpoint_address(endpoint if endpoint is not None else settings.endpoints[0])
    if not settings.uses_tls:
        return grpc.aio.insecure_channel(address, options=_OPTIONS)
    if (settings.cert_file is None) != (settings.key_file is None):
        raise ValueError("etcd client certificate and key go together: give both or neither")
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read_file(settings.ca_file, "CA file"),
        private_key=_read_file(settings.key_file, "client key"),
        certificate_chain=_read_file(settings.cert_file, "client certificate"),
    )
    return grpc.aio.secure_channel(address, credentials, options=_OPTIONS)


@dataclass(frozen=True)
class EtcdEndpoint:
    """One endpoint's channel and the etcd stubs on it."""

    endpoint: str
    channel: grpc.aio.Channel
    kv: Any
    watch: Any
    lease: Any
    maintenance: Any
    auth: Any

    @classmethod
    def open(cls, settings: EtcdSettings, endpoint: str) -> EtcdEndpoint:
        channel = open_channel(settings, endpoint)
        return cls(
            endpoint,
            channel,
            kv=rpc.KVStub(channel),
            watch=rpc.WatchStub(channel),
            lease=rpc.LeaseStub(channel),
            maintenance=rpc.MaintenanceStub(channel),
            auth=rpc.AuthStub(channel),
        )

    @property
    def state(self) -> grpc.ChannelConnectivity:
        return self.channel.get_state(try_to_connect=True)


class EtcdChannels:
    """The endpoints of one etcd cluster; :attr:`current` is where calls go, :meth:`failed` moves it on."""

    def __init__(self, settings: EtcdSettings) -> None:
        check_endpoints(settings.endpoints)
        self.endpoints = [EtcdEndpoint.open(settings, endpoint) for endpoint in settings.endpoints]
        self._current = 0
        for endpoint in self.endpoints:
            _ = endpoint.state  # connect now, so that failover finds a connection ready

    @property
    def current(self) -> EtcdEndpoint:
        """The endpoint for the next call. One whose connection has dropped (its member stopped or restarted:
        the channel leaves READY at once) is passed over for a connected one before any call fails on it."""
        endpoint = self.endpoints[self._current]
        if len(self.endpoints) > 1 and endpoint.channel.get_state() != _READY:
            self._move_on(endpoint, "not connected", ready_only=True)
        return self.endpoints[self._current]

    def failed(self, used: EtcdEndpoint, code: grpc.StatusCode) -> None:
        """A call on ``used`` ended with ``code``; if that looks like the endpoint failing, move on."""
        if code in _FAILOVER_CODES and len(self.endpoints) > 1 and used is self.endpoints[self._current]:
            self._move_on(used, code.name, ready_only=False)
        # else: another call has already moved on from it

    def _move_on(self, left: EtcdEndpoint, reason: str, *, ready_only: bool) -> None:
        """To the next connected endpoint; unless ``ready_only``, else the next not known to be failing."""
        count = len(self.endpoints)
        others = [self.endpoints[(self._current + step) % count] for step in range(1, count)]
        states = [other.state for other in others]  # also asks idle channels to connect
        ready = [o for o, s in zip(others, states, strict=True) if s == _READY]
        healthy = [o for o, s in zip(others, states, strict=True) if s != grpc.ChannelConnectivity.TRANSIENT_FAILURE]
        candidates = ready if ready_only else (ready or healthy or others)
        if not candidates:
            return
        chosen = candidates[0]
        self._current = self.endpoints.index(chosen)
        log.warning(
            "etcd endpoint %s left (%s); calls now go to %s",
            left.endpoint,
            reason,
            chosen.endpoint,
            extra={"fields": {"event": "etcd_failover", "from": left.endpoint, "to": chosen.endpoint}},
        )

    async def close(self) -> None:
        for endpoint in self.endpoints:
            await endpoint.channel.close()
