"""The coordinator's spans, on OpenTelemetry's API, and the SDK set up from the ``OTEL_*`` variables. Imported only
while tracing is on (coordinator.tracing.start_from_environment): it needs the ``[otel]`` extra.

The spans (docs/operations.md#traces says what each means to an operator):

- one SERVER span per call, gRPC or HTTP/JSON, named ``inbox.coordinator.v1.Coordinator/ClaimReply``, continuing
  the caller's W3C ``traceparent``/``tracestate`` (baggage is not read); a call carried by a Batch gets its own,
  continuing the context its BatchCall carries, and linked to the Batch's span;
- ``etcd transaction``: one transaction of a call, from when it was queued for the group commit to its answer,
  with an event when its batch was sent;
- ``etcd group commit``: the one etcd request that carried several calls' transactions, linked to each of them,
  and the child of the first of them that is sampled;
- ``etcd Txn``, ``etcd Range``, ``etcd LeaseGrant``: each request to etcd, as long as it took.

What goes into an attribute is chosen here, from named fields: never a message's summary (subject line, sender),
a fencing token, a bearer token or any other credential (tests/server/test_traces.py reads every attribute).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextvars import Token
from typing import Any, Protocol

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from coordinator.tracing import TraceSettings
from inbox_wire.spans import TRACEPARENT, TRACESTATE, enum_label, request_attributes

log = logging.getLogger("coordinator.tracing")

__all__ = ["CallSpan", "Tracing", "start"]

SERVICE_NAME = "inbox-coordinator"
_TRACE_HEADERS = frozenset({TRACEPARENT, TRACESTATE})
_PROPAGATOR = TraceContextTextMapPropagator()
_EMPTY = otel_context.Context()
# The gRPC codes that are the server's failure (OpenTelemetry's rule for a gRPC server span): a refusal of the
# caller's request (INVALID_ARGUMENT, PERMISSION_DENIED, a STALE_TOKEN result...) leaves the span's status unset.
# UNKNOWN, DEADLINE_EXCEEDED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE, DATA_LOSS:
_SERVER_FAULTS = frozenset({2, 4, 12, 13, 14, 15})
# Results that name who stands in the way: the span says who holds the subject, or who answered it.
_HOLDER_RESULTS = frozenset({"held", "already_replied"})


class _Observer(Protocol):
    def etcd_call(self, method: str, seconds: float, error: str | None) -> None: ...


def _version() -> str:
    try:
        from inbox_wire import VERSION
    except ImportError:  # pragma: no cover - the wire package ships with the coordinator
        return ""
    return VERSION


def start(settings: TraceSettings) -> Tracing:
    """A TracerProvider of this process's own (never OpenTelemetry's global one: a coordinator embedded in a
    program leaves that program's tracing alone), exporting through a BatchSpanProcessor: a span is queued on
    the call's path and sent by a thread of the SDK, so a receiver that is slow, wrong or down never slows a call
    (the queue drops what does not fit, OTEL_BSP_MAX_QUEUE_SIZE)."""
    resource = Resource.create({"service.version": _version()})
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
    # The sampler comes from OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG (TracerProvider reads them).
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    for exporter in settings.exporters:
        provider.add_span_processor(_processor(exporter, settings.protocol))
    tracing = Tracing(provider)
    tracing.destination = ", ".join(_destination(exporter, settings.protocol) for exporter in settings.exporters)
    tracing.destination += f", as service {resource.attributes.get('service.name')}"
    log.info(
        "traces: on, %s",
        tracing.destination,
        extra={"fields": {"event": "traces", "exporters": list(settings.exporters), "protocol": settings.protocol}},
    )
    return tracing


def _destination(exporter: str, protocol: str) -> str:
    """Where spans go, as the SDK's exporter reads the environment (for the banner and the log)."""
    if exporter == "console":
        return "to stdout (console)"
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if not endpoint:
        base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if protocol == "grpc":
            endpoint = base or "http://localhost:4317"
        else:
            endpoint = (base.rstrip("/") + "/v1/traces") if base else "http://localhost:4318/v1/traces"
    return f"OTLP {protocol} to {endpoint}"


def _processor(exporter: str, protocol: str) -> SpanProcessor:
    chosen: SpanExporter
    if exporter == "console":
        chosen = ConsoleSpanExporter()
    elif protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        chosen = GrpcExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        chosen = HttpExporter()
    return BatchSpanProcessor(chosen)


class CallSpan:
    """One call's span while it is the current one (its context attached until :meth:`Tracing.call_ended`)."""

    __slots__ = ("span", "token")

    def __init__(self, span: Span, token: Token[otel_context.Context]) -> None:
        self.span = span
        self.token = token


class Tracing:
    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.destination = ""
        """Where the spans go, said in the banner."""
        self.tracer = provider.get_tracer("inbox-coordinator", _version())

    def close(self, timeout_s: float) -> None:
        """Flushes and shuts the exporters down on a thread of its own, waiting for it at most ``timeout_s``: the
        SDK's exporter retries a receiver that is down for up to its own timeout (OTEL_EXPORTER_OTLP_TIMEOUT)."""
        done = threading.Thread(target=self.provider.shutdown, name="traces shutdown", daemon=True)
        done.start()
        done.join(timeout_s)
        if done.is_alive():
            log.warning("traces: the exporter did not finish within %g s; the spans left are dropped", timeout_s)

    # -- calls -------------------------------------------------------------------------------------------

    def call_started(self, path: str, metadata: Iterable[tuple[str, Any]] | None, face: str) -> CallSpan | None:
        """The span of a call arriving with ``metadata`` (gRPC metadata, or the HTTP face's headers: lower-case
        names), made current; None when it is not sampled (then nothing below it records either)."""
        carrier = {key: value for key, value in metadata or () if key in _TRACE_HEADERS and isinstance(value, str)}
        parent = _PROPAGATOR.extract(carrier, context=_EMPTY) if carrier else _EMPTY
        service, _, method = path.lstrip("/").rpartition("/")
        span = self.tracer.start_span(
            path.lstrip("/"),
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"rpc.system": face, "rpc.service": service, "rpc.method": method},
        )
        if not span.is_recording():
            return None
        return CallSpan(span, otel_context.attach(trace.set_span_in_context(span)))

    def call_ended(
        self, call: CallSpan, request: Any, code: int, result: str, response: Any, *, principal: str = ""
    ) -> None:
        span = call.span
        _describe(span, request, code, result, response)
        if principal:
            span.set_attribute("inbox.principal", principal)
        otel_context.detach(call.token)
        span.end()

    @staticmethod
    def exemplar(call: CallSpan | None) -> dict[str, str] | None:
        """The labels of a Prometheus exemplar for the call's metrics: its trace and span ids."""
        if call is None:
            return None
        context = call.span.get_span_context()
        return {"trace_id": f"{context.trace_id:032x}", "span_id": f"{context.span_id:016x}"}

    def refused(self, reason: str, retry_after_ms: int | None) -> None:
        """The error reason of the call being answered (RATE_LIMITED, REQUEST_ID_REUSED, ...), on its span; with
        RATE_LIMITED, how long the rate limiter asks the caller to wait."""
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attribute("inbox.reason", reason)
            if retry_after_ms is not None:
                span.set_attribute("inbox.retry_after_ms", retry_after_ms)

    def batch_carries(self, calls: Sequence[Any]) -> None:
        """Links the current span (a Batch's) to the context each of its calls carries."""
        span = trace.get_current_span()
        if not span.is_recording():
            return
        span.set_attribute("inbox.batch.calls", len(calls))
        for call in calls:
            context = _carried_context(call)
            if context is not None:
                span.add_link(context)

    def carried_started(self, path: str, call: Any) -> CallSpan | None:
        """The span of one call a Batch carried: the child of the context its BatchCall carries (else of the
        Batch's span), linked to the Batch's span, made current in the task that runs it."""
        batch = trace.get_current_span()
        carried = _carried_context(call)
        parent = trace.set_span_in_context(trace.NonRecordingSpan(carried)) if carried is not None else None
        service, _, method = path.lstrip("/").rpartition("/")
        links = [Link(batch.get_span_context())] if carried is not None and batch.is_recording() else None
        span = self.tracer.start_span(
            path.lstrip("/"),
            context=parent,
            kind=SpanKind.SERVER,
            links=links,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method, "inbox.batched": True},
        )
        if not span.is_recording():
            return None
        return CallSpan(span, otel_context.attach(trace.set_span_in_context(span)))

    # -- the store -----------------------------------------------------------------------------------------

    def observe_etcd(self, inner: _Observer) -> _Observer:
        """``inner`` (the metrics), and a span for every etcd request, as long as it took."""
        return _TracedObserver(self.tracer, inner)

    def transaction_started(self) -> Span | None:
        """A transaction queued for the group commit: its span, under the current one (None when not sampled)."""
        if not trace.get_current_span().is_recording():
            return None
        return self.tracer.start_span("etcd transaction", kind=SpanKind.INTERNAL)

    @staticmethod
    def transaction_ended(span: Span, error: BaseException | None) -> None:
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        span.end()

    @contextlib.contextmanager
    def sending(self, spans: Sequence[Span | None]) -> Iterator[None]:
        """While one etcd request carries the transactions of ``spans`` (None: not sampled): alone, it runs as
        its transaction's child; together, under one ``etcd group commit`` span linked to each of them."""
        sampled = [span for span in spans if span is not None]
        for span in sampled:
            span.add_event("sent", {"inbox.group_commit.transactions": len(spans)})
        if not sampled:
            yield
            return
        if len(spans) == 1:
            token = otel_context.attach(trace.set_span_in_context(sampled[0]))
            try:
                yield
            finally:
                otel_context.detach(token)
            return
        shared = self.tracer.start_span(
            "etcd group commit",
            context=trace.set_span_in_context(sampled[0]),
            kind=SpanKind.INTERNAL,
            links=[Link(span.get_span_context()) for span in sampled],
            attributes={"inbox.group_commit.transactions": len(spans)},
        )
        for span in sampled[1:]:
            span.add_link(shared.get_span_context())
        token = otel_context.attach(trace.set_span_in_context(shared))
        try:
            yield
        except BaseException as error:
            shared.set_status(Status(StatusCode.ERROR, type(error).__name__))
            raise
        finally:
            otel_context.detach(token)
            shared.end()


def _carried_context(call: Any) -> trace.SpanContext | None:
    traceparent = getattr(call, "traceparent", "")
    if not traceparent:
        return None
    carrier = {TRACEPARENT: traceparent}
    if call.tracestate:
        carrier[TRACESTATE] = call.tracestate
    context = trace.get_current_span(_PROPAGATOR.extract(carrier, context=_EMPTY)).get_span_context()
    return context if context.is_valid else None


class _TracedObserver:
    def __init__(self, tracer: trace.Tracer, inner: _Observer) -> None:
        self._tracer = tracer
        self._inner = inner

    def etcd_call(self, method: str, seconds: float, error: str | None) -> None:
        self._inner.etcd_call(method, seconds, error)
        if not trace.get_current_span().is_recording():
            return
        name = method.removesuffix("Request")
        ended = time.time_ns()
        span = self._tracer.start_span(
            f"etcd {name}",
            kind=SpanKind.CLIENT,
            start_time=ended - int(seconds * 1e9),
            attributes={"db.system.name": "etcd", "db.operation.name": name},
        )
        if error is not None:
            span.set_attribute("error.type", error)
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=ended)


# -- what a request and a response say about a call ------------------------------------------------------------


def _describe(span: Span, request: Any, code: int, result: str, response: Any) -> None:
    span.set_attribute("rpc.grpc.status_code", code)
    span.set_attribute("inbox.result", result)
    if code in _SERVER_FAULTS:
        span.set_status(Status(StatusCode.ERROR, result))
    span.set_attributes(request_attributes(request))
    if result in _HOLDER_RESULTS and response is not None:
        status = getattr(response, "status", None)
        if status is not None and status.DESCRIPTOR.fields_by_name.get("holder") is not None and status.holder:
            span.set_attribute("inbox.holder", status.holder)
            span.set_attribute("inbox.holder.kind", enum_label(status, "holder_kind"))
