"""Webhook signature checks for the two formats an inbox agent is likely to receive.

* **Nylas v3**: ``x-nylas-signature`` is the hex HMAC-SHA256 of the raw request body,
  keyed by the webhook secret. A new endpoint is first verified with
  ``GET ?challenge=<value>``, which must be answered by echoing the value.
* **Standard Webhooks** (https://www.standardwebhooks.com/): ``webhook-id``,
  ``webhook-timestamp`` and ``webhook-signature`` headers; the signature covers
  ``"{id}.{timestamp}." + body`` and the timestamp bounds replays.

Always pass the body exactly as received (``bytes``), before any JSON parsing: a
re-serialised document is semantically equal but byte-for-byte different, and its
signature will not match.

Errors from the request (missing header, bad format, mismatch, stale timestamp) raise
:class:`WebhookVerificationError`; answer those with 400/401. Errors from the server's
own configuration (empty or undecodable secret, negative tolerance) raise a plain
:class:`ValueError`, and passing ``str`` instead of ``bytes`` raises :class:`TypeError`,
so that a misconfiguration is not mistaken for a forged request.

Messages never contain the secret or the expected signature.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import math
import time
from collections.abc import Mapping

__all__ = [
    "NYLAS_SIGNATURE_HEADER",
    "WebhookVerificationError",
    "nylas_challenge_response",
    "sign_nylas",
    "sign_standard_webhook",
    "verify_nylas_signature",
    "verify_standard_webhook",
]

NYLAS_SIGNATURE_HEADER = "x-nylas-signature"
"""Header carrying the Nylas v3 signature (HTTP header names are case-insensitive)."""

_NYLAS_HEX_LENGTH = 64  # SHA-256 digest, hex-encoded
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
_MAX_CHALLENGE_LENGTH = 1024

_SW_ID = "webhook-id"
_SW_TIMESTAMP = "webhook-timestamp"
_SW_SIGNATURE = "webhook-signature"
_SW_SECRET_PREFIX = "whsec_"
_SW_VERSION = "v1"
_SHA256_LENGTH = 32


class WebhookVerificationError(ValueError):
    """The webhook request is not authentic (or not well formed): reject it.

    The message says what was wrong (missing header, bad format, mismatch, timestamp
    out of tolerance); it never contains the secret or the expected signature.
    """


# --------------------------------------------------------------------------- helpers


def _body_bytes(raw_body: bytes | bytearray | memoryview) -> bytes:
    if isinstance(raw_body, bytes):
        return raw_body
    if isinstance(raw_body, bytearray | memoryview):
        return bytes(raw_body)
    raise TypeError(
        f"raw_body must be the request body as received (bytes), not {type(raw_body).__name__}; "
        "re-encoded or re-serialised bodies do not match their signature"
    )


def _nylas_key(secret: str | bytes) -> bytes:
    if isinstance(secret, str):
        key = secret.encode("utf-8")
    elif isinstance(secret, bytes | bytearray):
        key = bytes(secret)
    else:
        raise TypeError(f"webhook secret must be str or bytes, not {type(secret).__name__}")
    if not key:
        raise ValueError("webhook secret is empty: check the server's configuration")
    return key


def _standard_key(secret: str) -> bytes:
    if not isinstance(secret, str):
        raise TypeError(f"Standard Webhooks secret must be str, not {type(secret).__name__}")
    encoded = secret.strip().removeprefix(_SW_SECRET_PREFIX)
    try:
        key = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(
            "Standard Webhooks secret is not valid base64 (expected 'whsec_<base64>'): check the server's configuration"
        ) from None
    if not key:
        raise ValueError("Standard Webhooks secret is empty: check the server's configuration")
    return key


# ------------------------------------------------------------------------------ Nylas


def sign_nylas(raw_body: bytes | bytearray | memoryview, secret: str | bytes) -> str:
    """Return the ``x-nylas-signature`` value for *raw_body*: lower-case hex HMAC-SHA256.

    Meant for tests and local tooling that need to produce requests Nylas would send.
    """
    return hmac.new(_nylas_key(secret), _body_bytes(raw_body), hashlib.sha256).hexdigest()


def verify_nylas_signature(
    raw_body: bytes | bytearray | memoryview, signature_header: str | None, secret: str | bytes
) -> None:
    """Check a Nylas v3 webhook's ``x-nylas-signature`` header; return ``None`` if authentic.

    *raw_body* must be the exact bytes received (never re-serialised JSON).
    *signature_header* is the header's value, or ``None`` when the request had none.
    Surrounding whitespace is ignored and hex digits may be upper or lower case.
    The comparison runs in constant time.

    Raises :class:`WebhookVerificationError` when the header is missing, is not 64 hex
    characters, or does not match the body.
    """
    body = _body_bytes(raw_body)
    key = _nylas_key(secret)
    if signature_header is None:
        raise WebhookVerificationError(f"missing {NYLAS_SIGNATURE_HEADER} header")
    if not isinstance(signature_header, str):
        raise WebhookVerificationError(
            f"{NYLAS_SIGNATURE_HEADER} header must be a string, not {type(signature_header).__name__}"
        )
    received = signature_header.strip()
    if not received:
        raise WebhookVerificationError(f"{NYLAS_SIGNATURE_HEADER} header is empty")
    if len(received) != _NYLAS_HEX_LENGTH:
        raise WebhookVerificationError(
            f"{NYLAS_SIGNATURE_HEADER} header has {len(received)} characters, "
            f"expected {_NYLAS_HEX_LENGTH} hex digits (HMAC-SHA256)"
        )
    if not _HEX_DIGITS.issuperset(received):
        raise WebhookVerificationError(f"{NYLAS_SIGNATURE_HEADER} header is not hexadecimal")
    expected = hmac.new(key, body, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected.encode("ascii"), received.lower().encode("ascii")):
        raise WebhookVerificationError(
            f"{NYLAS_SIGNATURE_HEADER} does not match the request body "
            "(wrong secret, or the body was altered or re-serialised)"
        )


def nylas_challenge_response(query: Mapping[str, str]) -> str | None:
    """Return the body to answer a Nylas endpoint-verification request, or ``None``.

    When a webhook is created, Nylas sends ``GET <endpoint>?challenge=<value>`` and
    expects, within 10 seconds, a ``200`` response whose body is exactly ``<value>``
    (``text/plain``, no quoting or JSON). *query* is the request's query parameters.

    Returns ``None`` when there is no ``challenge`` parameter (not a verification
    request). Raises :class:`WebhookVerificationError` when it is empty, not a single
    string, or longer than 1024 characters.
    """
    if "challenge" not in query:
        return None
    value = query["challenge"]
    if not isinstance(value, str):
        raise WebhookVerificationError(
            f"'challenge' query parameter must be a single string, not {type(value).__name__}"
        )
    if not value:
        raise WebhookVerificationError("'challenge' query parameter is empty")
    if len(value) > _MAX_CHALLENGE_LENGTH:
        raise WebhookVerificationError(
            f"'challenge' query parameter is {len(value)} characters long, "
            f"more than the {_MAX_CHALLENGE_LENGTH} allowed"
        )
    return value


# ------------------------------------------------------------------ Standard Webhooks


def _standard_digest(key: bytes, msg_id: str, timestamp: int, body: bytes) -> bytes:
    signed = f"{msg_id}.{timestamp}.".encode() + body
    return hmac.new(key, signed, hashlib.sha256).digest()


def sign_standard_webhook(raw_body: bytes | bytearray | memoryview, *, msg_id: str, timestamp: int, secret: str) -> str:
    """Return a ``webhook-signature`` value (``v1,<base64>``) for a Standard Webhooks message.

    *timestamp* is in unix seconds; *secret* is ``whsec_<base64>`` (the prefix is optional).
    Meant for tests and local tooling.
    """
    if isinstance(timestamp, bool) or not isinstance(timestamp, int) or timestamp < 0:
        raise ValueError("timestamp must be a non-negative integer (unix seconds)")
    if not msg_id:
        raise ValueError("msg_id must be a non-empty string")
    digest = _standard_digest(_standard_key(secret), msg_id, timestamp, _body_bytes(raw_body))
    return f"{_SW_VERSION},{base64.b64encode(digest).decode('ascii')}"


def _required_header(headers: Mapping[str, str], name: str) -> str:
    value = headers.get(name)
    if value is None:
        raise WebhookVerificationError(f"missing {name} header")
    if not isinstance(value, str):
        raise WebhookVerificationError(f"{name} header must be a string, not {type(value).__name__}")
    value = value.strip()
    if not value:
        raise WebhookVerificationError(f"{name} header is empty")
    return value


def verify_standard_webhook(
    raw_body: bytes | bytearray | memoryview,
    headers: Mapping[str, str],
    secret: str,
    *,
    tolerance: float = 300.0,
    now: float | None = None,
) -> None:
    """Check a Standard Webhooks request; return ``None`` if authentic and fresh.

    *headers* may be any mapping of the request's headers; names are matched
    case-insensitively. The ``webhook-signature`` header is a space-separated list of
    ``<version>,<base64>`` entries: entries of versions other than ``v1`` are ignored,
    and at least one ``v1`` entry must match. *secret* is ``whsec_<base64>`` (the
    prefix is optional). ``webhook-timestamp`` must be within ``tolerance`` seconds of
    *now* (default: the current time) in either direction.

    Raises :class:`WebhookVerificationError` on a missing or malformed header, a
    timestamp too old or too new, or no matching signature.
    """
    body = _body_bytes(raw_body)
    key = _standard_key(secret)
    if not (isinstance(tolerance, int | float) and tolerance >= 0 and math.isfinite(tolerance)):
        raise ValueError("tolerance must be a finite, non-negative number of seconds")

    normalised = {str(name).lower(): value for name, value in headers.items()}
    msg_id = _required_header(normalised, _SW_ID)
    timestamp_text = _required_header(normalised, _SW_TIMESTAMP)
    signature_text = _required_header(normalised, _SW_SIGNATURE)

    if not (timestamp_text.isascii() and timestamp_text.isdigit()):
        raise WebhookVerificationError(f"{_SW_TIMESTAMP} header is not an integer number of unix seconds")
    timestamp = int(timestamp_text)
    current = time.time() if now is None else now
    if not math.isfinite(current):
        raise ValueError("now must be a finite number of unix seconds")
    if timestamp < current - tolerance:
        raise WebhookVerificationError(
            f"{_SW_TIMESTAMP} is too old: {current - timestamp:.0f}s in the past, "
            f"tolerance is {tolerance:g}s (replayed or delayed message, or clock skew)"
        )
    if timestamp > current + tolerance:
        raise WebhookVerificationError(
            f"{_SW_TIMESTAMP} is too new: {timestamp - current:.0f}s in the future, "
            f"tolerance is {tolerance:g}s (clock skew?)"
        )

    candidates: list[bytes] = []
    for entry in signature_text.split():
        version, sep, encoded = entry.partition(",")
        if not sep or version != _SW_VERSION:
            continue  # other versions (and unparseable entries) are ignored, per the spec
        try:
            decoded = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            continue
        if len(decoded) == _SHA256_LENGTH:
            candidates.append(decoded)
    if not candidates:
        raise WebhookVerificationError(f"{_SW_SIGNATURE} header has no well-formed '{_SW_VERSION},<base64>' signature")

    expected = _standard_digest(key, msg_id, timestamp, body)
    # Compare against every candidate (no early exit) so timing does not reveal which matched.
    matched = False
    for candidate in candidates:
        matched |= hmac.compare_digest(expected, candidate)
    if not matched:
        raise WebhookVerificationError(
            f"no {_SW_VERSION} signature in {_SW_SIGNATURE} matches the request "
            "(wrong secret, or the id, timestamp or body was altered)"
        )
