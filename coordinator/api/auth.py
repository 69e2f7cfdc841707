"""Who is calling: bearer tokens and client certificates mapped to principals, from a file that reloads.

The token file is TOML; tokens are stored only as SHA-256 hashes (tokens are 32 random bytes, so a plain
hash is enough: there is nothing to brute-force). Example:

    [[principals]]
    id = "support-agent-1"
    kind = "agent"                       # or "human"
    mailboxes = ["grant-7f3a", "acme-*"] # exact names or globs (*, ?, [...])
    roles = []                           # "report", "takeover", "resolve", "admin"
    token_sha256 = ["5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8"]
    certificate_names = ["agent-1.acme.internal"]   # mTLS: a client certificate's CN or DNS SAN
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from coordinator.core.domain import Caller, Grants, HolderKind
from coordinator.core.errors import InvalidArgument, PermissionDenied, Unauthenticated
from coordinator.core.limits import PRINCIPAL_MAX_BYTES, check_text
from inbox_wire import PRINCIPAL_KIND_METADATA, PRINCIPAL_METADATA

# report: may say a message was sent from its mailboxes (RecordOutgoing), and names threads as the provider does
# (its webhook workers); takeover: a person may take a message from an agent or a colleague; resolve: may settle
# an unconfirmed send, and undo a reply recorded as written outside; admin: every role and every mailbox.
ROLES = frozenset({"report", "takeover", "resolve", "admin"})
# The authenticated principal of the call running in this task, for the per-call log line.
current_principal: ContextVar[str] = ContextVar("inbox_coordinator_principal", default="")
AUTHORIZATION_METADATA = "authorization"


class TokenFileError(ValueError):
    """The token file cannot be used; the message names the entry and the field."""


@dataclass(frozen=True)
class MailboxGrants(Grants):
    """The mailboxes a principal may act in (exact names or globs) and its roles."""

    patterns: tuple[str, ...] = ()
    role_names: frozenset[str] = frozenset()

    def may_access(self, mailbox: str) -> bool:
        if "admin" in self.role_names:
            return True
        return any(fnmatchcase(mailbox, pattern) for pattern in self.patterns)

    def has_role(self, role: str) -> bool:
        return role in self.role_names or "admin" in self.role_names


@dataclass(frozen=True)
class Principal:
    id: str
    kind: HolderKind
    grants: MailboxGrants
    token_hashes: frozenset[str] = frozenset()
    certificate_names: frozenset[str] = frozenset()

    def caller(self) -> Caller:
        return Caller(self.id, self.kind, self.grants)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> tuple[str, str]:
    """A fresh bearer token and the hash to put in the token file."""
    token = "ict_" + secrets.token_urlsafe(32)
    return token, hash_token(token)


def _strings(where: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise TokenFileError(f"{where}: must be a list of strings")
    return value


def parse_principals(data: Mapping[str, Any], source: str) -> list[Principal]:
    entries = data.get("principals", [])
    if not isinstance(entries, list):
        raise TokenFileError(f"{source}: 'principals' must be an array of tables ([[principals]])")
    unknown = set(data) - {"principals"}
    if unknown:
        raise TokenFileError(f"{source}: unknown top-level keys {sorted(unknown)}; only [[principals]] is allowed")
    principals: list[Principal] = []
    seen_ids: set[str] = set()
    seen_tokens: dict[str, str] = {}
    # A certificate name is an identity as much as a token is: under two principals, one typo would silently
    # hand a certificate the other's rights (the last entry would win).
    seen_names: dict[str, str] = {}
    for index, entry in enumerate(entries):
        where = f"{source}: principals[{index}]"
        if not isinstance(entry, dict):
            raise TokenFileError(f"{where}: must be a table")
        extra = set(entry) - {"id", "kind", "mailboxes", "roles", "token_sha256", "certificate_names"}
        if extra:
            raise TokenFileError(f"{where}: unknown keys {sorted(extra)}")
        principal_id = entry.get("id")
        if not isinstance(principal_id, str):
            raise TokenFileError(f"{where}.id: required, a string")
        try:
            check_text("id", principal_id, PRINCIPAL_MAX_BYTES, required=True)
        except InvalidArgument as error:
            raise TokenFileError(f"{where}.{error}") from None
        if principal_id in seen_ids:
            raise TokenFileError(f"{where}.id: {principal_id!r} is defined twice")
        seen_ids.add(principal_id)
        try:
            kind = HolderKind(entry.get("kind", "agent"))
        except ValueError:
            raise TokenFileError(f"{where}.kind: must be 'agent' or 'human'") from None
        roles = frozenset(_strings(f"{where}.roles", entry.get("roles", [])))
        if roles - ROLES:
            raise TokenFileError(f"{where}.roles: unknown {sorted(roles - ROLES)}; known: {sorted(ROLES)}")
        hashes = _strings(f"{where}.token_sha256", entry.get("token_sha256", []))
        for token_hash in hashes:
            if len(token_hash) != 64 or any(c not in "0123456789abcdef" for c in token_hash):
                raise TokenFileError(f"{where}.token_sha256: {token_hash[:12]}... is not 64 lowercase hex digits")
        _claim_unique(f"{where}.token_sha256", "the same token", hashes, seen_tokens, principal_id)
        names = _strings(f"{where}.certificate_names", entry.get("certificate_names", []))
        _claim_unique(f"{where}.certificate_names", "certificate name {!r}", names, seen_names, principal_id)
        if not hashes and not names:
            raise TokenFileError(f"{where}: needs token_sha256 or certificate_names, or it can never authenticate")
        mailboxes = _strings(f"{where}.mailboxes", entry.get("mailboxes", []))
        principals.append(
            Principal(
                principal_id,
                kind,
                MailboxGrants(tuple(mailboxes), roles),
                frozenset(hashes),
                frozenset(names),
            )
        )
    return principals


def _claim_unique(where: str, what: str, values: Iterable[str], seen: dict[str, str], principal_id: str) -> None:
    """Records that ``values`` identify ``principal_id``; refuses one that identifies someone else already."""
    for value in values:
        owner = seen.setdefault(value, principal_id)
        if owner != principal_id:
            raise TokenFileError(
                f"{where}: {what.format(value)} is also given to {owner!r}; a credential identifies one principal"
            )


def load_token_file(path: Path) -> list[Principal]:
    try:
        data = tomllib.loads(path.read_text())
    except OSError as error:
        raise TokenFileError(f"{path}: cannot read: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise TokenFileError(f"{path}: not valid TOML: {error}") from None
    return parse_principals(data, str(path))


@dataclass(frozen=True)
class CallCredentials:
    """What a call presented: its metadata and the identities of its verified client certificate."""

    metadata: Mapping[str, str]
    certificate_names: Sequence[str] = ()


@dataclass(frozen=True)
class Identity:
    """Who a caller is and what it may do, as GetCaller tells it (``inboxctl whoami``, the board)."""

    principal: str
    kind: HolderKind
    roles: tuple[str, ...]
    mailboxes: tuple[str, ...]
    """Globs; ``("*",)`` for an admin, whose grants reach every mailbox."""
    development_mode: bool


class Authenticator:
    """Maps a call's credentials to a Caller."""

    # Whether authenticate() looks at client certificates; reading them costs time on every call.
    uses_certificates = True
    # Whether every caller has every right (no authentication: development mode).
    grants_everything = False

    def authenticate(self, credentials: CallCredentials) -> Caller:
        raise NotImplementedError

    def identity(self, caller: Caller) -> Identity:
        """What ``caller`` was granted: a token principal's grants as its file says (an admin has every role and
        mailbox); without authentication, every right."""
        grants = caller.grants
        granted = grants if isinstance(grants, MailboxGrants) and not self.grants_everything else ALL_ACCESS
        admin = "admin" in granted.role_names
        return Identity(
            principal=caller.principal,
            kind=caller.kind,
            roles=tuple(sorted(ROLES if admin else granted.role_names)),
            mailboxes=("*",) if admin else granted.patterns,
            development_mode=self.grants_everything,
        )


ALL_ACCESS = MailboxGrants(("*",), ROLES)


class DevelopmentAuthenticator(Authenticator):
    """No authentication: the principal is whatever the metadata says, with every right. Loopback only."""

    uses_certificates = False
    grants_everything = True

    def authenticate(self, credentials: CallCredentials) -> Caller:
        principal = credentials.metadata.get(PRINCIPAL_METADATA, "")
        if not principal:
            raise Unauthenticated(
                f"no principal: send the metadata key {PRINCIPAL_METADATA!r} (the name this agent or person acts as)"
            )
        kind_text = credentials.metadata.get(PRINCIPAL_KIND_METADATA, "agent").lower()
        try:
            kind = HolderKind(kind_text)
        except ValueError:
            raise InvalidArgument(PRINCIPAL_KIND_METADATA, f"is {kind_text!r}; use 'agent' or 'human'") from None
        check_text("principal", principal, PRINCIPAL_MAX_BYTES, required=True)
        return Caller(principal, kind, ALL_ACCESS)


@dataclass
class _Index:
    by_token: dict[str, Principal] = field(default_factory=dict)
    by_certificate: dict[str, Principal] = field(default_factory=dict)


class TokenAuthenticator(Authenticator):
    """Bearer tokens and client certificates from a token file. ``reload()`` swaps the whole file in at
    once: a token removed from the file stops working for the very next call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._index = self._build(load_token_file(path))

    @staticmethod
    def _build(principals: Iterable[Principal]) -> _Index:
        index = _Index()
        for principal in principals:
            for token_hash in principal.token_hashes:
                index.by_token[token_hash] = principal
            for name in principal.certificate_names:
                index.by_certificate[name] = principal
        return index

    def reload(self) -> int:
        """Reads the file again; on error the old principals stay in force and the error is raised."""
        principals = load_token_file(self.path)
        index = self._build(principals)
        with self._lock:
            self._index = index
        return len(principals)

    def authenticate(self, credentials: CallCredentials) -> Caller:
        index = self._index
        principal = self._from_token(index, credentials.metadata.get(AUTHORIZATION_METADATA, ""))
        if principal is None:
            principal = self._from_certificate(index, credentials.certificate_names)
        if principal is None:
            raise Unauthenticated(
                "no valid credentials: send 'authorization: Bearer <token>' with a current token"
                + (" (the client certificate is not mapped to a principal)" if credentials.certificate_names else "")
            )
        claimed = credentials.metadata.get(PRINCIPAL_METADATA)
        if claimed is not None and claimed != principal.id:
            raise PermissionDenied(
                f"the call names principal {claimed!r} in {PRINCIPAL_METADATA!r} but its credentials are for "
                f"{principal.id!r}; a principal acts only as itself",
                reason="PRINCIPAL_MISMATCH",
            )
        return principal.caller()

    @staticmethod
    def _from_certificate(index: _Index, names: Sequence[str]) -> Principal | None:
        found = {
            index.by_certificate[name].id: index.by_certificate[name] for name in names if name in index.by_certificate
        }
        if len(found) > 1:
            # Each name is unique in the file, but one certificate can carry several (CN and SANs).
            raise Unauthenticated(
                f"the client certificate's names map to several principals ({', '.join(sorted(found))}); "
                "issue it with the names of one principal only"
            )
        return next(iter(found.values()), None)

    @staticmethod
    def _from_token(index: _Index, header: str) -> Principal | None:
        scheme, _, token = header.partition(" ")
        if not token or scheme.lower() != "bearer":
            return None
        presented = hash_token(token.strip())
        # Constant-time comparison against the one candidate the hash lookup found.
        principal = index.by_token.get(presented)
        if principal is None:
            return None
        match = any(hmac.compare_digest(presented, known) for known in principal.token_hashes)
        return principal if match else None


@dataclass(frozen=True)
class TlsSettings:
    """The gRPC port's TLS: a certificate and key, and for mTLS the CA that signs client certificates."""

    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None
    require_client_cert: bool = False


def server_credentials(tls: TlsSettings) -> Any:
    import grpc

    def read(path: Path, what: str) -> bytes:
        try:
            return path.read_bytes()
        except OSError as error:
            raise ValueError(f"{what} {path}: cannot read: {error.strerror}") from None

    pair = (read(tls.key_file, "TLS key"), read(tls.cert_file, "TLS certificate"))
    client_ca = read(tls.client_ca_file, "client CA") if tls.client_ca_file is not None else None
    if tls.require_client_cert and client_ca is None:
        raise ValueError("requiring client certificates needs a client CA file")
    if client_ca is not None and not tls.require_client_cert:
        # grpcio asks for a client certificate only when it requires one: with a CA and no requirement, no
        # certificate would ever be seen (and a mapped one would get UNAUTHENTICATED).
        raise ValueError("a client CA needs require_client_cert: gRPC cannot ask for an optional client certificate")
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca, require_client_auth=tls.require_client_cert)
