"""One spelling of a message id, so that one message is one claim however its id was written.

The same message reaches agents and people written several ways: with the spaces or line break a copy and
paste brings, and, for an RFC 5322 Message-ID (Gmail's ``inReplyTo``, an IMAP server's headers), with or
without the angle brackets that enclose it in a header (``<CAF=x@mail.gmail.com>``). Each spelling claimed as
written is a claim of its own, and a second reply. The rule, the same in every client (conformance vectors
``conformance/message_ids.json``): the whitespace around the id is dropped; an id enclosed whole in one pair of
angle brackets, with none inside, is the id within them, its own surrounding whitespace dropped too. Nothing
else is rewritten: no case folding (a Message-ID's left part is case-sensitive, and no provider we support
documents its message ids as case-insensitive), no Unicode normalisation, nothing inside the id.
"""

from __future__ import annotations

__all__ = ["WHITESPACE", "canonical_message_id"]

WHITESPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000\ufeff"
)
"""What is dropped around an id: Unicode's White_Space characters, and the byte order mark (U+FEFF, invisible,
and what a pasted text may begin with). Spelled out, because ``str.strip()`` and JavaScript's ``trim()`` each
drop a slightly different set."""


def canonical_message_id(message_id: str) -> str:
    """``message_id`` as every client claims it: `` <m1@x> `` and ``m1@x`` are one message (see the module)."""
    trimmed = message_id.strip(WHITESPACE)
    if len(trimmed) > 2 and trimmed[0] == "<" and trimmed[-1] == ">":
        inner = trimmed[1:-1]
        if "<" not in inner and ">" not in inner and inner.strip(WHITESPACE):
            return inner.strip(WHITESPACE)
    return trimmed
