"""What a client is configured with: the target, identity metadata, TLS credentials, timeouts, retry policy,
channel arguments, batching and the outgoing-message rules, checked once by :func:`make_options`.

Separate from the clients and the flows: :mod:`._settings` (``inboxctl`` and ``from_env()``) needs the defaults
here without importing any client, and the flows (:mod:`._core`) read the result without knowing how it was made.
"""

from __future__ import annotations

import ipaddress
import logging
import ssl
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import grpc

from inbox_wire import BATCH_MAX_CALLS, PRINCIPAL_KIND_METADATA, PRINCIPAL_METADATA, VERSION

from ._outgoing import OutgoingRules
from ._types import HolderKind, RetryPolicy

__all__ = ["DEFAULT_TARGET", "DEFAULT_TIMEOUT", "USER_AGENT", "ClientOptions", "make_options"]

log = logging.getLogger("inbox_claims")

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_TIMEOUT = 10.0
USER_AGENT = "inbox-claims-python/" + ".".join(VERSION.split(".")[:2])

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """Everything a client is configured with, validated once (see the clients' ``__init__``)."""

    target: str
    principal: str | None
    kind: HolderKind
    credentials: grpc.ChannelCredentials | None
    """``None``: a plaintext channel (development)."""
    timeout: float
    retry: RetryPolicy
    metadata: tuple[tuple[str, str], ...]
    channel_options: tuple[tuple[str, Any], ...] = field(default=())
    max_batch: int = 64
    """Concurrent calls sent together in one Batch RPC, at most; 1: every call alone."""
    outgoing: OutgoingRules = field(default_factory=OutgoingRules)
    """How the guard tells a message the mailbox sent (never answered) from one it received."""
    protocol: Literal["grpc", "http-json"] = "grpc"
    """``http-json``: the calls go to the coordinator's HTTP/JSON face (``target`` is its address)."""
    http_tls: ssl.SSLContext | None = None
    """With ``http-json`` and TLS: how the face's certificate is checked."""

    @property
    def http_base_url(self) -> str:
        return f"{'https' if self.http_tls is not None else 'http'}://{self.target}"

    def open_channel(self, insecure: Callable[..., T], secure: Callable[..., T]) -> T:
        """A channel from ``grpc`` or ``grpc.aio``: plaintext without credentials, else secure."""
        if self.credentials is None:
            return insecure(self.target, self.channel_options)
        return secure(self.target, self.credentials, self.channel_options)


def _ascii_metadata(name: str, value: str) -> str:
    if not value or not value.isascii() or not value.isprintable():
        raise ValueError(f"{name} must be non-empty printable ASCII (it travels in gRPC metadata), not {value!r}")
    return value


def make_options(
    target: str,
    *,
    principal: str | None,
    kind: HolderKind | Literal["agent", "human"],
    token: str | None,
    tls: bool,
    root_certificates: bytes | None,
    client_certificate: bytes | None,
    client_key: bytes | None,
    credentials: grpc.ChannelCredentials | None,
    timeout: float,
    retry: RetryPolicy | None,
    channel_options: Sequence[tuple[str, Any]],
    max_batch: int = 64,
    sent_folders: str | Iterable[str] | None = None,
    mailbox_addresses: str | Iterable[str] | None = None,
    protocol: Literal["grpc", "http-json"] = "grpc",
) -> ClientOptions:
    if not target:
        raise ValueError("target must be HOST:PORT (or any gRPC target), e.g. '127.0.0.1:50051'")
    holder_kind = kind if isinstance(kind, HolderKind) else HolderKind(kind)
    wants_tls = tls or any(v is not None for v in (root_certificates, client_certificate, client_key))
    if credentials is not None and wants_tls:
        raise ValueError("pass either credentials= or tls=/root_certificates=/client_certificate=/client_key=")
    if (client_certificate is None) != (client_key is None):
        raise ValueError("mutual TLS needs both client_certificate= and client_key= (PEM bytes)")
    if protocol not in ("grpc", "http-json"):
        raise ValueError(f"protocol must be 'grpc' or 'http-json', not {protocol!r}")
    http_tls = None
    if protocol == "http-json":
        if credentials is not None or client_certificate is not None:
            raise ValueError(
                "protocol='http-json' takes tls=True or root_certificates=, not credentials= or a client "
                "certificate (mutual TLS): use protocol='grpc' for those"
            )
        if wants_tls:
            http_tls = ssl.create_default_context(cadata=root_certificates.decode() if root_certificates else None)
    elif wants_tls:
        credentials = grpc.ssl_channel_credentials(root_certificates, client_key, client_certificate)
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, not {timeout}")
    if not 1 <= max_batch <= BATCH_MAX_CALLS:
        raise ValueError(f"max_batch must be 1..{BATCH_MAX_CALLS} (the coordinator's limit per batch), not {max_batch}")
    metadata: list[tuple[str, str]] = []
    if principal is not None:
        metadata.append((PRINCIPAL_METADATA, _ascii_metadata("principal", principal)))
        metadata.append((PRINCIPAL_KIND_METADATA, holder_kind.value))
    if token is not None:
        metadata.append(("authorization", "Bearer " + _ascii_metadata("token", token)))
    if token is not None and credentials is None and not _is_loopback(target):
        log.warning("sending a bearer token to %s over a plaintext channel; pass tls=True", target)
    policy = retry if retry is not None else RetryPolicy()
    # gRPC's own reconnection backoff (1 s initial, 120 s cap by default) would make retries find the channel
    # still waiting; keep it within the retry policy's range so a coordinator that comes back is found.
    reconnect_ms = int(max(policy.initial_backoff, 0.05) * 1000)
    defaults: dict[str, Any] = {
        "grpc.primary_user_agent": USER_AGENT,
        "grpc.initial_reconnect_backoff_ms": reconnect_ms,
        "grpc.min_reconnect_backoff_ms": reconnect_ms,
        "grpc.max_reconnect_backoff_ms": int(max(policy.max_backoff * 1000, reconnect_ms)),
    }
    defaults.update(dict(channel_options))
    return ClientOptions(
        target=target,
        principal=principal,
        kind=holder_kind,
        credentials=credentials,
        timeout=float(timeout),
        retry=policy,
        metadata=tuple(metadata),
        channel_options=tuple(defaults.items()),
        max_batch=max_batch,
        outgoing=OutgoingRules.of(sent_folders, mailbox_addresses),
        protocol=protocol,
        http_tls=http_tls,
    )


def _is_loopback(target: str) -> bool:
    host = target.removeprefix("dns:").removeprefix("ipv4:").removeprefix("ipv6:").rpartition(":")[0].strip("[]")
    if host == "localhost" or target.startswith("unix:"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
