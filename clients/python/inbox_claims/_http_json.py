"""The coordinator's HTTP/JSON face for the clients' unary calls (``protocol="http-json"``): a call as a Connect
request with a JSON body (the same method, request and metadata as over gRPC, its trace context in its
``traceparent`` header), and its answer, or its error as the gRPC path gives it (:class:`RpcFailure`). The clients
only send it, with httpx, blocking or asyncio (docs/client.md#over-http-json)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import grpc
from google.protobuf import json_format, message_factory

from inbox_wire import RETRY_AFTER_METADATA
from inbox_wire.v1 import coordinator_pb2 as pb

from ._effects import Rpc, RpcFailure
from ._options import ClientOptions

__all__ = ["HttpRequest", "answer", "failed", "httpx_module", "request"]

_SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"]
_RESPONSES: dict[str, Any] = {}
# Connect's HTTP statuses of an error without a readable body (https://connectrpc.com/docs/protocol#error-codes).
_BY_HTTP_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.UNIMPLEMENTED,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    409: grpc.StatusCode.ABORTED,
    412: grpc.StatusCode.FAILED_PRECONDITION,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.UNAVAILABLE,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.UNAVAILABLE,
}

HttpRequest = tuple[str, dict[str, str], bytes]
"""The URL, the headers and the body of one call."""


def httpx_module() -> Any:
    """httpx, which ``protocol="http-json"`` sends with (an optional dependency, as for the providers)."""
    try:
        import httpx
    except ImportError:  # pragma: no cover - the development extra has it
        raise ImportError("protocol='http-json' needs httpx: pip install 'inbox-coordinator[nylas]'") from None
    return httpx


def request(options: ClientOptions, effect: Rpc) -> HttpRequest:
    url = f"{options.http_base_url}/{_SERVICE.full_name}/{effect.method}"
    headers = {
        "content-type": "application/json",
        "connect-protocol-version": "1",
        "connect-timeout-ms": str(max(int(effect.timeout * 1000), 1)),
        **dict(options.metadata),
        **dict(effect.metadata),
    }
    return url, headers, json_format.MessageToJson(effect.request, indent=None).encode("utf-8")


def answer(method: str, status: int, headers: Mapping[str, str], body: bytes) -> Any:
    """The response message of a 200, or the :class:`RpcFailure` of anything else (raised)."""
    if status == 200:
        response = _RESPONSES.get(method)
        if response is None:
            response = _RESPONSES[method] = message_factory.GetMessageClass(
                _SERVICE.methods_by_name[method].output_type
            )
        return json_format.Parse(body, response(), ignore_unknown_fields=True)
    code, message = _BY_HTTP_STATUS.get(status, grpc.StatusCode.UNKNOWN), f"HTTP {status}"
    try:
        document = json.loads(body)
        code = grpc.StatusCode[str(document["code"]).upper()]
        message = str(document.get("message", ""))
    except (ValueError, KeyError, TypeError):
        pass  # not Connect's error body (a proxy's page): the HTTP status says what it can
    retry_after = None
    value = headers.get(RETRY_AFTER_METADATA)
    if value is not None and value.isdigit():
        retry_after = int(value) / 1000
    raise RpcFailure(code, message, retry_after)


def failed(error: Exception) -> RpcFailure:
    """A call that got no answer: timed out (DEADLINE_EXCEEDED) or not connected (UNAVAILABLE), retried as over
    gRPC."""
    httpx = httpx_module()
    if isinstance(error, httpx.TimeoutException):
        return RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer in time: {error}")
    return RpcFailure(grpc.StatusCode.UNAVAILABLE, f"the coordinator's HTTP face could not be reached: {error}")
