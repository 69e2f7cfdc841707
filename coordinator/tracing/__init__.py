"""OpenTelemetry traces of the coordinator (docs/operations.md#traces).

Beside the layers, as logging is: every layer calls it and it imports none of them (docs/design.md#architecture).
``active`` is the process's tracing, or None; every hook in the server starts with ``tracing.active is not None``,
and that check is all that tracing costs while it is off (docs/performance.md#traces). It is turned on by the
standard ``OTEL_*`` environment variables alone (:func:`settings_from`), read once by ``inbox-coordinator serve``
(:func:`start_from_environment`); OpenTelemetry's SDK and exporters come with the ``[otel]`` extra and are
imported only then.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coordinator.tracing._spans import CallSpan as CallSpan
    from coordinator.tracing._spans import Tracing

__all__ = ["TraceSettings", "active", "close", "settings_from", "start_from_environment"]

log = logging.getLogger(__name__)

active: Tracing | None = None
"""The process's tracing while it is on; None while it is off."""

PROTOCOLS = ("http/protobuf", "grpc")
EXPORTERS = ("otlp", "console")


@dataclass(frozen=True)
class TraceSettings:
    """What the ``OTEL_*`` variables ask for (the SDK's exporters and sampler read the rest themselves: the
    endpoint, headers, timeout, OTEL_TRACES_SAMPLER/ARG, OTEL_BSP_*, OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES)."""

    exporters: tuple[str, ...]
    protocol: str
    problems: tuple[str, ...] = ()
    """Values not understood, each said in a warning and replaced by the default."""


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() == "true"


def settings_from(environ: Mapping[str, str]) -> TraceSettings | None:
    """Tracing's settings from the ``OTEL_*`` variables, or None when they do not ask for traces.

    OpenTelemetry's own default exporter is ``otlp`` to localhost; a coordinator exports nothing until told to:
    traces are on when OTEL_TRACES_EXPORTER names an exporter (``otlp``, ``console``; ``none`` is off) or an
    OTLP endpoint is set (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), and not
    OTEL_SDK_DISABLED=true."""
    if _truthy(environ.get("OTEL_SDK_DISABLED")):
        return None
    named = [name.strip().lower() for name in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if name.strip()]
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if "none" in named or (not named and not endpoint):
        return None
    problems = [
        f"OTEL_TRACES_EXPORTER={name!r} is not an exporter this coordinator has ({', '.join(EXPORTERS)}); ignored"
        for name in named
        if name not in EXPORTERS
    ]
    exporters = tuple(dict.fromkeys(name for name in named if name in EXPORTERS)) or ("otlp",)
    variable = (
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
        if environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        else "OTEL_EXPORTER_OTLP_PROTOCOL"
    )
    protocol = (environ.get(variable) or "http/protobuf").strip().lower()
    if protocol not in PROTOCOLS:
        problems.append(f"{variable}={protocol!r} is not one of {', '.join(PROTOCOLS)}; http/protobuf is used")
        protocol = "http/protobuf"
    return TraceSettings(exporters, protocol, tuple(problems))


_starting = threading.Lock()


def start_from_environment(environ: Mapping[str, str] | None = None) -> Tracing | None:
    """Turns tracing on for this process when the ``OTEL_*`` variables ask for it (once: later calls answer the
    same). Never fails a start: a value not understood, or the ``[otel]`` extra missing, is a warning."""
    global active
    with _starting:
        if active is not None:
            return active
        settings = settings_from(os.environ if environ is None else environ)
        if settings is None:
            return None
        for problem in settings.problems:
            log.warning("traces: %s", problem)
        try:
            from coordinator.tracing._spans import start
        except ImportError as error:
            log.warning(
                "traces: the OTEL_* environment asks for traces, but OpenTelemetry's SDK is not installed (%s); "
                "serving without traces. Install it with: pip install 'inbox-coordinator[otel]'",
                error,
            )
            return None
        try:
            active = start(settings)
        except (ValueError, TypeError) as error:  # the SDK's own refusal of an OTEL_BSP_* value, say
            log.warning("traces: OpenTelemetry's SDK refused its settings (%s); serving without traces", error)
            return None
        return active


def close(timeout_s: float = 2.0) -> None:
    """Sends the spans still queued, waiting at most ``timeout_s`` (a receiver that is down never holds up a
    stop for longer), and turns tracing off."""
    global active
    with _starting:
        tracing, active = active, None
    if tracing is not None:
        tracing.close(timeout_s)
