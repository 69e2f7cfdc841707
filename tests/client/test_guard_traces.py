"""The Python guard's traces (docs/operations.md#traces): one Nylas notification through the ASGI webhook adapter,
answered through ``inbox_claims.nylas.send``, is ONE trace: the web framework's span, the adapter's
``inbox notification`` beneath it, the guard's ``inbox reply`` beneath that with the user's own span, the client's
calls, ``inbox send`` and its request to Nylas (whose ``traceparent`` names it), and beneath each call the
coordinator's span and the store's. A real coordinator process on a real etcd, every span received by a real OTLP
receiver; the agent is a process of its own (tests/data/traces/python_guard_agent.py). No summary, credential or
secret is in any attribute; a receiver stopped mid-run fails no reply."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.store.etcd.process import EtcdServer
from coordinator.testing.otlp import OtlpReceiver, ReceivedSpan
from inbox_claims import Coordinator, Subject, SubjectState
from tests.helpers import new_request_id
from tests.tracing import COORDINATOR_SERVICE, assert_store_beneath, serve_traced

AGENT = Path(__file__).resolve().parents[1] / "data" / "traces" / "python_guard_agent.py"
MAILBOX = "guard-traces@shop.example"
# What the agent's notification, webhook and API key hold (tests/data/traces/python_guard_agent.py).
SECRETS = ("webhook-secret-7f3a9c", "nyk_v0_api-key-4be1d2", "Where is my order 4411?", "carla.customer@example.org")
CALLS = ["ClaimReply", "RenewClaim", "BeginSend", "ConfirmSent"]


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as started:
        yield started


def run_agent(receiver: OtlpReceiver, address: str, mode: str, protocol: str = "grpc") -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(AGENT), receiver.http_endpoint, address, MAILBOX, mode, protocol],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def one(spans: list[ReceivedSpan], name: str, **where: Any) -> ReceivedSpan:
    found = [span for span in spans if span.name == name and all(getattr(span, k) == v for k, v in where.items())]
    assert len(found) == 1, f"{len(found)} spans {name!r} {where}: {sorted(span.name for span in spans)}"
    return found[0]


def reply_complete(trace_id: str) -> Any:
    def enough(spans: list[ReceivedSpan]) -> bool:
        mine = [span for span in spans if span.trace_id == trace_id]
        servers = sum(span.kind == "SERVER" and span.service == COORDINATOR_SERVICE for span in mine)
        return servers >= len(CALLS) and any(span.name == "POST /webhooks/nylas" for span in mine)

    return enough


def strings(values: Any) -> Iterator[str]:
    for value in values.values() if isinstance(values, dict) else values:
        if isinstance(value, str):
            yield value
        elif isinstance(value, list | tuple | dict):
            yield from strings(value)


@pytest.mark.parametrize(("protocol", "rpc_system"), [("grpc", "grpc"), ("http-json", "connect_rpc")])
def test_one_guarded_reply_is_one_trace_from_the_notification_to_etcd(
    shared_etcd: EtcdServer, receiver: OtlpReceiver, protocol: str, rpc_system: str
) -> None:
    """Over gRPC, and over the coordinator's HTTP/JSON face (the client's ``protocol="http-json"``)."""
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.grpc_endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    with serve_traced(shared_etcd, f"test/guard-traces-{new_request_id()}/", env) as (address, http):
        agent = run_agent(receiver, address if protocol == "grpc" else http, "reply", protocol)
        stdout, stderr = agent.communicate(timeout=60)
        assert agent.returncode == 0, stderr
        out = json.loads(stdout)
        assert out["statuses"] == [200]
        spans = receiver.wait_for(reply_complete(out["trace_id"]))
    mine = [span for span in spans if span.trace_id == out["trace_id"]]

    framework = one(mine, "POST /webhooks/nylas")
    assert not framework.parent_span_id
    notification = one(mine, "inbox notification", parent_span_id=framework.span_id)
    assert notification.attributes["inbox.provider"] == "nylas"
    assert notification.attributes["inbox.outcome"] == "acknowledged"
    assert notification.attributes["http.response.status_code"] == 200
    assert [name for name, _ in notification.events] == ["verified", "recorded"]

    reply = one(mine, "inbox reply", parent_span_id=notification.span_id)
    assert reply.service == "python-agent"
    assert reply.attributes["inbox.mailbox"] == MAILBOX
    assert reply.attributes["inbox.subject.kind"] == "message"
    assert reply.attributes["inbox.subject.id"] == "msg-1"
    assert reply.attributes["inbox.notification_id"] == "notif-msg-1"
    assert reply.attributes["inbox.outcome"] == "replied"
    assert reply.attributes["inbox.fencing_token"] > 0
    assert reply.status != 2
    assert [name for name, _ in reply.events] == ["renewed"]

    # The user's span and the send beneath the reply; the request to Nylas carried the send's context.
    one(mine, "draft reply", parent_span_id=reply.span_id)
    send = one(mine, "inbox send", parent_span_id=reply.span_id)
    (nylas_send,) = out["sends"]
    assert nylas_send["path"] == f"/v3/grants/{MAILBOX}/messages/send".replace("@", "%40")
    assert nylas_send["traceparent"].split("-")[1:3] == [out["trace_id"], send.span_id]

    # Each call: the client's span beneath the reply, the coordinator's beneath it, the store's beneath that.
    clients = [span for span in mine if span.kind == "CLIENT" and span.service == "python-agent"]
    assert sorted(span.name.rpartition("/")[2] for span in clients) == sorted(CALLS)
    for client in clients:
        assert client.parent_span_id == reply.span_id
        server = one(mine, client.name, kind="SERVER", parent_span_id=client.span_id)
        assert server.service == COORDINATOR_SERVICE
        assert server.attributes["rpc.system"] == rpc_system
        assert_store_beneath(spans, server)
    begin = one(mine, "inbox.coordinator.v1.Coordinator/BeginSend", kind="SERVER")
    confirm = one(mine, "inbox.coordinator.v1.Coordinator/ConfirmSent", kind="SERVER")
    assert begin.end_ns <= send.start_ns
    assert send.end_ns <= confirm.start_ns
    assert reply.start_ns <= min(span.start_ns for span in clients)
    assert reply.end_ns >= max(span.end_ns for span in clients)

    # No summary (subject line, sender), webhook secret or API key in any attribute, event or resource of any
    # span of the trace, the coordinator's and the store's included; the fencing token only as itself.
    token = str(reply.attributes["inbox.fencing_token"])
    for span in mine:
        texts = [
            *strings(span.attributes),
            *(text for _, attributes in span.events for text in strings(attributes)),
            *strings(span.resource),
        ]
        for text in texts:
            assert not any(secret in text for secret in SECRETS), f"{span.name} carries {text!r}"
            assert text != token, f"{span.name} carries the fencing token as text"
        tokens = [key for key, value in span.attributes.items() if value == reply.attributes["inbox.fencing_token"]]
        assert tokens in ([], ["inbox.fencing_token"]), f"{span.name}: {tokens}"


def test_a_receiver_stopped_mid_run_fails_no_reply(shared_etcd: EtcdServer) -> None:
    """The agent exports to a receiver that stops after its first reply: the next notifications are recorded
    (200) and answered, each reply sent once and recorded REPLIED."""
    receiver = OtlpReceiver().start()
    with serve_traced(shared_etcd, f"test/guard-traces-{new_request_id()}/", {}) as (address, _http):
        agent = run_agent(receiver, address, "stop-mid-run")
        try:
            assert agent.stdout is not None
            assert agent.stdin is not None
            assert agent.stdout.readline().strip() == "delivered"
            receiver.wait_for(lambda spans: any(span.name == "inbox reply" for span in spans))
            receiver.stop()
            agent.stdin.write("go on\n")
            agent.stdin.flush()
            stdout, stderr = agent.communicate(timeout=60)
        finally:
            if agent.poll() is None:
                agent.kill()
        assert agent.returncode == 0, stderr
        out = json.loads(stdout)
        assert out["statuses"] == [200, 200, 200]
        assert len(out["sends"]) == 3
        with Coordinator(address, principal="agent-1") as coord:
            for message_id in ("msg-1", "msg-2", "msg-3"):
                status = coord.status(Subject.message(MAILBOX, message_id))
                assert status.state is SubjectState.REPLIED, (message_id, status)


def test_a_refusal_and_a_loss_are_the_reply_spans_outcomes(shared_etcd: EtcdServer, receiver: OtlpReceiver) -> None:
    """A guard refused a message another agent holds ends its reply span ``held`` (no error); a claim a person
    took over has a ``claim lost`` event with its reason and ends ``lost``, the renewal that found it beneath it
    (answered stale_token; the send then never reached BeginSend)."""
    with serve_traced(shared_etcd, f"test/guard-traces-{new_request_id()}/", {}) as (address, _http):
        agent = run_agent(receiver, address, "outcomes")
        stdout, stderr = agent.communicate(timeout=60)
    assert agent.returncode == 0, stderr
    out = json.loads(stdout)
    assert out["held_answer"] is None  # the guard absorbed the refusal: the function never ran
    assert out["noticed"] is True
    assert out["loss"] == "taken_over"

    def replies(trace_id: str, count: int) -> list[ReceivedSpan]:
        spans = receiver.wait_for(
            lambda spans: sum(s.trace_id == trace_id and s.name == "inbox reply" for s in spans) >= count
        )
        return [span for span in spans if span.trace_id == trace_id and span.name == "inbox reply"]

    held = replies(out["held"], 2)
    assert sorted(span.attributes["inbox.outcome"] for span in held) == ["held", "released"]
    assert all(span.status != 2 for span in held)
    (refused,) = [span for span in held if span.attributes["inbox.outcome"] == "held"]
    assert "inbox.fencing_token" not in refused.attributes  # never granted

    (lost,) = replies(out["lost"], 1)
    assert lost.attributes["inbox.outcome"] == "lost"
    assert lost.status != 2  # a loss is an outcome of the design, not a failure
    assert ("claim lost", {"inbox.loss_reason": "taken_over"}) in lost.events
    calls = [s for s in receiver.trace(out["lost"]) if s.parent_span_id == lost.span_id]
    # The person's Takeover was made inside the block (the test's shortcut): a call in the block is the reply's child.
    assert sorted(s.name.rpartition("/")[2] for s in calls) == ["ClaimReply", "RenewClaim", "Takeover"]
    (renewal,) = [s for s in calls if s.name.endswith("/RenewClaim")]
    assert renewal.attributes["inbox.result"] == "stale_token"
