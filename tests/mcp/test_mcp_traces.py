"""The MCP tools' traces (docs/mcp.md#traces): an agent's tool call, made with the MCP SDK's client under a span of
the agent's own, is one trace: the SDK's client span carries ``_meta.traceparent``, the SDK's server span
continues it, our ``inbox tool <name>`` span is beneath that, and beneath ours the claim, the client's calls, the
coordinator's spans and the store's; through the guard, the forwarded call to the email server too. A claim kept
across calls is linked from the later call. A real coordinator process on a real etcd, every span received by a
real OTLP receiver; the agent is a process of its own (tests/data/traces/python_mcp_agent.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from coordinator.store.etcd.process import EtcdServer
from coordinator.testing.otlp import OtlpReceiver, ReceivedSpan
from tests.helpers import new_request_id
from tests.tracing import COORDINATOR_SERVICE, assert_store_beneath, serve_traced

REPO = Path(__file__).resolve().parents[2]
AGENT = REPO / "tests" / "data" / "traces" / "python_mcp_agent.py"
MAILBOX = "mcp-traces@shop.example"
SERVICE = "inbox.coordinator.v1.Coordinator"


def one(spans: list[ReceivedSpan], name: str, **where: object) -> ReceivedSpan:
    found = [span for span in spans if span.name == name and all(getattr(span, k) == v for k, v in where.items())]
    assert len(found) == 1, f"{len(found)} spans {name!r} {where}: {sorted(span.name for span in spans)}"
    return found[0]


def servers(trace_id: str, count: int) -> Callable[[list[ReceivedSpan]], bool]:
    def enough(spans: list[ReceivedSpan]) -> bool:
        mine = [span for span in spans if span.trace_id == trace_id]
        return sum(span.kind == "SERVER" and span.service == COORDINATOR_SERVICE for span in mine) >= count

    return enough


def beneath(spans: list[ReceivedSpan], child: ReceivedSpan, parent: ReceivedSpan) -> bool:
    """Whether ``parent`` is ``child``'s parent, or its parent's (the SDK's client span, where its transport
    makes one: in memory it calls the server in the caller's context)."""
    by_id = {span.span_id: span for span in spans}
    up = by_id.get(child.parent_span_id)
    return child.parent_span_id == parent.span_id or (
        up is not None and up.name.startswith("MCP send ") and up.parent_span_id == parent.span_id
    )


def tool_span(spans: list[ReceivedSpan], trace_id: str, tool: str) -> ReceivedSpan:
    """The agent's span > the SDK's server span (which continued the request's context) > ours: one trace."""
    mine = [span for span in spans if span.trace_id == trace_id]
    (root,) = [span for span in mine if not span.parent_span_id]
    assert root.name.startswith("agent turn")
    (sdk_server,) = [span for span in mine if span.name == f"tools/call {tool}" and beneath(mine, span, root)]
    ours = one(mine, f"inbox tool {tool}", parent_span_id=sdk_server.span_id)
    assert ours.attributes["inbox.tool"] == tool
    assert ours.attributes["inbox.mailbox"] == MAILBOX
    return ours


def assert_calls_beneath(spans: list[ReceivedSpan], parent: ReceivedSpan, methods: list[str]) -> None:
    mine = [span for span in spans if span.trace_id == parent.trace_id]
    clients = [span for span in mine if span.kind == "CLIENT" and span.name.startswith(SERVICE)]
    assert sorted(span.name.rpartition("/")[2] for span in clients) == sorted(methods)
    for client in clients:
        assert client.parent_span_id == parent.span_id
        server = one(mine, client.name, kind="SERVER", parent_span_id=client.span_id)
        assert_store_beneath(spans, server)


def test_an_mcp_tool_call_is_one_trace_from_the_agent_to_etcd(shared_etcd: EtcdServer) -> None:
    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.grpc_endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
        with serve_traced(shared_etcd, f"test/mcp-traces-{new_request_id()}/", env) as (address, _http):
            agent = subprocess.run(
                [sys.executable, str(AGENT), receiver.http_endpoint, address, MAILBOX],
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
            assert agent.returncode == 0, agent.stderr
            out = json.loads(agent.stdout)
            assert out["guard_error"] is False
            assert out["sends"] == 1
            assert (out["claimed"], out["released"]) == ("granted", "released")
            receiver.wait_for(servers(out["guard"], 3))
            receiver.wait_for(servers(out["claim"], 2))
            spans = receiver.wait_for(lambda spans: any(span.trace_id == out["release"] for span in spans))

    # Through the guard: the send tool's call, the reply's span beneath ours, the forwarded call beneath the send.
    guard = tool_span(spans, out["guard"], "send_message")
    assert guard.attributes["inbox.subject.id"] == "mcp-1"
    assert guard.attributes["inbox.outcome"] == "ok"
    mine = [span for span in spans if span.trace_id == out["guard"]]
    reply = one(mine, "inbox reply", parent_span_id=guard.span_id)
    assert reply.attributes["inbox.outcome"] == "replied"
    assert reply.attributes["inbox.fencing_token"] > 0
    assert_calls_beneath(spans, reply, ["ClaimReply", "BeginSend", "ConfirmSent"])
    send = one(mine, "inbox send", parent_span_id=reply.span_id)
    upstream = [
        span for span in mine if span.name == "tools/call send_message" and span.span_id != guard.parent_span_id
    ]
    assert len(upstream) == 1, "the email server did not continue the forwarded call's trace"
    assert beneath(mine, upstream[0], send)

    # Our server: claim_message claims (the reply's span starts in that call); release_message, a later call in
    # another trace, releases it: its span links to the reply's, whose calls (the release's too) stay beneath it.
    claim = tool_span(spans, out["claim"], "claim_message")
    assert claim.attributes["inbox.outcome"] == "granted"
    claimed = [span for span in spans if span.trace_id == out["claim"]]
    reply = one(claimed, "inbox reply", parent_span_id=claim.span_id)
    assert_calls_beneath(spans, reply, ["ClaimReply", "ReleaseClaim"])
    assert reply.attributes["inbox.outcome"] == "released"
    release = tool_span(spans, out["release"], "release_message")
    assert release.attributes["inbox.outcome"] == "released"
    assert release.links == ((reply.trace_id, reply.span_id),)

    # The summary the agent gave is in no attribute of any span.
    for span in spans:
        for value in [*span.attributes.values(), *(v for _, attrs in span.events for v in attrs.values())]:
            assert not (isinstance(value, str) and ("5521" in value or "dora.buyer" in value)), (span.name, value)
