"""A Nylas webhook endpoint as a plain ASGI app: verify, ack 200 at once, work in a background task.

::

    from inbox_claims import AsyncCoordinator
    from inbox_claims.asgi import nylas_webhook_app
    from inbox_claims.nylas import AsyncNylas, NylasReply

    coord = AsyncCoordinator(principal="support-agent-1")
    nylas = AsyncNylas(NYLAS_API_KEY)

    async def answer(notification, claim):  # runs inside coord.reply_to(notification): dedup + claim, renewed
        reply = NylasReply.answering(notification, body=await write_reply(notification))
        await claim.send(nylas.send, notification.grant_id, reply, idempotency_key=claim.idempotency_key)

    webhook = nylas_webhook_app(NYLAS_WEBHOOK_SECRET, answer, coordinator=coord)

    # Starlette / FastAPI: the app is an ASGI endpoint, so it can be a route (or app.mount() it)
    app = Starlette(routes=[Route("/webhooks/nylas", webhook, methods=["GET", "POST"])],
                    lifespan=webhook.lifespan)   # on shutdown, let running work finish

    # or serve it alone: uvicorn mymodule:webhook  (it answers the lifespan protocol itself)

What one request gets:

* ``GET ?challenge=<value>`` (Nylas endpoint verification): ``200``, the value echoed raw as ``text/plain``.
* ``POST``: the raw body is read (at most ``max_body_bytes``, else ``413``) and its signature checked
  (``x-nylas-signature``, or the Standard Webhooks headers with ``scheme="standard"``): ``401`` with a short
  reason when it is missing or wrong. Then the envelope is parsed (``400`` when it is not one). Nothing is
  stored before both checks pass: no delivery is recorded, nothing is claimed.
* With ``coordinator=``, a good notification is answered only once the coordinator recorded it: the one
  ClaimReply that dedups it and claims its message (or, for a message the mailbox sent, the RecordOutgoing that
  reports it), milliseconds, far inside Nylas's 10 seconds. Then ``200``, and ``handle`` runs in a background
  task on the claim already held (drafting a reply takes longer than Nylas waits). When the coordinator cannot
  record it within ``admission_timeout`` (5 s), ``503``: Nylas delivers it again, so nothing is acknowledged
  that nothing recorded (docs/design.md#no-notification-lost). A refusal (a redelivery, a message held or
  answered, an outgoing message) is recorded too: ``200``, one log line, ``handle`` not called.
* Without ``coordinator``, a good notification is answered ``200`` at once and handed to ``handle``.
* Once the app is closing, ``503``: Nylas delivers it again later, to a replica that is not going away.

The framework-neutral checks live in :class:`WebhookGate`, which :mod:`inbox_claims.wsgi` shares.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, MutableMapping
from typing import Any, Literal, TypedDict, TypeVar, Unpack, overload

from ._async import AsyncClaim, AsyncCoordinator
from ._effects import Flow
from ._envelope import Notification
from ._errors import CoordinatorUnavailable, PermissionDenied, QuotaExceeded, Unauthenticated
from ._guard import ANSWERED_EVENTS, ReplyPolicy, outgoing_of
from ._outgoing import OutgoingRules
from ._tracing import NotificationTrace, traced_notification
from .providers._seam import (
    Accepted,
    Answer,
    Batch,
    MessageFacts,
    Provider,
    ProviderError,
    RangesTaken,
    WebhookRequest,
    periodic_check,
    retry_later,
)
from .providers.nylas import NylasProvider

__all__ = [
    "DEFAULT_EVENTS",
    "DEFAULT_MAX_BODY_BYTES",
    "GateAnswer",
    "ReplyPolicy",
    "WebhookApp",
    "WebhookGate",
    "WebhookOptions",
    "nylas_webhook_app",
    "webhook_app",
]

T = TypeVar("T")

log = logging.getLogger("inbox_claims.webhooks")

Scheme = Literal["nylas", "standard"]
Scope = Literal["message", "thread"]
AsgiScope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
"""Nylas truncates message notifications past 1 MB (``.truncated``); 4 MiB leaves room for any envelope."""
DEFAULT_EVENTS = ANSWERED_EVENTS
"""The notification types (without variant suffix) that ``coordinator=`` mode replies to."""
DEFAULT_ADMISSION_TIMEOUT = 5.0
"""Seconds a notification waits for the coordinator to record it before it is answered 503 (Nylas gives 10)."""
_TEXT = "text/plain; charset=utf-8"
GIVE_BACK_S = 2.0
"""Seconds a failed delivery's cursor ranges get to be given back; past it they wait for their leases."""


GateAnswer = Answer
"""What to answer one webhook request (the providers' :class:`~inbox_claims.providers.Answer`)."""


def plain(flow: Flow[T]) -> T:
    """Runs a flow that performs no effect (a Nylas check, which reads only the request)."""
    try:
        effect = next(flow)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    raise TypeError(f"this provider needs a coordinator to run its checks (it asked for {effect!r})")


class WebhookGate:
    """The checks of a webhook request before the provider reads it: the body's size. ``provider`` then checks the
    signature and answers the handshakes (docs/providers.md)."""

    def __init__(self, provider: Provider, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if max_body_bytes < 1:
            raise ValueError("max_body_bytes must be positive")
        self.provider = provider
        self.max_body_bytes = max_body_bytes

    def too_large(self, content_length: str | None) -> Answer | None:
        """``413`` when a declared ``Content-Length`` is over the limit (before reading the body)."""
        declared = (content_length or "").strip()
        return self.body_too_large() if declared.isdigit() and int(declared) > self.max_body_bytes else None

    def body_too_large(self) -> Answer:
        return Answer(413, f"body larger than {self.max_body_bytes} bytes")

    def request(self, method: str, query: str, headers: Mapping[str, str], body: bytes) -> WebhookRequest | Answer:
        if len(body) > self.max_body_bytes:
            return self.body_too_large()
        return WebhookRequest(method, query, headers, body)


def checked(answer: Answer | Accepted, provider: Provider) -> Answer | Accepted:
    """Logs a refusal (one WARNING line: a forged or malformed request is worth an operator's look)."""
    if isinstance(answer, Answer) and answer.status in (400, 401, 403):
        log.warning("%s webhook refused (%d): %s", provider.name, answer.status, answer.body)
    return answer


def closing_answer() -> Answer:
    return Answer(503, "shutting down; deliver again later", (("retry-after", "5"),))


OK = Answer(200, "ok")


def periodic_outcome(provider: str, answer: Answer | BaseException, interval: float) -> None:
    """Logs a periodic check that recorded nothing (it runs again after ``interval`` seconds)."""
    if isinstance(answer, BaseException):
        log.error("the %s periodic check failed; it runs again in %g s", provider, interval, exc_info=answer)
    elif answer.status >= 300:
        log.warning("the %s periodic check recorded nothing (%s); again in %g s", provider, answer.body, interval)


def unrecorded_answer(what: str, error: BaseException) -> Answer:
    """What a delivery the coordinator did not record is answered: never 2xx, so that the provider delivers it
    again (``503`` while the coordinator or the provider's API cannot answer; ``403`` when the coordinator refuses
    this agent the mailbox, which an operator fixes in the token file, and the provider's next attempt then gets
    through; ``500`` for anything else, logged)."""
    if isinstance(error, CoordinatorUnavailable | QuotaExceeded | ProviderError | TimeoutError):
        log.warning("%s answered 503, not recorded: %s; the provider delivers it again", what, error)
        return retry_later("the coordinator could not record this notification")
    if isinstance(error, PermissionDenied | Unauthenticated):
        log.error("%s answered 403, not recorded: the coordinator refused this agent: %s", what, error.details)
        return Answer(403, f"the coordinator refused this agent, nothing recorded: {error.details}")
    log.error("%s answered 500, not recorded", what, exc_info=error)
    return Answer(500, "this notification could not be recorded; see the agent's log")


Handler = Callable[[Notification], Awaitable[object]]
GuardedHandler = Callable[[Notification, AsyncClaim], Awaitable[object]]
FactsHandler = Callable[[MessageFacts, AsyncClaim], Awaitable[object]]
Work = Callable[[], Awaitable[object]]
Admission = Callable[[Accepted], Awaitable[tuple[Answer, list[tuple[MessageFacts, Work]]]]]
"""Records a delivery before it is answered (``coordinator=`` mode): the answer, and the work to run after it."""


class WebhookApp:
    """The ASGI app made by :func:`nylas_webhook_app`: an HTTP endpoint (any path) and the lifespan protocol.

    Each accepted notification runs ``handler(notification)`` in its own task; the app keeps references to the
    running tasks (``running``), logs what they raise, and on shutdown (:meth:`aclose`, the lifespan's shutdown,
    or :meth:`lifespan` for Starlette/FastAPI) lets them finish for up to ``shutdown_grace`` seconds before
    cancelling the rest.
    """

    def __init__(
        self,
        gate: WebhookGate,
        handler: Handler | None = None,
        *,
        shutdown_grace: float = 30.0,
        admission: Admission | None = None,
        check: Callable[[WebhookRequest], Awaitable[Answer | Accepted]] | None = None,
    ) -> None:
        if (handler is None) == (admission is None):
            raise TypeError("pass either handler (run after the 200) or admission (recorded before it)")
        self.gate = gate
        self.handler = handler
        self.admission = admission
        self.shutdown_grace = shutdown_grace
        self._tasks: set[asyncio.Task[object]] = set()
        self._closing = False
        self._check = check
        # The provider's periodic check (Gmail's history check), run through the admission like a delivery.
        self._periodic = periodic_check(gate.provider) if admission is not None else None
        self._periodic_task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    @property
    def running(self) -> int:
        """How many notifications are being handled now."""
        return len(self._tasks)

    @property
    def closing(self) -> bool:
        return self._closing

    async def __call__(self, scope: AsgiScope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan_protocol(receive, send)
            return
        if scope["type"] != "http":
            raise RuntimeError(f"the webhook app serves HTTP, not {scope['type']}")
        self._start_periodic()  # where the app's lifespan was not run, from its first request
        method = scope["method"]
        with traced_notification(self.gate.provider.name, method) as notification:
            answer = await self._answer(scope, receive, method, notification)
            if answer is None:
                return  # the client went away
            notification.answered(answer.status)
            await _respond(send, answer, head=method == "HEAD")

    async def _answer(
        self, scope: AsgiScope, receive: Receive, method: str, notification: NotificationTrace
    ) -> Answer | None:
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        answer: Answer | Accepted | WebhookRequest | None
        answer = self.gate.too_large(headers.get("content-length")) if method == "POST" else None
        if answer is None:
            body = await self._read_body(receive) if method == "POST" else b""
            if body is None:
                return None
            answer = self.gate.request(method, scope.get("query_string", b"").decode("latin-1"), headers, body)
            if isinstance(answer, WebhookRequest):
                answer = checked(await self._checked(answer), self.gate.provider)
        if isinstance(answer, Accepted):
            notification.verified()
            answer = closing_answer() if self._closing else await self._accept(answer)
            notification.recorded(self.admission is not None and answer.status < 300)
        return answer

    async def _checked(self, request: WebhookRequest) -> Answer | Accepted:
        if self._check is not None:
            return await self._check(request)
        return plain(self.gate.provider.check(request))

    async def _accept(self, accepted: Accepted) -> Answer:
        """Records the delivery (with ``admission``) and starts its work; the answer to give the provider."""
        if self.admission is None:
            assert self.handler is not None
            self._spawn(accepted.delivery, functools.partial(self.handler, accepted.delivery))
            return self.gate.provider.acknowledge()
        answer, works = await self.admission(accepted)
        for facts, work in works:
            self._spawn(facts, work)
        return answer

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The raw body; past the size limit, only as much as shows it is too large (the rest is drained)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            if size <= self.gate.max_body_bytes:
                chunks.append(chunk)
            size += len(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def start(self) -> None:
        """Schedules the provider's periodic check now (an app run without its lifespan: a watcher's)."""
        self._closing = False
        self._start_periodic()

    async def deliver(self, accepted: Accepted) -> Answer:
        """A delivery a watcher opened itself (IMAP's IDLE): admitted as a webhook's, its work started; the answer a
        webhook would have had (a 503 when nothing was recorded)."""
        return closing_answer() if self._closing else await self._accept(accepted)

    def _start_periodic(self) -> None:
        if self._periodic is None or self._periodic_task is not None or self._closing:
            return
        self._stopping = asyncio.Event()
        self._periodic_task = asyncio.get_running_loop().create_task(
            self._run_periodic(*self._periodic), name=f"{self.gate.provider.name} periodic check"
        )

    async def _run_periodic(self, interval: float, delivery: Callable[[], Accepted]) -> None:
        """Every ``interval`` seconds until the app closes: the provider's periodic check, admitted as a delivery
        (its messages claimed, its cursor advanced) and its work run as a notification's."""
        name = self.gate.provider.name
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), interval)
            if self._stopping.is_set():
                return
            try:
                answer: Answer | BaseException = await self._accept(delivery())
            except Exception as error:
                answer = error
            periodic_outcome(name, answer, interval)

    @property
    def periodic_running(self) -> bool:
        """True while the provider's periodic check is scheduled (Gmail's history check)."""
        return self._periodic_task is not None and not self._periodic_task.done()

    def _spawn(self, about: object, work: Work) -> None:
        task = asyncio.get_running_loop().create_task(self._handle(about, work), name=f"webhook {_name(about)}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, about: object, work: Work) -> object:
        try:
            return await work()
        except Exception:
            log.exception("handling %s failed", _name(about))
            return None

    async def aclose(self, grace: float | None = None) -> None:
        """Stops taking notifications (``503``), waits up to ``grace`` seconds (default ``shutdown_grace``) for
        the running ones, then cancels what is left and waits for it to unwind."""
        self._closing = True
        periodic, self._periodic_task = self._periodic_task, None
        if periodic is not None:  # a check under way finishes (its range committed or given back)
            self._stopping.set()
            _, late = await asyncio.wait({periodic}, timeout=self._grace(grace))
            if late:
                periodic.cancel()
        tasks = set(self._tasks)
        if not tasks:
            return
        log.info("waiting up to %.1f s for %d running webhook task(s)", self._grace(grace), len(tasks))
        _, pending = await asyncio.wait(tasks, timeout=self._grace(grace))
        if pending:
            log.warning("cancelling %d webhook task(s) still running after the shutdown grace", len(pending))
            for task in pending:
                task.cancel()
            await asyncio.wait(pending)

    def _grace(self, grace: float | None) -> float:
        return self.shutdown_grace if grace is None else grace

    @contextlib.asynccontextmanager
    async def lifespan(self, *_app: object) -> AsyncIterator[None]:
        """For Starlette/FastAPI's ``lifespan=``: the provider's periodic check scheduled from startup; on shutdown,
        let running work finish (see :meth:`aclose`)."""
        self._closing = False
        self._start_periodic()
        try:
            yield
        finally:
            await self.aclose()

    async def _lifespan_protocol(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._closing = False
                self._start_periodic()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return


def _name(about: object) -> str:
    if isinstance(about, Notification):
        return f"notification {about.notification_id} ({about.type})"
    if isinstance(about, MessageFacts):
        return f"message {about.message_id} (notification {about.dedup_key})"
    return repr(about)


async def _respond(send: Send, answer: Answer, *, head: bool = False) -> None:
    body = answer.body.encode("utf-8")
    headers = [(b"content-type", answer.content_type.encode()), (b"content-length", str(len(body)).encode())]
    headers += [(name.encode("latin-1"), value.encode("latin-1")) for name, value in answer.headers]
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if head else body})


class WebhookOptions(TypedDict, total=False):
    """The options of :func:`nylas_webhook_app` and :func:`inbox_claims.wsgi.nylas_webhook_wsgi` (all optional)."""

    scheme: Scheme
    """``"nylas"`` (default): ``x-nylas-signature``; ``"standard"``: Standard Webhooks headers."""
    tolerance: float
    """Standard Webhooks: how far ``webhook-timestamp`` may be from now, in seconds (default 300)."""
    max_body_bytes: int
    """Larger bodies are answered 413 (default 4 MiB)."""
    shutdown_grace: float
    """Seconds that running work gets to finish on shutdown (default 30)."""
    events: Collection[str]
    """With ``coordinator=``: the notification types replied to (default ``DEFAULT_EVENTS``)."""
    ttl: int
    """With ``coordinator=``: the claim's TTL in seconds, renewed every third of it (default 60)."""
    scope: Scope
    """With ``coordinator=``: claim the ``"message"`` (default) or the whole ``"thread"``."""
    note: str
    """With ``coordinator=``: the claim's note, shown to humans watching the mailbox."""
    admission_timeout: float
    """With ``coordinator=``: seconds the coordinator gets to record a notification before it is answered 503
    (default 5; Nylas waits 10)."""


def make_gate(provider: Provider, options: WebhookOptions) -> WebhookGate:
    return WebhookGate(provider, max_body_bytes=options.get("max_body_bytes", DEFAULT_MAX_BODY_BYTES))


def nylas_provider(secret: str | bytes, options: WebhookOptions) -> NylasProvider:
    return NylasProvider(secret, scheme=options.get("scheme", "nylas"), tolerance=options.get("tolerance", 300.0))


def admission_timeout(options: WebhookOptions, provider: str = "nylas") -> float:
    bound = _PROVIDER_WAIT.get(provider, 10.0)
    timeout = options.get("admission_timeout", min(DEFAULT_ADMISSION_TIMEOUT, bound - 0.5))
    if not 0 < timeout < bound:
        raise ValueError(
            f"admission_timeout must be between 0 and {bound:g} seconds ({provider} waits {bound:g}), not {timeout}"
        )
    return float(timeout)


# How long each provider waits for an answer: Nylas 10 s; Graph wants its 202 within 3 s; Pub/Sub's push
# acknowledgement deadline is 10 s by default; Svix (AgentMail, Resend) waits 15 s.
# An IMAP watcher has no one waiting: its bound only keeps a stuck read from holding the cursor's range.
_PROVIDER_WAIT = {"nylas": 10.0, "graph": 3.0, "gmail": 10.0, "agentmail": 15.0, "resend": 15.0, "imap": 60.0}


def with_outgoing(rules: OutgoingRules, provider: Provider, facts: MessageFacts) -> MessageFacts:
    """The facts with the outgoing rules' verdict (the client's settings and the addresses the provider knows)."""
    return dataclasses.replace(facts, outgoing=outgoing_of(rules, facts, provider.mailbox_addresses))


def guarded_async(
    coordinator: AsyncCoordinator, provider: Provider, handle: FactsHandler, policy: ReplyPolicy, timeout: float
) -> tuple[Admission, Callable[[WebhookRequest], Awaitable[Answer | Accepted]]]:
    """For the policy's events: the delivery's batch opened, each message admitted (``coordinator.reply_to(facts)``:
    a refusal logged and dropped), the batch committed, all before the answer; and the work that runs
    ``handle(facts, claim)`` inside each claim afterwards. With the provider's check, run on the client's I/O."""

    async def check(request: WebhookRequest) -> Answer | Accepted:
        try:
            return await coordinator._drive(provider.check(request))
        except ProviderError as error:
            return unrecorded_answer(f"a {provider.name} webhook", error)

    async def admit(accepted: Accepted) -> tuple[Answer, list[tuple[MessageFacts, Work]]]:
        deadline = time.monotonic() + timeout
        works: list[tuple[MessageFacts, Work]] = []
        batch: Batch | None = None
        ranges = RangesTaken(coordinator._core)
        try:
            async with asyncio.timeout(timeout):
                batch = await coordinator._drive(provider.open(accepted, ranges))
            for facts in batch.facts:
                facts = with_outgoing(coordinator._core.options.outgoing, provider, facts)
                if not policy.wants(facts):
                    continue
                claim = coordinator.reply_to(facts, **policy.claim_options())
                with policy.absorbing(facts):
                    await claim.admit(within=max(deadline - time.monotonic(), 0.05))
                    works.append((facts, functools.partial(_guarded_work, policy, facts, claim, handle)))
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.05)):
                await coordinator._drive(batch.commit())
        except Exception as error:
            # The claims admitted are recorded: their work runs. The rest is not: the provider delivers again, and
            # what was recorded answers DUPLICATE_DELIVERY then. A cursor's range is given back unmoved, also when
            # the provider failed (or ran out of time) before its batch was made.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(GIVE_BACK_S):
                    if batch is not None:
                        await coordinator._drive(batch.abandon())
                    await coordinator._drive(ranges.give_back())
            return unrecorded_answer(f"a {provider.name} delivery", error), works
        for action in batch.actions:
            log.info("%s: %s", provider.name, action)
        return provider.acknowledge(), works

    return admit, check


async def _guarded_work(policy: ReplyPolicy, facts: MessageFacts, claim: AsyncClaim, handle: FactsHandler) -> object:
    """The drafting of one admitted claim: ``handle(facts, claim)`` inside it, its refusals absorbed."""
    with policy.absorbing(facts):
        async with claim:
            return await handle(facts, claim)
    return None


def webhook_app(
    provider: Provider, handle: FactsHandler, *, coordinator: AsyncCoordinator, **options: Unpack[WebhookOptions]
) -> WebhookApp:
    """An ASGI app for any provider's webhook (docs/providers.md): the provider checks each request and opens its
    delivery into facts; each incoming message is claimed before the provider gets its answer (Nylas 200, Graph
    202, Gmail 200; 503 when the coordinator or the provider's API cannot answer within ``admission_timeout``),
    and ``await handle(facts, claim)`` runs in the background inside each granted claim. An outgoing message is
    reported, never handed to ``handle``. Options as :func:`nylas_webhook_app`'s (``scheme`` and ``tolerance``
    belong to the provider)."""
    admission, check = guarded_async(
        coordinator, provider, handle, ReplyPolicy.of(options), admission_timeout(options, provider.name)
    )
    return WebhookApp(
        make_gate(provider, options),
        shutdown_grace=options.get("shutdown_grace", 30.0),
        admission=admission,
        check=check,
    )


@overload
def nylas_webhook_app(
    secret: str | bytes, handle: Handler, *, coordinator: None = None, **options: Unpack[WebhookOptions]
) -> WebhookApp: ...
@overload
def nylas_webhook_app(
    secret: str | bytes, handle: GuardedHandler, *, coordinator: AsyncCoordinator, **options: Unpack[WebhookOptions]
) -> WebhookApp: ...
def nylas_webhook_app(
    secret: str | bytes, handle: Any, *, coordinator: AsyncCoordinator | None = None, **options: Unpack[WebhookOptions]
) -> WebhookApp:
    """An ASGI app for a Nylas webhook endpoint (see the module's docstring).

    Without ``coordinator``, ``await handle(notification)`` runs for every accepted notification, of any type.
    With ``coordinator`` (an :class:`~inbox_claims.AsyncCoordinator`), ``await handle(notification, claim)``
    runs inside ``coordinator.reply_to(notification, ttl=..., scope=..., note=...)``, only for the
    notification types in ``events`` (default :data:`~inbox_claims.ANSWERED_EVENTS`: ``message.created`` and
    ``message.updated``, any variant); as with ``guard``, the expected refusals (a redelivery, a message held by
    someone else or answered already, a message the mailbox sent, a claim lost while drafting) are logged and
    dropped. The notification is answered only once the coordinator recorded it (``503`` when it cannot within
    ``admission_timeout``), and ``handle`` then runs in the background.

    ``scheme="standard"`` checks Standard Webhooks signatures (``webhook-id``, ``webhook-timestamp``,
    ``webhook-signature``, within ``tolerance`` seconds) instead of ``x-nylas-signature``. The other options:
    :class:`WebhookOptions`.
    """
    provider = nylas_provider(secret, options)
    if coordinator is None:
        return WebhookApp(make_gate(provider, options), handle, shutdown_grace=options.get("shutdown_grace", 30.0))

    async def on_notification(facts: MessageFacts, claim: AsyncClaim) -> object:
        return await handle(facts.source, claim)  # Nylas's handlers get the Notification, as they always did

    return webhook_app(provider, on_notification, coordinator=coordinator, **options)
