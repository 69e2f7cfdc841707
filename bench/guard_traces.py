"""What the guard's traces cost the agent per reply (docs/performance.md#traces), a micro-benchmark of the client
alone: one reply is the guard's whole logic in this process, ``GuardState`` from a Nylas notification, entering
(ClaimReply), ``send`` (BeginSend, the send function, ConfirmSent) and leaving, each call's answer given at once
by the coordinator's own protobuf answers (no network, no coordinator: the I/O is the same in every setting, so
the difference is the tracing). Settings, alternating round by round, each run in a process of its own (as an
agent process is set up once):

- ``absent``: OpenTelemetry cannot be imported (what ``inbox_claims._tracing`` sets then; the baseline);
- ``api``: OpenTelemetry's API installed, no tracer provider set up by the application (the no-op tracer);
- ``sampled-0``: the SDK's tracer provider, sampling nothing (every span started and found not sampled);
- ``sampled-1``: the SDK's, recording every span, to a batch processor whose exporter drops them (the cost of
  making and queueing spans in the agent's thread, not of sending them).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inbox_wire.v1 import coordinator_pb2 as pb

if TYPE_CHECKING:
    from inbox_claims._core import Core
    from inbox_claims._effects import Flow

    from ._common import Environment

SETTINGS = ("absent", "api", "sampled-0", "sampled-1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replies", type=int, default=5000, help="replies per setting per round (default 5000)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, the settings alternating (default 5)")


def _answers() -> dict[str, Any]:
    status = pb.SubjectStatus(state=pb.SUBJECT_STATE_CLAIMED, fencing_token=41, ttl_seconds=60)
    return {
        "ClaimReply": pb.ClaimReplyResponse(result=pb.ClaimReplyResponse.GRANTED, status=status),
        "BeginSend": pb.BeginSendResponse(result=pb.FENCE_RESULT_OK, status=status),
        "ConfirmSent": pb.ConfirmSentResponse(result=pb.FENCE_RESULT_OK, status=status),
        "ReleaseClaim": pb.ReleaseClaimResponse(result=pb.FENCE_RESULT_OK, status=status),
    }


def _drive(flow: Flow[Any], answers: dict[str, Any]) -> Any:
    from inbox_claims._effects import Invoke, Rpc, Sleep

    answer: Any = None
    while True:
        try:
            effect = flow.send(answer)
        except StopIteration as done:
            return done.value
        if isinstance(effect, Rpc):
            answer = answers[effect.method]
        elif isinstance(effect, Invoke):
            answer = effect.fn(*effect.args, **effect.kwargs)
        elif isinstance(effect, Sleep):
            answer = None
        else:
            raise TypeError(f"unexpected effect {effect!r}")


def _notification(index: int) -> Any:
    from inbox_claims.webhooks import parse_notification

    return parse_notification(
        {
            "specversion": "1.0",
            "type": "message.created",
            "source": "/google/emails/realtime",
            "id": f"notif-{index}",
            "time": 1723821985,
            "data": {
                "application_id": "app-1",
                "object": {
                    "id": f"m-{index}",
                    "grant_id": "support@shop.example",
                    "thread_id": f"t-{index}",
                    "object": "message",
                    "subject": "Where is my order?",
                    "from": [{"email": "bea@example.org"}],
                    "date": 1723821980,
                },
            },
        }
    )


def _sent() -> str:
    return "sent-1"


def _replies(core: Core, count: int, answers: dict[str, Any]) -> float:
    """CPU seconds of this process for ``count`` replies, each the guard's whole cycle (CPU time, not wall time: on
    a shared machine another process's work would be counted as ours; the SDK's export thread is counted)."""
    from inbox_claims._guard import GuardState

    notifications = [_notification(index) for index in range(count)]
    started = time.process_time()
    for notification in notifications:
        state = GuardState.for_reply(
            core, notification, mailbox=None, message_id=None, thread_id=None, notification_id=None,
            scope="message", ttl=60, note="",
        )  # fmt: skip
        _drive(state.enter(), answers)
        _drive(state.send(_sent, (), {}), answers)
        _drive(state.exit(), answers)
    return time.process_time() - started


def _set_up(setting: str) -> Callable[[], None]:
    """This process as an agent of ``setting`` would be (before the client is imported); what shuts it down."""
    if setting == "absent":
        sys.modules["opentelemetry"] = None  # type: ignore[assignment]  # import fails, as without the package
        return lambda: None
    if setting == "api":
        return lambda: None  # installed, and no tracer provider set up
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON

    class Dropped(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider(sampler=ALWAYS_ON if setting == "sampled-1" else ALWAYS_OFF)
    provider.add_span_processor(BatchSpanProcessor(Dropped(), max_queue_size=1 << 16))
    trace.set_tracer_provider(provider)
    return provider.shutdown


def child(setting: str, replies: int) -> float:
    """Microseconds per reply in this process, set up as ``setting``."""
    shutdown = _set_up(setting)
    from inbox_claims import Coordinator, _tracing

    assert (_tracing.call_started.__globals__["trace"] is None) == (setting == "absent")
    core = Coordinator(principal="bench-agent")._core  # its channel is never opened: no call leaves
    answers = _answers()
    _replies(core, min(replies, 500), answers)  # warm-up: caches, lazy imports
    per_reply = _replies(core, replies, answers) / replies * 1e6
    shutdown()
    return per_reply


def measure(replies: int, rounds: int, report: Callable[[str], None] = print) -> dict[str, list[float]]:
    """Microseconds per reply of each setting, one figure per round, each in a process of its own."""
    per_reply: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for round_ in range(rounds):
        for name in _rotated(SETTINGS, round_):
            ran = subprocess.run(
                [sys.executable, "-m", "bench.guard_traces", name, str(replies)],
                capture_output=True,
                text=True,
                check=True,
                cwd=Path(__file__).resolve().parents[1],
            )
            per_reply[name].append(float(ran.stdout.strip()))
        report(f"round {round_ + 1}: " + ", ".join(f"{n} {per_reply[n][-1]:.1f} µs" for n in SETTINGS))
    return per_reply


def _rotated(names: Sequence[str], by: int) -> Iterator[str]:
    for index in range(len(names)):
        yield names[(index + by) % len(names)]


async def run(options: argparse.Namespace, env: Environment) -> int:
    print(
        f"== guard-traces: the client guard's CPU per reply, OpenTelemetry {', '.join(SETTINGS)}; "
        f"{options.rounds} round(s) of {options.replies} replies, each setting in a process of its own",
        flush=True,
    )
    per_reply = measure(options.replies, options.rounds)
    base = statistics.median(per_reply["absent"])
    print(f"\nthe guard's cycle per reply, CPU µs, median (and least) of {options.rounds} rounds of {options.replies}:")
    print("| setting | µs per reply | least | x absent | µs more |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in SETTINGS:
        median = statistics.median(per_reply[name])
        least = min(per_reply[name])
        print(f"| {name} | {median:.1f} | {least:.1f} | {median / base:.2f}x | {median - base:+.1f} |")
    return 0


if __name__ == "__main__":
    print(child(sys.argv[1], int(sys.argv[2])))
