"""The connection settings ``inboxctl`` and ``Coordinator.from_env()`` share: their environment variables and
how they become a client's arguments."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._options import DEFAULT_TARGET


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    env: str
    default: Any
    help: str


SETTINGS = (
    Setting("target", "INBOX_COORDINATOR_TARGET", DEFAULT_TARGET, "the coordinator, HOST:PORT"),
    Setting("principal", "INBOX_PRINCIPAL", None, "who you are, in development mode (default: your login name)"),
    Setting("kind", "INBOX_PRINCIPAL_KIND", "human", "agent or human (development mode; default human)"),
    Setting("token", "INBOX_TOKEN", None, "bearer token, sent as 'authorization: Bearer TOKEN'"),
    Setting("tls", "INBOX_TLS", False, "use TLS with the system's root certificates"),
    Setting("ca_file", "INBOX_CA_FILE", None, "TLS: PEM file of the CA that signed the coordinator's certificate"),
    Setting("cert_file", "INBOX_CERT_FILE", None, "mutual TLS: your client certificate (PEM)"),
    Setting("key_file", "INBOX_KEY_FILE", None, "mutual TLS: your client key (PEM)"),
    Setting("call_timeout", "INBOX_CALL_TIMEOUT", 5.0, "seconds per call to the coordinator (default 5)"),
)


def from_environment(environ: Mapping[str, str]) -> dict[str, Any]:
    """Each setting from its variable (an empty one counts as unset), else its default."""
    return {setting.name: environ.get(setting.env) or setting.default for setting in SETTINGS}


def _read_pem(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as error:
        raise ValueError(f"cannot read the {what} {path}: {error.strerror}") from None


def client_arguments(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``Coordinator``/``AsyncCoordinator`` for resolved settings (raises ValueError)."""
    try:
        timeout = float(settings["call_timeout"])
    except (TypeError, ValueError):
        raise ValueError(f"call_timeout must be a number of seconds, not {settings['call_timeout']!r}") from None
    tls = settings["tls"]
    if isinstance(tls, str):
        tls = tls.lower() in ("1", "true", "yes", "on")
    if settings["kind"] not in ("agent", "human"):
        raise ValueError(f"kind must be 'agent' or 'human', not {settings['kind']!r}")
    return {
        "target": settings["target"],
        "principal": settings["principal"],
        "kind": settings["kind"],
        "token": settings["token"],
        "tls": bool(tls),
        "root_certificates": _read_pem(settings["ca_file"], "CA file"),
        "client_certificate": _read_pem(settings["cert_file"], "client certificate"),
        "client_key": _read_pem(settings["key_file"], "client key"),
        "timeout": timeout,
    }
