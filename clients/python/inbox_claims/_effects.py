"""The effects a flow yields, the :class:`Runner` that steps a flow for a client, and :class:`Op`, one call.

Every client call is a *flow*: a generator that yields effects (:class:`Rpc`, :class:`Sleep`, :class:`Invoke`,
:class:`OpenStream`, :class:`ReadStream`, :class:`Emit`) and receives their results. The flow decides everything
(what to send, what an answer means, whether and when to retry, which exception to raise); :mod:`._sync` and
:mod:`._async` only perform the effects, with blocking gRPC and threads or with ``grpc.aio`` and tasks. A failed
RPC comes back into the flow as :class:`RpcFailure`.

Separate from the flows themselves (:mod:`._core`, :mod:`._guard`): this is the contract between the flows and
the two clients' I/O, and what the batching (:mod:`._batch`) reads, with no knowledge of any particular call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Generic, TypeAlias, TypeVar

import grpc
from google.protobuf.message import Message

from inbox_wire import RETRY_AFTER_METADATA

from ._errors import error_for

__all__ = [
    "Effect",
    "Emit",
    "Flow",
    "Invoke",
    "Op",
    "OpenStream",
    "ReadStream",
    "Rpc",
    "RpcFailure",
    "Runner",
    "Sleep",
    "Stream",
]

R = TypeVar("R")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Rpc:
    """One attempt of a unary call. Answers the response message, or raises :class:`RpcFailure`."""

    method: str
    request: Message
    timeout: float
    metadata: tuple[tuple[str, str], ...] = ()
    """The call's own metadata besides the client's: its W3C trace context (:mod:`._tracing`)."""


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


@dataclass(frozen=True, slots=True)
class Invoke:
    """Call the user's function (awaiting its result in the async client). Answers what it returned."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True, slots=True)
class OpenStream:
    """Start a server-streaming call. Answers a handle for :class:`ReadStream`."""

    method: str
    request: Message


@dataclass(frozen=True, slots=True)
class ReadStream:
    """Read the next message of a stream. Answers it, ``None`` at the end, or raises :class:`RpcFailure`."""

    handle: Any


@dataclass(frozen=True, slots=True)
class Emit:
    """Hand one item to the caller of an iterator."""

    item: Any


Effect: TypeAlias = Rpc | Sleep | Invoke | OpenStream | ReadStream | Emit
Flow: TypeAlias = Generator[Effect, Any, R]


class RpcFailure(Exception):
    """What a driver throws into a flow when an RPC ended with a status other than OK."""

    def __init__(self, code: grpc.StatusCode, details: str, retry_after: float | None = None) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.retry_after = retry_after

    @classmethod
    def from_grpc(cls, error: grpc.RpcError) -> RpcFailure:
        """Reads code, details and the ``retry-after-ms`` trailer (sent with RESOURCE_EXHAUSTED)."""
        retry_after = None
        trailing = getattr(error, "trailing_metadata", lambda: None)() or ()
        for key, value in trailing:
            if key == RETRY_AFTER_METADATA:
                with contextlib.suppress(ValueError, TypeError):
                    retry_after = max(int(value), 0) / 1000
        return cls(error.code(), error.details() or "", retry_after)

    def error(self, method: str, attempts: int) -> Exception:
        return error_for(self.code, self.details, method=method, attempts=attempts, retry_after=self.retry_after)


class Stream(Generic[T]):
    """A flow that emits items of type ``T``: the clients turn it into an (async) iterator."""

    __slots__ = ("flow",)

    def __init__(self, flow: Flow[None]) -> None:
        self.flow = flow


class Runner:
    """Steps one flow for a client, which only performs the effects::

        with Runner(flow) as runner:
            for effect in runner:                    # the next effect the flow wants
                with runner.performing(effect):      # an exception raised here goes back into the flow
                    runner.answer = perform(effect)  # the effect's result goes back into the flow

    Leaving the ``with`` ends the flow and cancels the streams it opened. ``returned`` is what the flow returned.
    :class:`Emit` effects are the client's to hand out; they need no answer.
    """

    def __init__(self, flow: Flow[Any]) -> None:
        self._flow = flow
        self._streams: list[Any] = []
        self._error: BaseException | None = None
        self.answer: Any = None
        self.returned: Any = None

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for stream in self._streams:
            stream.cancel()
        self._flow.close()

    def __iter__(self) -> Runner:
        return self

    def __next__(self) -> Effect:
        answer, error, self.answer, self._error = self.answer, self._error, None, None
        try:
            return self._flow.throw(error) if error is not None else self._flow.send(answer)
        except StopIteration as stop:
            self.returned = stop.value
            raise StopIteration from None

    def performing(self, effect: Effect) -> _Performing:
        return _Performing(self, effect)


class _Performing:
    __slots__ = ("effect", "runner")

    def __init__(self, runner: Runner, effect: Effect) -> None:
        self.runner = runner
        self.effect = effect

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, error: BaseException | None, tb: object) -> bool:
        if error is not None:
            self.runner._error = error  # thrown into the flow at the next step: the flow decides
        elif isinstance(self.effect, OpenStream):
            self.runner._streams.append(self.runner.answer)
        return True


@dataclass(frozen=True, slots=True)
class Op(Generic[R]):
    """One logical unary call: the request (with its request id, kept by every retry) and its decoder."""

    method: str
    request: Message
    decode: Callable[[Any], R]
