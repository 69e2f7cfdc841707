"""Which incoming messages are automated mail: an agent never answers them (issue 33, docs/design.md#reply-storms).

An agent answering an out-of-office, a mailing list, a bounce or another company's autoresponder starts a loop no
per-message dedup stops: each message is new. RFC 3834 says an automatic responder must not answer a message marked
``Auto-Submitted`` other than ``no``; the other rules catch the senders that mark nothing that standard (lists,
Exchange's ``X-Auto-Response-Suppress``, bounces, no-reply addresses). The guard records such a message for people
(RecordIncoming with the reason) and never runs the handler: a person can still claim and answer it.

The rules are data both clients share: conformance/automated.json holds the cases each client's tests run, and its
``about`` says them in words.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["AUTO_SUBMITTED_HEADER", "AUTO_SUBMITTED_VALUE", "automated_reason"]

AUTO_SUBMITTED_HEADER = "Auto-Submitted"
AUTO_SUBMITTED_VALUE = "auto-replied"
"""What an agent's reply is marked with (RFC 3834 section 5: a response sent in reply to a message)."""

_PRECEDENCE = frozenset({"bulk", "list", "junk", "auto_reply"})
# Presence alone counts: a list or an autoresponder sets these, a person's mail client never does.
_PRESENT = ("List-Id", "List-Unsubscribe", "X-Autoreply", "X-Autorespond", "X-Auto-Response-Suppress")
_BOUNCERS = frozenset({"mailer-daemon", "postmaster"})
# "no-reply" or "do-not-reply" as a whole word of the local part: "notifications-noreply" and "noreply.orders" are
# automated senders, "bruno.reply" and "noreplies" are people.
_NO_REPLY = re.compile(r"(?:^|[._+-])(?:no|do[._-]?not)[._-]?reply(?:$|[._+-])")


def _keyword(value: str) -> str:
    return re.split(r"[;(]", value, maxsplit=1)[0].strip().lower()


def automated_reason(headers: Mapping[str, str], sender: str | None, content_type: str | None = None) -> str | None:
    """The rule that makes a message automated, named with its value ("Auto-Submitted: auto-replied", "List-Id",
    "no-reply sender noreply@shop.example"), or None for a message an agent may answer.

    ``headers`` are the message's headers (names compared without case), ``sender`` its From address,
    ``content_type`` its Content-Type when known apart from the headers."""
    lower = {name.strip().lower(): value.strip() for name, value in headers.items()}
    submitted = lower.get("auto-submitted")
    if submitted is not None:
        keyword = _keyword(submitted)
        if keyword != "no":
            return f"{AUTO_SUBMITTED_HEADER}: {keyword}" if keyword else AUTO_SUBMITTED_HEADER
    precedence = lower.get("precedence", "").lower()
    if precedence in _PRECEDENCE:
        return f"Precedence: {precedence}"
    for name in _PRESENT:
        if name.lower() in lower:
            return name
    media = _keyword(content_type if content_type is not None else lower.get("content-type", ""))
    address = (sender or "").strip().lower()
    local = address.rpartition("@")[0] if "@" in address else address
    if media == "multipart/report" or local in _BOUNCERS:
        return "delivery status notification"
    if local and _NO_REPLY.search(local):
        return f"no-reply sender {address}"
    return None
