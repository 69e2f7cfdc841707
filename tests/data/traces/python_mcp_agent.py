"""An agent calling MCP tools with the MCP SDK's own client (in memory), traced with OpenTelemetry's SDK exporting
OTLP/HTTP to the receiver named on the command line: a send through the guard in front of the fake email server,
and our server's claim_message then release_message, each turn under a span of the agent's own. Run from the
repository's root by tests/mcp/test_mcp_traces.py, which reads the trace ids it prints."""

import asyncio
import json
import sys

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from inbox_claims.mcp import SendTool
from tests.mcp import support
from tests.mcp.fake_email import SEND_TOOL, SEND_TOOL_SPEC, Outbox, a_reply, fake_email_server

endpoint, address, mailbox = sys.argv[1:4]
provider = TracerProvider(resource=Resource.create({"service.name": "mcp-agent"}))
provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces")))
trace.set_tracer_provider(provider)
tracer = trace.get_tracer("agent")


def trace_id() -> str:
    return f"{trace.get_current_span().get_span_context().trace_id:032x}"


async def main() -> dict[str, object]:
    out: dict[str, object] = {}
    outbox = Outbox()
    tools = [SendTool.parse(SEND_TOOL_SPEC)]
    async with support.guarded(address, "agent-1", fake_email_server(outbox), tools) as client:
        with tracer.start_as_current_span("agent turn: send through the guard"):
            result = await client.call_tool(SEND_TOOL, a_reply(mailbox, "mcp-1"))
            out["guard"] = trace_id()
            out["guard_error"] = bool(result.is_error)
    out["sends"] = len(outbox.sends_for("mcp-1"))
    async with support.agent_session(address, "agent-2") as (client, _session):
        message = {"mailbox": mailbox, "message_id": "mcp-2"}
        summary = {"subject_line": "Refund for order 5521?", "sender": "dora.buyer@example.org"}
        with tracer.start_as_current_span("agent turn: claim"):
            claimed = await client.call_tool("claim_message", {**message, "summary": summary})
            out["claim"] = trace_id()
            out["claimed"] = (claimed.structured_content or {}).get("outcome")
        with tracer.start_as_current_span("agent turn: release"):
            released = await client.call_tool("release_message", message)
            out["release"] = trace_id()
            out["released"] = (released.structured_content or {}).get("outcome")
    return out


result = asyncio.run(main())
provider.shutdown()
print(json.dumps(result), flush=True)
