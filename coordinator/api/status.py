"""Error statuses with machine-readable details: a ``google.rpc.Status`` in the ``grpc-status-details-bin``
trailer (read it with grpcio-status' ``rpc_status.from_call``, or any gRPC library's status-details support)
carrying an ``ErrorInfo`` whose ``reason`` names the error kind, and a ``RetryInfo`` when the server knows
when a retry can succeed. The ``retry-after-ms`` trailer says the same as RetryInfo for clients that predate
the details (the Python client reads it)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NoReturn

import grpc
from google.protobuf.duration_pb2 import Duration
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from coordinator import tracing
from coordinator.core.errors import (
    CoordinatorError,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    SlowConsumer,
    StoreConflict,
    StoreUnavailable,
    Unauthenticated,
)
from inbox_wire import RETRY_AFTER_METADATA

DOMAIN = "inbox-coordinator"
# What a caller is told about a bug (an exception the servicer did not expect): never the exception itself.
INTERNAL_REASON = "INTERNAL"
INTERNAL_ERROR_MESSAGE = "internal error; the coordinator logged it (search its log for this call)"

Trailers = tuple[tuple[str, str | bytes], ...]

# The reason of a call cut off by the server's call deadline (--call-deadline).
CALL_DEADLINE_REASON = "CALL_DEADLINE"

_STATUS_CODES: dict[type[CoordinatorError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    StoreUnavailable: grpc.StatusCode.UNAVAILABLE,
    StoreConflict: grpc.StatusCode.ABORTED,
    SlowConsumer: grpc.StatusCode.ABORTED,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def status_code(error: CoordinatorError) -> grpc.StatusCode:
    """The status of the nearest class in ``error``'s hierarchy that has one: a new subclass answers as its
    parent does instead of falling through."""
    for cls in type(error).__mro__:
        code = _STATUS_CODES.get(cls)
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL


def deadline_message(deadline: float) -> str:
    return f"the call ran past the server's limit of {deadline:g} s; retry it with the same request id"


def error_trailers(
    code: grpc.StatusCode,
    message: str,
    reason: str,
    *,
    retry_after_ms: int | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Trailers:
    """The trailing metadata of an error status: its details, and ``retry-after-ms`` when there is a hint."""
    status = status_pb2.Status(code=code.value[0], message=message)
    status.details.add().Pack(error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=metadata or {}))
    trailers: list[tuple[str, str | bytes]] = []
    if retry_after_ms is not None:
        delay = Duration()
        delay.FromMilliseconds(retry_after_ms)
        status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        trailers.append((RETRY_AFTER_METADATA, str(retry_after_ms)))
    trailers.extend(rpc_status.to_status(status).trailing_metadata)
    return tuple(trailers)


def retry_after_ms(error: CoordinatorError) -> int | None:
    return math.ceil(error.retry_after_s * 1000) if isinstance(error, ResourceExhausted) else None


def error_metadata(error: CoordinatorError) -> dict[str, str]:
    return {"field": error.field} if isinstance(error, InvalidArgument) else {}


async def abort(
    context: grpc.aio.ServicerContext[Any, Any],
    code: grpc.StatusCode,
    message: str,
    reason: str,
    *,
    retry_after_ms: int | None = None,
    metadata: Mapping[str, str] | None = None,
) -> NoReturn:
    """Ends the call with ``code`` and ``message``, and the details that name ``reason``."""
    traces = tracing.active
    if traces is not None:
        traces.refused(reason, retry_after_ms)
    trailers = error_trailers(code, message, reason, retry_after_ms=retry_after_ms, metadata=metadata)
    await context.abort(code, message, trailing_metadata=trailers)
    raise AssertionError("grpc's abort() returned")  # it raises; this satisfies NoReturn
