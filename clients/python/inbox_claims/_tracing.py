"""The client's spans, when OpenTelemetry's API is installed (an optional import: the application's own
OpenTelemetry set-up brings it, and the tracer provider it configured is the one used).

Each call (``Core.call``: one logical call, its retries included) is one CLIENT span, named as the coordinator
names its own (``inbox.coordinator.v1.Coordinator/ClaimReply``), the child of the span current where the call was
made; each retry is an event on it, with the wait (a rate limit's included). Its W3C trace context goes with
every attempt: ``traceparent``/``tracestate`` metadata, or the BatchCall's fields when the call shares a Batch
RPC with others, so the coordinator's span of the call continues it (docs/operations.md#traces). Without
OpenTelemetry, or with no trace to record or continue, nothing is done but a check.

The guard's spans (docs/operations.md#traces): a notification's (``inbox notification``: verify, record,
acknowledge, in the webhook adapters) and a reply's (``inbox reply``: from the claim to leaving its block, the
user's own spans, BeginSend, the send and ConfirmSent beneath it), with renewals and a loss as its events; a
provider's request carries the current span's ``traceparent`` (:func:`trace_headers`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import grpc

from inbox_wire.spans import TRACEPARENT, TRACESTATE, request_attributes, result_label

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # OpenTelemetry is optional: without it, no spans and no trace context on the wire
    trace = None  # type: ignore[assignment]

__all__ = [
    "CallSpan",
    "GuardSpan",
    "NotificationTrace",
    "ToolTrace",
    "attach",
    "call_started",
    "child",
    "detach",
    "notification_started",
    "reply_started",
    "trace_headers",
    "traced_notification",
    "traced_tool",
]

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


def _nothing_to_do(parent: GuardSpan | None = None) -> bool:
    """No tracer provider set up by the application and no trace to continue: every span would be a no-op, so
    none is made (the cost of this check alone; docs/performance.md#traces)."""
    return (
        parent is None
        and isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
        and not trace.get_current_span().get_span_context().is_valid
    )


def call_started(method: str, request: Any, parent: GuardSpan | None = None) -> CallSpan | None:
    """The span of a call of ``method`` with ``request``, and its trace context for the wire; None without
    OpenTelemetry, or when there is neither a span to record nor a trace to continue. ``parent``: the guard's
    span the call is made for (a renewal runs in a thread or task of its own), else the current span."""
    if trace is None or _nothing_to_do(parent):
        return None
    tracer = _get_tracer()
    span = tracer.start_span(
        f"{_SERVICE}/{method}", context=parent.context if parent is not None else None, kind=trace.SpanKind.CLIENT
    )
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


class GuardSpan:
    """A guard's span (a notification's or a reply's) and the context that makes it the parent of what runs for
    it. Only identifiers and outcomes are set on it: never a summary, a credential or a header's value."""

    __slots__ = ("context", "done", "span")

    def __init__(self, span: Any) -> None:
        self.span = span
        self.context = trace.set_span_in_context(span)
        self.done = False

    def set(self, attributes: Mapping[str, str | int]) -> None:
        if self.span.is_recording():
            self.span.set_attributes(attributes)

    def event(self, name: str, attributes: Mapping[str, str | int | float] | None = None) -> None:
        self.span.add_event(name, attributes or {})

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """This span is the current one in the block (the user's spans, a provider's request beneath it)."""
        token = otel_context.attach(self.context)
        try:
            yield
        finally:
            otel_context.detach(token)

    def end(self, outcome: str, error: BaseException | None = None) -> None:
        """Ends the span (once) with its ``inbox.outcome``; ``error``: what ended it, when it failed (its type
        only: an exception's message may quote a summary)."""
        if self.done:
            return
        self.done = True
        self.span.set_attribute("inbox.outcome", outcome)
        if error is not None:
            self.span.set_attribute("error.type", type(error).__qualname__)
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, type(error).__qualname__))
        self.span.end()


def _guard_span(name: str, attributes: Mapping[str, str | int], kind: Any = None) -> GuardSpan | None:
    if trace is None or _nothing_to_do():
        return None
    span = _get_tracer().start_span(name, kind=kind or trace.SpanKind.INTERNAL)
    if not span.get_span_context().is_valid:
        return None  # nothing to record or continue: the guard runs untraced
    if span.is_recording():
        span.set_attributes(attributes)
    return GuardSpan(span)


def reply_started(mailbox: str, subject_kind: str, subject_id: str, notification_id: str) -> GuardSpan | None:
    """The span of one guarded reply, the child of the span current where it is claimed (the notification's in
    the webhook adapters); None without OpenTelemetry or a trace."""
    attributes: dict[str, str | int] = {
        "inbox.mailbox": mailbox,
        "inbox.subject.kind": subject_kind,
        "inbox.subject.id": subject_id,
    }
    if notification_id:
        attributes["inbox.notification_id"] = notification_id
    return _guard_span("inbox reply", attributes)


def notification_started(provider: str) -> GuardSpan | None:
    """The span of one webhook delivery, the child of the current span (a web framework's instrumentation)."""
    return _guard_span("inbox notification", {"inbox.provider": provider})


class NotificationTrace:
    """What a webhook adapter tells of one delivery: its span's steps, or nothing without a span."""

    __slots__ = ("span",)

    def __init__(self, span: GuardSpan | None) -> None:
        self.span = span

    def verified(self) -> None:
        """The signature (or the provider's token) was good and the delivery read."""
        if self.span is not None:
            self.span.event("verified")

    def recorded(self, recorded: bool) -> None:
        """The coordinator recorded the delivery (its claims admitted, its batch committed)."""
        if self.span is not None and recorded:
            self.span.event("recorded")

    def answered(self, status: int) -> None:
        """The provider's answer: ``acknowledged`` (2xx: not delivered again), ``retry_later`` (503: it will be),
        ``refused`` (another 4xx: a bad signature, a body too large), ``failed`` (500)."""
        if self.span is None:
            return
        self.span.set({"http.response.status_code": status})
        outcome = (
            "acknowledged"
            if status < 300
            else "retry_later"
            if status == 503
            else "refused"
            if status < 500
            else "failed"
        )
        self.span.end(outcome)


_UNTRACED = NotificationTrace(None)


@contextlib.contextmanager
def traced_notification(provider: str, method: str) -> Iterator[NotificationTrace]:
    """A delivery's span (a POST's: a challenge or a probe gets none), current in the block so that the claims
    it admits are its children; ended by ``answered``, or as ``failed`` by an exception."""
    span = notification_started(provider) if method == "POST" else None
    if span is None:
        yield _UNTRACED
        return
    with _running(span, "no_answer"):  # unanswered: the client went away before the body was read
        yield NotificationTrace(span)


def trace_headers() -> dict[str, str]:
    """The current span's W3C trace context as HTTP headers (``traceparent``, ``tracestate``), for a request to a
    provider; empty without OpenTelemetry or a current span."""
    if _propagator is None or not trace.get_current_span().get_span_context().is_valid:
        return {}
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier


def attach(span: GuardSpan | None) -> object:
    """Makes ``span`` the current span until :func:`detach` (in the same thread or task); what to detach."""
    return otel_context.attach(span.context) if span is not None else None


def detach(token: object) -> None:
    if token is not None:
        otel_context.detach(token)  # type: ignore[arg-type]


@contextlib.contextmanager
def child(parent: GuardSpan | None, name: str) -> Iterator[None]:
    """A span beneath ``parent``, current in the block (a provider's request carries it); an exception out of
    the block marks it failed, by its type only (its message may quote a summary)."""
    if parent is None:
        yield
        return
    span = _get_tracer().start_span(name, context=parent.context)
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield
    except BaseException as error:
        span.set_attribute("error.type", type(error).__qualname__)
        span.set_status(trace.Status(trace.StatusCode.ERROR, type(error).__qualname__))
        raise
    finally:
        otel_context.detach(token)
        span.end()


class ToolTrace:
    """What an MCP tool call tells of itself: its span's link to the claim it acts on, its outcome."""

    __slots__ = ("span",)

    def __init__(self, span: GuardSpan | None) -> None:
        self.span = span

    def acts_on(self, mailbox: str, subject_id: str, claim: GuardSpan | None) -> None:
        """The message (or thread) the call is about, and the reply's span of a claim an earlier call took
        (another trace, the earlier call's): linked, so that one leads to the other."""
        if self.span is None:
            return
        self.span.set({"inbox.mailbox": mailbox, "inbox.subject.id": subject_id})
        if claim is not None and claim.span is not self.span:
            self.span.span.add_link(claim.span.get_span_context())

    def answered(self, result: Any) -> None:
        """The tool's result: its structured ``outcome`` (``granted``, ``sent``, ``held``, …), else ``error`` or
        ``ok`` as the result says."""
        if self.span is None:
            return
        document = result if isinstance(result, Mapping) else {}
        structured = getattr(result, "structured_content", None) or document.get("structuredContent") or {}
        failed = getattr(result, "is_error", None) or document.get("isError") is True
        outcome = structured.get("outcome") if isinstance(structured, Mapping) else None
        self.span.end(outcome if isinstance(outcome, str) else "error" if failed else "ok")


_UNTRACED_TOOL = ToolTrace(None)


@contextlib.contextmanager
def traced_tool(tool: str, mailbox: str | None = None) -> Iterator[ToolTrace]:
    """An MCP tool call's span (``inbox tool claim_message``), beneath the MCP SDK's span of the request (which
    continues the caller's ``_meta.traceparent``), current in the block: the claim and the calls it makes, and
    the guard's forwarded call, beneath it. Ended by ``answered``, or as ``failed`` by an exception."""
    attributes = {"inbox.tool": tool, **({"inbox.mailbox": mailbox} if mailbox else {})}
    span = _guard_span(f"inbox tool {tool}", attributes)
    if span is None:
        yield _UNTRACED_TOOL
        return
    with _running(span, "ok"):
        yield ToolTrace(span)


@contextlib.contextmanager
def _running(span: GuardSpan, unreported: str) -> Iterator[None]:
    """``span`` current in the block; ended as ``failed`` by an exception, as ``unreported`` when the block did
    not end it itself (ended once: an outcome it reported stands)."""
    try:
        with span.current():
            yield
    except BaseException as error:
        span.end("failed", error)
        raise
    span.end(unreported)
