"""Refused TLS handshakes, in the coordinator's own log.

gRPC does not tell the application about a handshake it refused (a client certificate missing, expired or
signed by an unknown CA): the client only sees UNAVAILABLE "Socket closed", and grpc core writes one line to
the process's stderr (``Handshake failed with error SSL_ERROR_SSL: ...: certificate has expired``), in its
own format, without the peer's address. This module routes file descriptor 2 through a pipe read by a
thread: those lines become structured log records (event ``tls_handshake_refused``, with a ``reason`` an
operator can act on), and every other line passes through unchanged.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from typing import BinaryIO

log = logging.getLogger("inbox_coordinator.tls")

_HANDSHAKE_FAILED = re.compile(r"Handshake failed with error (?P<detail>.*)")

# What OpenSSL/BoringSSL says -> (reason, what to do about it).
REASONS: tuple[tuple[str, str, str], ...] = (
    (
        "PEER_DID_NOT_RETURN_A_CERTIFICATE",
        "client_certificate_missing",
        "the client sent no certificate and --require-client-cert is on: give the client its certificate and key",
    ),
    (
        "certificate has expired",
        "client_certificate_expired",
        "the client's certificate has expired: issue it a new one",
    ),
    (
        "certificate is not yet valid",
        "client_certificate_not_yet_valid",
        "the client's certificate is not valid yet: check its notBefore and the clocks",
    ),
    (
        "unable to get local issuer certificate",
        "client_certificate_untrusted",
        "the client's certificate is not signed by --tls-client-ca: issue it from that CA, or add its CA there",
    ),
    (
        "self signed certificate",
        "client_certificate_untrusted",
        "the client's certificate is self-signed: issue it from the CA in --tls-client-ca",
    ),
    (
        "WRONG_VERSION_NUMBER",
        "not_tls",
        "the client spoke plaintext (or another protocol) to this TLS port: use TLS credentials in the client",
    ),
    (
        "HTTP_REQUEST",
        "not_tls",
        "the client spoke plaintext HTTP to this TLS port: use TLS credentials in the client",
    ),
)


def classify(detail: str) -> tuple[str, str]:
    """(reason, advice) for grpc core's handshake error text."""
    for needle, reason, advice in REASONS:
        if needle in detail:
            return reason, advice
    return "other", "see the detail; `openssl s_client` against this port shows the handshake (docs/security.md)"


def capture_handshake_failures() -> None:
    """From now on, grpc core's stderr lines about refused handshakes are logged; call before logs.setup(), so
    that the log handler writes to the original stderr, which ``sys.stderr`` is pointed at."""
    original = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    sys.stderr = os.fdopen(original, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    passthrough = os.fdopen(original, "wb", buffering=0, closefd=False)
    threading.Thread(target=_pump, args=(read_end, passthrough), name="grpc stderr", daemon=True).start()


def _pump(read_end: int, passthrough: BinaryIO) -> None:
    with os.fdopen(read_end, "rb") as lines:
        for line in lines:
            match = _HANDSHAKE_FAILED.search(line.decode(errors="replace"))
            if match is None:
                passthrough.write(line)
                continue
            detail = match.group("detail").strip()
            reason, advice = classify(detail)
            log.warning(
                "TLS handshake refused: %s (%s)",
                advice,
                detail,
                extra={"fields": {"event": "tls_handshake_refused", "reason": reason, "detail": detail}},
            )
