"""A Nylas webhook endpoint as a plain WSGI app (Flask, Django, gunicorn...): verify, ack 200, work in a thread pool.

::

    from flask import Flask
    from inbox_claims import Coordinator
    from inbox_claims.nylas import Nylas, NylasReply
    from inbox_claims.wsgi import nylas_webhook_wsgi

    coord, nylas = Coordinator(principal="support-agent-1"), Nylas(NYLAS_API_KEY)

    def answer(notification, claim):  # runs inside coord.reply_to(notification), in a worker thread
        reply = NylasReply.answering(notification, body=write_reply(notification))
        claim.send(nylas.send, notification.grant_id, reply, idempotency_key=claim.idempotency_key)

    webhook = nylas_webhook_wsgi(NYLAS_WEBHOOK_SECRET, answer, coordinator=coord, workers=8)

    app = Flask(__name__)
    app.add_url_rule("/webhooks/nylas", view_func=webhook.flask_view(), methods=["GET", "POST"])
    atexit.register(webhook.close)   # let running work finish (up to shutdown_grace seconds)

The requests get the answers described in :mod:`inbox_claims.asgi` (same checks, :class:`WebhookGate`): the
challenge echoed, ``401`` for a bad signature and ``400`` for a bad envelope before anything is stored; with
``coordinator=``, ``200`` once the coordinator recorded the notification (its claim is then held and renewed,
``503`` when the coordinator cannot record it within ``admission_timeout``), and the work runs in the app's
thread pool; without, ``200`` at once.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, Unpack, overload

from ._envelope import Notification
from ._sync import Claim, Coordinator
from ._tracing import NotificationTrace, traced_notification
from .asgi import (
    ReplyPolicy,
    WebhookGate,
    admission_timeout,
    checked,
    closing_answer,
    make_gate,
    nylas_provider,
    periodic_outcome,
    plain,
    unrecorded_answer,
    with_outgoing,
)
from .asgi import WebhookOptions as Options
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
)

if TYPE_CHECKING:
    from werkzeug.wrappers import Response

__all__ = ["WebhookWSGIApp", "nylas_webhook_wsgi", "webhook_wsgi"]

log = logging.getLogger("inbox_claims.webhooks")

Handler = Callable[[Notification], object]
GuardedHandler = Callable[[Notification, Claim], object]
FactsHandler = Callable[[MessageFacts, Claim], object]
Work = Callable[[], object]
Admission = Callable[[Accepted], tuple[Answer, list[tuple[MessageFacts, Work]]]]
"""Records a delivery before it is answered (``coordinator=`` mode): the answer, and the work to run after it."""
StartResponse = Callable[..., object]

_REASONS = {
    200: "OK",
    500: "Internal Server Error",
    400: "Bad Request",
    401: "Unauthorized",
    405: "Method Not Allowed",
    413: "Content Too Large",
    503: "Service Unavailable",
}


class WebhookWSGIApp:
    """The WSGI app made by :func:`nylas_webhook_wsgi`; any path. Each accepted notification runs
    ``handler(notification)`` in a pool of ``workers`` threads; :meth:`close` lets running work finish."""

    def __init__(
        self,
        gate: WebhookGate,
        handler: Handler | None = None,
        *,
        workers: int = 8,
        shutdown_grace: float = 30.0,
        admission: Admission | None = None,
        check: Callable[[WebhookRequest], Answer | Accepted] | None = None,
    ) -> None:
        if (handler is None) == (admission is None):
            raise TypeError("pass either handler (run after the 200) or admission (recorded before it)")
        self.gate = gate
        self.handler = handler
        self.admission = admission
        self.shutdown_grace = shutdown_grace
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="nylas-webhook")
        self._futures: set[Future[object]] = set()
        self._lock = threading.Lock()
        self._closing = False
        self._check = check
        # The provider's periodic check (Gmail's history check): a thread per process, started by its first request
        # (a server that forks its workers after loading the app gets one in each worker).
        self._periodic = periodic_check(gate.provider) if admission is not None else None
        self._periodic_thread: threading.Thread | None = None
        self._periodic_pid = 0
        self._stopping = threading.Event()

    @property
    def running(self) -> int:
        """How many notifications are queued or being handled now."""
        with self._lock:
            return len(self._futures)

    def start_periodic(self) -> None:
        """Schedules the provider's periodic check in this process, if it has one (done by the first request)."""
        if self._periodic is None or self._closing:
            return
        with self._lock:
            if self._periodic_thread is not None and self._periodic_pid == os.getpid():
                return
            self._periodic_pid = os.getpid()
            self._stopping = threading.Event()
            self._periodic_thread = threading.Thread(
                target=self._run_periodic,
                args=self._periodic,
                name=f"{self.gate.provider.name}-periodic-check",
                daemon=True,
            )
        self._periodic_thread.start()

    def _run_periodic(self, interval: float, delivery: Callable[[], Accepted]) -> None:
        """Every ``interval`` seconds until :meth:`close`: the check admitted as a delivery, its work queued."""
        while not self._stopping.wait(interval):
            try:
                answer: Answer | BaseException = self._accept(delivery())
            except Exception as error:
                answer = error
            periodic_outcome(self.gate.provider.name, answer, interval)

    def __call__(self, environ: Mapping[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        self.start_periodic()
        method = str(environ.get("REQUEST_METHOD", "GET")).upper()
        with traced_notification(self.gate.provider.name, method) as notification:
            answer = self._answer(environ, method, notification)
            notification.answered(answer.status)
        payload = answer.body.encode("utf-8")
        status = f"{answer.status} {_REASONS.get(answer.status, '')}".rstrip()
        response_headers = [("Content-Type", answer.content_type), ("Content-Length", str(len(payload)))]
        start_response(status, response_headers + list(answer.headers))
        return [b"" if method == "HEAD" else payload]

    def _answer(self, environ: Mapping[str, Any], method: str, notification: NotificationTrace) -> Answer:
        headers = _headers(environ)
        body = b""
        answer: Answer | Accepted | WebhookRequest | None
        answer = self.gate.too_large(headers.get("content-length")) if method == "POST" else None
        if answer is None:
            if method == "POST":
                body = _read_body(environ, headers, self.gate.max_body_bytes)
            answer = self.gate.request(method, str(environ.get("QUERY_STRING", "")), headers, body)
            if isinstance(answer, WebhookRequest):
                request = answer
                answer = self._check(request) if self._check is not None else plain(self.gate.provider.check(request))
                answer = checked(answer, self.gate.provider)
        if isinstance(answer, Accepted):
            notification.verified()
            answer = self._accept(answer)
            notification.recorded(self.admission is not None and answer.status < 300)
        return answer

    def _accept(self, accepted: Accepted) -> Answer:
        """Records the delivery (with ``admission``, in this request's thread) and queues its work."""
        if self._closing:
            return closing_answer()
        if self.admission is None:
            assert self.handler is not None
            handler, notification = self.handler, accepted.delivery
            return self._submit(notification, lambda: handler(notification)) or self.gate.provider.acknowledge()
        answer, works = self.admission(accepted)
        for facts, work in works:
            refused = self._submit(facts, work)
            if refused is not None:
                return refused
        return answer

    def _submit(self, about: object, work: Work) -> Answer | None:
        with self._lock:
            if self._closing:
                return closing_answer()
            future = self._pool.submit(self._handle, about, work)
            self._futures.add(future)
        future.add_done_callback(self._done)
        return None

    def _done(self, future: Future[object]) -> None:
        with self._lock:
            self._futures.discard(future)

    def _handle(self, about: object, work: Work) -> object:
        try:
            return work()
        except Exception:
            log.exception("handling %s failed", about)
            return None

    def close(self, grace: float | None = None) -> None:
        """Stops taking notifications (``503``), waits up to ``grace`` seconds (default ``shutdown_grace``) for
        the queued and running ones, then drops the queued rest (threads cannot be cancelled: a handler still
        running goes on in its thread)."""
        with self._lock:
            self._closing = True
            futures = set(self._futures)
            periodic, self._periodic_thread = self._periodic_thread, None
        self._stopping.set()
        if periodic is not None:  # a check under way finishes (its range committed or given back)
            periodic.join(self.shutdown_grace if grace is None else grace)
        _, pending = wait(futures, timeout=self.shutdown_grace if grace is None else grace)
        if pending:
            log.warning("%d webhook task(s) still queued or running after the shutdown grace", len(pending))
        self._pool.shutdown(wait=False, cancel_futures=True)

    def flask_view(self) -> Callable[[], Response]:
        """A Flask view function serving this app: ``app.add_url_rule(path, view_func=webhook.flask_view(),
        methods=["GET", "POST"])``. Needs Flask (the ``wsgi`` extra)."""
        from flask import request
        from werkzeug.wrappers import Response

        def nylas_webhook() -> Response:
            return Response.from_app(self, request.environ)

        return nylas_webhook


def _headers(environ: Mapping[str, Any]) -> dict[str, str]:
    headers = {
        key[5:].replace("_", "-").lower(): str(value) for key, value in environ.items() if key.startswith("HTTP_")
    }
    for key in ("CONTENT_TYPE", "CONTENT_LENGTH"):
        if environ.get(key):
            headers[key.replace("_", "-").lower()] = str(environ[key])
    return headers


def _read_body(environ: Mapping[str, Any], headers: Mapping[str, str], limit: int) -> bytes:
    """The raw body: ``Content-Length`` bytes, or (chunked) up to one byte past ``limit`` to show it is too large."""
    stream = environ["wsgi.input"]
    length = headers.get("content-length", "").strip()
    if length.isdigit():
        return bytes(stream.read(int(length)))
    chunks: list[bytes] = []
    size = 0
    while size <= limit and (chunk := stream.read(min(65536, limit + 1 - size))):
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def guarded_sync(
    coordinator: Coordinator, provider: Provider, handle: FactsHandler, policy: ReplyPolicy, timeout: float
) -> tuple[Admission, Callable[[WebhookRequest], Answer | Accepted]]:
    """The blocking twin of :func:`inbox_claims.asgi.guarded_async`: the batch opened, each message admitted and the
    batch committed in the request; ``handle(facts, claim)`` inside each claim in the pool."""

    def check(request: WebhookRequest) -> Answer | Accepted:
        try:
            return coordinator._drive(provider.check(request))
        except ProviderError as error:
            return unrecorded_answer(f"a {provider.name} webhook", error)

    def admit(accepted: Accepted) -> tuple[Answer, list[tuple[MessageFacts, Work]]]:
        deadline = time.monotonic() + timeout
        works: list[tuple[MessageFacts, Work]] = []
        batch: Batch | None = None
        ranges = RangesTaken(coordinator._core)
        try:
            batch = coordinator._drive(provider.open(accepted, ranges))
            for facts in batch.facts:
                facts = with_outgoing(coordinator._core.options.outgoing, provider, facts)
                if not policy.wants(facts):
                    continue
                claim = coordinator.reply_to(facts, **policy.claim_options())
                with policy.absorbing(facts):
                    claim.admit(within=max(deadline - time.monotonic(), 0.05))
                    works.append((facts, functools.partial(_guarded_work, policy, facts, claim, handle)))
            coordinator._drive(batch.commit())
        except Exception as error:  # as the asgi twin: what was admitted runs, the rest is delivered again
            with contextlib.suppress(Exception):
                if batch is not None:
                    coordinator._drive(batch.abandon())
                coordinator._drive(ranges.give_back())
            return unrecorded_answer(f"a {provider.name} delivery", error), works
        for action in batch.actions:
            log.info("%s: %s", provider.name, action)
        return provider.acknowledge(), works

    return admit, check


def _guarded_work(policy: ReplyPolicy, facts: MessageFacts, claim: Claim, handle: FactsHandler) -> object:
    with policy.absorbing(facts), claim:
        return handle(facts, claim)
    return None


def webhook_wsgi(
    provider: Provider,
    handle: FactsHandler,
    *,
    coordinator: Coordinator,
    workers: int = 8,
    **options: Unpack[Options],
) -> WebhookWSGIApp:
    """A WSGI app for any provider's webhook, as :func:`inbox_claims.asgi.webhook_app` with a blocking
    :class:`~inbox_claims.Coordinator` and ``handle(facts, claim)`` a plain function, run in ``workers`` threads."""
    admission, check = guarded_sync(
        coordinator, provider, handle, ReplyPolicy.of(options), admission_timeout(options, provider.name)
    )
    return WebhookWSGIApp(
        make_gate(provider, options),
        workers=workers,
        shutdown_grace=options.get("shutdown_grace", 30.0),
        admission=admission,
        check=check,
    )


@overload
def nylas_webhook_wsgi(
    secret: str | bytes, handle: Handler, *, coordinator: None = None, workers: int = 8, **options: Unpack[Options]
) -> WebhookWSGIApp: ...
@overload
def nylas_webhook_wsgi(
    secret: str | bytes,
    handle: GuardedHandler,
    *,
    coordinator: Coordinator,
    workers: int = 8,
    **options: Unpack[Options],
) -> WebhookWSGIApp: ...
def nylas_webhook_wsgi(
    secret: str | bytes,
    handle: Any,
    *,
    coordinator: Coordinator | None = None,
    workers: int = 8,
    **options: Unpack[Options],
) -> WebhookWSGIApp:
    """A WSGI app for a Nylas webhook endpoint, as :func:`inbox_claims.asgi.nylas_webhook_app` (same options,
    :class:`~inbox_claims.asgi.WebhookOptions`) with a blocking :class:`~inbox_claims.Coordinator` and ``handle``
    a plain function, run in a pool of ``workers`` threads."""
    provider = nylas_provider(secret, options)
    if coordinator is None:
        gate = make_gate(provider, options)
        return WebhookWSGIApp(gate, handle, workers=workers, shutdown_grace=options.get("shutdown_grace", 30.0))

    def on_notification(facts: MessageFacts, claim: Claim) -> object:
        return handle(facts.source, claim)  # Nylas's handlers get the Notification, as they always did

    return webhook_wsgi(provider, on_notification, coordinator=coordinator, workers=workers, **options)
