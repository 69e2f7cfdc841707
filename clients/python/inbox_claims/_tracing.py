"""The client's spans, when OpenTelemetry's API is installed (an optional import: the application's own
OpenTelemetry set-up brings it, and the tracer provider it configured is the one used).

Each call (``Core.call``: one logical call, its retries included) is one CLIENT span, named as the coordinator
names its own (``inbox.coordinator.v1.Coordinator/ClaimReply``), the child of the span current where the call was
made; each retry is an event on it, with the wait (a rate limit's included). Its W3C trace context goes with
every attempt: ``traceparent``/``tracestate`` metadata, or the BatchCall's fields when the call shares a Batch
RPC with others, so the coordinator's span of the call continues it (docs/operations.md#traces). Without
OpenTelemetry, or with no trace to record or continue, nothing is done but a check.
"""

from __future__ import annotations

from typing import Any

import grpc

from inbox_wire.spans import TRACEPARENT, TRACESTATE, request_attributes, result_label

try:
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # OpenTelemetry is optional: without it, no spans and no trace context on the wire
    trace = None  # type: ignore[assignment]

__all__ = ["CallSpan", "call_started"]

_SERVICE = "inbox.coordinator.v1.Coordinator"
_propagator = TraceContextTextMapPropagator() if trace is not None else None
_tracer: Any = None


def _get_tracer() -> Any:
    global _tracer
    if _tracer is None:
        from inbox_wire import VERSION

        # A proxy until the application sets its provider, and that provider's tracer afterwards.
        _tracer = trace.get_tracer("inbox_claims", VERSION)
    return _tracer


class CallSpan:
    """One call's span, and the metadata that carries its context."""

    __slots__ = ("done", "metadata", "span")

    def __init__(self, span: Any, metadata: tuple[tuple[str, str], ...]) -> None:
        self.span = span
        self.metadata = metadata
        self.done = False

    def retrying(self, failure_code: grpc.StatusCode, attempt: int, delay_s: float) -> None:
        self.span.add_event(
            "retry",
            {
                "rpc.grpc.status_code": failure_code.value[0],
                "inbox.attempt": attempt,
                "inbox.retry_delay_ms": round(delay_s * 1000, 1),
            },
        )

    def answered(self, response: Any) -> None:
        self.span.set_attribute("inbox.result", result_label(response))
        self.span.set_attribute("rpc.grpc.status_code", 0)
        self.end()

    def failed(self, code: grpc.StatusCode, attempts: int) -> None:
        self.span.set_attribute("inbox.result", code.name.lower())
        self.span.set_attribute("rpc.grpc.status_code", code.value[0])
        self.span.set_attribute("inbox.attempts", attempts)
        self.span.set_status(trace.Status(trace.StatusCode.ERROR, code.name))
        self.end()

    def end(self) -> None:
        """Ends the span (once: a call that ended without an answer, its caller cancelled, ends it as it is)."""
        if not self.done:
            self.done = True
            self.span.end()


def call_started(method: str, request: Any) -> CallSpan | None:
    """The span of a call of ``method`` with ``request``, and its trace context for the wire; None without
    OpenTelemetry, or when there is neither a span to record nor a trace to continue."""
    if trace is None:
        return None
    tracer = _get_tracer()
    span = tracer.start_span(f"{_SERVICE}/{method}", kind=trace.SpanKind.CLIENT)
    context = span.get_span_context()
    if not context.is_valid:
        return None
    if span.is_recording():
        span.set_attributes({"rpc.system": "grpc", "rpc.service": _SERVICE, "rpc.method": method})
        span.set_attributes(request_attributes(request))
    carrier: dict[str, str] = {}
    assert _propagator is not None
    _propagator.inject(carrier, context=trace.set_span_in_context(span))
    return CallSpan(span, tuple((key, carrier[key]) for key in (TRACEPARENT, TRACESTATE) if key in carrier))
