"""One command per mutating call: its request id and its arguments as domain values, and the fingerprint that
tells a retry from a reuse of its request id (docs/design.md#retries).

A command is what the service builds from a request and what the engine and the domain read their arguments
from, so adding an argument to a call touches its command, the service's conversion and the code that uses it.

**The fingerprint** (``Command.fingerprint``) digests every field except ``request_id``, so no argument can be
forgotten. Version 1, stable across releases and languages:

1. the document is the JSON array ``[rpc, fields]``: the RPC's name, then an object of the command's fields
   except ``request_id`` and except every field whose value is its default;
2. values: strings as strings, integers in decimal, booleans, ``None`` as null, an enum as its value, a domain
   dataclass (``Subject``, ``Summary``) as an object of its fields, by the same rule (defaults left out);
3. written as canonical JSON: keys sorted (field names are ASCII), no spaces, ``"`` and ``\\`` and the control
   characters with a short form (``\\b \\f \\n \\r \\t``) as short escapes, every other control character
   and every character outside ASCII as ``\\uxxxx`` in lower-case hex (a surrogate pair beyond U+FFFF): as
   Python's ``json.dumps(..., sort_keys=True, separators=(",", ":"), ensure_ascii=True)`` writes it, and
   depending on no Unicode table;
4. hashed with BLAKE2b, 8-byte digest, over those ASCII bytes; written ``v1:`` + the digest in unpadded
   base64url.

A field at its default is left out so that a field a later release adds, with a default, leaves the
fingerprint of every call that does not use it as the earlier release computed it: a retry that crosses a
rolling upgrade is still a retry. Anything else that changes the bytes is a new version with its own prefix,
and ``recognises`` then keeps recognising version 1 for as long as it keeps the legacy fingerprint below.

A command is fingerprinted as the caller sent it, after deterministic normalisation only (the engine resolves a
TTL of 0 to the rules' default and an empty summary to none), never after anything read from the store: a
retry must compute the same fingerprint whatever the store holds by then.

**The legacy fingerprint** (``legacy_fingerprint``): before version 1, fingerprints were BLAKE2b digests of the
``repr()`` of a hand-listed tuple of some of the arguments, without a prefix. Records written by such a release
carry them for as long as they live: reply records for the reply retention (72 h by default), end marks and
delivery records for the delivery retention (24 h). ``recognises`` compares a stored fingerprint without the
``v1:`` prefix with the old tuple, so a retry crossing the upgrade is still a retry and another call is still
REQUEST_ID_REUSED (judged on the old tuple's arguments only: those are all the old record knows). The legacy
branch must stay until no record written by a release before version 1 can remain, that is for the reply
retention after the last replica of the old release stopped; the release after that may delete
``legacy_fingerprint``, its implementations and ``_legacy_digest``, and make ``recognises`` compare with
``fingerprint`` alone. (The other way round there is no bridge: during the upgrade, a replica of the earlier
release answers a retry of a call a new replica recorded REQUEST_ID_REUSED, refused and never applied twice.)
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any, ClassVar

from coordinator.core.values import ResolveOutcome, Subject, Summary

FINGERPRINT_VERSION = "v1"
_PREFIX = FINGERPRINT_VERSION + ":"
_DIGEST_BYTES = 8


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.blake2b(data, digest_size=_DIGEST_BYTES).digest()).decode().rstrip("=")


_NO_DEFAULT = object()
# Each dataclass's fields and their defaults, read once: every call of the coordinator fingerprints its command.
_FIELDS: dict[type, tuple[tuple[str, Any], ...]] = {}


def _fields_and_defaults(cls: type) -> tuple[tuple[str, Any], ...]:
    known = _FIELDS.get(cls)
    if known is None:
        known = _FIELDS[cls] = tuple((field.name, _default(field)) for field in dataclasses.fields(cls))
    return known


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return _NO_DEFAULT


def _non_default_fields(value: Any, *, skip: str = "") -> dict[str, Any]:
    fields = {}
    for name, default in _fields_and_defaults(type(value)):
        current = getattr(value, name)
        if name != skip and (default is _NO_DEFAULT or current != default):
            fields[name] = _encodable(current)
    return fields


def _encodable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return _encodable(value.value)
    if value is None or isinstance(value, str | int):  # bool included: JSON writes it true or false
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _non_default_fields(value)
    # Floats among them: their decimal text differs between languages.
    raise TypeError(f"a command field of type {type(value).__name__} has no fingerprint encoding")


# One encoder for every command: json.dumps with options builds a new JSONEncoder on each call.
_CANONICAL_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def canonical_document(command: Command) -> str:
    """The text version 1 hashes (see the module's docstring): also what the golden vectors show."""
    return _CANONICAL_JSON.encode([command.rpc, _non_default_fields(command, skip="request_id")])


# --- the legacy fingerprint: delete with legacy_fingerprint (see the module's docstring) --------------------
# The text of the old repr((call, arguments)), written out rather than asked of the classes, so that a field
# added to Subject, or another Python's repr of a class, cannot change it.


def _legacy_repr(value: object) -> str:
    if isinstance(value, Subject):
        kind = f"<SubjectKind.{value.kind.name}: {value.kind.value!r}>"
        return f"Subject(mailbox={value.mailbox!r}, kind={kind}, id={value.id!r})"
    if isinstance(value, ResolveOutcome):
        return f"<ResolveOutcome.{value.name}: {value.value!r}>"
    if isinstance(value, str | int):  # bool included: True, False
        return repr(value)
    raise TypeError(f"no legacy fingerprint had a {type(value).__name__}")


def _legacy_digest(call: str, *arguments: object) -> str:
    parts = [_legacy_repr(argument) for argument in arguments]
    inner = ", ".join(parts) + ("," if len(parts) == 1 else "")
    return _digest(f"({call!r}, ({inner}))".encode())


# --- the commands ---------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Command:
    """A mutating call: ``request_id`` chosen by the client once per logical call, repeated by its retries."""

    rpc: ClassVar[str]
    request_id: str

    @functools.cached_property
    def fingerprint(self) -> str:
        """Version 1 of the digest of every field but ``request_id`` (the module's docstring)."""
        return _PREFIX + _digest(canonical_document(self).encode("ascii"))

    def legacy_fingerprint(self) -> str | None:
        """The fingerprint a release before version 1 recorded for this call; None: it recorded none."""
        return None

    def recognises(self, recorded: str) -> bool:
        """Whether ``recorded``, a fingerprint kept in a record, is this call's: of any version still read."""
        if recorded.startswith(_PREFIX):
            return recorded == self.fingerprint
        return recorded == self.legacy_fingerprint()


@dataclass(frozen=True, kw_only=True)
class RecordDelivery(Command):
    """Its arguments are its record's key: no release recorded a fingerprint for it."""

    rpc: ClassVar[str] = "RecordDelivery"
    mailbox: str
    notification_id: str


@dataclass(frozen=True, kw_only=True)
class ClaimReply(Command):
    rpc: ClassVar[str] = "ClaimReply"
    subject: Subject
    notification_id: str = ""
    ttl_seconds: int = 0  # 0: the rules' default, resolved before the fingerprint is taken
    note: str = ""
    summary: Summary | None = None
    # The message's thread and received time, as the caller sent them (docs/design.md#replies-written-outside).
    thread_id: str = ""
    received_ms: int | None = None
    # The sender's address, for the agents' reply budget per correspondent (docs/design.md#reply-storms).
    correspondent: str = ""

    def legacy_fingerprint(self) -> str:
        return _legacy_digest("ClaimReply", self.subject, self.notification_id, self.ttl_seconds, self.note)


@dataclass(frozen=True, kw_only=True)
class RecordOutgoing(Command):
    rpc: ClassVar[str] = "RecordOutgoing"
    mailbox: str
    message_id: str
    thread_id: str
    sent_ms: int | None  # required: None is refused, kept to say which field was unset
    notification_id: str = ""
    sender: str = ""
    # The fencing token of the claim stamp the message carries (docs/design.md#providers); 0: none.
    claim_token: int = 0

    def legacy_fingerprint(self) -> str:
        return _legacy_digest(
            "RecordOutgoing",
            self.mailbox,
            self.notification_id,
            self.message_id,
            self.thread_id,
            self.sent_ms,
            self.sender,
        )


@dataclass(frozen=True, kw_only=True)
class RecordIncoming(Command):
    """Added after version 1: it has no legacy fingerprint (docs/design.md#reply-storms)."""

    rpc: ClassVar[str] = "RecordIncoming"
    mailbox: str
    message_id: str
    thread_id: str
    received_ms: int | None  # required: None is refused, kept to say which field was unset
    notification_id: str = ""
    summary: Summary | None = None
    automated: str = ""


@dataclass(frozen=True, kw_only=True)
class RenewClaim(Command):
    rpc: ClassVar[str] = "RenewClaim"
    subject: Subject
    token: int
    ttl_seconds: int = 0  # as ClaimReply's

    def legacy_fingerprint(self) -> str:
        return _legacy_digest("RenewClaim", self.subject, self.token, self.ttl_seconds)


@dataclass(frozen=True, kw_only=True)
class ReleaseClaim(Command):
    rpc: ClassVar[str] = "ReleaseClaim"
    subject: Subject
    token: int
    redeliverable: bool = False

    def legacy_fingerprint(self) -> str:
        return _legacy_digest("ReleaseClaim", self.subject, self.token, self.redeliverable)


@dataclass(frozen=True, kw_only=True)
class BeginSend(Command):
    rpc: ClassVar[str] = "BeginSend"
    subject: Subject
    token: int

    def legacy_fingerprint(self) -> str:
        return _legacy_digest("BeginSend", self.subject, self.token)


@dataclass(frozen=True, kw_only=True)
class ConfirmSent(Command):
    """Its reply record keeps no request id: a retry is told apart by the state and ``sent_message_id``."""

    rpc: ClassVar[str] = "ConfirmSent"
    subject: Subject
    token: int
    sent_message_id: str = ""

    def legacy_fingerprint(self) -> str:
        return _legacy_digest("ConfirmSent", self.subject, self.token, self.sent_message_id)


@dataclass(frozen=True, kw_only=True)
class AbortSend(Command):
    rpc: ClassVar[str] = "AbortSend"
    subject: Subject
    token: int
    reason: str = ""
    redeliverable: bool = False

    def legacy_fingerprint(self) -> str:
        return _legacy_digest("AbortSend", self.subject, self.token, self.reason, self.redeliverable)


@dataclass(frozen=True, kw_only=True)
class MarkReplied(Command):
    rpc: ClassVar[str] = "MarkReplied"
    subject: Subject
    token: int
    sent_message_id: str = ""
    note: str = ""

    def legacy_fingerprint(self) -> str:
        return _legacy_digest("MarkReplied", self.subject, self.token, self.sent_message_id, self.note)


@dataclass(frozen=True, kw_only=True)
class Takeover(Command):
    rpc: ClassVar[str] = "Takeover"
    subject: Subject
    ttl_seconds: int = 0  # as ClaimReply's
    note: str = ""
    # As the caller sent it: the summary the engine fills in from the claim taken over is not the call's.
    summary: Summary | None = None
    from_person: str = ""

    def legacy_fingerprint(self) -> str:
        # from_person only when given: so did the release that added it, for the releases before.
        named = [self.from_person] if self.from_person else []
        return _legacy_digest("Takeover", self.subject, self.ttl_seconds, self.note, *named)


@dataclass(frozen=True, kw_only=True)
class ResolveInDoubt(Command):
    rpc: ClassVar[str] = "ResolveInDoubt"
    subject: Subject
    outcome: ResolveOutcome
    sent_message_id: str = ""
    note: str = ""

    def legacy_fingerprint(self) -> str:
        return _legacy_digest("ResolveInDoubt", self.subject, self.outcome, self.sent_message_id, self.note)


@dataclass(frozen=True, kw_only=True)
class UndoOutsideReply(Command):
    """Added after version 1 was defined: it has no legacy fingerprint."""

    rpc: ClassVar[str] = "UndoOutsideReply"
    subject: Subject
    note: str = ""


@dataclass(frozen=True, kw_only=True)
class TakeCursorRange(Command):
    """Added after version 1: no release recorded a legacy fingerprint for it."""

    rpc: ClassVar[str] = "TakeCursorRange"
    mailbox: str
    name: str
    through_position: int = 0
    ttl_seconds: int = 0  # 0: the rules' default, resolved before the fingerprint is taken


@dataclass(frozen=True, kw_only=True)
class AdvanceCursor(Command):
    rpc: ClassVar[str] = "AdvanceCursor"
    mailbox: str
    name: str
    range_token: int
    value: str = ""
    position: int = 0


COMMANDS: tuple[type[Command], ...] = (
    RecordDelivery,
    ClaimReply,
    RecordOutgoing,
    RecordIncoming,
    RenewClaim,
    ReleaseClaim,
    BeginSend,
    ConfirmSent,
    AbortSend,
    MarkReplied,
    Takeover,
    ResolveInDoubt,
    UndoOutsideReply,
    TakeCursorRange,
    AdvanceCursor,
)
