"""Counts, times and logs every call, knowing nothing of the servicer.

Not a grpc interceptor: each method handler is wrapped once, when the servicers are registered (``register_on``),
because grpc.aio's interceptor path costs every call ~10 µs before any interceptor code runs and takes calls off
the registered-method fast path (docs/performance.md, "Per-call cost": the observer as an interceptor cost an
empty handler 35 µs a call, wrapped at registration nothing measurable).

The result label is read from the response message's ``result`` field, whatever the message: an enum value
name without its type's prefix, lower-cased (``GRANTED`` is ``granted``, ``FENCE_RESULT_STALE_TOKEN`` is
``stale_token``); a response without one is ``ok``, an error is its status code (``unavailable``). The log
fields come from the request the same way: ``request_id``, ``subject.mailbox`` or ``mailbox``, ``subject.id``.

It also reads each call's request message itself, under a deadline: grpc would wait for it forever, holding
the call's memory (a client, or an attacker, can open a stream and never send). Unary and server-streaming
handlers are served as request-streaming ones, whose handler starts before the message arrives; the wire
format is the same, so clients see no difference.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import grpc
from google.protobuf.message import DecodeError

from coordinator import tracing
from coordinator.api.auth import current_principal
from coordinator.api.encoded import writes_encoded
from coordinator.api.status import INTERNAL_ERROR_MESSAGE, INTERNAL_REASON, abort
from inbox_wire import PRINCIPAL_METADATA
from inbox_wire.spans import result_label

log = logging.getLogger("inbox_coordinator.rpc")

# Services whose calls are logged at DEBUG: probes every few seconds would drown everything else.
_QUIET_SERVICES = frozenset({"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"})
_CLIENT_CODES = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
_ROUTINE_CODES = frozenset({grpc.StatusCode.OK, grpc.StatusCode.CANCELLED})
_SERVER_TROUBLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
_CODES_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


_field_readers: dict[str, Callable[[Any], dict[str, str]]] = {}


def request_fields(request: Any) -> dict[str, str]:
    """request_id, mailbox and subject id of a request, for whichever of them its message has."""
    descriptor = getattr(request, "DESCRIPTOR", None)
    if descriptor is None:
        return {}
    reader = _field_readers.get(descriptor.full_name)
    if reader is None:
        reader = _field_readers[descriptor.full_name] = _fields_reader(descriptor)
    return reader(request)


def _fields_reader(descriptor: Any) -> Callable[[Any], dict[str, str]]:
    names = descriptor.fields_by_name
    has_request_id = "request_id" in names
    has_mailbox = "mailbox" in names
    subject = names.get("subject")
    has_subject = (
        subject is not None and subject.message_type is not None and "mailbox" in subject.message_type.fields_by_name
    )

    def read(request: Any) -> dict[str, str]:
        fields: dict[str, str] = {}
        if has_request_id:
            fields["request_id"] = request.request_id
        if has_subject and request.HasField("subject"):
            fields["mailbox"] = request.subject.mailbox
            fields["subject_id"] = request.subject.id
        elif has_mailbox:
            fields["mailbox"] = request.mailbox
        return fields

    return read


def _code_of(error: BaseException, context: grpc.aio.ServicerContext[Any, Any]) -> grpc.StatusCode:
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return grpc.StatusCode.CANCELLED
    if isinstance(error, grpc.aio.AbortError):
        return _set_code(context) or grpc.StatusCode.UNKNOWN
    return grpc.StatusCode.UNKNOWN  # what grpc answers for an exception the servicer let through


def _set_code(context: grpc.aio.ServicerContext[Any, Any]) -> grpc.StatusCode | None:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(code, int):
        return next((c for c in grpc.StatusCode if c.value[0] == code), None)
    return None


UNDECODABLE_REASON = "UNDECODABLE_REQUEST"
REQUEST_TIMEOUT_REASON = "REQUEST_TIMEOUT"
MISSING_REQUEST_REASON = "MISSING_REQUEST"


@dataclass(frozen=True)
class Undecodable:
    """Stands in for a request whose bytes did not parse, so that the call is answered INVALID_ARGUMENT, counted
    and logged like any refused call (grpc would answer UNKNOWN, naming the Python exception, and count
    nothing)."""

    problem: str


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None
    descriptor = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    message = descriptor.full_name if descriptor is not None else "the request message"

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as error:
            if "UTF-8" in str(error):
                return Undecodable(
                    f"the request ({message}) has a string field that is not valid UTF-8; send every string as "
                    "UTF-8 (a string cut inside a multi-byte character or a UTF-16 surrogate pair is not)"
                )
            return Undecodable(
                f"the request is not a valid protobuf encoding of {message}; send the message that "
                "proto/inbox/coordinator/v1/coordinator.proto defines for this method"
            )

    return deserialize


async def _read_request(context: grpc.aio.ServicerContext[Any, Any], timeout_s: float) -> Any:
    """The call's one request message, or an error status when it is not there within ``timeout_s``."""
    task = asyncio.current_task()
    assert task is not None
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    # One timer handle, not asyncio.timeout(): this runs on every call of the hot path.
    timer = asyncio.get_running_loop().call_later(timeout_s, expire)
    try:
        request = await context.read()
    except asyncio.CancelledError:
        if not expired:
            raise  # the client went away, or the server is stopping
        task.uncancel()
        await abort(
            context,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"the request message did not arrive within {timeout_s:g} s of the call's start; a gRPC client sends "
            "it at once, so look for a stalled client or proxy",
            REQUEST_TIMEOUT_REASON,
        )
    finally:
        timer.cancel()
    if request is grpc.aio.EOF:
        await abort(
            context,
            grpc.StatusCode.INVALID_ARGUMENT,
            "the call ended without its request message; send exactly one",
            MISSING_REQUEST_REASON,
        )
    if isinstance(request, Undecodable):
        await abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.problem, UNDECODABLE_REASON)
    return request


async def _internal_error(method: _Method, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    """A bug: logged with its traceback here, answered INTERNAL with no Python detail."""
    log.exception("%s failed with an unexpected error", method.name)
    await abort(context, grpc.StatusCode.INTERNAL, INTERNAL_ERROR_MESSAGE, INTERNAL_REASON)


class _Labelled(Protocol):
    def labels(self, *values: str) -> Any: ...


class CallMetrics(Protocol):
    """The metric families every call feeds, by its labels (coordinator.ops.metrics.Metrics has them): calls by
    service, method and result; their duration; those in flight."""

    @property
    def rpcs(self) -> _Labelled: ...

    @property
    def rpc_seconds(self) -> _Labelled: ...

    @property
    def rpcs_in_flight(self) -> _Labelled: ...


@dataclass
class _Method:
    service: str
    name: str
    quiet: bool
    counted: dict[str, Any]
    timed: Any
    in_flight: Any
    routine_level: int  # for an OK or CANCELLED call
    face: str = "grpc"  # the span's rpc.system: grpc, or connect_rpc for the HTTP/JSON face
    path: str = ""  # service/method: the span's name


class RpcObserver:
    """Metrics and one access-log line per call."""

    def __init__(self, metrics: CallMetrics, request_timeout_s: float = 10.0, *, access_log: bool = False) -> None:
        self._metrics = metrics
        # Answered and cancelled calls are the bulk: at info only when asked for (a line per call is costly).
        self._routine_level = logging.INFO if access_log else logging.DEBUG
        self._request_timeout_s = request_timeout_s
        self._batched: dict[str, _Method] = {}

    def register_on(self, server: grpc.aio.Server) -> grpc.aio.Server:
        """What to pass, in the server's place, to the generated ``add_*Servicer_to_server`` functions and to
        reflection: they register handlers wrapped by this observer. (Typed as the server because those
        functions ask for one; they only call the two registering methods it has.)"""
        return cast(grpc.aio.Server, _ObservedRegistry(self, server))

    def wrap_handler(self, path: str, handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
        return self._wrap(path, handler)

    def batch_call(
        self,
        path: str,
        request: Any,
        response: Any,
        error: Any,
        seconds: float,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        """One call carried by a Batch (``path``: its unary RPC's): counted, timed and logged as that RPC."""
        observed = self._batched.get(path)
        if observed is None:
            observed = self._batched[path] = self._method(path)
        code = _CODES_BY_NUMBER.get(error.code, grpc.StatusCode.UNKNOWN) if error is not None else grpc.StatusCode.OK
        details = error.message if error is not None else ""
        _record(self._metrics, observed, request, context, code, response, details, seconds, timed=True)

    def observe(self, path: str, inner: Callable[..., Any], *, streaming: bool = False) -> Callable[..., Any]:
        """``inner``, the servicer's method of ``path``, counted, timed and logged as a gRPC call to it is: for
        the HTTP face, whose calls reach the same methods. ``streaming``: a server stream written with
        ``context.write`` (Watch), not timed as a call."""
        method = self._method(path, face="connect_rpc")
        if inspect.isasyncgenfunction(inner):
            return self._stream(method, inner)
        return self._unary(method, inner, timed=not streaming)

    def _method(self, path: str, face: str = "grpc") -> _Method:
        service, _, name = path.lstrip("/").rpartition("/")
        return _Method(
            face=face,
            path=f"{service}/{name}",
            service=service,
            name=name,
            quiet=service in _QUIET_SERVICES,
            counted={},
            timed=self._metrics.rpc_seconds.labels(service, name),
            in_flight=self._metrics.rpcs_in_flight.labels(service, name),
            routine_level=logging.DEBUG if service in _QUIET_SERVICES else self._routine_level,
        )

    def _wrap(self, path: str, handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
        method = self._method(path)
        deserializer = _tolerant(handler.request_deserializer)
        if handler.unary_unary is not None and inspect.iscoroutinefunction(handler.unary_unary):
            return grpc.stream_unary_rpc_method_handler(
                self._unary(method, handler.unary_unary, timed=True),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            return grpc.stream_stream_rpc_method_handler(
                self._stream(method, handler.unary_stream),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None and inspect.iscoroutinefunction(handler.unary_stream):
            return grpc.stream_stream_rpc_method_handler(
                self._unary(method, handler.unary_stream, timed=False),  # a stream written with context.write
                request_deserializer=deserializer,
                response_serializer=writes_encoded(handler.response_serializer),
            )
        return handler  # client-streaming calls (reflection) pass through untouched

    def _unary(
        self, method: _Method, inner: Callable[..., Awaitable[Any]], *, timed: bool
    ) -> Callable[..., Awaitable[Any]]:
        async def call(_requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            with _Observed(self._metrics, method, context, timed=timed) as observed:
                observed.request = request = await _read_request(context, self._request_timeout_s)
                try:
                    observed.response = await inner(request, context)
                except (grpc.aio.AbortError, asyncio.CancelledError):
                    raise
                except Exception:
                    await _internal_error(method, context)
                return observed.response

        return call

    def _stream(self, method: _Method, inner: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
        async def call(_requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            with _Observed(self._metrics, method, context, timed=False, traced=False) as observed:
                observed.sent = 0
                observed.request = request = await _read_request(context, self._request_timeout_s)
                try:
                    async for item in inner(request, context):
                        yield item
                        observed.sent += 1
                except (grpc.aio.AbortError, asyncio.CancelledError, GeneratorExit):
                    raise
                except Exception:
                    await _internal_error(method, context)

        return call


class _ObservedRegistry:
    """Stands in for the server when servicers register: wraps each method handler once, then hands it on."""

    def __init__(self, observer: RpcObserver, server: grpc.aio.Server) -> None:
        self._observer = observer
        self._server = server

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        self._server.add_registered_method_handlers(
            service,
            {name: self._observer.wrap_handler(f"/{service}/{name}", handler) for name, handler in handlers.items()},
        )

    def add_generic_rpc_handlers(self, generic_handlers: Any) -> None:
        self._server.add_generic_rpc_handlers(
            tuple(_ObservedGenericHandler(self._observer, handler) for handler in generic_handlers)
        )


class _ObservedGenericHandler(grpc.GenericRpcHandler):
    """A generic handler's lookups, wrapped (grpc consults these for methods not registered by name)."""

    def __init__(self, observer: RpcObserver, inner: grpc.GenericRpcHandler) -> None:
        self._observer = observer
        self._inner = inner
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler[Any, Any], grpc.RpcMethodHandler[Any, Any]]] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None
        path = str(handler_call_details.method)
        cached = self._wrapped.get(path)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._observer.wrap_handler(path, handler)
        self._wrapped[path] = (handler, wrapped)
        return wrapped


class _Observed:
    """One call: in flight while inside; counted, timed and logged on the way out."""

    def __init__(
        self,
        metrics: CallMetrics,
        method: _Method,
        context: grpc.aio.ServicerContext[Any, Any],
        *,
        timed: bool,
        traced: bool = True,
    ) -> None:
        self._metrics = metrics
        self._method = method
        self._traced = traced
        self.request: Any = None  # until it arrived and parsed
        self._context = context
        self._timed = timed
        self.response: Any = None
        self.sent: int | None = None  # messages written, for a stream
        self._span: tracing.CallSpan | None = None

    def __enter__(self) -> _Observed:
        self._started = time.perf_counter()
        self._method.in_flight.inc()
        traces = tracing.active
        if traces is not None and self._traced and not self._method.quiet:
            self._span = traces.call_started(self._method.path, self._context.invocation_metadata(), self._method.face)
        return self

    def __exit__(self, _type: type[BaseException] | None, error: BaseException | None, _tb: object) -> None:
        self._method.in_flight.dec()
        seconds = time.perf_counter() - self._started
        code = _code_of(error, self._context) if error is not None else _set_code(self._context) or grpc.StatusCode.OK
        details = "" if code is grpc.StatusCode.OK else self._context.details() or ""
        response = self.response if code is grpc.StatusCode.OK else None
        traces = tracing.active
        span = self._span if traces is not None else None
        result = _record(
            self._metrics,
            self._method,
            self.request,
            self._context,
            code,
            response,
            details,
            seconds,
            timed=self._timed,
            sent=self.sent,
            exemplar=traces.exemplar(span) if traces is not None and span is not None else None,
        )
        if traces is not None and span is not None:
            traces.call_ended(span, self.request, code.value[0], result, response, principal=_principal(self._context))


def _record(
    metrics: CallMetrics,
    method: _Method,
    request: Any,
    context: grpc.aio.ServicerContext[Any, Any],
    code: grpc.StatusCode,
    response: Any,
    details: str,
    seconds: float,
    *,
    timed: bool,
    sent: int | None = None,
    exemplar: dict[str, str] | None = None,
) -> str:
    """Counts, times and logs one call, whether it came alone or in a Batch; its result label. ``exemplar``: the
    labels naming its trace, on its metrics (Prometheus shows them in the OpenMetrics exposition)."""
    if timed:
        method.timed.observe(seconds, exemplar)
    result = result_label(response) if code is grpc.StatusCode.OK and response is not None else code.name.lower()
    counter = method.counted.get(result)
    if counter is None:
        counter = method.counted[result] = metrics.rpcs.labels(method.service, method.name, result)
    counter.inc(1, exemplar)
    level = (
        logging.DEBUG
        if method.quiet
        else method.routine_level
        if code in _ROUTINE_CODES
        else logging.INFO
        if code in _CLIENT_CODES
        else logging.WARNING
        if code in _SERVER_TROUBLE
        else logging.ERROR
    )
    if not log.isEnabledFor(level):
        return result
    fields: dict[str, Any] = {
        "event": "rpc",
        "method": method.name,
        "code": code.name,
        "result": result,
        "duration_ms": round(seconds * 1000, 2),
    }
    if sent is not None:
        fields["messages"] = sent
    fields.update(request_fields(request))
    principal = _principal(context)
    if principal:
        fields["principal"] = principal
    fields["peer"] = context.peer()
    if code is not grpc.StatusCode.OK:
        fields["details"] = details
    log.log(level, "%s %s %s", method.name, code.name, result, extra={"fields": fields})
    return result


def _principal(context: grpc.aio.ServicerContext[Any, Any]) -> str:
    """Who made the call: as authenticated when the call got that far, else what its metadata claims."""
    authenticated = current_principal.get()
    if authenticated:
        return authenticated
    for key, value in context.invocation_metadata() or ():
        if key == PRINCIPAL_METADATA and isinstance(value, str):
            return value
    return ""
