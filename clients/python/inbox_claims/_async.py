"""The asyncio client: its calls (each runs a flow of :mod:`._core`), the effects performed with ``grpc.aio``, and
a task per guarded claim."""

# The calls' timeout= is the blocking client's too: it bounds every attempt's gRPC deadline (which the
# coordinator sees) and the retries between them; an asyncio.timeout() around the call would only cancel it.
# ruff: noqa: ASYNC109

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Iterable
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
from ._errors import ClaimLost
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

__all__ = ["AsyncClaim", "AsyncCoordinator"]

log = logging.getLogger("inbox_claims")

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class AsyncCoordinator(ClientBase):
    """An asyncio client of the Inbox Coordinator.

    ``async with AsyncCoordinator(principal="agent-1") as coord:`` ... or ``await coord.close()`` when done.
    The channel opens on first use, in the running event loop; use one client per event loop.
    """

    _channel: grpc.aio.Channel | None = None
    _stub: pb_grpc.CoordinatorStub | None = None
    _coalescer: Coalescer[asyncio.Future[Any]] | None = None
    _sending: set[asyncio.Task[None]] | None = None
    _flush_scheduled = False
    _http: Any = None

    # -- I/O ---------------------------------------------------------------------------------------------

    def _get_stub(self) -> pb_grpc.CoordinatorStub:
        self._check_open()
        if self._stub is None:
            self._channel = self._core.options.open_channel(grpc.aio.insecure_channel, grpc.aio.secure_channel)
            self._stub = pb_grpc.CoordinatorStub(self._channel)
        return self._stub

    async def _perform(self, effect: Effect) -> Any:
        metadata = self._core.options.metadata
        if isinstance(effect, Rpc):
            if self._core.options.protocol == "http-json":
                return await self._over_http(effect)
            if effect.method in BATCHABLE and self._core.options.max_batch > 1:
                return await self._batched(effect)
            return await self._unary(effect)
        try:
            if isinstance(effect, ReadStream):
                message = await effect.handle.read()
                return None if message is grpc.aio.EOF else message
        except grpc.RpcError as error:
            raise RpcFailure.from_grpc(error) from None
        if isinstance(effect, Sleep):
            return await asyncio.sleep(effect.seconds)
        if isinstance(effect, Invoke):
            result = effect.fn(*effect.args, **effect.kwargs)
            return await result if inspect.isawaitable(result) else result
        if isinstance(effect, OpenStream):
            if self._core.options.protocol == "http-json":
                raise RuntimeError(f"{effect.method} is a stream: it needs protocol='grpc' (the gRPC port)")
            return getattr(self._get_stub(), effect.method)(effect.request, metadata=metadata)
        raise TypeError(f"unknown effect {effect!r}")

    async def _over_http(self, effect: Rpc) -> Any:
        self._check_open()
        if self._http is None:
            self._http = http_json.httpx_module().AsyncClient(verify=self._core.options.http_tls or True)
        url, headers, body = http_json.request(self._core.options, effect)
        try:
            response = await self._http.post(url, headers=headers, content=body, timeout=effect.timeout)
        except Exception as error:
            if isinstance(error, http_json.httpx_module().HTTPError):
                raise http_json.failed(error) from None
            raise
        return http_json.answer(effect.method, response.status_code, response.headers, response.content)

    async def _unary(self, effect: Rpc) -> Any:
        method = getattr(self._get_stub(), effect.method)
        try:
            metadata = self._core.options.metadata + effect.metadata
            return await method(effect.request, timeout=effect.timeout, metadata=metadata)
        except grpc.RpcError as error:
            raise RpcFailure.from_grpc(error) from None

    async def _batched(self, effect: Rpc) -> Any:
        """Sends ``effect`` together with the calls made at the same time (see ``_batch``)."""
        if self._coalescer is None:
            self._coalescer = Coalescer(self._core.options.max_batch)
            self._sending = set()
        if not self._coalescer.supported:
            return await self._unary(effect)
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._coalescer.add(effect, answer)
        self._flush_soon()
        result = await answer
        return await self._unary(effect) if result is _batch.RESEND else result

    def _flush_soon(self) -> None:
        # On the next pass of the loop, not now: the callers woken together by the last batch's answers
        # all get to queue their next call first, and go in one batch rather than one alone and the rest.
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        coalescer = self._coalescer
        try:
            while coalescer is not None and (batch := coalescer.next_batch()) is not None:
                task = asyncio.create_task(self._send_batch(coalescer, batch))
                assert self._sending is not None
                self._sending.add(task)
                task.add_done_callback(self._sending.discard)
        except Exception as error:  # a bug here must fail the waiting callers, not leave them waiting forever
            while coalescer is not None and coalescer.pending:
                _rpc, answer = coalescer.pending.popleft()
                if not answer.done():
                    answer.set_exception(error)

    async def _send_batch(
        self, coalescer: Coalescer[asyncio.Future[Any]], batch: list[tuple[Rpc, asyncio.Future[Any]]]
    ) -> None:
        live = [(rpc, answer) for rpc, answer in batch if not answer.done()]  # a cancelled caller's call stays home
        results: list[Any]
        try:
            results = await self._answers(coalescer, [rpc for rpc, _answer in live]) if live else []
        except asyncio.CancelledError:
            closed = RuntimeError(f"this {type(self).__name__} was closed while the call was in flight")
            for _rpc, answer in live:
                if not answer.done():
                    answer.set_exception(closed)
            raise
        except Exception as error:  # the client was closed before the batch went, say: every caller hears it
            results = [error] * len(live)
        finally:
            coalescer.finished()
            if coalescer.pending:
                self._flush_soon()
        for (_rpc, answer), result in zip(live, results, strict=True):
            if answer.done():
                continue
            if isinstance(result, BaseException):
                answer.set_exception(result)
            else:
                answer.set_result(result)

    async def _answers(self, coalescer: Coalescer[asyncio.Future[Any]], calls: list[Rpc]) -> list[Any]:
        try:
            return _batch.answers(calls, await self._unary(_batch.send(calls)))
        except RpcFailure as failure:
            return _batch.failed(coalescer, calls, failure)

    async def _run(self, flow: Flow[Any], result: list[Any]) -> AsyncGenerator[Any, None]:
        """Runs a flow: yields what it emits, appends what it returns to ``result``."""
        with Runner(flow) as runner:
            for effect in runner:
                if isinstance(effect, Emit):
                    yield effect.item
                    continue
                with runner.performing(effect):
                    runner.answer = await self._perform(effect)
            result.append(runner.returned)

    def _iterate(self, stream: Stream[T]) -> AsyncGenerator[T, None]:
        return self._run(stream.flow, [])

    async def _drive(self, flow: Flow[R]) -> R:
        result: list[R] = []
        async for item in self._run(flow, result):
            raise AssertionError(f"a unary flow emitted {item!r}")
        return result[0]

    async def close(self) -> None:
        """Closes the channel. Claims still open stop renewing (their renewal fails) and expire by TTL."""
        channel, self._channel, self._stub = self._channel, None, None
        http, self._http = self._http, None
        self._closed = True
        for task in tuple(self._sending or ()):
            task.cancel()
        if channel is not None:
            await channel.close()
        if http is not None:
            await http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- the calls: each runs its flow from Core (what it sends, how it reads the answer, when it retries) --

    async def record_delivery(
        self, mailbox: str, notification_id: str, *, timeout: float | None = None
    ) -> DeliveryResult:
        """Delivery dedup on its own: ``is_new`` on the first sighting of ``notification_id`` in ``mailbox``.

        Prefer ``reply_to`` (or ``claim(..., notification_id=...)``) when the notification leads to a reply:
        then dedup and claim are one etcd transaction.
        """
        return await self._drive(self._core.record_delivery(mailbox, notification_id, timeout=timeout))

    async def record_outgoing(
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
        return await self._drive(
            self._core.record_outgoing(
                mailbox, message_id, thread_id, sent_at, sender=sender, notification_id=notification_id, timeout=timeout
            )
        )

    async def record_incoming(
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
        return await self._drive(
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

    async def claim(
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
        return await self._drive(
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

    async def renew(self, subject: Subject, token: int, *, ttl: int = 0, timeout: float | None = None) -> FenceResult:
        """RenewClaim: pushes the claim's expiry ``ttl`` seconds out (``ok`` False: the token is stale)."""
        return await self._drive(self._core.renew(subject, token, ttl=ttl, timeout=timeout))

    async def release(
        self, subject: Subject, token: int, *, redeliverable: bool = False, timeout: float | None = None
    ) -> FenceResult:
        """ReleaseClaim: gives the claim up without replying; the subject becomes FREE. ``redeliverable``: this
        is not a decision about the message (the work failed), so a redelivery of its notification may claim
        again; leave it False when you decided not to reply."""
        return await self._drive(self._core.release(subject, token, redeliverable=redeliverable, timeout=timeout))

    async def begin_send(self, subject: Subject, token: int, *, timeout: float | None = None) -> FenceResult:
        """BeginSend, the commit point: CLAIMED to SENDING only if ``token`` is current (else ``ok`` False:
        do not send). Afterwards call ``confirm_sent`` or ``abort_send`` before the send deadline."""
        return await self._drive(self._core.begin_send(subject, token, timeout=timeout))

    async def confirm_sent(
        self, subject: Subject, token: int, sent_message_id: str = "", *, timeout: float | None = None
    ) -> FenceResult:
        """ConfirmSent: the reply went out (SENDING or IN_DOUBT to REPLIED), with the mail API's message id."""
        return await self._drive(self._core.confirm_sent(subject, token, sent_message_id, timeout=timeout))

    async def abort_send(
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
        return await self._drive(
            self._core.abort_send(subject, token, reason, redeliverable=redeliverable, timeout=timeout)
        )

    async def mark_replied(
        self, subject: Subject, token: int, *, sent_message_id: str = "", note: str = "", timeout: float | None = None
    ) -> FenceResult:
        """MarkReplied: the holder answered without the coordinator (in a mail client, by phone): CLAIMED to
        REPLIED, so later claims answer ALREADY_REPLIED. Fenced like ``begin_send`` (``ok`` False: not yours)."""
        return await self._drive(
            self._core.mark_replied(subject, token, sent_message_id=sent_message_id, note=note, timeout=timeout)
        )

    async def status(self, subject: Subject, *, timeout: float | None = None) -> SubjectStatus:
        """GetStatus: one subject's state (FREE when nothing is recorded)."""
        return await self._drive(self._core.status(subject, timeout=timeout))

    async def get_cursor(self, mailbox: str, name: str, *, timeout: float | None = None) -> tuple[str, int]:
        """GetCursor: a mailbox's named cursor (docs/design.md#cursors) as ``(value, position)``; ``("", 0)`` when it
        was never advanced. The providers move it (Gmail's ``gmail-history``, Graph's ``graph-delta:<folder>``)."""
        return await self._drive(self._core.get_cursor(mailbox, name, timeout=timeout))

    async def take_cursor_range(self, mailbox: str, name: str, through_position: int = 0, ttl: int = 60) -> CursorRange:
        """TakeCursorRange: TAKEN (the range from the cursor's value is this client's until ``ttl`` seconds pass or
        it advances), COVERED (the cursor reached ``through_position``) or BUSY (another worker's range lasts)."""
        return await self._drive(self._core.take_cursor_range(mailbox, name, through_position, ttl))

    async def advance_cursor(self, mailbox: str, name: str, taken: CursorRange, value: str, position: int) -> bool:
        """AdvanceCursor: moves the cursor to the end of the range ``taken`` (the range's start gives it back); False
        (STALE_RANGE) when another worker took the cursor since."""
        return await self._drive(self._core.advance_cursor(mailbox, name, taken, value, position))

    async def caller(self, *, timeout: float | None = None) -> CallerIdentity:
        """GetCaller: who the coordinator takes this client's credentials to be (principal, kind, roles, mailboxes)."""
        return await self._drive(self._core.caller(timeout=timeout))

    async def list_claims(
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
        return await self._drive(
            self._core.list_claims(mailbox, states=states, page_size=page_size, page_token=page_token, timeout=timeout)
        )

    async def recent_messages(
        self, mailbox: str, *, query: str = "", page_size: int = 0, timeout: float | None = None
    ) -> tuple[RecentMessage, ...]:
        """ListRecentMessages: the mailbox's recently delivered messages (the delivery retention, 24 h), newest
        first, whose subject line, sender or id contains ``query``: what a person picks one to answer from."""
        return await self._drive(self._core.recent_messages(mailbox, query=query, page_size=page_size, timeout=timeout))

    async def waiting_for_a_person(self, mailbox: str, *, timeout: float | None = None) -> tuple[RecentMessage, ...]:
        """What agents leave to people (docs/design.md#reply-storms): the conversations where agents are stopped
        (``agents_stopped``, until the budget frees), then the automated messages (``automated``) among the newest
        100 delivered; a person can claim and answer any of them."""
        return await self._drive(self._core.waiting_for_a_person(mailbox, timeout=timeout))

    def iter_claims(
        self, mailbox: str, *, states: Iterable[SubjectState] = (), page_size: int = 0
    ) -> AsyncGenerator[SubjectStatus, None]:
        """Every subject ``list_claims`` would list, page after page (each page read at its own revision)."""
        return self._iterate(self._core.iter_claims(mailbox, states=states, page_size=page_size))

    def watch(self, mailbox: str, *, reconnect: bool = True) -> AsyncGenerator[WatchItem, None]:
        """Watch: a :class:`WatchSnapshot` of the mailbox, then a :class:`WatchEvent` for every transition.

        With ``reconnect`` (the default) a stream that ends with UNAVAILABLE (the coordinator restarted, or
        lost its etcd watch) is opened again with the retry policy's backoff, and resumes after the revision of
        the last snapshot or event received: the events missed meanwhile arrive, without a new snapshot (one
        comes only when etcd no longer has that revision). The retry budget is renewed by every item received.
        Runs until you stop iterating.
        """
        return self._iterate(self._core.watch(mailbox, reconnect=reconnect))

    async def takeover(
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
        return await self._drive(
            self._core.takeover(subject, ttl=ttl, note=note, summary=summary, from_person=from_person, timeout=timeout)
        )

    async def resolve_in_doubt(
        self, subject: Subject, *, sent: bool, sent_message_id: str = "", note: str = "", timeout: float | None = None
    ) -> SubjectStatus:
        """ResolveInDoubt: settles an IN_DOUBT subject after someone checked the sent folder: ``sent=True``
        records it REPLIED (with ``sent_message_id`` when known), ``sent=False`` frees it."""
        return await self._drive(
            self._core.resolve_in_doubt(subject, sent=sent, sent_message_id=sent_message_id, note=note, timeout=timeout)
        )

    async def undo_outside_reply(
        self, subject: Subject, *, note: str = "", timeout: float | None = None
    ) -> OutsideReplyUndone:
        """UndoOutsideReply (a person with the role ``resolve``): a reply recorded as written outside did not
        answer this message; it becomes FREE, answerable again, and the undo is recorded (who, when)."""
        return await self._drive(self._core.undo_outside_reply(subject, note=note, timeout=timeout))

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
        on_lost: Callable[[AsyncClaim], object] | None = None,
        cancel_on_loss: bool = False,
    ) -> AsyncClaim:
        """A guarded claim on the message a notification is about: ``async with coord.reply_to(n) as claim``.

        Entering makes ONE ClaimReply call that records the delivery (``notification_id``) and claims the
        message (``scope="thread"``: the thread), raising :class:`DuplicateDelivery`, :class:`ReplyHeld` or
        :class:`AlreadyReplied` when it is not yours. Inside, a task renews the claim every ``ttl / 3``
        seconds; if the claim is found lost, ``claim.lost`` (an ``asyncio.Event``) is set, ``on_lost(claim)``
        is called (awaited if it returns an awaitable), and with ``cancel_on_loss=True`` the task running the
        block is cancelled and :class:`ClaimLost` comes out of the ``async with``. ``await claim.send(fn)``
        passes the fenced commit point, calls ``fn`` and records the reply. Leaving the block without sending
        releases the claim.

        ``notification``: what the handler has, the raw body, the decoded event or a parsed notification.
        Explicit ``mailbox``/``message_id``/``thread_id``/``notification_id`` override the notification's
        (or replace it: ``reply_to(mailbox=..., message_id=...)``); ``summary`` (which email it is, shown to the
        people watching) overrides the one read from the notification. ``received_at`` (when the message arrived,
        for a claim made without its notification) with ``thread_id``: a reply written from the mailbox in that
        thread ends the claim, as it does for a claim made from a notification, which carries both. A
        notification about a message the
        mailbox sent (in a sent folder, or from one of its own addresses: the client's ``sent_folders`` and
        ``mailbox_addresses``) is never claimed: entering reports it with RecordOutgoing, logs one line and
        raises :class:`OutgoingMessage`.
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
        return AsyncClaim(self, state, on_lost, cancel_on_loss)

    @overload
    def guard(
        self, fn: Callable[Concatenate[EventT, P], Awaitable[R]], /
    ) -> Callable[Concatenate[EventT, P], Coroutine[Any, Any, R | None]]: ...
    @overload
    def guard(self, fn: None = None, /, **options: Unpack[GuardOptions]) -> AsyncGuard: ...
    def guard(self, fn: Callable[..., Awaitable[Any]] | None = None, /, **options: Unpack[GuardOptions]) -> Any:
        """Decorator: ``async def answer(event, ...)`` runs inside ``reply_to(event)``, or not at all.

        ``event`` (the first argument) is what the handler has: the raw body, the decoded JSON event or a
        :class:`Notification`; it is passed on unchanged. Notifications of types not in ``events`` (default
        :data:`ANSWERED_EVENTS`: ``message.created`` and ``message.updated``) are skipped. The expected
        refusals (:class:`DuplicateDelivery`, :class:`ReplyHeld`, :class:`AlreadyReplied`, :class:`ClaimLost`)
        are logged, one line each, and the call returns ``None``; ``raise_refusals=True`` raises them instead.
        Inside, ``await inbox_claims.nylas.send(...)`` passes the fenced commit point (and
        ``inbox_claims.current_claim()`` is the claim, for ``await claim.send(...)`` with a send of your own).
        Use as ``@coord.guard`` or ``@coord.guard(ttl=120)``; options: :class:`GuardOptions`.
        """
        policy = ReplyPolicy.of(options)

        def decorate(
            fn: Callable[Concatenate[EventT, P], Awaitable[R]],
        ) -> Callable[Concatenate[EventT, P], Coroutine[Any, Any, R | None]]:
            @functools.wraps(fn)
            async def guarded_call(event: EventT, /, *args: P.args, **kwargs: P.kwargs) -> R | None:
                notification = policy.answered(event)
                if notification is not None:
                    with policy.absorbing(notification):
                        async with self.reply_to(notification, **policy.claim_options()):
                            return await fn(event, *args, **kwargs)
                return None

            return guarded_call

        return decorate if fn is None else decorate(fn)

    def guarded(
        self,
        *,
        ttl: int = 60,
        scope: Scope = "message",
        note: str = "",
        on_lost: Callable[[AsyncClaim], object] | None = None,
        cancel_on_loss: bool = False,
    ) -> Callable[
        [Callable[Concatenate[Notification, AsyncClaim, P], Awaitable[R]]],
        Callable[Concatenate[Notification, P], Coroutine[Any, Any, R]],
    ]:
        """Decorator: ``async fn(notification, claim, ...)`` runs inside ``reply_to(notification)``.

        The decorated coroutine function is called as ``await fn(notification, ...)``; it raises what
        ``reply_to`` raises (catch :class:`ClaimNotGranted` to ignore duplicates and messages not yours).
        """

        def decorate(
            fn: Callable[Concatenate[Notification, AsyncClaim, P], Awaitable[R]],
        ) -> Callable[Concatenate[Notification, P], Coroutine[Any, Any, R]]:
            @functools.wraps(fn)
            async def guarded_call(notification: Notification, /, *args: P.args, **kwargs: P.kwargs) -> R:
                guard = self.reply_to(
                    notification, ttl=ttl, scope=scope, note=note, on_lost=on_lost, cancel_on_loss=cancel_on_loss
                )
                async with guard as claim:
                    return await fn(notification, claim, *args, **kwargs)

            return guarded_call

        return decorate


def _identity(value: T) -> T:
    return value


class AsyncGuard(Protocol):
    """What ``AsyncCoordinator.guard(ttl=...)`` returns: a decorator of ``async def answer(event, ...)``."""

    def __call__(
        self, fn: Callable[Concatenate[EventT, P], Awaitable[R]], /
    ) -> Callable[Concatenate[EventT, P], Coroutine[Any, Any, R | None]]: ...


class AsyncClaim(ClaimBase):
    """A guarded claim of the asyncio client (from :meth:`AsyncCoordinator.reply_to`); an async context manager."""

    def __init__(
        self,
        client: AsyncCoordinator,
        state: GuardState,
        on_lost: Callable[[AsyncClaim], object] | None,
        cancel_on_loss: bool,
    ) -> None:
        super().__init__(state)
        self._client = client
        self._on_lost = on_lost
        self._cancel_on_loss = cancel_on_loss
        self._renewal: asyncio.Task[None] | None = None
        self._body: asyncio.Task[Any] | None = None
        self._cancelled_body = False
        self._admitted = False
        self.lost = asyncio.Event()
        """Set once the claim is found lost (taken over, expired, answered from the mailbox, or unrenewable)."""

    async def admit(self, *, within: float | None = None) -> Self:
        """Makes the claim's one ClaimReply call (a refusal is raised, as entering raises it) and starts its
        renewal, without entering the block yet: ``async with claim:`` later, in any task, runs the block on the
        claim already held. The webhook adapters admit in the request and answer Nylas only then (so that no
        notification is acknowledged that the coordinator did not record), and run the block in the background.
        ``within``: seconds for the call with its retries (default: the retry policy's); a claim granted after
        it gave up lapses with its TTL, and a redelivery of the notification claims again."""
        if self._admitted:
            return self
        deadline = time.monotonic() + within if within is not None else None
        await self._client._drive(self._state.enter(deadline))
        self._admitted = True
        self._renewal = asyncio.create_task(self._renew(), name=f"inbox-claims renewal {self.token}")
        return self

    async def __aenter__(self) -> Self:
        await self.admit()
        self._make_current()
        self._body = asyncio.current_task()
        return self

    async def _renew(self) -> None:
        try:
            loss = await self._client._drive(self._state.renewal())
        except Exception:
            log.exception("the renewal of %s stopped on an unexpected error", self.subject)
            return
        if loss is not None:
            await self._notice_loss(cancel=self._cancel_on_loss)

    async def _notice_loss(self, *, cancel: bool) -> None:
        if self.lost.is_set():
            return
        self.lost.set()
        if self._on_lost is not None:
            try:
                result = self._on_lost(self)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("the on_lost callback of %s raised", self.subject)
        if cancel and self._body is not None:
            self._cancelled_body = True
            self._body.cancel(f"inbox-claims: the claim on {self.subject} was lost")

    async def _stop_renewal(self) -> None:
        renewal, self._renewal = self._renewal, None
        if renewal is not None and renewal is not asyncio.current_task():
            renewal.cancel()
            await asyncio.wait([renewal])  # unlike awaiting it, does not raise its CancelledError here

    @overload
    async def send(self, fn: Awaitable[str | None], /) -> str | None: ...
    @overload
    async def send(
        self, fn: Callable[P, Awaitable[str | None] | str | None], /, *args: P.args, **kwargs: P.kwargs
    ) -> str | None: ...
    async def send(self, fn: Any, /, *args: Any, **kwargs: Any) -> str | None:
        """Sends the reply through the fenced commit point, once.

        ``fn`` is the send: an awaitable (``await claim.send(nylas.send(http, grant_id, draft))``), or a
        function called as ``fn(*args, **kwargs)`` (async or plain). BeginSend first (refused:
        :class:`ClaimLost`, and the send never runs: an awaitable is closed unawaited), then the send, which
        must give the sent message's id (``str``) or ``None``, then ConfirmSent. If the send raises
        :class:`SendRejected`, AbortSend frees the subject and the exception propagates; any other exception
        leaves the subject SENDING (reported IN_DOUBT later) and raises :class:`SendOutcomeUnknown` from it.
        Returns the sent message's id.
        """
        awaitable = None
        if not callable(fn):
            if not inspect.isawaitable(fn) or args or kwargs:
                raise TypeError(f"claim.send takes an awaitable, or a function and its arguments, not {fn!r}")
            awaitable, fn = fn, functools.partial(_identity, fn)
        await self._stop_renewal()
        try:
            return await self._client._drive(self._state.send(fn, args, kwargs))
        except ClaimLost:
            await self._notice_loss(cancel=False)
            raise
        finally:
            if inspect.iscoroutine(awaitable) and inspect.getcoroutinestate(awaitable) == inspect.CORO_CREATED:
                awaitable.close()  # never started (BeginSend refused): no "never awaited" warning

    async def mark_replied(self, *, sent_message_id: str = "", note: str = "") -> None:
        """Records that the reply was made outside ``send`` (by a person in a mail client, by phone): the
        subject becomes REPLIED and every later notification for it is answered ALREADY_REPLIED. Fenced like
        ``send``: raises :class:`ClaimLost` if the claim is no longer yours (nothing is recorded then)."""
        await self._stop_renewal()
        try:
            await self._client._drive(self._state.mark_replied(sent_message_id, note))
        except ClaimLost:
            await self._notice_loss(cancel=False)
            raise

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        body, self._body = self._body, None  # from here on, a loss no longer cancels anything
        self._stop_being_current()
        await self._stop_renewal()
        await self._client._drive(self._state.exit(failed=exc is not None, error=exc))
        if (
            self._cancelled_body
            and body is not None
            and body.uncancel() == 0
            and isinstance(exc, asyncio.CancelledError)
        ):
            raise self._state.lost_error() from exc
        return False
