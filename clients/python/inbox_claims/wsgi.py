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

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, Unpack, overload

from ._envelope import Notification
from ._sync import Claim, Coordinator
from .asgi import (
    OK,
    GateAnswer,
    ReplyPolicy,
    WebhookGate,
    admission_timeout,
    closing_answer,
    make_gate,
    unrecorded_answer,
)
from .asgi import WebhookOptions as Options

if TYPE_CHECKING:
    from werkzeug.wrappers import Response

__all__ = ["WebhookWSGIApp", "nylas_webhook_wsgi"]

log = logging.getLogger("inbox_claims.webhooks")

Handler = Callable[[Notification], object]
GuardedHandler = Callable[[Notification, Claim], object]
Work = Callable[[], object]
Admission = Callable[[Notification], Work | None]
"""Records a notification before it is answered (``coordinator=`` mode): the work to run after the 200, or None."""
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

    @property
    def running(self) -> int:
        """How many notifications are queued or being handled now."""
        with self._lock:
            return len(self._futures)

    def __call__(self, environ: Mapping[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        method = str(environ.get("REQUEST_METHOD", "GET")).upper()
        headers = _headers(environ)
        body = b""
        answer = self.gate.too_large(headers.get("content-length")) if method == "POST" else None
        if answer is None:
            if method == "POST":
                body = _read_body(environ, headers, self.gate.max_body_bytes)
            answer = self.gate.check(method, str(environ.get("QUERY_STRING", "")), headers, body)
        if answer.notification is not None:
            answer = self._accept(answer.notification)
        payload = answer.body.encode("utf-8")
        status = f"{answer.status} {_REASONS.get(answer.status, '')}".rstrip()
        response_headers = [("Content-Type", answer.content_type), ("Content-Length", str(len(payload)))]
        start_response(status, response_headers + list(answer.headers))
        return [b"" if method == "HEAD" else payload]

    def _accept(self, notification: Notification) -> GateAnswer:
        """Records the notification (with ``admission``, in this request's thread) and queues its work."""
        if self._closing:
            return closing_answer()
        if self.admission is None:
            assert self.handler is not None
            handler = self.handler
            return self._submit(notification, lambda: handler(notification))
        try:
            work = self.admission(notification)
        except Exception as error:
            return unrecorded_answer(notification, error)
        return OK if work is None else self._submit(notification, work)

    def _submit(self, notification: Notification, work: Work) -> GateAnswer:
        with self._lock:
            if self._closing:
                return closing_answer()
            future = self._pool.submit(self._handle, notification, work)
            self._futures.add(future)
        future.add_done_callback(self._done)
        return OK

    def _done(self, future: Future[object]) -> None:
        with self._lock:
            self._futures.discard(future)

    def _handle(self, notification: Notification, work: Work) -> object:
        try:
            return work()
        except Exception:
            log.exception("handling notification %s (%s) failed", notification.notification_id, notification.type)
            return None

    def close(self, grace: float | None = None) -> None:
        """Stops taking notifications (``503``), waits up to ``grace`` seconds (default ``shutdown_grace``) for
        the queued and running ones, then drops the queued rest (threads cannot be cancelled: a handler still
        running goes on in its thread)."""
        with self._lock:
            self._closing = True
            futures = set(self._futures)
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


def guarded_sync(coordinator: Coordinator, handle: GuardedHandler, policy: ReplyPolicy, timeout: float) -> Admission:
    """The blocking twin of :func:`inbox_claims.asgi.guarded_async`: admit the claim in the request, run
    ``handle(notification, claim)`` inside it in the pool."""

    def admit(notification: Notification) -> Work | None:
        if not policy.wants(notification):
            return None
        claim = coordinator.reply_to(notification, **policy.claim_options())
        with policy.absorbing(notification):
            claim.admit(within=timeout)

            def work() -> object:
                with policy.absorbing(notification), claim:
                    return handle(notification, claim)
                return None

            return work
        return None

    return admit


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
    gate = make_gate(secret, options)
    grace = options.get("shutdown_grace", 30.0)
    if coordinator is None:
        return WebhookWSGIApp(gate, handle, workers=workers, shutdown_grace=grace)
    admission = guarded_sync(coordinator, handle, ReplyPolicy.of(options), admission_timeout(options))
    return WebhookWSGIApp(gate, workers=workers, shutdown_grace=grace, admission=admission)
