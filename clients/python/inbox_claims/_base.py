"""What both clients share besides their calls and I/O: construction (arguments, ``from_env()``), identity, and
the check that the client is still open.

:class:`~inbox_claims.Coordinator` and :class:`~inbox_claims.AsyncCoordinator` subclass :class:`ClientBase`
and add their I/O and their methods. Separate from the flows (:mod:`._core`) because it reads the environment
(:mod:`._settings`), which the flows never do.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, Self

import grpc

from ._core import Core
from ._options import DEFAULT_TARGET, DEFAULT_TIMEOUT, make_options
from ._outgoing import MAILBOX_ADDRESSES_ENV, SENT_FOLDERS_ENV
from ._settings import client_arguments, from_environment
from ._types import HolderKind, RetryPolicy

__all__ = ["ClientBase"]


class ClientBase:
    """Options shared by :class:`~inbox_claims.Coordinator` and :class:`~inbox_claims.AsyncCoordinator`."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        principal: str | None = None,
        kind: HolderKind | Literal["agent", "human"] = "agent",
        token: str | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
        client_certificate: bytes | None = None,
        client_key: bytes | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        retry: RetryPolicy | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
        max_batch: int = 64,
        sent_folders: str | Iterable[str] | None = None,
        mailbox_addresses: str | Iterable[str] | None = None,
        protocol: Literal["grpc", "http-json"] = "grpc",
    ) -> None:
        """Connects lazily to the coordinator at ``target`` (HOST:PORT, default ``127.0.0.1:50051``).

        Identity: ``principal`` and ``kind`` ("agent" or "human") are sent as the metadata
        ``x-inbox-principal`` / ``x-inbox-principal-kind`` (development mode); ``token`` as
        ``authorization: Bearer <token>`` once the coordinator authenticates.
        Transport: plaintext by default; ``tls=True`` (system roots), or ``root_certificates`` (PEM bytes),
        plus ``client_certificate`` and ``client_key`` for mutual TLS; or a ready ``credentials``
        (``grpc.ChannelCredentials``).
        ``timeout``: the deadline of each attempt of each call, in seconds. ``retry``: a :class:`RetryPolicy`
        (default: 6 attempts, 0.1 s to 2 s exponential backoff with jitter). ``channel_options``: extra gRPC
        channel arguments.
        ``max_batch``: calls made at the same time (by concurrent tasks or threads sharing this client) go
        to the coordinator together, up to this many in one Batch RPC; each is still its own call, with its
        own answer, error and retries. 1 sends every call alone.
        ``sent_folders`` and ``mailbox_addresses``: how the guard tells a message the mailbox sent from one it
        received (docs/client.md, "Outgoing messages"): folder ids of sent mail besides Google's ``SENT`` (for
        Microsoft and IMAP: ``nylas.sent_folder_ids``), and the mailbox's own addresses. A notification about an
        outgoing message is never handed to your code: it is reported with ``record_outgoing``.
        ``protocol``: ``"grpc"`` (default), or ``"http-json"`` to call the coordinator's HTTP/JSON face instead
        (``target`` is its ``--http-listen`` address; where only HTTP/1.1 gets through): the same calls, answers,
        errors and traces, each call a request of its own (no Batch RPC), and no ``watch`` (docs/client.md).
        """
        self._core = Core(
            make_options(
                target,
                principal=principal,
                kind=kind,
                token=token,
                tls=tls,
                root_certificates=root_certificates,
                client_certificate=client_certificate,
                client_key=client_key,
                credentials=credentials,
                timeout=timeout,
                retry=retry,
                channel_options=channel_options,
                max_batch=max_batch,
                sent_folders=sent_folders,
                mailbox_addresses=mailbox_addresses,
                protocol=protocol,
            )
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Self:
        """A client configured by the environment variables ``inboxctl`` reads (``environ``: default
        ``os.environ``): ``INBOX_COORDINATOR_TARGET`` (default ``127.0.0.1:50051``), ``INBOX_PRINCIPAL``,
        ``INBOX_PRINCIPAL_KIND`` (default ``agent`` here), ``INBOX_TOKEN``, ``INBOX_TLS``, ``INBOX_CA_FILE``,
        ``INBOX_CERT_FILE``, ``INBOX_KEY_FILE``, ``INBOX_CALL_TIMEOUT`` (default 5 s), and for the guard
        ``INBOX_SENT_FOLDERS`` and ``INBOX_MAILBOX_ADDRESSES`` (comma-separated: ``sent_folders`` and
        ``mailbox_addresses``). Keyword arguments override them (``from_env(max_batch=16)``). Raises
        ``ValueError`` naming the variable to set when neither ``INBOX_PRINCIPAL`` nor ``INBOX_TOKEN`` says who
        the client is."""
        variables = os.environ if environ is None else environ
        settings = from_environment(variables)
        if not variables.get("INBOX_PRINCIPAL_KIND"):
            settings["kind"] = "agent"  # inboxctl's default is a human at a terminal; this is an agent
        arguments = client_arguments(settings)
        arguments["sent_folders"] = variables.get(SENT_FOLDERS_ENV)
        arguments["mailbox_addresses"] = variables.get(MAILBOX_ADDRESSES_ENV)
        arguments.update(overrides)
        if arguments["principal"] is None and arguments["token"] is None:
            raise ValueError(
                "from_env() found no identity: set INBOX_TOKEN (a bearer token) or, in development mode, "
                "INBOX_PRINCIPAL (the agent's name)"
            )
        target = arguments.pop("target")
        return cls(target, **arguments)

    _closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} is closed; make a new one")

    @property
    def target(self) -> str:
        return self._core.options.target

    @property
    def principal(self) -> str | None:
        return self._core.options.principal

    @property
    def kind(self) -> HolderKind:
        return self._core.options.kind

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.target!r}, principal={self.principal!r})"
