"""The blocking client: its calls (each runs a flow of :mod:`._core`), the effects performed with ``grpc`` (sync),
and a thread per guarded claim."""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterable
from datetime import datetime
from types import TracebackType
from typing import Any, Concatenate, Literal, ParamSpec, Protocol, Self, TypeVar, Unpack, overload

import grpc

from inbox_wire.v1 import coordinator_pb2_grpc as pb_grpc

from . import _batch
from . import _http_json as http_json
from ._base import ClientBase
from ._batch import BATCHABLE, Coalescer
from ._effects import Effect, Emit, Flow, Invoke, OpenStream, ReadStream, Rpc, RpcFailure, Runner, Sleep, Stream
from ._envelope import Notification
from ._errors import ClaimLost, SendRejected
from ._guard import (
    ClaimBase,
    Event,
    EventT,
    GuardOptions,
    GuardState,
    ReplyPolicy,
    Scope,
)
from ._types import (
    CallerIdentity,
    ClaimResult,
    ClaimsPage,
    DeliveryResult,
    FenceResult,
    IncomingResult,
    MessageSummary,
    OutgoingResult,
    OutsideReplyUndone,
    RecentMessage,
    Subject,
    SubjectState,
    SubjectStatus,
    TakeoverResult,
    WatchItem,
)
from .providers._seam import CursorRange

__all__ = ["Claim", "Coordinator"]

log = logging.getLogger("inbox_claims")

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class _AwaitableNotSent(SendRejected, TypeError):
    """A sync claim's send function returned an awaitable: it never ran, so nothing was sent."""


class _Waiter:
    """A thread waiting for its call's answer from a batch."""

    __slots__ = ("answer", "ready")

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.answer: Any = None


class Coordinator(ClientBase):
    """A blocking client of the Inbox Coordinator; safe to share between threads.

    ``with Coordinator(principal="agent-1") as coord:`` ... or call :meth:`close` when done. See
    :class:`~inbox_claims.AsyncCoordinator` for the asyncio client (same methods, awaited).
    """

    _channel: grpc.Channel | None = None
    _stub: pb_grpc.CoordinatorStub | None = None
    _http: Any = None
    _opening = threading.Lock()
    _coalescer: Coalescer[_Waiter] | None = None
    _batching: threading.Lock

    # -- I/O ---------------------------------------------------------------------------------------------

    def _get_stub(self) -> pb_grpc.CoordinatorStub:
        with self._opening:
            self._check_open()
            if self._stub is None:
                self._channel = self._core.options.open_channel(grpc.insecure_channel, grpc.secure_channel)
                self._stub = pb_grpc.CoordinatorStub(self._channel)
            return self._stub

    def _perform(self, effect: Effect, sleep: Callable[[float], Any]) -> Any:
        metadata = self._core.options.metadata
        if isinstance(effect, Rpc):
            if self._core.options.protocol == "http-json":
                return self._over_http(effect)
            if effect.method in BATCHABLE and self._core.options.max_batch > 1:
                return self._batched(effect)
            return self._unary(effect)
        try:
            if isinstance(effect, ReadStream):
                return next(effect.handle, None)
        except grpc.RpcError as error:
            raise RpcFailure.from_grpc(error) from None
        if isinstance(effect, Sleep):
            return sleep(effect.seconds)
        if isinstance(effect, Invoke):
            result = effect.fn(*effect.args, **effect.kwargs)
            if inspect.isawaitable(result):
                getattr(result, "close", lambda: None)()
                raise _AwaitableNotSent(
                    "the send function returned an awaitable, which Coordinator (sync) cannot run: nothing was "
                    "sent. Use AsyncCoordinator, or a plain function."
                )
            return result
        if isinstance(effect, OpenStream):
            if self._core.options.protocol == "http-json":
                raise RuntimeError(f"{effect.method} is a stream: it needs protocol='grpc' (the gRPC port)")
            return getattr(self._get_stub(), effect.method)(effect.request, metadata=metadata)
        raise TypeError(f"unknown effect {effect!r}")

    def _over_http(self, effect: Rpc) -> Any:
        with self._opening:
            self._check_open()
            if self._http is None:
                self._http = http_json.httpx_module().Client(verify=self._core.options.http_tls or True)
        url, headers, body = http_json.request(self._core.options, effect)
        try:
            response = self._http.post(url, headers=headers, content=body, timeout=effect.timeout)
        except Exception as error:
            if isinstance(error, http_json.httpx_module().HTTPError):
                raise http_json.failed(error) from None
            raise
        return http_json.answer(effect.method, response.status_code, response.headers, response.content)

    def _unary(self, effect: Rpc) -> Any:
        method = getattr(self._get_stub(), effect.method)
        try:
            metadata = self._core.options.metadata + effect.metadata
            return method(effect.request, timeout=effect.timeout, metadata=metadata)
        except grpc.RpcError as error:
            raise RpcFailure.from_grpc(error) from None

    def _batched(self, effect: Rpc) -> Any:
        """Sends ``effect`` together with the calls other threads make at the same time (see ``_batch``).
        Batches go out as gRPC futures: whichever thread finds a batch slot free starts one, and the batch
        that comes back starts the next from gRPC's callback, so no caller's thread is kept sending for
        others, and a caller that stops waiting (an interrupt) strands nobody."""
        if self._coalescer is None:
            with self._opening:
                if self._coalescer is None:
                    self._batching = threading.Lock()
                    self._coalescer = Coalescer(self._core.options.max_batch)
        coalescer = self._coalescer
        if not coalescer.supported:
            return self._unary(effect)
        waiter = _Waiter()
        with self._batching:
            coalescer.add(effect, waiter)
            batch = coalescer.next_batch()
        if batch is not None:
            self._launch(coalescer, batch)
        waiter.ready.wait()
        if waiter.answer is _batch.RESEND:
            return self._unary(effect)
        if isinstance(waiter.answer, BaseException):
            raise waiter.answer
        return waiter.answer

    def _launch(self, coalescer: Coalescer[_Waiter], batch: list[tuple[Rpc, _Waiter]]) -> None:
        calls = [rpc for rpc, _waiter in batch]
        rpc = _batch.send(calls)
        try:
            method = getattr(self._get_stub(), rpc.method)
            metadata = self._core.options.metadata + rpc.metadata
            future = method.future(rpc.request, timeout=rpc.timeout, metadata=metadata)
        except Exception as error:  # the client was closed, say: every caller hears it, none is left waiting
            failed = error

            def reraise() -> Any:
                raise failed

            self._landed(coalescer, batch, reraise)
            return
        future.add_done_callback(lambda done: self._landed(coalescer, batch, done.result))

    def _landed(
        self, coalescer: Coalescer[_Waiter], batch: list[tuple[Rpc, _Waiter]], outcome: Callable[[], Any]
    ) -> None:
        """A batch came back (on a gRPC thread): answer its callers, then start the next batch.
        ``outcome()`` returns the RPC's response or raises its error."""
        calls = [rpc for rpc, _waiter in batch]
        results: list[Any]
        try:
            results = _batch.answers(calls, outcome())
        except grpc.RpcError as error:
            results = _batch.failed(coalescer, calls, RpcFailure.from_grpc(error))
        except Exception as error:
            results = [error] * len(calls)
        for (_rpc, waiter), result in zip(batch, results, strict=True):
            waiter.answer = result
            waiter.ready.set()
        with self._batching:
            coalescer.finished()
            after = coalescer.next_batch()
        if after is not None:
            self._launch(coalescer, after)

    def _run(
        self, flow: Flow[Any], result: list[Any], sleep: Callable[[float], Any] = time.sleep
    ) -> Generator[Any, None, None]:
        """Runs a flow: yields what it emits, appends what it returns to ``result``."""
        with Runner(flow) as runner:
            for effect in runner:
                if isinstance(effect, Emit):
                    yield effect.item
                    continue
                with runner.performing(effect):
                    runner.answer = self._perform(effect, sleep)
            result.append(runner.returned)

    def _iterate(self, stream: Stream[T]) -> Generator[T, None, None]:
        return self._run(stream.flow, [])

    def _drive(self, flow: Flow[R], sleep: Callable[[float], Any] = time.sleep) -> R:
        result: list[R] = []
        for item in self._run(flow, result, sleep):
            raise AssertionError(f"a unary flow emitted {item!r}")
        return result[0]

    def close(self) -> None:
        """Closes the channel. Claims still open stop renewing (their renewal fails) and expire by TTL."""
        with self._opening:
            if self._channel is not None:
                self._channel.close()
            if self._http is not None:
                self._http.close()
            self._channel = self._stub = self._http = None
            self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the calls: each runs its flow from Core (what it sends, how it reads the answer, when it retries) --

    def record_delivery(self, mailbox: str, notification_id: str, *, timeout: float | None = None) -> DeliveryResult:
        """Delivery dedup on its own: ``is_new`` on the first sighting of ``notification_id`` in ``mailbox``.

        Prefer ``reply_to`` (or ``claim(..., notification_id=...)``) when the notification leads to a reply:
        then dedup and claim are one etcd transaction.
        """
        return self._drive(self._core.record_delivery(mailbox, notification_id, timeout=timeout))

    def record_outgoing(
        self,
        mailbox: str,
        message_id: str,
        thread_id: str,
        sent_at: datetime,
        *,
        sender: str = "",
        notification_id: str = "",
        timeout: float | None = None,
    ) -> OutgoingResult:
        """RecordOutgoing: a message the mailbox sent (in a sent folder, or from one of its own addresses). The
        coordinator answers whether it is the mailbox's own reply (OWN_REPLY) or one written outside it
        (ANSWERED_OUTSIDE: it ended the claims on the messages of its thread received at or before ``sent_at``).
        The guard calls it for you on every outgoing notification; never answer such a message."""
        return self._drive(
            self._core.record_outgoing(
                mailbox, message_id, thread_id, sent_at, sender=sender, notification_id=notification_id, timeout=timeout
            )
        )

    def record_incoming(
        self,
        mailbox: str,
        message_id: str,
        thread_id: str,
        received_at: datetime,
        *,
        automated: str = "",
        summary: MessageSummary | None = None,
        notification_id: str = "",
        timeout: float | None = None,
    ) -> IncomingResult:
        """RecordIncoming: an inbound message nobody claims (docs/design.md#reply-storms): automated mail
        (``automated`` says why, up to 256 bytes; agents leave it, people see it and may answer it), or a customer's
        newer message found by looking at the thread before a send (``automated`` empty). A customer's
        message moves the thread's latest inbound message, so an agent's claim on an older one is refused at
        BeginSend (:class:`~inbox_claims.ConversationMovedOn`); automated mail never does. The guard calls it for you on
        automated mail."""
        return self._drive(
            self._core.record_incoming(
                mailbox,
                message_id,
                thread_id,
                received_at,
                automated=automated,
                summary=summary,
                notification_id=notification_id,
                timeout=timeout,
            )
        )

    def claim(
        self,
        subject: Subject,
        *,
        ttl: int = 0,
        notification_id: str = "",
        note: str = "",
        summary: MessageSummary | None = None,
        thread_id: str = "",
        received_at: datetime | None = None,
        timeout: float | None = None,
    ) -> ClaimResult:
        """ClaimReply: the exclusive, TTL'd right to reply to ``subject`` (``ttl`` 0: the server's default).

        Answers a :class:`ClaimResult` (GRANTED, HELD, ALREADY_REPLIED, DUPLICATE_DELIVERY); nothing is
        renewed for you. Agents should use ``reply_to``, which renews, fences the send and cleans up.
        ``thread_id`` and ``received_at`` (both or neither: the message's thread and when it was received, as
        the provider says) let a reply written outside the coordinator in that thread end the claim.
        """
        return self._drive(
            self._core.claim(
                subject,
                ttl=ttl,
                notification_id=notification_id,
                note=note,
                summary=summary,
                thread_id=thread_id,
                received_at=received_at,
                timeout=timeout,
            )
        )

    def renew(self, subject: Subject, token: int, *, ttl: int = 0, timeout: float | None = None) -> FenceResult:
        """RenewClaim: pushes the claim's expiry ``ttl`` seconds out (``ok`` False: the token is stale)."""
        return self._drive(self._core.renew(subject, token, ttl=ttl, timeout=timeout))

    def release(
        self, subject: Subject, token: int, *, redeliverable: bool = False, timeout: float | None = None
    ) -> FenceResult:
        """ReleaseClaim: gives the claim up without replying; the subject becomes FREE. ``redeliverable``: this
        is not a decision about the message (the work failed), so a redelivery of its notification may claim
        again; leave it False when you decided not to reply."""
        return self._drive(self._core.release(subject, token, redeliverable=redeliverable, timeout=timeout))

    def begin_send(self, subject: Subject, token: int, *, timeout: float | None = None) -> FenceResult:
        """BeginSend, the commit point: CLAIMED to SENDING only if ``token`` is current (else ``ok`` False:
        do not send). Afterwards call ``confirm_sent`` or ``abort_send`` before the send deadline."""
        return self._drive(self._core.begin_send(subject, token, timeout=timeout))

    def confirm_sent(
        self, subject: Subject, token: int, sent_message_id: str = "", *, timeout: float | None = None
    ) -> FenceResult:
        """ConfirmSent: the reply went out (SENDING or IN_DOUBT to REPLIED), with the mail API's message id."""
        return self._drive(self._core.confirm_sent(subject, token, sent_message_id, timeout=timeout))

    def abort_send(
        self,
        subject: Subject,
        token: int,
        reason: str = "",
        *,
        redeliverable: bool = False,
        timeout: float | None = None,
    ) -> FenceResult:
        """AbortSend: the send certainly did not go out (SENDING or IN_DOUBT to FREE); ``redeliverable`` as in
        ``release``."""
        return self._drive(self._core.abort_send(subject, token, reason, redeliverable=redeliverable, timeout=timeout))

    def mark_replied(
        self, subject: Subject, token: int, *, sent_message_id: str = "", note: str = "", timeout: float | None = None
    ) -> FenceResult:
        """MarkReplied: the holder answered without the coordinator (in a mail client, by phone): CLAIMED to
        REPLIED, so later claims answer ALREADY_REPLIED. Fenced like ``begin_send`` (``ok`` False: not yours)."""
        return self._drive(
            self._core.mark_replied(subject, token, sent_message_id=sent_message_id, note=note, timeout=timeout)
        )

    def status(self, subject: Subject, *, timeout: float | None = None) -> SubjectStatus:
        """GetStatus: one subject's state (FREE when nothing is recorded)."""
        return self._drive(self._core.status(subject, timeout=timeout))

    def get_cursor(self, mailbox: str, name: str, *, timeout: float | None = None) -> tuple[str, int]:
        """GetCursor: a mailbox's named cursor (docs/design.md#cursors) as ``(value, position)``; ``("", 0)`` when it
        was never advanced. The providers move it (Gmail's ``gmail-history``, Graph's ``graph-delta:<folder>``)."""
        return self._drive(self._core.get_cursor(mailbox, name, timeout=timeout))

    def take_cursor_range(self, mailbox: str, name: str, through_position: int = 0, ttl: int = 60) -> CursorRange:
        """TakeCursorRange: TAKEN (the range from the cursor's value is this client's until ``ttl`` seconds pass or
        it advances), COVERED (the cursor reached ``through_position``) or BUSY (another worker's range lasts)."""
        return self._drive(self._core.take_cursor_range(mailbox, name, through_position, ttl))

    def advance_cursor(self, mailbox: str, name: str, taken: CursorRange, value: str, position: int) -> bool:
        """AdvanceCursor: moves the cursor to the end of the range ``taken`` (the range's start gives it back); False
        (STALE_RANGE) when another worker took the cursor since."""
        return self._drive(self._core.advance_cursor(mailbox, name, taken, value, position))

    def caller(self, *, timeout: float | None = None) -> CallerIdentity:
        """GetCaller: who the coordinator takes this client's credentials to be (principal, kind, roles, mailboxes)."""
        return self._drive(self._core.caller(timeout=timeout))

    def list_claims(
        self,
        mailbox: str,
        *,
        states: Iterable[SubjectState] = (),
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> ClaimsPage:
        """ListClaims: one page of the mailbox's subjects that are not FREE (only ``states`` if given), in key
        order. Pass the page's ``next_page_token`` for the next one, or use ``iter_claims``."""
        return self._drive(
            self._core.list_claims(mailbox, states=states, page_size=page_size, page_token=page_token, timeout=timeout)
        )

    def recent_messages(
        self, mailbox: str, *, query: str = "", page_size: int = 0, timeout: float | None = None
    ) -> tuple[RecentMessage, ...]:
        """ListRecentMessages: the mailbox's recently delivered messages (the delivery retention, 24 h), newest
        first, whose subject line, sender or id contains ``query``: what a person picks one to answer from."""
        return self._drive(self._core.recent_messages(mailbox, query=query, page_size=page_size, timeout=timeout))

    def waiting_for_a_person(self, mailbox: str, *, timeout: float | None = None) -> tuple[RecentMessage, ...]:
        """What agents leave to people (docs/design.md#reply-storms): the conversations where agents are stopped
        (``agents_stopped``, until the budget frees), then the automated messages (``automated``) among the newest
        100 delivered; a person can claim and answer any of them."""
        return self._drive(self._core.waiting_for_a_person(mailbox, timeout=timeout))

    def iter_claims(
        self, mailbox: str, *, states: Iterable[SubjectState] = (), page_size: int = 0
    ) -> Generator[SubjectStatus, None, None]:
        """Every subject ``list_claims`` would list, page after page (each page read at its own revision)."""
        return self._iterate(self._core.iter_claims(mailbox, states=states, page_size=page_size))

    def watch(self, mailbox: str, *, reconnect: bool = True) -> Generator[WatchItem, None, None]:
        """Watch: a :class:`WatchSnapshot` of the mailbox, then a :class:`WatchEvent` for every transition.

        With ``reconnect`` (the default) a stream that ends with UNAVAILABLE (the coordinator restarted, or
        lost its etcd watch) is opened again with the retry policy's backoff, and resumes after the revision of
        the last snapshot or event received: the events missed meanwhile arrive, without a new snapshot (one
        comes only when etcd no longer has that revision). The retry budget is renewed by every item received.
        Runs until you stop iterating.
        """
        return self._iterate(self._core.watch(mailbox, reconnect=reconnect))

    def takeover(
        self,
        subject: Subject,
        *,
        ttl: int = 0,
        note: str = "",
        summary: MessageSummary | None = None,
        from_person: str = "",
        timeout: float | None = None,
    ) -> TakeoverResult:
        """Takeover (humans only): ends an agent's claim (its token goes stale at once) and gives the caller a
        new one. From a person only when ``from_person`` names them (the caller confirmed it; otherwise HELD);
        never after the send began (ALREADY_REPLIED)."""
        return self._drive(
            self._core.takeover(subject, ttl=ttl, note=note, summary=summary, from_person=from_person, timeout=timeout)
        )

    def resolve_in_doubt(
        self, subject: Subject, *, sent: bool, sent_message_id: str = "", note: str = "", timeout: float | None = None
    ) -> SubjectStatus:
        """ResolveInDoubt: settles an IN_DOUBT subject after someone checked the sent folder: ``sent=True``
        records it REPLIED (with ``sent_message_id`` when known), ``sent=False`` frees it."""
        return self._drive(
            self._core.resolve_in_doubt(subject, sent=sent, sent_message_id=sent_message_id, note=note, timeout=timeout)
        )

    def undo_outside_reply(
        self, subject: Subject, *, note: str = "", timeout: float | None = None
    ) -> OutsideReplyUndone:
        """UndoOutsideReply (a person with the role ``resolve``): a reply recorded as written outside did not
        answer this message; it becomes FREE, answerable again, and the undo is recorded (who, when)."""
        return self._drive(self._core.undo_outside_reply(subject, note=note, timeout=timeout))

    # -- the guard -------------------------------------------------------------------------------------------

    def reply_to(
        self,
        notification: Event | None = None,
        *,
        mailbox: str | None = None,
        message_id: str | None = None,
        thread_id: str | None = None,
        notification_id: str | None = None,
        scope: Scope = "message",
        ttl: int = 60,
        note: str = "",
        summary: MessageSummary | None = None,
        received_at: datetime | None = None,
        on_lost: Callable[[Claim], object] | None = None,
    ) -> Claim:
        """A guarded claim on the message a notification is about; use it as ``with coord.reply_to(n) as claim``.

        Entering makes ONE ClaimReply call that records the delivery (``notification_id``) and claims the
        message (``scope="thread"``: the thread), raising :class:`DuplicateDelivery`, :class:`ReplyHeld` or
        :class:`AlreadyReplied` when it is not yours. Inside, a thread renews the claim every ``ttl / 3``
        seconds; ``claim.lost`` (a ``threading.Event``) is set and ``on_lost(claim)`` is called (in that
        thread) if the claim is found lost. ``claim.send(fn)`` passes the fenced commit point, calls ``fn``
        and records the reply. Leaving the block without sending releases the claim.

        ``notification``: what the handler has, the raw body, the decoded event or a parsed notification.
        Explicit ``mailbox``/``message_id``/``thread_id``/``notification_id`` override the notification's
        (or replace it: ``reply_to(mailbox=..., message_id=...)``); ``summary`` (which email it is, shown to the
        people watching) overrides the one read from the notification. ``received_at`` (when the message arrived,
        for a claim made without its notification) with ``thread_id``: a reply written from the mailbox in that
        thread ends the claim, as it does for a claim made from a notification, which carries both. A
        notification about a message the
        mailbox sent is never claimed: entering reports it with RecordOutgoing and raises
        :class:`OutgoingMessage` (see :meth:`AsyncCoordinator.reply_to`).
        """
        state = GuardState.for_reply(
            self._core,
            notification,
            mailbox=mailbox,
            message_id=message_id,
            thread_id=thread_id,
            notification_id=notification_id,
            scope=scope,
            ttl=ttl,
            note=note,
            summary=summary,
            received_at=received_at,
        )
        return Claim(self, state, on_lost)

    @overload
    def guard(self, fn: Callable[Concatenate[EventT, P], R], /) -> Callable[Concatenate[EventT, P], R | None]: ...
    @overload
    def guard(self, fn: None = None, /, **options: Unpack[GuardOptions]) -> Guard: ...
    def guard(self, fn: Callable[..., Any] | None = None, /, **options: Unpack[GuardOptions]) -> Any:
        """Decorator: ``def answer(event, ...)`` runs inside ``reply_to(event)``, or not at all.

        The blocking twin of :meth:`AsyncCoordinator.guard` (see there): skips the types not in ``events``,
        logs and absorbs the expected refusals (``raise_refusals=True`` raises them), and inside it
        ``inbox_claims.nylas.send(http, grant_id, draft)`` with an ``httpx.Client`` passes the commit point.
        """
        policy = ReplyPolicy.of(options)

        def decorate(fn: Callable[Concatenate[EventT, P], R]) -> Callable[Concatenate[EventT, P], R | None]:
            @functools.wraps(fn)
            def guarded_call(event: EventT, /, *args: P.args, **kwargs: P.kwargs) -> R | None:
                notification = policy.answered(event)
                if notification is not None:
                    with policy.absorbing(notification), self.reply_to(notification, **policy.claim_options()):
                        return fn(event, *args, **kwargs)
                return None

            return guarded_call

        return decorate if fn is None else decorate(fn)

    def guarded(
        self,
        *,
        ttl: int = 60,
        scope: Scope = "message",
        note: str = "",
        on_lost: Callable[[Claim], object] | None = None,
    ) -> Callable[[Callable[Concatenate[Notification, Claim, P], R]], Callable[Concatenate[Notification, P], R]]:
        """Decorator: ``fn(notification, claim, ...)`` runs inside ``reply_to(notification)``.

        The decorated function is called as ``fn(notification, ...)``; it raises what ``reply_to`` raises.
        """

        def decorate(fn: Callable[Concatenate[Notification, Claim, P], R]) -> Callable[Concatenate[Notification, P], R]:
            @functools.wraps(fn)
            def guarded_call(notification: Notification, /, *args: P.args, **kwargs: P.kwargs) -> R:
                with self.reply_to(notification, ttl=ttl, scope=scope, note=note, on_lost=on_lost) as claim:
                    return fn(notification, claim, *args, **kwargs)

            return guarded_call

        return decorate


class Guard(Protocol):
    """What ``Coordinator.guard(ttl=...)`` returns: a decorator of ``def answer(event, ...)``."""

    def __call__(self, fn: Callable[Concatenate[EventT, P], R], /) -> Callable[Concatenate[EventT, P], R | None]: ...


class Claim(ClaimBase):
    """A guarded claim of the blocking client (from :meth:`Coordinator.reply_to`); a context manager."""

    def __init__(self, client: Coordinator, state: GuardState, on_lost: Callable[[Claim], object] | None) -> None:
        super().__init__(state)
        self._client = client
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._admitted = False
        self.lost = threading.Event()
        """Set once the claim is found lost (taken over, expired, answered from the mailbox, or unrenewable)."""

    def admit(self, *, within: float | None = None) -> Self:
        """Makes the claim's one ClaimReply call (a refusal is raised, as entering raises it) and starts its
        renewal, without entering the block yet: ``with claim:`` later, in any thread, runs the block on the claim
        already held (see :meth:`AsyncClaim.admit`). ``within``: seconds for the call with its retries."""
        if self._admitted:
            return self
        deadline = time.monotonic() + within if within is not None else None
        self._client._drive(self._state.enter(deadline))
        self._admitted = True
        thread = threading.Thread(target=self._renew, name=f"inbox-claims renewal {self.token}", daemon=True)
        thread.start()
        return self

    def __enter__(self) -> Self:
        self.admit()
        self._make_current()
        return self

    def _renew(self) -> None:
        try:
            loss = self._client._drive(self._state.renewal(), sleep=self._stop.wait)
        except Exception:
            log.exception("the renewal of %s stopped on an unexpected error", self.subject)
            return
        if loss is not None:
            self._notice_loss()

    def _notice_loss(self) -> None:
        if self.lost.is_set():
            return
        self.lost.set()
        if self._on_lost is not None:
            try:
                self._on_lost(self)
            except Exception:
                log.exception("the on_lost callback of %s raised", self.subject)

    def send(self, fn: Callable[P, str | None], /, *args: P.args, **kwargs: P.kwargs) -> str | None:
        """Sends the reply through the fenced commit point, once.

        BeginSend (refused: :class:`ClaimLost`, and ``fn`` is never called), then ``fn(*args, **kwargs)``,
        which must return the sent message's id (``str``) or ``None``, then ConfirmSent. If ``fn`` raises
        :class:`SendRejected`, AbortSend frees the subject and the exception propagates; any other exception
        leaves the subject SENDING (reported IN_DOUBT later) and raises :class:`SendOutcomeUnknown` from it.
        Returns what ``fn`` returned.
        """
        self._stop.set()
        try:
            return self._client._drive(self._state.send(fn, args, kwargs))  # type: ignore[no-any-return]
        except ClaimLost:
            self._notice_loss()
            raise

    def mark_replied(self, *, sent_message_id: str = "", note: str = "") -> None:
        """Records that the reply was made outside ``send`` (by a person in a mail client, by phone): the
        subject becomes REPLIED and every later notification for it is answered ALREADY_REPLIED. Fenced like
        ``send``: raises :class:`ClaimLost` if the claim is no longer yours (nothing is recorded then)."""
        self._stop.set()
        try:
            self._client._drive(self._state.mark_replied(sent_message_id, note))
        except ClaimLost:
            self._notice_loss()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        self._stop.set()
        self._stop_being_current()
        self._client._drive(self._state.exit(failed=exc is not None, error=exc))
        return False
