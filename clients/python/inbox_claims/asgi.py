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
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal, TypedDict, Unpack, overload
from urllib.parse import parse_qs

from ._async import AsyncClaim, AsyncCoordinator
from ._envelope import Notification, NotificationError, parse_notification
from ._errors import CoordinatorUnavailable, QuotaExceeded
from ._guard import ANSWERED_EVENTS, ReplyPolicy
from ._webhooks import (
    NYLAS_SIGNATURE_HEADER,
    WebhookVerificationError,
    nylas_challenge_response,
    sign_nylas,
    sign_standard_webhook,
    verify_nylas_signature,
    verify_standard_webhook,
)

__all__ = [
    "DEFAULT_EVENTS",
    "DEFAULT_MAX_BODY_BYTES",
    "GateAnswer",
    "ReplyPolicy",
    "WebhookApp",
    "WebhookGate",
    "WebhookOptions",
    "nylas_webhook_app",
]

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


@dataclass(frozen=True, slots=True)
class GateAnswer:
    """What to answer one webhook request; ``notification`` is set when the body was accepted (hand it on)."""

    status: int
    body: str
    headers: tuple[tuple[str, str], ...] = ()
    notification: Notification | None = None

    @property
    def content_type(self) -> str:
        return _TEXT


class WebhookGate:
    """The checks of a webhook request, without any web framework: challenge, size, signature, envelope.

    ``secret`` is the webhook secret (Nylas: the one shown when the webhook was created; Standard Webhooks:
    ``whsec_<base64>``); it is checked here, so a misconfiguration fails at start, not on the first request.
    """

    def __init__(
        self,
        secret: str | bytes,
        *,
        scheme: Scheme = "nylas",
        tolerance: float = 300.0,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        if scheme == "nylas":
            sign_nylas(b"", secret)  # raises on an empty or mistyped secret
        elif scheme == "standard":
            if not isinstance(secret, str):
                raise TypeError("a Standard Webhooks secret is a str ('whsec_<base64>')")
            sign_standard_webhook(b"", msg_id="config-check", timestamp=0, secret=secret)
        else:
            raise ValueError(f"scheme must be 'nylas' or 'standard', not {scheme!r}")
        if max_body_bytes < 1:
            raise ValueError("max_body_bytes must be positive")
        self.secret = secret
        self.scheme: Scheme = scheme
        self.tolerance = tolerance
        self.max_body_bytes = max_body_bytes

    def too_large(self, content_length: str | None) -> GateAnswer | None:
        """``413`` when a declared ``Content-Length`` is over the limit (before reading the body)."""
        declared = (content_length or "").strip()
        return self.body_too_large() if declared.isdigit() and int(declared) > self.max_body_bytes else None

    def body_too_large(self) -> GateAnswer:
        return GateAnswer(413, f"body larger than {self.max_body_bytes} bytes")

    def check(self, method: str, query: str, headers: Mapping[str, str], body: bytes) -> GateAnswer:
        """The answer to one request. ``query`` is the raw query string, ``headers`` has lower-case names,
        ``body`` is the raw body exactly as received."""
        if method in ("GET", "HEAD"):
            return self._challenge(query)
        if method != "POST":
            return GateAnswer(405, "use GET ?challenge= or POST", (("allow", "GET, HEAD, POST"),))
        if len(body) > self.max_body_bytes:
            return self.body_too_large()
        try:
            if self.scheme == "nylas":
                verify_nylas_signature(body, headers.get(NYLAS_SIGNATURE_HEADER), self.secret)
            else:
                assert isinstance(self.secret, str)
                verify_standard_webhook(body, headers, self.secret, tolerance=self.tolerance)
        except WebhookVerificationError as error:
            log.warning("webhook refused (401): %s", error)
            return GateAnswer(401, f"signature refused: {error}")
        try:
            notification = parse_notification(body)
        except NotificationError as error:
            log.warning("webhook refused (400): %s", error)
            return GateAnswer(400, f"not a notification envelope: {error}")
        return GateAnswer(200, "ok", notification=notification)

    def _challenge(self, query: str) -> GateAnswer:
        parsed = parse_qs(query, keep_blank_values=True)
        single: dict[str, Any] = {name: values[0] if len(values) == 1 else values for name, values in parsed.items()}
        try:
            value = nylas_challenge_response(single)
        except WebhookVerificationError as error:
            return GateAnswer(400, str(error))
        if value is None:
            return GateAnswer(400, "expected GET ?challenge=<value> (endpoint verification) or a signed POST")
        return GateAnswer(200, value)


def closing_answer() -> GateAnswer:
    return GateAnswer(503, "shutting down; deliver again later", (("retry-after", "5"),))


OK = GateAnswer(200, "ok")


def unrecorded_answer(notification: Notification, error: Exception) -> GateAnswer:
    """What a notification the coordinator did not record is answered: never 200, so that Nylas delivers it
    again (``503`` while the coordinator cannot be reached, ``500`` for anything else, which is logged)."""
    if isinstance(error, CoordinatorUnavailable | QuotaExceeded):
        log.warning(
            "notification %s answered 503, the coordinator did not record it: %s; Nylas delivers it again",
            notification.notification_id,
            error,
        )
        return GateAnswer(
            503, "the coordinator could not record this notification; deliver it again later", (("retry-after", "5"),)
        )
    log.error("notification %s answered 500, not recorded", notification.notification_id, exc_info=error)
    return GateAnswer(500, "this notification could not be recorded; see the agent's log")


Handler = Callable[[Notification], Awaitable[object]]
GuardedHandler = Callable[[Notification, AsyncClaim], Awaitable[object]]
Work = Callable[[], Awaitable[object]]
Admission = Callable[[Notification], Awaitable[Work | None]]
"""Records a notification before it is answered (``coordinator=`` mode): the work to run after the 200, or None."""


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
    ) -> None:
        if (handler is None) == (admission is None):
            raise TypeError("pass either handler (run after the 200) or admission (recorded before it)")
        self.gate = gate
        self.handler = handler
        self.admission = admission
        self.shutdown_grace = shutdown_grace
        self._tasks: set[asyncio.Task[object]] = set()
        self._closing = False

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
            raise RuntimeError(f"the Nylas webhook app serves HTTP, not {scope['type']}")
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        method = scope["method"]
        answer = self.gate.too_large(headers.get("content-length")) if method == "POST" else None
        if answer is None:
            body = await self._read_body(receive) if method == "POST" else b""
            if body is None:
                return  # the client went away
            answer = self.gate.check(method, scope.get("query_string", b"").decode("latin-1"), headers, body)
        notification = answer.notification
        if notification is not None:
            answer = closing_answer() if self._closing else await self._accept(notification)
        await _respond(send, answer, head=method == "HEAD")

    async def _accept(self, notification: Notification) -> GateAnswer:
        """Records the notification (with ``admission``) and starts its work; the answer to give Nylas."""
        if self.admission is None:
            assert self.handler is not None
            self._spawn(notification, functools.partial(self.handler, notification))
            return OK
        try:
            work = await self.admission(notification)
        except Exception as error:
            return unrecorded_answer(notification, error)
        if work is not None:
            self._spawn(notification, work)
        return OK

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

    def _spawn(self, notification: Notification, work: Work) -> None:
        task = asyncio.get_running_loop().create_task(
            self._handle(notification, work), name=f"nylas webhook {notification.notification_id}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, notification: Notification, work: Work) -> object:
        try:
            return await work()
        except Exception:
            log.exception("handling notification %s (%s) failed", notification.notification_id, notification.type)
            return None

    async def aclose(self, grace: float | None = None) -> None:
        """Stops taking notifications (``503``), waits up to ``grace`` seconds (default ``shutdown_grace``) for
        the running ones, then cancels what is left and waits for it to unwind."""
        self._closing = True
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
        """For Starlette/FastAPI's ``lifespan=``: on shutdown, let running work finish (see :meth:`aclose`)."""
        self._closing = False
        try:
            yield
        finally:
            await self.aclose()

    async def _lifespan_protocol(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._closing = False
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _respond(send: Send, answer: GateAnswer, *, head: bool = False) -> None:
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


def make_gate(secret: str | bytes, options: WebhookOptions) -> WebhookGate:
    return WebhookGate(
        secret,
        scheme=options.get("scheme", "nylas"),
        tolerance=options.get("tolerance", 300.0),
        max_body_bytes=options.get("max_body_bytes", DEFAULT_MAX_BODY_BYTES),
    )


def admission_timeout(options: WebhookOptions) -> float:
    timeout = options.get("admission_timeout", DEFAULT_ADMISSION_TIMEOUT)
    if not 0 < timeout < 10:
        raise ValueError(f"admission_timeout must be between 0 and 10 seconds (Nylas waits 10), not {timeout}")
    return float(timeout)


def guarded_async(
    coordinator: AsyncCoordinator, handle: GuardedHandler, policy: ReplyPolicy, timeout: float
) -> Admission:
    """For the policy's events: ``coordinator.reply_to(notification)`` admitted before the answer (a refusal
    logged and dropped), and the work that runs ``handle(notification, claim)`` inside it afterwards."""

    async def admit(notification: Notification) -> Work | None:
        if not policy.wants(notification):
            return None
        claim = coordinator.reply_to(notification, **policy.claim_options())
        with policy.absorbing(notification):
            await claim.admit(within=timeout)

            async def work() -> object:
                with policy.absorbing(notification):
                    async with claim:
                        return await handle(notification, claim)
                return None

            return work
        return None

    return admit


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
    gate = make_gate(secret, options)
    grace = options.get("shutdown_grace", 30.0)
    if coordinator is None:
        return WebhookApp(gate, handle, shutdown_grace=grace)
    admission = guarded_async(coordinator, handle, ReplyPolicy.of(options), admission_timeout(options))
    return WebhookApp(gate, shutdown_grace=grace, admission=admission)
