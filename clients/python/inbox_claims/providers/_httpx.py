"""The providers' HTTP transports on httpx (the ``graph`` and ``gmail`` extras), and the driver that runs a provider's
flow on one of them alone (a send function, outside any client): blocking or asyncio, the same flow."""

from __future__ import annotations

from collections.abc import Awaitable, Coroutine
from typing import Any, Protocol, TypeVar

import httpx

from .._current import current_claim_base
from .._effects import Invoke
from ._seam import ClaimStamp, Flow, HttpRequest, HttpResponse, ProviderError

T = TypeVar("T")

__all__ = ["AsyncHttp", "BlockingHttp", "HttpTransport", "current_stamp", "drive"]


class HttpTransport(Protocol):
    """What a provider sends its API requests with: ``BlockingHttp``, ``AsyncHttp``, or a test double (tests/providers)
    answering ``HttpRequest`` with ``HttpResponse``; ``is_async`` says whether its answer is awaited."""

    @property
    def is_async(self) -> bool: ...

    def __call__(self, request: HttpRequest) -> HttpResponse | Awaitable[HttpResponse]: ...


def _request(request: HttpRequest) -> dict[str, Any]:
    return {
        "method": request.method,
        "url": request.url,
        "params": list(request.params) or None,
        "headers": dict(request.headers),
        "json": request.json_body,
        "content": request.content,
    }


def _failed(request: HttpRequest, error: httpx.HTTPError) -> ProviderError:
    kind = "timed out" if isinstance(error, httpx.TimeoutException) else f"failed ({type(error).__name__})"
    return ProviderError(f"{request.method} {request.url} {kind}: {error}")


class BlockingHttp:
    """Sends with an ``httpx.Client``; for the blocking client and the WSGI adapter."""

    is_async = False

    def __init__(self, client: httpx.Client | None = None, *, timeout: float = 30.0) -> None:
        self.client = client or httpx.Client(timeout=timeout)

    def __call__(self, request: HttpRequest) -> HttpResponse:
        try:
            response = self.client.request(**_request(request))
        except httpx.HTTPError as error:
            raise _failed(request, error) from error
        return HttpResponse(response.status_code, response.content, dict(response.headers))


class AsyncHttp:
    """Sends with an ``httpx.AsyncClient``; for the asyncio client and the ASGI adapter."""

    is_async = True

    def __init__(self, client: httpx.AsyncClient | None = None, *, timeout: float = 30.0) -> None:
        self.client = client or httpx.AsyncClient(timeout=timeout)

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        try:
            response = await self.client.request(**_request(request))
        except httpx.HTTPError as error:
            raise _failed(request, error) from error
        return HttpResponse(response.status_code, response.content, dict(response.headers))


def current_stamp() -> ClaimStamp:
    """The stamp of the guarded claim whose block runs now: what a reply through a provider without an idempotency
    key carries (docs/providers.md, "The claim stamp")."""
    claim = current_claim_base()
    if claim is None:
        raise RuntimeError("reply outside a guarded claim: call it as claim.send(provider.reply, message, body=...)")
    return ClaimStamp(claim.idempotency_key, claim.token)


def drive(flow: Flow[T], transport: HttpTransport) -> T | Coroutine[Any, Any, T]:
    """Runs a flow whose only effects are the transport's requests: at once with a blocking transport, as a
    coroutine with an asyncio one (what ``claim.send`` awaits)."""
    if transport.is_async:
        return _drive_async(flow)
    answer: Any = None
    while True:
        try:
            effect = flow.send(answer)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        answer = _perform_blocking(effect)


def _perform_blocking(effect: Any) -> Any:
    if not isinstance(effect, Invoke):
        raise TypeError(f"a provider's send performs only HTTP requests, not {effect!r}")
    return effect.fn(*effect.args, **effect.kwargs)


async def _drive_async(flow: Flow[T]) -> T:
    answer: Any = None
    while True:
        try:
            effect = flow.send(answer)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        if not isinstance(effect, Invoke):
            raise TypeError(f"a provider's send performs only HTTP requests, not {effect!r}")
        answer = await effect.fn(*effect.args, **effect.kwargs)
