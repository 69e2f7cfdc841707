"""``inbox_claims.guard``: the guard on a client made for you from the environment (``from_env()``), so that
an existing handler needs no set-up code: one client per process for blocking handlers, one per event loop
for async ones (a ``grpc.aio`` channel belongs to the loop that opened it)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar, Unpack, overload

from ._async import AsyncClaim, AsyncCoordinator
from ._guard import EventT, GuardOptions, current_claim_base
from ._sync import Claim, Coordinator

P = ParamSpec("P")
R = TypeVar("R")

_lock = threading.Lock()
_blocking: Coordinator | None = None
_per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncCoordinator] = weakref.WeakKeyDictionary()


def current_claim() -> Claim | AsyncClaim | None:
    """The guarded claim whose block (``reply_to``) or ``guard``-ed function runs in this task or thread, if any."""
    claim = current_claim_base()
    assert claim is None or isinstance(claim, Claim | AsyncClaim)
    return claim


def default_coordinator() -> Coordinator:
    """The process's blocking client from ``Coordinator.from_env()``, made on first use."""
    global _blocking
    with _lock:
        if _blocking is None:
            _blocking = Coordinator.from_env()
        return _blocking


def default_async_coordinator() -> AsyncCoordinator:
    """The running event loop's client from ``AsyncCoordinator.from_env()``, made on first use."""
    loop = asyncio.get_running_loop()
    with _lock:
        client = _per_loop.get(loop)
        if client is None:
            client = _per_loop[loop] = AsyncCoordinator.from_env()
        return client


class AnyGuard(Protocol):
    """What ``guard(ttl=...)`` returns: a decorator of ``async def`` or plain ``def answer(event, ...)``."""

    @overload
    def __call__(
        self, fn: Callable[Concatenate[EventT, P], Coroutine[Any, Any, R]], /
    ) -> Callable[Concatenate[EventT, P], Coroutine[Any, Any, R | None]]: ...
    @overload
    def __call__(self, fn: Callable[Concatenate[EventT, P], R], /) -> Callable[Concatenate[EventT, P], R | None]: ...


@overload
def guard(
    fn: Callable[Concatenate[EventT, P], Coroutine[Any, Any, R]], /
) -> Callable[Concatenate[EventT, P], Coroutine[Any, Any, R | None]]: ...
@overload
def guard(fn: Callable[Concatenate[EventT, P], R], /) -> Callable[Concatenate[EventT, P], R | None]: ...
@overload
def guard(fn: None = None, /, **options: Unpack[GuardOptions]) -> AnyGuard: ...
def guard(fn: Callable[..., Any] | None = None, /, **options: Unpack[GuardOptions]) -> Any:
    """Decorator: ``answer(event, ...)`` (``async def`` or plain ``def``) runs inside a claim on the message
    ``event`` is about, or not at all. ``@guard`` or ``@guard(ttl=120)`` (options: :class:`GuardOptions`).

    It is :meth:`AsyncCoordinator.guard` (or :meth:`Coordinator.guard` for a plain function) on the client
    ``from_env()`` makes (``INBOX_COORDINATOR_TARGET``, ``INBOX_TOKEN`` or ``INBOX_PRINCIPAL``...; see
    ``docs/client.md``): ``event`` is the raw body, the decoded JSON event or a :class:`Notification`; only
    ``message.created`` and ``message.updated`` (``events=``) are answered; a redelivery, a message held by
    someone else or answered already, and a claim lost or taken over are each one log line and a ``None``
    result (``raise_refusals=True`` raises them). Inside, ``inbox_claims.nylas.send(http, grant_id, draft)``
    passes the fenced commit point.
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def guarded_async(event: Any, /, *args: Any, **kwargs: Any) -> Any:
                return await default_async_coordinator().guard(**options)(fn)(event, *args, **kwargs)

            return guarded_async

        @functools.wraps(fn)
        def guarded(event: Any, /, *args: Any, **kwargs: Any) -> Any:
            return default_coordinator().guard(**options)(fn)(event, *args, **kwargs)

        return guarded

    return decorate if fn is None else decorate(fn)
