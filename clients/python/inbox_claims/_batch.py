"""Coalescing concurrent calls into Batch RPCs: which calls go together, and how a Batch's answer is read.

Both clients send the calls their callers make at the same time as one ``Batch`` RPC: one round trip, one
server dispatch and one etcd group commit for many callers. This module is the whole policy; the clients
only wait (an asyncio future, a thread's event). Each call keeps its own flow: its own request id, its own
retries, its own error, exactly as if it had been sent alone.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf.message import Message

from inbox_wire import BATCH_MAX_CALLS
from inbox_wire.spans import TRACEPARENT, TRACESTATE
from inbox_wire.v1 import coordinator_pb2 as pb

from ._effects import Rpc, RpcFailure

W = TypeVar("W")

# The unary methods a Batch may carry, and their field in BatchCall / BatchResult, as the .proto declares
# them: the field carrying ClaimReplyRequest is the ClaimReply call.
BATCHABLE: dict[str, str] = {
    field.message_type.name.removesuffix("Request"): field.name
    for field in pb.BatchCall.DESCRIPTOR.oneofs_by_name["call"].fields
    if field.message_type is not None
}
__all__ = ["BATCHABLE", "BATCH_MAX_CALLS", "RESEND", "Coalescer", "answers", "failed", "send"]
MAX_BATCHES_IN_FLIGHT = 2
"""Two: while one batch is out, the next fills; a third would only split the callers into smaller batches."""

_SMALLEST_SPLIT = 8
_TRACE_FIELDS = frozenset({TRACEPARENT, TRACESTATE})
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def send(calls: Sequence[Rpc]) -> Rpc:
    """The one RPC that carries ``calls``: the call itself when it is alone, else a Batch whose deadline
    is the earliest of theirs (a call that cannot wait longer must not be kept waiting by the others)."""
    if len(calls) == 1:
        return calls[0]
    request = pb.BatchRequest()
    for call in calls:
        carried = request.calls.add()
        getattr(carried, BATCHABLE[call.method]).CopyFrom(call.request)
        for key, value in call.metadata:  # the call's trace context, which its own metadata would have carried
            if key in _TRACE_FIELDS:
                setattr(carried, key, value)
    return Rpc("Batch", request, min(call.timeout for call in calls))


def answers(calls: Sequence[Rpc], response: Message) -> list[Message | RpcFailure]:
    """Each call's answer from what :func:`send`'s RPC answered: its response, or the failure it would
    have ended with on its own."""
    if len(calls) == 1:
        return [response]
    assert isinstance(response, pb.BatchResponse)
    if len(response.results) != len(calls):
        failure = RpcFailure(
            grpc.StatusCode.INTERNAL, f"the coordinator answered {len(response.results)} of {len(calls)} calls"
        )
        return [failure] * len(calls)
    out: list[Message | RpcFailure] = []
    for call, result in zip(calls, response.results, strict=True):
        field = result.WhichOneof("result")
        if field == "error":
            error = result.error
            retry_after = error.retry_after_ms / 1000 if error.retry_after_ms > 0 else None
            out.append(RpcFailure(_CODES.get(error.code, grpc.StatusCode.UNKNOWN), error.message, retry_after))
        elif field == BATCHABLE[call.method]:
            out.append(getattr(result, field))
        else:
            out.append(RpcFailure(grpc.StatusCode.INTERNAL, f"the coordinator answered {field} to a {call.method}"))
    return out


class Coalescer(Generic[W]):
    """Queues calls with whatever the client waits on (``W``), and hands out the batches to send: at most
    ``max_batch`` calls each, at most :data:`MAX_BATCHES_IN_FLIGHT` out at once, what waits spread over
    the free slots. Calls that come while
    the batches in flight are out wait and go together in the next: the busier the client, the bigger its
    batches, and an idle client's call goes at once, alone. Not thread-safe: the sync client holds a lock.
    """

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self.pending: deque[tuple[Rpc, W]] = deque()
        self.in_flight = 0
        self.supported = True  # False once the coordinator answered Batch with UNIMPLEMENTED (an old one)

    def add(self, rpc: Rpc, waiter: W) -> None:
        self.pending.append((rpc, waiter))

    def next_batch(self) -> list[tuple[Rpc, W]] | None:
        """The calls to send now (and counted in flight until :meth:`finished`), or ``None``: wait."""
        if not self.pending or self.in_flight >= MAX_BATCHES_IN_FLIGHT:
            return None
        # Spread what waits over the free slots: two half batches keep the client, the coordinator and etcd
        # busy at once (one is being answered while the other is worked on), where one full batch would
        # leave each idle in turn. A few calls are not worth two round trips.
        free = MAX_BATCHES_IN_FLIGHT - self.in_flight
        size = min(max(-(-len(self.pending) // free), _SMALLEST_SPLIT), self.max_batch, len(self.pending))
        self.in_flight += 1
        return [self.pending.popleft() for _ in range(size)]

    def finished(self) -> None:
        """A batch came back."""
        self.in_flight -= 1


RESEND = object()
"""The answer that tells a waiting call: the coordinator has no Batch RPC, send yourself alone."""


def failed(coalescer: Coalescer[Any], calls: Sequence[Rpc], failure: RpcFailure) -> list[Any]:
    """What each call of an RPC that failed as a whole gets: the failure (its retries decide what next), or
    :data:`RESEND` when the failure only says that the coordinator predates Batch, which ends batching."""
    if len(calls) > 1 and failure.code is grpc.StatusCode.UNIMPLEMENTED:
        coalescer.supported = False
        return [RESEND] * len(calls)
    return [failure] * len(calls)
