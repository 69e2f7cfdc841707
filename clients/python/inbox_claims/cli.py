"""``inboxctl``: see and steer who is answering which email, from a terminal.

For support staff and operators: who holds a message (since when, expiring in how long), a live view of a
mailbox, claiming a message for yourself, releasing it, taking it over from an agent, settling the sends
whose outcome is unknown (IN_DOUBT), and undoing a reply recorded as written outside that did not answer one.
``inboxctl --help`` and ``inboxctl COMMAND --help`` show examples.

Settings come from flags, then the environment, then a TOML file (``--config``, ``$INBOXCTL_CONFIG``, or
``~/.config/inboxctl.toml``)::

    target = "coordinator.internal:50051"
    principal = "ana@example.com"     # development mode only; with a token the coordinator knows who you are
    token = "..."                      # sent as "authorization: Bearer ..."
    ca_file = "/etc/inbox/ca.pem"      # TLS; cert_file and key_file for mutual TLS

Exit codes: 0 done; 1 refused (held by someone else, already replied, not yours, not in doubt...);
2 usage error (bad arguments, configuration, or a value the coordinator rejects); 3 the coordinator cannot be
reached (or is over its rate limit): try again; 4 not authenticated or not permitted; 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import enum
import getpass
import json
import os
import shutil
import sys
import tomllib
import unicodedata
from collections.abc import Callable, Coroutine, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from ._async import AsyncCoordinator
from ._errors import (
    CoordinatorError,
    CoordinatorUnavailable,
    FailedPrecondition,
    InvalidRequest,
    PermissionDenied,
    QuotaExceeded,
    Unauthenticated,
)
from ._settings import SETTINGS, client_arguments
from ._types import (
    ClaimOutcome,
    EventType,
    HolderKind,
    OutsideReply,
    RecentMessage,
    RetryPolicy,
    Subject,
    SubjectState,
    SubjectStatus,
    TakeoverOutcome,
    WatchEvent,
    WatchItem,
    WatchSnapshot,
)

__all__ = ["EXIT_DENIED", "EXIT_OK", "EXIT_REFUSED", "EXIT_UNAVAILABLE", "EXIT_USAGE", "main"]

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
EXIT_DENIED = 4
EXIT_INTERRUPTED = 130

DEFAULT_CLAIM_TTL = 900
CLI_RETRY = RetryPolicy(attempts=3, initial_backoff=0.1, max_backoff=0.5)

EXIT_CODES = """\
exit codes:
  0  done
  1  refused: held by someone else, already replied, not yours, not in doubt...
  2  usage error: bad arguments or configuration, or a value the coordinator rejects
  3  the coordinator cannot be reached (or is over its rate limit): try again
  4  not authenticated, or not permitted (a role you lack, another principal's claim)
"""


class UsageError(Exception):
    """A mistake in the command line or the configuration (exit 2)."""


# -------------------------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class ConfigFile:
    """Where a command looks for its TOML settings file: the file its variable names, else ``name`` in
    ``$XDG_CONFIG_HOME`` (``~/.config``). The keys are the ``SETTINGS`` names for every command."""

    env: str
    name: str


INBOXCTL_CONFIG = ConfigFile("INBOXCTL_CONFIG", "inboxctl.toml")


def config_path(explicit: str | None, file: ConfigFile = INBOXCTL_CONFIG) -> tuple[Path, bool]:
    """The config file to read, and whether it must exist (named by --config or by its variable)."""
    if explicit:
        return Path(explicit).expanduser(), True
    if os.environ.get(file.env):
        return Path(os.environ[file.env]).expanduser(), True
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / file.name, False


def read_config(path: Path, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise UsageError(f"config file {path} does not exist")
        return {}
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise UsageError(f"cannot read config file {path}: {error}") from None
    known = {setting.name for setting in SETTINGS}
    unknown = sorted(set(document) - known)
    if unknown:
        raise UsageError(f"config file {path}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return document


def resolve_settings(
    options: argparse.Namespace,
    *,
    file: ConfigFile = INBOXCTL_CONFIG,
    defaults: Mapping[str, Any] | None = None,
    login_name: bool = True,
) -> dict[str, Any]:
    """Each setting from the flag, else the environment, else the config file, else its default (``defaults``
    overrides ``SETTINGS``' own). ``login_name``: without a principal or a token, the login name is the principal
    (a person at a terminal); otherwise the principal stays unset."""
    document = read_config(*config_path(getattr(options, "config", None), file))
    resolved: dict[str, Any] = {}
    for setting in SETTINGS:
        flag = getattr(options, setting.name, None)
        env = os.environ.get(setting.env)
        if flag is not None:
            value = flag
        elif env is not None and env != "":
            value = env
        else:
            value = document.get(setting.name, (defaults or {}).get(setting.name, setting.default))
        resolved[setting.name] = value
    if resolved["kind"] not in ("agent", "human"):
        raise UsageError(f"kind must be 'agent' or 'human', not {resolved['kind']!r}")
    if login_name and resolved["principal"] is None and resolved["token"] is None:
        resolved["principal"] = getpass.getuser()
    return resolved


def make_client(settings: dict[str, Any]) -> AsyncCoordinator:
    try:
        return AsyncCoordinator(**client_arguments(settings), retry=CLI_RETRY)
    except ValueError as error:
        raise UsageError(str(error)) from None


# -------------------------------------------------------------------------------------------- rendering


def ago(moment: datetime | None, now: datetime) -> str:
    return "" if moment is None else f"{span((now - moment).total_seconds())} ago"


def within(moment: datetime | None, now: datetime) -> str:
    if moment is None:
        return ""
    seconds = (moment - now).total_seconds()
    return f"in {span(seconds)}" if seconds >= 0 else f"{span(-seconds)} ago"


def span(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``, ``3d04h``."""
    whole = max(int(seconds), 0)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def clock(moment: datetime | None) -> str:
    """Local wall-clock time: ``14:03:07`` today, ``2026-12-02 14:03`` another day."""
    if moment is None:
        return ""
    local = moment.astimezone()
    return local.strftime("%H:%M:%S" if local.date() == datetime.now().astimezone().date() else "%Y-%m-%d %H:%M")


def describe_subject(subject: Subject) -> str:
    return f"{subject.kind.value} {subject.id} in {subject.mailbox}"


def holder_text(status: SubjectStatus) -> str:
    kind = f" ({status.holder_kind.value})" if status.holder_kind else ""
    return f"{status.holder}{kind}"


def outside_reply_words(reply: OutsideReply, *, who: bool = True, name: Callable[[str], str] = str) -> str:
    """``answered from the mailbox by Ana Lima <ana@shop.example> (its From line; recorded by worker-1) at 14:05``:
    the sender is only what the message says, so the principal that vouched for it is named beside it."""
    words = "answered from the mailbox"
    recorder = f"recorded by {name(reply.recorded_by)}" if reply.recorded_by else ""
    if who:
        words += f" by {name(reply.sender or 'someone')}" + (f" (its From line; {recorder})" if recorder else "")
    elif recorder:
        words += f" ({recorder})"
    if reply.sent_at is not None:
        words += f" at {clock(reply.sent_at)}"
    return words


def answered_outside(status: SubjectStatus, *, who: bool = True, name_width: int | None = None) -> str:
    """A reply written outside the coordinator, in people's words (``outside_reply_words``), and what it meant for
    the subject (an agent stopped; both replies went out). ``who=False`` leaves out the sender where the holder
    already names them (a table's HOLDER column); ``name_width`` cuts the names in it, never the words around them
    (a table cell stays readable whatever the length of the time, which carries its date on another day)."""
    reply = status.outside_reply
    if reply is None:
        return ""

    def name(text: str) -> str:
        return text if name_width is None else _cut(text, name_width)

    words = outside_reply_words(reply, who=who or not status.replied_outside, name=name)
    if status.replied_outside:
        return words + (f"; {name(reply.stopped_holder)} stopped, a person answered" if reply.stopped_holder else "")
    also = {
        SubjectState.SENDING: "is sending a reply too: both go out",
        SubjectState.IN_DOUBT: "may have sent a reply too",
    }.get(status.state, "sent a reply too: both went out")
    return f"{words}; {name(status.holder)} {also}"


def status_lines(status: SubjectStatus, now: datetime) -> list[str]:
    """A person-readable account of one subject."""
    lines = [f"{describe_subject(status.subject)}: {status.state.name}"]
    summary = status.summary
    if summary is not None:
        if summary.subject_line:
            lines.append(f"  subject   {summary.subject_line}")
        received = f" (received {clock(summary.received_at)})" if summary.received_at else ""
        if summary.sender or received:
            lines.append(f"  from      {summary.sender or '?'}{received}")
    state = status.state
    if state is SubjectState.CLAIMED:
        lines.append(
            f"  held by   {holder_text(status)} since {clock(status.acquired_at)} ({ago(status.acquired_at, now)})"
        )
        lines.append(f"  expires   {within(status.expires_at, now)} ({clock(status.expires_at)}) unless renewed")
    elif state is SubjectState.SENDING:
        lines.append(f"  sending   by {holder_text(status)} since {clock(status.send_started_at)}")
        lines.append(f"  in doubt  {within(status.send_deadline, now)} unless the send is confirmed")
    elif state is SubjectState.IN_DOUBT:
        lines.append(
            f"  send by   {holder_text(status)} began {ago(status.send_started_at, now)} and was never confirmed"
        )
        lines.append("  check the mailbox's sent folder, then: inboxctl resolve MAILBOX ID --sent | --not-sent")
    elif state is SubjectState.REPLIED and status.replied_outside:
        lines.append(f"  replied   {answered_outside(status)} ({ago(status.sent_at, now)})")
    elif state is SubjectState.REPLIED:
        how = "by hand " if status.replied_by_hand else ""
        lines.append(f"  replied   {how}by {holder_text(status)} {ago(status.sent_at, now)} ({clock(status.sent_at)})")
        if status.sent_message_id:
            lines.append(f"  sent id   {status.sent_message_id}")
        lines.append(f"  kept      until {clock(status.expires_at)} ({within(status.expires_at, now)})")
    if status.outside_reply is not None and not status.replied_outside:
        lines.append(f"  also      {answered_outside(status)}")
    if status.automated:
        lines.append(f"  automated automated message ({status.automated}): agents leave it; you can still answer it")
    if status.agents_stopped is not None:
        lines.append(f"  stopped   {status.agents_stopped.reason}")
    if status.fencing_token and state is not SubjectState.FREE:
        lines.append(f"  token     {status.fencing_token}")
    if status.note:
        lines.append(f"  note      {status.note}")
    return lines


def table(statuses: Sequence[SubjectStatus], now: datetime) -> list[str]:
    """One row per subject: kind, id, (subject line and sender, when any row has them,) state, holder, since,
    expires, note."""
    described = any(status.summary is not None for status in statuses)
    header: tuple[str, ...] = ("KIND", "ID", "STATE", "HOLDER", "SINCE", "EXPIRES", "NOTE")
    if described:
        header = (*header[:2], "SUBJECT", "FROM", *header[2:])
    rows = [header]
    for status in statuses:
        sending = status.state in (SubjectState.SENDING, SubjectState.IN_DOUBT)
        since = status.send_started_at if sending else status.acquired_at
        if status.state is SubjectState.REPLIED:
            since = status.sent_at
        expires = status.send_deadline if status.state is SubjectState.SENDING else status.expires_at
        row: tuple[str, ...] = (
            status.subject.kind.value,
            _cut(status.subject.id, 40),
            status.state.name,
            _cut(holder_text(status), 36),
            ago(since, now),
            "never" if status.state is SubjectState.IN_DOUBT else within(expires, now),
            visible(answered_outside(status, who=False, name_width=36))
            if status.outside_reply
            else _cut(status.note, 40),
        )
        if described:
            summary = status.summary
            email = (_cut(summary.subject_line, 40), _cut(summary.sender, 30)) if summary else ("", "")
            row = (*row[:2], *email, *row[2:])
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]


def _cut(text: str, width: int) -> str:
    text = visible(text)
    return text if len(text) <= width else text[: width - 1] + "…"


# Kept as they are: the joiners (emoji sequences, Persian and Indic words need them and they move nothing).
_JOINERS = frozenset("\u200c\u200d")


def _hidden(ch: str) -> bool:
    category = unicodedata.category(ch)
    return (category == "Cf" and ch not in _JOINERS) or category in ("Cc", "Zl", "Zp")


def visible(text: str) -> str:
    """``text`` with every character that changes how the text around it shows without being seen itself
    (bidirectional overrides and isolates, zero-width spaces, controls) written out as ``<U+202E>``: a terminal
    seldom isolates right-to-left text, so "Invoice U+202E gnp.exe" would read "Invoice exe.png". The
    coordinator drops them from summaries (proto: MessageSummary); ids, notes and older records may hold them."""
    if text.isascii() and text.isprintable():
        return text
    return "".join(f"<U+{ord(ch):04X}>" if _hidden(ch) else ch for ch in text)


def _json_visible(document: str) -> str:
    """The same characters in JSON output, as JSON escapes: the data is unchanged, the terminal shows them."""
    if document.isascii():
        return document
    return "".join(json.dumps(ch)[1:-1] if _hidden(ch) else ch for ch in document)


def event_line(event: WatchEvent, now: datetime) -> str:
    status = event.status
    parts = [clock(now), event.type.name, describe_subject(status.subject)]
    if status.summary is not None and status.summary.subject_line:
        parts.append(json.dumps(_cut(status.summary.subject_line, 60), ensure_ascii=False))
    if status.holder:
        parts.append(f"by {holder_text(status)}")
    if event.previous_holder and event.previous_holder != status.holder:
        parts.append(f"(was {event.previous_holder})")
    if status.state is SubjectState.CLAIMED and status.expires_at:
        parts.append(f"expires {within(status.expires_at, now)}")
    if event.reason:
        parts.append(f"reason: {event.reason}")
    if event.type is EventType.ANSWERED_OUTSIDE:
        parts = [clock(now), event.type.name, describe_subject(status.subject) + ":", answered_outside(status)]
    if event.type is EventType.OUTSIDE_REPLY_UNDONE:
        parts = [clock(now), event.type.name, describe_subject(status.subject) + ":", undone_words(event)]
    return " ".join(parts)


def undone_words(event: WatchEvent) -> str:
    """``bo undid "answered from the mailbox by ... (recorded by worker-1) at 14:05" at 14:09: answerable again``."""
    undone = f'"{outside_reply_words(event.undone)}"' if event.undone is not None else "a reply recorded as outside"
    when = f" at {clock(event.at)}" if event.at is not None else ""
    note = f" ({event.reason})" if event.reason else ""
    return f"{event.by or 'someone'} undid {undone}{when}{note}: it can be answered again"


def jsonable(value: Any) -> Any:
    """Dataclasses, enums and datetimes as JSON values (times in ISO 8601 UTC)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: jsonable(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat()
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(item) for item in value]
    return value


# -------------------------------------------------------------------------------------------- commands


@dataclasses.dataclass
class Context:
    client: AsyncCoordinator
    options: argparse.Namespace
    settings: dict[str, Any]
    out: TextIO

    @property
    def json(self) -> bool:
        return bool(self.options.json)

    def emit(self, document: Any) -> None:
        print(_json_visible(json.dumps(jsonable(document), ensure_ascii=False)), file=self.out, flush=True)

    def say(self, *lines: str) -> None:
        for line in lines:
            print(visible(line), file=self.out)
        self.out.flush()

    def subject(self) -> Subject:
        options = self.options
        make = Subject.thread if options.thread else Subject.message
        return make(options.mailbox, options.id)


def now_utc() -> datetime:
    return datetime.now(UTC)


async def cmd_status(ctx: Context) -> int:
    status = await ctx.client.status(ctx.subject())
    if ctx.json:
        ctx.emit(status)
    else:
        ctx.say(*status_lines(status, now_utc()))
    return EXIT_OK


async def _show_list(ctx: Context, states: Sequence[SubjectState], nothing: str) -> list[SubjectStatus]:
    found: list[SubjectStatus] = []
    async for status in ctx.client.iter_claims(ctx.options.mailbox, states=states, page_size=500):
        found.append(status)
        if ctx.options.limit and len(found) >= ctx.options.limit:
            break
    if ctx.json:
        ctx.emit(found)
    else:
        ctx.say(*table(found, now_utc()) if found else [nothing])
    return found


# What each role lets a person do, in the words inboxctl's commands use.
ROLE_MEANINGS = {
    "takeover": "take a message over from an agent (inboxctl takeover)",
    "resolve": "settle a send nobody confirmed (inboxctl resolve), undo a wrong outside reply (inboxctl undo-outside)",
    "report": "report the mailbox's mail: say a message was sent from it (what its webhook workers do)",
    "admin": "every mailbox and every role",
}


async def cmd_whoami(ctx: Context) -> int:
    me = await ctx.client.caller()
    if ctx.json:
        ctx.emit(me)
        return EXIT_OK
    kind = "a person" if me.kind is HolderKind.HUMAN else "an agent"
    lines = [f"{me.principal} ({kind})", f"mailboxes: {', '.join(me.mailboxes) or 'none'}"]
    if me.roles:
        lines += ["may:", *(f"  {ROLE_MEANINGS.get(role, role)}" for role in me.roles)]
    else:
        lines.append("may: only claim, give back and answer messages in those mailboxes (no roles)")
    if me.kind is not HolderKind.HUMAN and "takeover" in me.roles:
        lines.append("(taking over needs a person: an agent's takeover is refused whatever its roles)")
    if me.development_mode:
        lines.append("development mode: the coordinator has no token file; anyone may name themselves")
    ctx.say(*lines)
    return EXIT_OK


async def cmd_ls(ctx: Context) -> int:
    states = [SubjectState[name.upper()] for name in ctx.options.state or ()]
    await _show_list(ctx, states, f"nothing held, sending, replied or in doubt in {ctx.options.mailbox}")
    return EXIT_OK


async def cmd_in_doubt(ctx: Context) -> int:
    mailbox = ctx.options.mailbox
    found = await _show_list(ctx, [SubjectState.IN_DOUBT], f"no send in doubt in {mailbox}")
    if found and not ctx.json:
        ctx.say(
            "",
            f"{len(found)} send(s) began and were never confirmed. Check the mailbox's sent folder for each, then:",
            f"  inboxctl resolve {mailbox} ID --sent [--sent-message-id ID]   (it went out)",
            f"  inboxctl resolve {mailbox} ID --not-sent                      (it did not: frees it)",
        )
    return EXIT_OK


def waiting_lines(message: RecentMessage) -> list[str]:
    """One email agents leave to people (docs/design.md#reply-storms), and how a person answers it."""
    stopped, summary = message.agents_stopped, message.summary
    if stopped is not None:
        lines = [stopped.reason]
    else:
        lines = [f"automated message ({message.automated}): agents leave it; you can still answer it"]
    if summary is not None:
        lines.append(f"  email     “{summary.subject_line}” from {summary.sender}")
    lines.append(f"  which     {describe_subject(message.subject)}")
    if stopped is not None:
        lines.append(f"  stopped   {message.seen_by} at {clock(message.first_seen_at)}")
        lines.append(f"  agents    may answer again from {clock(stopped.frees_at)}")
    lines.append(f"  answer it inboxctl claim {message.subject.mailbox} {message.subject.id}")
    return lines


async def cmd_waiting(ctx: Context) -> int:
    mailbox = ctx.options.mailbox
    found = await ctx.client.waiting_for_a_person(mailbox)
    if ctx.json:
        ctx.emit(found)
    elif not found:
        ctx.say(f"nothing waits for a person in {mailbox}: no conversation where agents are stopped, no automated mail")
    else:
        for index, message in enumerate(found):
            ctx.say(*([""] if index else []), *waiting_lines(message))
    return EXIT_OK


async def cmd_claim(ctx: Context) -> int:
    subject = ctx.subject()
    result = await ctx.client.claim(subject, ttl=ctx.options.ttl, note=ctx.options.note)
    if ctx.json:
        ctx.emit({"outcome": result.outcome, "status": result.status})
    status = result.status
    assert status is not None  # no notification id: never DUPLICATE_DELIVERY
    now = now_utc()
    if result.outcome is ClaimOutcome.GRANTED:
        if not ctx.json:
            ctx.say(
                f"claimed {describe_subject(subject)} (token {status.fencing_token}); "
                f"it frees {within(status.expires_at, now)} ({clock(status.expires_at)})",
                f"release it with: inboxctl release {subject.mailbox} {_quote(subject.id)}"
                + (" --thread" if ctx.options.thread else ""),
            )
        return EXIT_OK
    if result.outcome is ClaimOutcome.HELD and status.holder == await _me(ctx):
        # Yours already, through an earlier claim: say so, and until when (claiming again does not extend it).
        if not ctx.json:
            ctx.say(
                f"you already hold {describe_subject(subject)} (token {status.fencing_token}); "
                f"it frees {within(status.expires_at, now)} ({clock(status.expires_at)}) unless renewed",
                *status_lines(status, now),
            )
        return EXIT_OK
    if not ctx.json:
        why = "held by someone else" if result.outcome is ClaimOutcome.HELD else "already replied to"
        ctx.say(f"not claimed: {why}", *status_lines(status, now))
    return EXIT_REFUSED


async def _me(ctx: Context) -> str:
    """The principal this inboxctl acts as: the one it names (development mode), else the token's, asked of the
    coordinator."""
    named: str | None = ctx.settings["principal"]
    return named if named is not None else (await ctx.client.caller()).principal


def _is_mine(ctx: Context, status: SubjectStatus) -> bool:
    # With a token the coordinator knows who we are and refuses another's claim (PERMISSION_DENIED).
    return status.state is SubjectState.CLAIMED and (
        ctx.settings["principal"] is None or status.holder == ctx.settings["principal"]
    )


def _refuse(ctx: Context, why: str, status: SubjectStatus) -> int:
    if ctx.json:
        ctx.emit({"ok": False, "status": status})
    else:
        ctx.say(why, *status_lines(status, now_utc()))
    return EXIT_REFUSED


async def cmd_release(ctx: Context) -> int:
    subject = ctx.subject()
    token = ctx.options.fencing_token
    if token is None:
        status = await ctx.client.status(subject)
        if not _is_mine(ctx, status):
            return _refuse(ctx, "not released: you do not hold it", status)
        token = status.fencing_token
    result = await ctx.client.release(subject, token)
    if ctx.json:
        ctx.emit({"ok": result.ok, "status": result.status})
    elif result.ok:
        ctx.say(f"released {describe_subject(subject)}: it is {result.status.state.name} now")
    else:
        ctx.say(f"not released: token {token} is stale", *status_lines(result.status, now_utc()))
    return EXIT_OK if result.ok else EXIT_REFUSED


async def cmd_takeover(ctx: Context) -> int:
    subject = ctx.subject()
    result = await ctx.client.takeover(
        subject, ttl=ctx.options.ttl, note=ctx.options.note, from_person=ctx.options.from_person or ""
    )
    if ctx.json:
        ctx.emit(result)
    elif result.outcome is TakeoverOutcome.TAKEN_OVER:
        ctx.say(
            f"took {describe_subject(subject)} over from {result.previous_holder} "
            f"(its token {result.previous_token} is stale now: it cannot send)",
            f"you hold it (token {result.status.fencing_token}) until {clock(result.status.expires_at)}",
        )
    elif result.outcome is TakeoverOutcome.GRANTED:
        ctx.say(f"nobody held {describe_subject(subject)}: you hold it now (token {result.status.fencing_token})")
    else:
        held = result.outcome is TakeoverOutcome.HELD
        why = "a human holds it" if held else "the reply already began or went out"
        hint = (
            [f"to take it from {result.status.holder} (a colleague), say so: add --from {_quote(result.status.holder)}"]
            if held and result.status.holder not in (ctx.options.from_person, ctx.client.principal)
            else []
        )
        ctx.say(f"not taken over: {why}", *status_lines(result.status, now_utc()), *hint)
    return EXIT_OK if result.holds else EXIT_REFUSED


# How long the claim that `replied` takes on a FREE message lasts: only the instant until it is marked.
REPLIED_CLAIM_TTL = 30


async def cmd_replied(ctx: Context) -> int:
    """MarkReplied on your claim; on a FREE message, claim then mark (you answered without claiming first)."""
    subject, options = ctx.subject(), ctx.options
    token = options.fencing_token
    if token is None:
        status = await ctx.client.status(subject)
        if status.state is SubjectState.FREE:
            claimed = await ctx.client.claim(subject, ttl=REPLIED_CLAIM_TTL, note=options.note)
            if not claimed.granted:
                assert claimed.status is not None
                return _refuse(ctx, "not recorded: someone claimed it just now", claimed.status)
            token = claimed.token
        elif _is_mine(ctx, status):
            token = status.fencing_token
        else:
            hint = (
                f"take it over first: inboxctl takeover {subject.mailbox} {_quote(subject.id)}"
                if status.state is SubjectState.CLAIMED
                else "it is not held: nothing to record"
            )
            return _refuse(ctx, f"not recorded: you do not hold it ({hint})", status)
    result = await ctx.client.mark_replied(subject, token, sent_message_id=options.sent_id or "", note=options.note)
    if ctx.json:
        ctx.emit({"ok": result.ok, "status": result.status})
    elif result.ok:
        ctx.say(
            f"recorded: {describe_subject(subject)} was answered by hand; agents will not reply to it",
            *status_lines(result.status, now_utc()),
        )
    else:
        ctx.say("not recorded: your claim ended (it lapsed or was taken over)", *status_lines(result.status, now_utc()))
    return EXIT_OK if result.ok else EXIT_REFUSED


async def cmd_resolve(ctx: Context) -> int:
    options = ctx.options
    status = await ctx.client.resolve_in_doubt(
        ctx.subject(), sent=options.sent, sent_message_id=options.sent_message_id or "", note=options.note
    )
    if ctx.json:
        ctx.emit(status)
    else:
        ctx.say(f"resolved as {'sent' if options.sent else 'not sent'}", *status_lines(status, now_utc()))
    return EXIT_OK


async def cmd_undo_outside(ctx: Context) -> int:
    subject = ctx.subject()
    result = await ctx.client.undo_outside_reply(subject, note=ctx.options.note)
    if ctx.json:
        ctx.emit(result)
        return EXIT_OK
    reply = f'"{outside_reply_words(result.undone)}"' if result.undone is not None else "the reply recorded outside"
    ctx.say(
        f"undone: {reply} no longer counts as the answer to {describe_subject(subject)}",
        f"recorded as undone by {result.undone_by} at {clock(result.undone_at)}; it can be answered again",
        *status_lines(result.status, now_utc()),
    )
    return EXIT_OK


# The live table lists what needs a person first: unsettled sends, then sends, claims, replies.
_URGENCY = {SubjectState.IN_DOUBT: 0, SubjectState.SENDING: 1, SubjectState.CLAIMED: 2, SubjectState.REPLIED: 3}


class WatchView:
    """The watched mailbox as a table (redrawn in place on a terminal, cut to its height) or as one line per
    event; ``--state`` keeps only subjects in those states (an event that moves one out is still shown)."""

    def __init__(self, ctx: Context, live: bool) -> None:
        self.ctx = ctx
        self.live = live
        self.states = frozenset(SubjectState[name.upper()] for name in ctx.options.state or ())
        self.subjects: dict[Subject, SubjectStatus] = {}
        self.last = ""
        self.events = 0

    def wanted(self, status: SubjectStatus) -> bool:
        return not self.states or status.state in self.states

    def take(self, item: WatchItem) -> None:
        ctx, now = self.ctx, now_utc()
        if isinstance(item, WatchSnapshot):
            self.subjects = {status.subject: status for status in item.subjects if self.wanted(status)}
            if ctx.json:
                ctx.emit({"snapshot": item})
            elif not self.live:
                ctx.say(f"{clock(now)} watching {ctx.options.mailbox}: {len(self.subjects)} subject(s) {self.what()}")
                for status in self.subjects.values():
                    ctx.say(
                        f"{clock(now)} {status.state.name} {describe_subject(status.subject)} by {holder_text(status)}"
                    )
        else:
            shown = item.status.subject in self.subjects
            if not self.wanted(item.status):
                self.subjects.pop(item.status.subject, None)
                if not shown:
                    return  # neither in the filter nor leaving it
            else:
                self.subjects[item.status.subject] = item.status
            self.events += 1
            self.last = event_line(item, now)
            if ctx.json:
                ctx.emit({"event": item})
            elif not self.live:
                ctx.say(self.last)
        if self.live and not ctx.json:
            self.draw()

    def what(self) -> str:
        return " or ".join(state.name for state in sorted(self.states, key=_URGENCY.__getitem__)) or "not free"

    def draw(self) -> None:
        now = now_utc()
        rows = sorted(self.subjects.values(), key=lambda s: (_URGENCY[s.state], s.subject.kind.value, s.subject.id))
        mailbox = visible(self.ctx.options.mailbox)
        head = [f"inboxctl watch {mailbox}   {clock(now)}   {len(rows)} subject(s) {self.what()}", ""]
        foot = ["", f"last event: {visible(self.last or '-')}", "Ctrl-C to stop"]
        # Fit the terminal: the table's header row and what is around it, then as many rows as fit.
        room = max(shutil.get_terminal_size().lines - len(head) - len(foot) - 2, 1)
        shown = table(rows[:room], now) if rows else ["(nothing held)"]
        if len(rows) > room:
            shown.append(f"… and {len(rows) - room} more (narrow it with --state, or list them all with ls)")
        self.ctx.out.write("\x1b[H\x1b[J" + "\n".join(head + shown + foot) + "\n")
        self.ctx.out.flush()


async def cmd_watch(ctx: Context) -> int:
    options = ctx.options
    live = ctx.out.isatty() and not ctx.json
    view = WatchView(ctx, live)

    async def follow() -> None:
        async for item in ctx.client.watch(options.mailbox):
            view.take(item)
            if options.count is not None and view.events >= options.count:
                return

    async def tick() -> None:
        while True:
            await asyncio.sleep(1)
            view.draw()

    ticker = asyncio.create_task(tick()) if live else None
    try:
        await asyncio.wait_for(follow(), options.timeout)
    except TimeoutError:
        pass
    finally:
        if ticker is not None:
            ticker.cancel()
    return EXIT_OK


# -------------------------------------------------------------------------------------------- the parser

Command = Callable[[Context], Coroutine[Any, Any, int]]


def _quote(text: str) -> str:
    return text if text and all(c.isalnum() or c in "-_.@:+=" for c in text) else json.dumps(text)


def _common(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """The connection options and ``--json``, accepted before and after the command (``argparse.SUPPRESS`` keeps
    a value given before the command from being reset by the subcommand's default)."""
    connection_options(parser, top=top)
    parser.add_argument("--json", action="store_true", default=False if top else argparse.SUPPRESS, help="JSON output")


def connection_options(
    parser: argparse.ArgumentParser,
    *,
    top: bool = True,
    file: ConfigFile = INBOXCTL_CONFIG,
    defaults: Mapping[str, Any] | None = None,
    helps: Mapping[str, str] | None = None,
) -> None:
    """The flags of ``SETTINGS`` and ``--config``. ``defaults``: the defaults where they differ, said once in the
    help in place of the setting's own; ``helps``: a setting's help where the command means it otherwise (the
    MCP server's principal has no login-name default)."""
    default = None if top else argparse.SUPPRESS
    group = parser.add_argument_group("connection (flags > environment > config file)")
    for setting in SETTINGS:
        flag = "--" + setting.name.replace("_", "-")
        help_text = (helps or {}).get(setting.name, setting.help)
        if defaults and setting.name in defaults:
            # The setting's own default said nowhere: "(development mode; default human)" is "(development mode)".
            help_text = help_text.split(" (default")[0].split("; default")[0]
            help_text += ")" * (help_text.count("(") - help_text.count(")"))
            help_text += f" (default {defaults[setting.name]})"
        help_text = f"{help_text} [${setting.env}]"
        if setting.name == "tls":
            group.add_argument(flag, action="store_const", const=True, default=default, help=help_text)
        elif setting.name == "kind":
            group.add_argument(flag, choices=("agent", "human"), default=default, help=help_text)
        else:
            group.add_argument(flag, metavar=setting.name.upper(), default=default, help=help_text)
    group.add_argument("--config", metavar="FILE", default=default, help=f"TOML config file [${file.env}]")


def _subject_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("mailbox", help="the mailbox (a Nylas grant id, or the shared address)")
    parser.add_argument("id", help="the message id (or thread id with --thread)")
    parser.add_argument("--thread", action="store_true", help="ID is a thread id: the claim covers the conversation")


COMMANDS: dict[str, tuple[Command, str, str]] = {
    "status": (
        cmd_status,
        "who holds a message, since when, expiring in how long",
        "  inboxctl status grant-7f3a msg-123\n  inboxctl status grant-7f3a thr-9 --thread --json",
    ),
    "ls": (
        cmd_ls,
        "list a mailbox's messages that are held, sending, replied or in doubt",
        "  inboxctl ls grant-7f3a\n  inboxctl ls grant-7f3a --state claimed --state sending\n"
        "  inboxctl ls grant-7f3a --json | jq '.[].holder'",
    ),
    "watch": (
        cmd_watch,
        "follow a mailbox live: a table on a terminal, one line per event otherwise",
        "  inboxctl watch grant-7f3a\n  inboxctl watch grant-7f3a --state claimed --state in_doubt\n"
        "  inboxctl watch grant-7f3a --count 10 > events.log\n"
        "  inboxctl watch grant-7f3a --json --timeout 60",
    ),
    "claim": (
        cmd_claim,
        'claim a message for yourself ("I\'m answering this"): agents leave it alone',
        "  inboxctl claim grant-7f3a msg-123 --note 'calling the customer back'\n"
        "  inboxctl claim grant-7f3a msg-123 --ttl 1800",
    ),
    "release": (
        cmd_release,
        "give up your claim on a message without replying",
        "  inboxctl release grant-7f3a msg-123\n  inboxctl release grant-7f3a msg-123 --fencing-token 8841",
    ),
    "takeover": (
        cmd_takeover,
        "take a message over from an agent, or with --from from a colleague (humans with the takeover role): the "
        "holder cannot send any more",
        "  inboxctl takeover grant-7f3a msg-123 --note 'VIP customer, I will answer'\n"
        "  inboxctl takeover grant-7f3a msg-123 --from bo@example.com",
    ),
    "replied": (
        cmd_replied,
        "record that you answered a message yourself (mail client, phone): agents will not reply to it",
        "  inboxctl replied grant-7f3a msg-123 --note 'replied from Gmail'\n"
        "  inboxctl replied grant-7f3a msg-123 --sent-id 18c2f0a9e\n"
        "(on a message you hold; one nobody holds is claimed and recorded in one go; one an agent holds: take it\n"
        " over first)",
    ),
    "whoami": (
        cmd_whoami,
        "who the coordinator takes you to be: your name, kind, mailboxes and what you may do",
        "  inboxctl whoami\n  inboxctl whoami --json",
    ),
    "waiting": (
        cmd_waiting,
        "list what agents leave to people: conversations where agents are stopped (until their reply budget frees) "
        "and automated mail",
        "  inboxctl waiting grant-7f3a\n  inboxctl waiting grant-7f3a --json",
    ),
    "in-doubt": (
        cmd_in_doubt,
        "list the sends whose outcome is unknown (IN_DOUBT): each needs a person to check the sent folder",
        "  inboxctl in-doubt grant-7f3a\n  inboxctl in-doubt grant-7f3a --json",
    ),
    "resolve": (
        cmd_resolve,
        "settle an IN_DOUBT send after checking the sent folder",
        "  inboxctl resolve grant-7f3a msg-123 --sent --sent-message-id 18c2f0a9e\n"
        "  inboxctl resolve grant-7f3a msg-123 --not-sent --note 'not in Sent; the agent may answer again'",
    ),
    "undo-outside": (
        cmd_undo_outside,
        "a message shown as answered from the mailbox was not (recorded by mistake): make it answerable again "
        "(people with the resolve role)",
        "  inboxctl undo-outside grant-7f3a msg-123 --note 'Ana answered another customer in that thread'",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    width = max(len(name) for name in COMMANDS)
    overview = "\n".join(f"  {name:<{width}} {summary}" for name, (_, summary, _) in COMMANDS.items())
    examples = "\n".join(f"{examples.splitlines()[0]}" for _, _, examples in COMMANDS.values())
    parser = argparse.ArgumentParser(
        prog="inboxctl",
        description="See and steer who is answering which email (the Inbox Coordinator's claims).",
        epilog=f"commands:\n{overview}\n\nexamples:\n{examples}\n\n{EXIT_CODES}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(parser, top=True)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (handler, summary, examples) in COMMANDS.items():
        sub = commands.add_parser(
            name,
            help=summary,
            description=summary,
            epilog=f"examples:\n{examples}\n\n{EXIT_CODES}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sub.set_defaults(handler=handler)
        if name in ("ls", "watch", "in-doubt", "waiting"):
            sub.add_argument("mailbox", help="the mailbox (a Nylas grant id, or the shared address)")
        elif name != "whoami":
            _subject_arguments(sub)
        if name in ("ls", "in-doubt"):
            sub.add_argument("--limit", type=int, default=0, help="show at most this many (default: all)")
        if name in ("ls", "watch"):
            states = [state.name.lower() for state in SubjectState if state is not SubjectState.FREE]
            sub.add_argument("--state", action="append", choices=states, help="only this state (repeatable)")
        if name == "watch":
            sub.add_argument("--count", type=int, default=None, help="stop after this many events")
            sub.add_argument("--timeout", type=float, default=None, help="stop after this many seconds")
        if name in ("claim", "takeover"):
            sub.add_argument("--ttl", type=int, default=DEFAULT_CLAIM_TTL, help="seconds the claim lasts (default 900)")
            sub.add_argument("--note", default="", help="shown to everyone watching the mailbox")
        if name == "takeover":
            sub.add_argument(
                "--from",
                dest="from_person",
                default=None,
                metavar="PERSON",
                help="take it from this colleague (a person), who holds it now; without it a person's claim stands",
            )
        if name in ("release", "replied"):
            sub.add_argument("--fencing-token", type=int, default=None, help="the claim's token (default: yours)")
        if name == "replied":
            sub.add_argument("--sent-id", default=None, help="the id of the message you sent, when you know it")
            sub.add_argument("--note", default="", help="how it was answered (shown to everyone)")
        if name == "resolve":
            outcome = sub.add_mutually_exclusive_group(required=True)
            outcome.add_argument("--sent", dest="sent", action="store_true", help="the reply is in the sent folder")
            outcome.add_argument("--not-sent", dest="sent", action="store_false", help="it is not: free the message")
            sub.add_argument("--sent-message-id", default=None, help="with --sent: the sent message's id")
            sub.add_argument("--note", default="", help="who checked what")
        if name == "undo-outside":
            sub.add_argument("--note", default="", help="what you checked (shown to everyone)")
        _common(sub, top=False)
    return parser


async def run(options: argparse.Namespace, settings: dict[str, Any], out: TextIO) -> int:
    client = make_client(settings)
    try:
        handler: Command = options.handler
        return await handler(Context(client, options, settings, out))
    finally:
        await client.close()


def main(argv: Sequence[str] | None = None) -> int:
    """The ``inboxctl`` command; answers the exit code (see the module's docstring)."""
    parser = build_parser()
    options = parser.parse_args(argv)
    try:
        settings = resolve_settings(options)
        return asyncio.run(run(options, settings, sys.stdout))
    except UsageError as error:
        parser.exit(EXIT_USAGE, f"inboxctl: error: {error}\n")
    except InvalidRequest as error:
        return _fail(EXIT_USAGE, f"the coordinator rejected a value: {error.details}")
    except (CoordinatorUnavailable, QuotaExceeded) as error:
        return _fail(EXIT_UNAVAILABLE, f"cannot reach the coordinator at {settings['target']}: {error}")
    except PermissionDenied as error:
        return _fail(EXIT_DENIED, f"not permitted: {error.details}")
    except Unauthenticated as error:
        return _fail(EXIT_DENIED, f"not authenticated: {error.details}")
    except FailedPrecondition as error:
        return _fail(EXIT_REFUSED, f"refused: {error.details}")
    except CoordinatorError as error:
        return _fail(EXIT_REFUSED, f"the coordinator answered {error.code.name}: {error.details}")
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _fail(code: int, message: str) -> int:
    print(f"inboxctl: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
