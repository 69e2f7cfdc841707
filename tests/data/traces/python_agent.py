"""An agent as its developer writes it, traced with OpenTelemetry's SDK (exporting OTLP/HTTP to the receiver named
on the command line), calling a coordinator with the Python client: tests/client/test_client_traces.py runs it
and reads the trace ids it prints."""

import asyncio
import json
import sys

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from inbox_claims import AsyncCoordinator, Coordinator, Subject

endpoint, target, mailbox = sys.argv[1:4]
provider = TracerProvider(resource=Resource.create({"service.name": "python-agent"}))
provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces")))
trace.set_tracer_provider(provider)
tracer = trace.get_tracer("agent")
out = {}


def trace_id() -> str:
    return f"{trace.get_current_span().get_span_context().trace_id:032x}"


async def main() -> None:
    async with AsyncCoordinator(target, principal="agent-1") as coord:
        with tracer.start_as_current_span("answer notification (async)"):
            subject = Subject.message(mailbox, "async-1")
            claim = await coord.claim(subject, ttl=30)
            await coord.begin_send(subject, claim.token)
            await coord.confirm_sent(subject, claim.token, "sent-1")
            out["async"] = trace_id()

        async def one(index: int) -> str:
            with tracer.start_as_current_span(f"answer notification {index}"):
                assert (await coord.claim(Subject.message(mailbox, f"batched-{index}"), ttl=30)).granted
                return trace_id()

        out["batched"] = await asyncio.gather(*(one(index) for index in range(8)))


asyncio.run(main())
with Coordinator(target, principal="agent-1") as coord, tracer.start_as_current_span("answer notification (sync)"):
    subject = Subject.message(mailbox, "sync-1")
    claim = coord.claim(subject, ttl=30)
    coord.begin_send(subject, claim.token)
    coord.confirm_sent(subject, claim.token, "sent-1")
    out["sync"] = trace_id()
provider.shutdown()
print(json.dumps(out))
