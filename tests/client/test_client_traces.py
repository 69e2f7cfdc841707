"""The Python client's traces (docs/client.md#traces): with OpenTelemetry in the agent, every call is a CLIENT span
under the agent's own, and carries its trace context to the coordinator, whose spans (and the store's beneath
them) join the same trace: one trace from the agent to etcd, through a real coordinator process on a real etcd,
every span received by a real OTLP receiver. Batched calls keep their own traces. Without OpenTelemetry, the
client sends no trace context at all."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.store.etcd.process import EtcdServer
from coordinator.testing.otlp import OtlpReceiver, ReceivedSpan
from inbox_claims import Coordinator, Subject, _tracing
from inbox_claims._effects import Rpc
from inbox_claims._guard import GuardState
from tests.helpers import new_request_id
from tests.tracing import COORDINATOR_SERVICE, assert_store_beneath, calls_traced, links_arrived, serve_traced

AGENT = Path(__file__).resolve().parents[1] / "data" / "traces" / "python_agent.py"


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as started:
        yield started


def assert_client_call_trace(spans: list[ReceivedSpan], trace_id: str, service: str, methods: list[str]) -> None:
    """Each call of ``methods``: the agent's CLIENT span under its root span, and beneath it the coordinator's
    SERVER span, and beneath that the store's spans."""
    mine = [span for span in spans if span.trace_id == trace_id]
    (root,) = [span for span in mine if not span.parent_span_id]
    assert root.service == service
    clients = [span for span in mine if span.kind == "CLIENT" and span.service == service]
    assert sorted(span.name.rpartition("/")[2] for span in clients) == sorted(methods)
    for client in clients:
        assert client.parent_span_id == root.span_id
        assert client.attributes["rpc.system"] == "grpc"
        assert client.attributes["inbox.mailbox"] == "traces@shop.example"
        (server,) = [span for span in mine if span.kind == "SERVER" and span.parent_span_id == client.span_id]
        assert server.service == COORDINATOR_SERVICE
        assert server.name == client.name
        assert server.attributes["inbox.request_id"] == client.attributes["inbox.request_id"]
        assert server.attributes["inbox.result"] == client.attributes["inbox.result"]
        assert_store_beneath(spans, server)


def test_python_client_calls_join_the_agents_trace_down_to_etcd(
    shared_etcd: EtcdServer, receiver: OtlpReceiver
) -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.grpc_endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    with serve_traced(shared_etcd, f"test/traces-{new_request_id()}/", env) as (address, _http):
        agent = subprocess.run(
            [sys.executable, str(AGENT), receiver.http_endpoint, address, "traces@shop.example"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert agent.returncode == 0, agent.stderr
        ids = json.loads(agent.stdout)
        cycle = ["ClaimReply", "BeginSend", "ConfirmSent"]
        for key in ("async", "sync"):
            spans = receiver.wait_for(calls_traced(ids[key], 3))
            assert_client_call_trace(spans, ids[key], "python-agent", cycle)
        # Eight concurrent claims through one client: sent together in Batch RPCs, each still in its own trace.
        for trace_id in ids["batched"]:
            receiver.wait_for(calls_traced(trace_id, 1))
            spans = receiver.wait_for(links_arrived)
            assert_client_call_trace(spans, trace_id, "python-agent", ["ClaimReply"])
        batched = [span for span in receiver.spans if span.attributes.get("inbox.batched") is True]
        assert {span.trace_id for span in batched} <= set(ids["batched"])
        assert batched, "the concurrent claims were never batched"
        assert receiver.requests["grpc"] > 0  # the coordinator's spans came over OTLP/gRPC
        assert receiver.requests["http"] > 0  # the agent's over OTLP/HTTP


def test_without_opentelemetry_the_client_sends_no_trace_context() -> None:
    """OpenTelemetry is an optional import: in a process where it cannot be imported, the client works and its
    calls carry only the client's own metadata."""
    script = (
        "from inbox_claims import _tracing\n"
        "from inbox_claims import Coordinator, Subject\n"
        "assert _tracing.trace is None\n"
        "flow = Coordinator(principal='agent-1')._core.claim(Subject.message('m', 'x'))\n"
        "rpc = next(flow)\n"
        "assert rpc.metadata == (), rpc.metadata\n"
    )
    assert_runs_untraced(script)


def test_with_opentelemetry_and_no_trace_the_client_sends_none_either() -> None:
    """OpenTelemetry installed but not set up by the application (no tracer provider, no current span): nothing
    to record or continue, nothing on the wire."""
    rpc = next(Coordinator(principal="agent-1")._core.claim(Subject.message("m", "x")))
    assert isinstance(rpc, Rpc)
    assert rpc.metadata == ()


def test_a_guarded_reply_without_a_trace_opens_no_span_and_sends_no_context() -> None:
    """OpenTelemetry installed, nothing set up and no span current: the guard's reply has no span, and its
    calls carry only the client's own metadata (docs/performance.md#traces measures what the check costs)."""
    state = GuardState.for_reply(
        Coordinator(principal="agent-1")._core, None, mailbox="m", message_id="x", thread_id=None,
        notification_id=None, scope="message", ttl=30, note="",
    )  # fmt: skip
    rpc = next(state.enter())
    assert isinstance(rpc, Rpc)
    assert rpc.method == "ClaimReply"
    assert rpc.metadata == ()
    assert state.trace is None
    assert _tracing.trace_headers() == {}


def test_without_opentelemetry_a_guarded_reply_and_its_adapters_work() -> None:
    """In a process where OpenTelemetry cannot be imported, the guard's cycle runs (no span, no context) and the
    providers' requests carry no trace header."""
    script = (
        "from inbox_claims import Coordinator, _tracing\n"
        "from inbox_claims._guard import GuardState\n"
        "state = GuardState.for_reply(Coordinator(principal='a')._core, None, mailbox='m', message_id='x',\n"
        "    thread_id=None, notification_id=None, scope='message', ttl=30, note='')\n"
        "rpc = next(state.enter())\n"
        "assert rpc.metadata == () and state.trace is None, (rpc.metadata, state.trace)\n"
        "assert _tracing.trace_headers() == {}\n"
        "with _tracing.traced_notification('nylas', 'POST') as note, _tracing.traced_tool('t') as tool:\n"
        "    note.verified(); note.answered(200); tool.answered({})\n"
    )
    assert_runs_untraced(script)


def assert_runs_untraced(script: str) -> None:
    """Runs ``script`` in a process where OpenTelemetry cannot be imported (as without the package)."""
    untraced = "import sys; sys.modules['opentelemetry'] = None\n" + script + "print('untraced')\n"
    ran = subprocess.run([sys.executable, "-c", untraced], capture_output=True, text=True, timeout=60, check=False)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "untraced"
