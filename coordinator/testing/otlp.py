"""A receiver of OpenTelemetry traces on loopback, for tests and benchmarks: OTLP over HTTP (``POST /v1/traces``,
binary protobuf, gzip or not) and over gRPC (``opentelemetry.proto.collector.trace.v1.TraceService/Export``),
each request decoded with the ``opentelemetry-proto`` package into :class:`ReceivedSpan` records.

::

    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.http_endpoint}  # or receiver.grpc_endpoint with grpc
        ...
        spans = receiver.wait_for(lambda spans: len(spans) >= 3)

Needs the ``opentelemetry-proto`` package (the development extra brings it).
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2

__all__ = ["OtlpReceiver", "ReceivedSpan"]

# Span kinds, as the OTLP enum numbers them.
KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    """The resource's service.name."""
    trace_id: str
    span_id: str
    parent_span_id: str
    """Empty for a root span."""
    name: str
    kind: str
    attributes: dict[str, Any]
    links: tuple[tuple[str, str], ...]
    """(trace id, span id) of each link."""
    events: tuple[tuple[str, dict[str, Any]], ...]
    status: int
    """0 unset, 1 ok, 2 error."""
    start_ns: int
    end_ns: int
    trace_state: str = ""
    resource: dict[str, Any] = field(default_factory=dict)


def _value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    if kind == "kvlist_value":
        return {item.key: _value(item.value) for item in value.kvlist_value.values}
    return getattr(value, kind) if kind is not None else None


def _attributes(items: Any) -> dict[str, Any]:
    return {item.key: _value(item.value) for item in items}


def decode(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    spans = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        service=str(resource.get("service.name", "")),
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        name=span.name,
                        kind=KINDS.get(span.kind, str(span.kind)),
                        attributes=_attributes(span.attributes),
                        links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
                        events=tuple((event.name, _attributes(event.attributes)) for event in span.events),
                        status=span.status.code,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        trace_state=span.trace_state,
                        resource=resource,
                    )
                )
    return spans


class OtlpReceiver:
    """Both endpoints, each on a free loopback port, served by threads of their own; every span received is in
    :attr:`spans` (in arrival order). :meth:`stop` closes both: an exporter then finds nothing listening."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._changed = threading.Condition()
        self.requests = {"http": 0, "grpc": 0}
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self._body()
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_error(404 if self.path != "/v1/traces" else 415)
                    return
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                receiver._received("http", decode(request))
                answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() != "chunked":
                    return self.rfile.read(int(self.headers.get("Content-Length") or 0))
                chunks = []
                while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # the trailers, if any
                    pass
                return b"".join(chunks)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http.daemon_threads = True
        self._http_thread = threading.Thread(target=self._http.serve_forever, name="otlp http", daemon=True)

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(
                self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
            ) -> trace_service_pb2.ExportTraceServiceResponse:
                receiver._received("grpc", decode(request))
                return trace_service_pb2.ExportTraceServiceResponse()

        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._grpc)  # type: ignore[no-untyped-call]
        self.grpc_port = self._grpc.add_insecure_port("127.0.0.1:0")
        self.http_port = int(self._http.server_address[1])
        self._stopped = False

    @property
    def http_endpoint(self) -> str:
        """OTEL_EXPORTER_OTLP_ENDPOINT for http/protobuf (the exporter appends /v1/traces)."""
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_endpoint(self) -> str:
        """OTEL_EXPORTER_OTLP_ENDPOINT for grpc."""
        return f"http://127.0.0.1:{self.grpc_port}"

    def start(self) -> OtlpReceiver:
        self._http_thread.start()
        self._grpc.start()
        return self

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._grpc.stop(None)
        self._http.shutdown()
        self._http.server_close()

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _received(self, protocol: str, spans: list[ReceivedSpan]) -> None:
        with self._changed:
            self.requests[protocol] += 1
            self._spans.extend(spans)
            self._changed.notify_all()

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._changed:
            return list(self._spans)

    def wait_for(self, enough: Callable[[list[ReceivedSpan]], bool], timeout: float = 30.0) -> list[ReceivedSpan]:
        """Every span received, once ``enough`` says they are; AssertionError with what came when they never are."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not enough(self._spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({f"{span.service}: {span.name}" for span in self._spans})
                    raise AssertionError(f"the spans awaited never came within {timeout:g} s; received: {names}")
                self._changed.wait(left)
            return list(self._spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [span for span in self.spans if span.trace_id == trace_id]


@contextlib.contextmanager
def black_hole(port: int = 0) -> Iterator[int]:
    """A listener on loopback that accepts connections and never answers (a receiver that hangs): its port."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(64)
    accepted: list[socket.socket] = []
    stopping = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stopping.is_set():
            with contextlib.suppress(OSError):
                accepted.append(server.accept()[0])

    thread = threading.Thread(target=accept, name="otlp black hole", daemon=True)
    thread.start()
    try:
        yield int(server.getsockname()[1])
    finally:
        stopping.set()
        thread.join()
        for connection in accepted:
            connection.close()
        server.close()


def _more_than(count: int, closed: threading.Event, spans: list[ReceivedSpan]) -> bool:
    return len(spans) > count or closed.is_set()


def main() -> None:
    """``python -m coordinator.testing.otlp``: a receiver for tests in other languages (the Node client's). Prints
    ``otlp <http endpoint> <grpc endpoint>``, then every span received as one JSON line, until stdin closes."""
    import dataclasses
    import json
    import sys

    printed = 0
    with OtlpReceiver() as receiver:
        print(f"otlp {receiver.http_endpoint} {receiver.grpc_endpoint}", flush=True)
        closed = threading.Event()

        def read_stdin() -> None:
            if sys.stdin is not None:
                sys.stdin.read()
            closed.set()

        threading.Thread(target=read_stdin, daemon=True).start()
        while not closed.is_set():
            spans = receiver.wait_for(functools.partial(_more_than, printed, closed), timeout=3600)
            for span in spans[printed:]:
                print(json.dumps(dataclasses.asdict(span)), flush=True)
            printed = len(spans)


if __name__ == "__main__":
    main()
