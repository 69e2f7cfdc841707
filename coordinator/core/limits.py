"""Every limit on a request field, named, with the check that enforces it."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

from coordinator.core.errors import InvalidArgument

MAILBOX_MAX_BYTES = 320  # an email address is at most 254; grant ids are UUIDs
SUBJECT_ID_MAX_BYTES = 512  # provider ids are short, but RFC 5322 Message-IDs can be long
NOTIFICATION_ID_MAX_BYTES = 256
REQUEST_ID_MAX_BYTES = 128
PRINCIPAL_MAX_BYTES = 128
NOTE_MAX_BYTES = 1024
SENT_MESSAGE_ID_MAX_BYTES = 512
# The summary a person tells one email from another by (ClaimReply's and Takeover's `summary`).
SUMMARY_SUBJECT_LINE_MAX_BYTES = 512  # RFC 5322 allows 998 per line; a row on a screen shows far less
SUMMARY_SENDER_MAX_BYTES = 512  # a display name and an address (at most 254)
# Replies written outside the coordinator (RecordOutgoing) and the thread a claimed message belongs to.
THREAD_ID_MAX_BYTES = 512  # a provider's thread id, as long as a subject id may be
MESSAGE_ID_MAX_BYTES = 512  # RecordOutgoing's message id: a provider message id, as SUBJECT_ID_MAX_BYTES
SENDER_MAX_BYTES = 512  # RecordOutgoing's sender, as people read it: as SUMMARY_SENDER_MAX_BYTES
CORRESPONDENT_MAX_BYTES = 320  # ClaimReply's correspondent: an address (at most 254), as MAILBOX_MAX_BYTES
AUTOMATED_REASON_MAX_BYTES = 256  # RecordIncoming's reason: a header's name and value, read by people
PAGE_SIZE_DEFAULT = 100
# A ListClaims page token: the longest one issued (a mailbox and an id at their limits, JSON-escaped, in base64)
# is under 3.4 KB; anything longer was not issued here and is refused before it is decoded.
PAGE_TOKEN_MAX_BYTES = 4096
PAGE_SIZE_MAX = 1000
# ListRecentMessages: what a person types to find an email, how many answers, and how far back it reads (the
# newest deliveries of the mailbox, each at most the delivery retention old).
RECENT_QUERY_MAX_BYTES = 256
# A mailbox's cursor (docs/design.md#cursors): its name (gmail-history, graph-delta:inbox) and its value (a Gmail
# history id, a Graph delta link: Graph's links run to a few hundred bytes).
CURSOR_NAME_MAX_BYTES = 128
CURSOR_VALUE_MAX_BYTES = 4096
RECENT_PAGE_SIZE_DEFAULT = 20
RECENT_PAGE_SIZE_MAX = 100
RECENT_DELIVERIES_READ_MAX = 2000
# ListClaims filtered by state reads the mailbox in ranges of this many subjects, at most this many ranges for
# one page: a page costs at most 5 etcd reads of 1,000 keys, whatever the filter finds.
LIST_RANGE_SUBJECTS = 1000
LIST_RANGES_PER_PAGE = 5


@dataclass(frozen=True)
class Limits:
    ttl_min_seconds: int = 5
    ttl_max_seconds: int = 3600
    ttl_default_seconds: int = 60

    def ttl(self, requested: int) -> int:
        """0 means the default; anything else must lie in [min, max]."""
        if requested == 0:
            return self.ttl_default_seconds
        if not self.ttl_min_seconds <= requested <= self.ttl_max_seconds:
            raise InvalidArgument(
                "ttl_seconds",
                f"{requested} is outside {self.ttl_min_seconds}..{self.ttl_max_seconds} seconds "
                f"(0 means the default, {self.ttl_default_seconds})",
            )
        return requested


def _has_control_character(text: str) -> bool:
    if text.isprintable():  # the common case, decided in C: printable text has no control character
        return False
    return any(unicodedata.category(ch) == "Cc" for ch in text)


# Kept: zero-width joiner and non-joiner, which emoji sequences and Persian or Indic words need and which move
# nothing around them.
_JOINERS = frozenset("\u200c\u200d")


def _invisible(ch: str) -> bool:
    category = unicodedata.category(ch)
    return (category == "Cf" and ch not in _JOINERS) or category in ("Zl", "Zp")


def without_invisible_formatting(text: str) -> str:
    """``text`` without the characters that change how the text around them is shown and are not seen
    themselves: bidirectional embeddings, overrides, isolates and marks ("Invoice U+202E gnp.exe" shows as
    "Invoice exe.png"), zero-width spaces, the BOM, tag characters (Unicode category Cf but the joiners), and
    the line and paragraph separators. A summary comes from an email anyone can send, so it is cleaned rather
    than refused: refusing would let a sender's subject line fail the claim of the agent answering it."""
    if text.isascii():
        return text
    return "".join(ch for ch in text if not _invisible(ch))


def check_text(field: str, value: str, max_bytes: int, *, required: bool) -> str:
    """An identifier or note: UTF-8, within ``max_bytes``, no control characters; empty only if optional."""
    if not value:
        if required:
            raise InvalidArgument(field, "is required and was empty")
        return value
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise InvalidArgument(field, f"is {size} bytes; the limit is {max_bytes} bytes of UTF-8")
    if _has_control_character(value):
        raise InvalidArgument(field, "contains a control character (U+0000..U+001F or U+007F..U+009F)")
    if not value.isascii() and any(0xD800 <= ord(ch) <= 0xDFFF for ch in value):
        raise InvalidArgument(field, "contains an unpaired surrogate; send valid UTF-8")
    return value


# A provider's date (a message's `received_at`, `sent_at`) may lie this far ahead of the coordinator's clock: the
# provider's clock and the replica's may each be minutes off (the clock-skew tests run replicas 5 minutes fast
# and slow). Further ahead it is refused: a reply dated a year ahead would answer every message of its thread for
# its whole retention (docs/design.md#replies-written-outside).
TIME_AHEAD_TOLERANCE_MS = 10 * 60 * 1000


def check_time_ms(field: str, value_ms: int | None, *, required: bool, now_ms: int) -> int | None:
    """A provider's timestamp (a message's date): not before 1970, not later than ``now_ms`` (this replica's clock)
    plus TIME_AHEAD_TOLERANCE_MS; ``None`` only if optional."""
    if value_ms is None:
        if required:
            raise InvalidArgument(field, "is required and was unset")
        return None
    if value_ms < 0:
        raise InvalidArgument(field, "is before 1970; send the message's date as the provider gives it")
    ahead_ms = value_ms - now_ms
    if ahead_ms > TIME_AHEAD_TOLERANCE_MS:
        raise InvalidArgument(
            field,
            f"is {_duration(ahead_ms)} ahead of this coordinator's clock; a message's date may be at most "
            f"{_duration(TIME_AHEAD_TOLERANCE_MS)} ahead (the clock tolerance): send the date the provider gives, "
            "and check the clocks if it is",
        )
    return value_ms


def _duration(ms: int) -> str:
    minutes = ms / 60_000
    if minutes < 120:
        return f"{minutes:.0f} minutes"
    hours = minutes / 60
    if hours < 48:
        return f"{hours:.0f} hours"
    return f"{hours / 24:.0f} days"


_CURSOR_NAME = re.compile(r"[A-Za-z0-9._:-]+")


def check_cursor_name(name: str) -> str:
    """A cursor's name: 1 to CURSOR_NAME_MAX_BYTES of letters, digits and ``._:-``."""
    check_text("name", name, CURSOR_NAME_MAX_BYTES, required=True)
    if not _CURSOR_NAME.fullmatch(name):
        raise InvalidArgument("name", "may hold only letters, digits and . _ : - (gmail-history, graph-delta:inbox)")
    return name


def check_position(field: str, position: int) -> int:
    if position < 0:
        raise InvalidArgument(field, "is negative; a cursor's positions start at 0")
    return position


def check_page_size(requested: int, default: int = PAGE_SIZE_DEFAULT, maximum: int = PAGE_SIZE_MAX) -> int:
    """0 means ``default``; ListClaims pages by PAGE_SIZE_*, ListRecentMessages by RECENT_PAGE_SIZE_*."""
    if requested == 0:
        return default
    if requested > maximum:
        raise InvalidArgument("page_size", f"{requested} is over the limit of {maximum}")
    return requested
