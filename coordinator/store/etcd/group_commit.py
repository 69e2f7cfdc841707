"""Group commit: many independent etcd transactions in one request (docs/performance.md, finding 1)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aetcd import rpc

from coordinator import tracing


@dataclass
class _Pending:
    request: Any
    keys: frozenset[bytes]
    future: asyncio.Future[Any]
    span: Any = None  # the transaction's span while tracing is on and its call is sampled


class TxnBatcher:
    """Group commit: many independent transactions in one etcd request, each nested, each with its own
    compare and its own outcome, all committed at one revision.

    A transaction goes out on the event loop's next pass when a batch slot is free, so a lone call waits for
    nothing, and the calls that one Batch RPC (or one wake-up of many callers) starts in one pass go together
    instead of the first alone; under load, what arrives while batches are in flight goes out together.
    etcd refuses one request that writes a key twice, so a transaction touching a key already in the batch
    waits for the next one: semantics stay exactly those of one transaction per call.
    """

    def __init__(self, send: Callable[[Any], Awaitable[Any]], max_batch: int, max_in_flight: int) -> None:
        self._send_one = send
        self._max_batch = max_batch
        self._max_in_flight = max_in_flight
        self._pending: list[_Pending] = []
        self._in_flight = 0
        self._launch_scheduled = False
        self.requests = 0
        self.transactions = 0

    async def submit(self, request: Any, writes: frozenset[bytes]) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        traces = tracing.active
        span = traces.transaction_started() if traces is not None else None
        self._pending.append(_Pending(request, writes, future, span))
        if not self._launch_scheduled:
            self._launch_scheduled = True
            asyncio.get_running_loop().call_soon(self._launch)
        if span is None or traces is None:
            return await future
        try:
            answer = await future
        except BaseException as error:
            traces.transaction_ended(span, error)
            raise
        traces.transaction_ended(span, None)
        return answer

    def _launch(self) -> None:
        self._launch_scheduled = False
        while self._pending and self._in_flight < self._max_in_flight:
            batch = self._take()
            self._in_flight += 1
            task = asyncio.create_task(self._send(batch))
            task.add_done_callback(self._sent)

    def _take(self) -> list[_Pending]:
        batch: list[_Pending] = []
        written: set[bytes] = set()
        waiting: list[_Pending] = []
        for item in self._pending:
            if len(batch) >= self._max_batch or not written.isdisjoint(item.keys):
                waiting.append(item)
            else:
                batch.append(item)
                written.update(item.keys)
        self._pending = waiting
        return batch

    def _sent(self, _task: asyncio.Task[None]) -> None:
        self._in_flight -= 1
        self._launch()

    async def _send(self, batch: list[_Pending]) -> None:
        live = [item for item in batch if not item.future.cancelled()]
        if not live:
            return
        self.requests += 1
        self.transactions += len(live)
        traces = tracing.active
        try:
            with traces.sending([item.span for item in live]) if traces is not None else contextlib.nullcontext():
                if len(live) == 1:
                    live[0].future.set_result(await self._send_one(live[0].request))
                    return
                outer = rpc.TxnRequest(success=[rpc.RequestOp(request_txn=item.request) for item in live])
                response = await self._send_one(outer)
        except BaseException as error:
            for item in live:
                if not item.future.done():
                    item.future.set_exception(error)
            if not isinstance(error, Exception):
                raise
            return
        for item, answer in zip(live, response.responses, strict=True):
            nested = answer.response_txn
            nested.header.CopyFrom(response.header)
            if not item.future.done():
                item.future.set_result(nested)
