"""The seam between the mail providers and everything that coordinates (docs/providers.md, docs/design.md#providers).

A provider turns what its webhook delivers into :class:`MessageFacts`, the one value the guard, the webhook adapters,
the outgoing rules and the MCP tools read. Its three parts are flows of effects, as every call of the clients is
(:mod:`inbox_claims._effects`): an HTTP request is an ``Invoke`` of the provider's transport, which the blocking client
calls and the asyncio client awaits, so one flow serves both and neither holds a copy of the logic.

* ``check(request)``: the signature and the endpoint's handshakes, on the raw body, before anything is stored;
* ``open(accepted, cursors)``: the facts of one delivery, as a :class:`Batch` whose ``commit`` runs once every message
  of it was recorded (a provider whose notifications only point at a change keeps its position as a cursor in the
  coordinator: docs/design.md#cursors);
* sending, a send function for ``claim.send``: with the claim's idempotency key, or stamped from the claim.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from email.message import EmailMessage
from typing import Any, Literal, Protocol, TypeAlias, TypeVar
from urllib.parse import urlencode

from .._automated import automated_reason
from .._current import agent_headers
from .._effects import Effect, Invoke

__all__ = [
    "STAMP_HEADER",
    "Accepted",
    "Answer",
    "Automated",
    "Batch",
    "ClaimStamp",
    "CursorRange",
    "Cursors",
    "HttpRequest",
    "HttpResponse",
    "MessageFacts",
    "Provider",
    "ProviderError",
    "RangesTaken",
    "ReplyContext",
    "WebhookRequest",
    "parse_stamp",
]

T = TypeVar("T")
Flow: TypeAlias = Generator[Effect, Any, T]

STAMP_HEADER = "X-Inbox-Claim"
"""The header a reply sent without an idempotency key carries: ``<idempotency key>.<fencing token>``."""
_STAMP = re.compile(r"(ic1-[0-9a-f]{64})\.([1-9][0-9]{0,18})")


@dataclass(frozen=True, slots=True)
class ClaimStamp:
    """The claim a reply was sent under: its idempotency key and its fencing token."""

    key: str
    token: int

    def __str__(self) -> str:
        return f"{self.key}.{self.token}"

    def message_id(self, domain: str) -> str:
        """A ``Message-ID`` derived from the stamp (RFC 5322: ``<left@domain>``)."""
        return f"<{self}@{domain or 'inbox-claims.invalid'}>"


def parse_stamp(value: str | None) -> ClaimStamp | None:
    """The stamp of an ``X-Inbox-Claim`` value (or of a ``Message-ID`` derived from one); None for anything else."""
    if not value:
        return None
    text = value.strip()
    if text.startswith("<") and text.endswith(">"):
        text = text[1:-1].partition("@")[0]
    match = _STAMP.fullmatch(text)
    return ClaimStamp(match.group(1), int(match.group(2))) if match else None


@dataclass(frozen=True, slots=True)
class Automated:
    """Whether a message is automated mail (an auto-reply, a list, a bounce) and why, by the rules of
    conformance/automated.json over its headers: filled by a provider that read them (``MessageFacts.automated``
    None: not known, e.g. a Nylas notification without them)."""

    automated: bool
    why: str = ""

    @classmethod
    def of(cls, headers: Sequence[tuple[Any, Any]], sender: str | None) -> Automated:
        """The verdict on a message's headers (name, value pairs; the first of each name counts) and sender."""
        first: dict[str, str] = {}
        for name, value in headers:
            if isinstance(name, str) and isinstance(value, str):
                first.setdefault(name.lower(), value)
        why = automated_reason(first, sender)
        return cls(why is not None, why or "")


@dataclass(frozen=True, slots=True)
class ReplyContext:
    """What a reply needs: who to answer (``Reply-To``, else ``From``), its subject, and the message's ``Message-ID``
    and ``References`` (for ``In-Reply-To`` and ``References``)."""

    to: tuple[str, ...] = ()
    subject: str = ""
    internet_message_id: str | None = None
    references: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class MessageFacts:
    """What the coordinator needs from any provider's message: the neutral value (docs/providers.md)."""

    provider: str
    event: str
    """``message.created`` or ``message.updated`` (in Nylas's words, for every provider)."""
    mailbox: str
    dedup_key: str
    """The delivery's dedup key: ClaimReply's ``notification_id``."""
    message_id: str
    thread_id: str | None
    received_at: datetime | None
    sender: str
    """``Name <address>``, or whichever half is known."""
    subject_line: str
    from_addresses: tuple[str, ...] = ()
    folders: tuple[str, ...] = ()
    """Folder or label ids the message is in; ``SENT`` stands for the provider's sent folder."""
    outgoing: Any = None
    """Why the mailbox sent it (an ``OutgoingMatch``, as the client's outgoing rules decide), or None: incoming."""
    automated: Automated | None = None
    """None: not known (every provider, until the reply-storm rules fill it)."""
    stamp: ClaimStamp | None = None
    reply: ReplyContext = field(default_factory=ReplyContext)
    source: Any = field(default=None, repr=False, compare=False)
    """The provider's own document: the Nylas ``Notification``, the Graph message, the Gmail message."""


@dataclass(frozen=True, slots=True)
class WebhookRequest:
    """One request to a webhook endpoint: ``query`` the raw query string, ``headers`` with lower-case names,
    ``body`` the raw body exactly as received."""

    method: str
    query: str
    headers: Mapping[str, str]
    body: bytes


_TEXT = "text/plain; charset=utf-8"


@dataclass(frozen=True, slots=True)
class Answer:
    """What the endpoint answers."""

    status: int
    body: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    content_type: str = _TEXT


@dataclass(frozen=True, slots=True)
class Accepted:
    """A request whose signature held: ``delivery`` is the provider's parsed payload, for its ``open``."""

    delivery: Any


def retry_later(why: str) -> Answer:
    """A delivery nothing recorded: never 2xx, so that the provider delivers it again."""
    return Answer(503, f"{why}; deliver it again later", (("retry-after", "5"),))


class ProviderError(Exception):
    """The provider's API could not answer what a delivery needs (a 5xx, a timeout, a refusal): the delivery is not
    acknowledged, so that the provider delivers it again."""


@dataclass(frozen=True, slots=True)
class HttpRequest:
    """One request to a provider's API, for whichever HTTP client runs the flow."""

    method: str
    url: str
    params: tuple[tuple[str, str], ...] = ()
    headers: tuple[tuple[str, str], ...] = ()
    json_body: Any = None
    content: bytes | None = None
    """A body that is not JSON (Graph's base64 MIME), sent as is; its ``Content-Type`` is in ``headers``."""

    @property
    def full_url(self) -> str:
        return self.url + ("?" + urlencode(self.params) if self.params else "")


@dataclass(frozen=True, slots=True)
class HttpResponse:
    status: int
    content: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)

    def json(self) -> Any:
        """The JSON body, or None when it is not JSON."""
        try:
            return json.loads(self.content) if self.content else None
        except ValueError:
            return None


Transport = Callable[[HttpRequest], "HttpResponse | Awaitable[HttpResponse]"]
"""Sends one request: an httpx.Client-based function (blocking) or an httpx.AsyncClient-based one (a coroutine)."""


def http(transport: Transport, request: HttpRequest) -> Flow[HttpResponse]:
    """One request as an effect: the client running the flow calls (or awaits) the transport."""
    response: HttpResponse = yield Invoke(transport, (request,), {})
    return response


@dataclass(frozen=True, slots=True)
class CursorRange:
    """TakeCursorRange's answer: ``outcome`` TAKEN (the range starts at ``value``/``position``; ``token`` advances it),
    COVERED (the cursor is at or past what was asked) or BUSY (another worker's range lasts)."""

    outcome: Literal["TAKEN", "COVERED", "BUSY"]
    value: str = ""
    position: int = 0
    token: int = 0
    holder: str = ""
    expires_in: float = 0.0


class Cursors(Protocol):
    """The coordinator's cursors of one client (docs/design.md#cursors), as flows."""

    def take(self, mailbox: str, name: str, through_position: int, ttl: int) -> Flow[CursorRange]: ...

    def advance(self, mailbox: str, name: str, taken: CursorRange, value: str, position: int) -> Flow[bool]: ...


class RangesTaken:
    """The cursors of one delivery (a ``Cursors`` over another): remembers each range taken and not yet advanced, so
    that a delivery that fails anywhere (the provider's API, the coordinator, the admission's time bound) gives its
    ranges back at once (``give_back``), instead of leaving the mailbox to wait for their leases."""

    def __init__(self, cursors: Cursors) -> None:
        self.cursors = cursors
        self.open: dict[tuple[str, str], CursorRange] = {}

    def take(self, mailbox: str, name: str, through_position: int, ttl: int) -> Flow[CursorRange]:
        taken = yield from self.cursors.take(mailbox, name, through_position, ttl)
        if taken.outcome == "TAKEN":
            self.open[(mailbox, name)] = taken
        return taken

    def advance(self, mailbox: str, name: str, taken: CursorRange, value: str, position: int) -> Flow[bool]:
        self.open.pop((mailbox, name), None)
        moved = yield from self.cursors.advance(mailbox, name, taken, value, position)
        return moved

    def give_back(self) -> Flow[None]:
        """Advances every range still open to its start: the cursor unmoved, the range free for the next delivery."""
        while self.open:
            (mailbox, name), taken = self.open.popitem()
            yield from self.cursors.advance(mailbox, name, taken, taken.value, taken.position)


def _nothing() -> Flow[None]:
    return None
    yield  # a generator that performs no effect


@dataclass(frozen=True)
class Batch:
    """The facts of one delivery. ``commit`` runs once each was recorded (a cursor advances), ``abandon`` when one
    could not be (a cursor's range is given back). ``actions``: what the provider did besides (lifecycle)."""

    facts: tuple[MessageFacts, ...] = ()
    commit: Callable[[], Flow[None]] = _nothing
    abandon: Callable[[], Flow[None]] = _nothing
    actions: tuple[str, ...] = ()


class Provider(Protocol):
    """One mail platform behind the seam (docs/providers.md, "The provider protocol")."""

    name: str
    mailbox_addresses: tuple[str, ...]
    """The mailbox's own addresses, which the provider knows (added to the client's outgoing rules)."""

    def check(self, request: WebhookRequest) -> Flow[Answer | Accepted]: ...

    def open(self, accepted: Accepted, cursors: Cursors) -> Flow[Batch]: ...

    def acknowledge(self) -> Answer:
        """The answer to a delivery every message of which was recorded."""
        ...


def periodic_check(provider: Provider) -> tuple[float, Callable[[], Accepted]] | None:
    """A provider's periodic check when it has one switched on (Gmail's history check: what a dropped push would have
    said): its interval in seconds and the delivery it opens. The webhook adapters run it (docs/providers.md)."""
    periodic = getattr(provider, "periodic", None)
    interval = getattr(provider, "periodic_interval", 0)
    if callable(periodic) and isinstance(interval, int | float) and interval > 0:
        return float(interval), periodic
    return None


def header(headers: Sequence[tuple[Any, Any]] | Mapping[str, str], name: str) -> str | None:
    """The first header called ``name`` (case aside)."""
    items = headers.items() if isinstance(headers, Mapping) else headers
    wanted = name.lower()
    for key, value in items:
        if isinstance(key, str) and key.lower() == wanted and isinstance(value, str):
            return value
    return None


_ADDRESS = re.compile(r"<([^<>@\s]+@[^<>\s]+)>\s*$")


def split_address(text: str) -> tuple[str, str]:
    """``Name <addr>`` (or a bare address) as (name, address)."""
    text = text.strip()
    match = _ADDRESS.search(text)
    if match:
        name = text[: match.start()].strip().strip('"').strip()
        return name, match.group(1)
    return "", text


def display(name: str, address: str) -> str:
    """The sender as people read it: ``Name <address>``, or whichever half is there."""
    return f"{name} <{address}>" if name and address else name or address


def reply_mime(message: MessageFacts, body: str, stamp: ClaimStamp) -> EmailMessage:
    """A reply as MIME (Gmail's raw send, Graph's MIME ``createReply``): ``To`` the sender (its ``Reply-To``),
    ``In-Reply-To`` and ``References``, the claim's stamp, and an agent's ``Auto-Submitted: auto-replied``."""
    reply = EmailMessage()
    reply["To"] = ", ".join(message.reply.to)
    reply["Subject"] = message.reply.subject
    if message.reply.internet_message_id:
        reply["In-Reply-To"] = message.reply.internet_message_id
        reply["References"] = " ".join((*message.reply.references, message.reply.internet_message_id))
    reply[STAMP_HEADER] = str(stamp)
    for name, value in agent_headers():
        reply[name] = value
    reply.set_content(body)
    return reply


def newer_than(message: MessageFacts, found: Iterable[MessageFacts]) -> Iterator[MessageFacts]:
    """The messages of ``found`` received after ``message`` (itself left out): what a provider's ``look`` answers."""
    assert message.received_at is not None
    for facts in found:
        received = facts.received_at
        if facts.message_id != message.message_id and received is not None and received > message.received_at:
            yield facts


def reply_subject(subject: str) -> str:
    return subject if subject.lower().startswith("re:") else f"Re: {subject}".rstrip()


def message_ids(value: str | None) -> tuple[str, ...]:
    """The ``<...>`` ids of a ``References`` (or ``In-Reply-To``) header."""
    return tuple(re.findall(r"<[^<>\s]+>", value or ""))
