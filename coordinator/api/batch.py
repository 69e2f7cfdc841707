"""Batch: many unary calls in one RPC (the clients' coalescing of concurrent callers). Each carried call runs
concurrently and is answered exactly as its unary RPC would be (its response, or its error as that RPC's status),
under one deadline for the batch; one call's error or bug never costs the others their answers."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from coordinator import tracing
from coordinator.api.status import (
    CALL_DEADLINE_REASON,
    INTERNAL_ERROR_MESSAGE,
    INTERNAL_REASON,
    deadline_message,
    retry_after_ms,
    status_code,
)
from coordinator.core.domain import Caller
from coordinator.core.errors import CoordinatorError, InvalidArgument
from inbox_wire.spans import result_label
from inbox_wire.v1 import coordinator_pb2 as pb

if TYPE_CHECKING:
    from coordinator.tracing._spans import Tracing

log = logging.getLogger(__name__)

__all__ = ["BatchObserver", "BatchRunner", "CallHandler"]

_CODE_NAMES = {code.value[0]: code.name.lower() for code in grpc.StatusCode}

# One carried call: the handler of the unary RPC it stands for.
CallHandler = Callable[[Caller, Any], Awaitable[Any]]


class BatchObserver(Protocol):
    """Told about every call a Batch carried, as the interceptor is told about every RPC."""

    def batch_call(
        self,
        path: str,
        request: Any,
        response: Any,
        error: pb.CallError | None,
        seconds: float,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None: ...


class BatchRunner:
    """Runs the calls of a Batch. ``handlers``: the batch's oneof field -> its unary RPC's handler."""

    def __init__(
        self,
        handlers: Mapping[str, CallHandler],
        service_name: str,
        deadline_s: float,
        observer: BatchObserver | None = None,
    ) -> None:
        self._handlers = handlers
        self._deadline_s = deadline_s
        self._observer = observer
        # Each carried call is observed under the path of the unary RPC it stands for: /<service>/ClaimReply.
        self._paths = {field: f"/{service_name}/{field.title().replace('_', '')}" for field in handlers}
        self._batch_path = f"/{service_name}/Batch"

    async def run(
        self, caller: Caller, calls: Sequence[pb.BatchCall], context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.BatchResponse:
        started = time.perf_counter()
        fields = [call.WhichOneof("call") for call in calls]
        traces = tracing.active
        if traces is not None:
            traces.batch_carries(calls)
        # One deadline for the batch, not one timer per call: they all started together.
        tasks = [
            asyncio.create_task(
                self._one(caller, field, getattr(call, field) if field else None, started)
                if traces is None
                else self._traced(traces, call, caller, field, started)
            )
            for call, field in zip(calls, fields, strict=True)
        ]
        if tasks:
            await asyncio.wait(tasks, timeout=self._deadline_s)
        results = []
        for call, field, task in zip(calls, fields, tasks, strict=True):
            if task.done():
                response, refusal, seconds = task.result()
            else:
                task.cancel()
                response, seconds = None, time.perf_counter() - started
                refusal = pb.CallError(
                    code=grpc.StatusCode.DEADLINE_EXCEEDED.value[0],
                    message=deadline_message(self._deadline_s),
                    reason=CALL_DEADLINE_REASON,
                )
            if self._observer is not None:
                path = self._paths.get(field or "", self._batch_path)
                request = getattr(call, field) if field is not None else None
                self._observer.batch_call(path, request, response, refusal, seconds, context)
            if refusal is not None or field is None:
                results.append(pb.BatchResult(error=refusal))
            else:
                results.append(pb.BatchResult(**{field: response}))
        return pb.BatchResponse(results=results)

    async def _traced(
        self, traces: Tracing, call: pb.BatchCall, caller: Caller, field: str | None, started: float
    ) -> tuple[Any, pb.CallError | None, float]:
        """``_one`` under the carried call's own span (the child of the trace context its BatchCall carries)."""
        request = getattr(call, field) if field else None
        span = traces.carried_started(self._paths.get(field or "", self._batch_path), call)
        if span is None:
            return await self._one(caller, field, request, started)
        response, refusal, seconds = await self._one(caller, field, request, started)
        if refusal is not None:
            traces.refused(refusal.reason, refusal.retry_after_ms or None)
        code = refusal.code if refusal is not None else 0
        result = result_label(response) if refusal is None else _CODE_NAMES.get(code, str(code))
        traces.call_ended(span, request, code, result, response, principal=caller.principal)
        return response, refusal, seconds

    async def _one(
        self, caller: Caller, field: str | None, request: Any, started: float
    ) -> tuple[Any, pb.CallError | None, float]:
        """One call of a batch: its response or its error (as the unary call's status), and its duration."""
        try:
            if field is None:
                raise InvalidArgument("calls[].call", "is empty; set one of the request fields")
            response = await self._handlers[field](caller, request)
            return response, None, time.perf_counter() - started
        except CoordinatorError as failure:
            refused = pb.CallError(code=status_code(failure).value[0], message=str(failure), reason=failure.reason)
            retry_after = retry_after_ms(failure)
            if retry_after is not None:
                refused.retry_after_ms = retry_after
        except Exception:
            # One call's bug must not cost the other calls their answers; it is logged like an unary one's.
            log.exception("a %s call of a batch failed", field)
            refused = pb.CallError(
                code=grpc.StatusCode.INTERNAL.value[0], message=INTERNAL_ERROR_MESSAGE, reason=INTERNAL_REASON
            )
        return None, refused, time.perf_counter() - started
