"""The claims of one agent session, and the guarded send that both our server and the guard use.

A session is what one agent conversation holds: over stdio, the server process; over HTTP, one MCP session
(or, for clients without sessions, the server's principal), until it has been idle for the session timeout.
Its claims are ``AsyncClaim``s of the public client, entered by one tool call and left by another: renewed
at a third of their TTL while the session lives, released when it ends, and expiring by their TTL when the
process dies.

"The same call" of a send is the same reply (its fingerprint) to the same message by this principal (the
process's). A send runs in a task of its own, shielded from the tool call that started it: a client that gives
up waiting (its timeout, a dropped connection) leaves the send to finish and record its answer, and the claim
in the session that made it, never orphaned. A repeat of the call while it runs waits for it and gets its
answer; a repeat after it gets its first answer again (``SentReplies``, kept for the process), whichever session
makes it; after a restart the coordinator's state answers: a message REPLIED by this principal answers with its
reply record, which is what the first call answered too, and nothing is sent. The other operations (claim,
mark replied, release) run shielded too, for the same reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from datetime import datetime
from typing import Any, TypeVar

from .._async import AsyncClaim, AsyncCoordinator
from .._errors import (
    AlreadyReplied,
    ClaimLost,
    ReplyHeld,
    ReplyRefused,
    SendOutcomeUnknown,
    SendRejected,
    SentButUnconfirmed,
)
from .._types import MessageSummary, Subject, SubjectKind, SubjectState, SubjectStatus
from . import _answers as answers
from ._answers import Answer, Outcome

DEFAULT_TTL = 120
"""Seconds a session's claim lasts past its last renewal: how long after a crash the message frees."""
REMEMBERED_SENDS = 100_000
"""How many sends' first answers a process keeps for their repeats (the oldest forgotten first; a repeat of a
forgotten one is answered from the coordinator's reply record)."""

log = logging.getLogger("inbox_claims.mcp")
_T = TypeVar("_T")


class NotHandedOver(SendRejected):
    """The send never reached the mail service (it could not be reached): nothing went out, and the message is
    free again. Raised by a ``Deliver`` that knows so, or by a send's ``ready`` check before its commit point."""


Deliver = Callable[[AsyncClaim], Awaitable[str | None]]
"""The send itself, called after BeginSend with the claim (for its idempotency key); returns the sent message's
id. Raise ``SendRejected`` when it certainly did not send (``NotHandedOver`` when it never reached the mail
service); any other exception leaves the outcome unknown."""
Ready = Callable[[], Awaitable[None]]
"""Called before a send's commit point: raises ``NotHandedOver`` when the mail service cannot be reached now."""
# A message's thread id and when it arrived: with both, a reply written from the mailbox in the thread ends a claim.
Thread = tuple[str, datetime]


def fingerprint(arguments: Any) -> str:
    """What makes two sends "the same call": their arguments, canonical JSON, hashed."""
    canonical = json.dumps(arguments, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


@dataclasses.dataclass(frozen=True)
class _FirstSend:
    session: str
    fingerprint: str
    answer: Answer


@dataclasses.dataclass(frozen=True)
class _Running:
    session: str
    fingerprint: str
    task: asyncio.Task[Answer]


class SentReplies:
    """The sends of this process, by subject: the one running now, and the first answer of each (sent, or of
    unknown outcome)."""

    def __init__(self, *, remembered: int = REMEMBERED_SENDS) -> None:
        self._first: OrderedDict[Subject, _FirstSend] = OrderedDict()
        self._running: dict[Subject, _Running] = {}
        self._remembered = remembered

    def first(self, subject: Subject) -> _FirstSend | None:
        return self._first.get(subject)

    def running(self, subject: Subject) -> _Running | None:
        return self._running.get(subject)

    def record(self, subject: Subject, session: str, fingerprint: str, answer: Answer) -> None:
        if subject not in self._first:
            self._first[subject] = _FirstSend(session, fingerprint, answer)
            while len(self._first) > self._remembered:
                self._first.popitem(last=False)

    def start(self, subject: Subject, session: str, fingerprint: str, task: asyncio.Task[Answer]) -> None:
        self._running[subject] = _Running(session, fingerprint, task)
        task.add_done_callback(lambda _done: self._finished(subject, task))

    def _finished(self, subject: Subject, task: asyncio.Task[Answer]) -> None:
        running = self._running.get(subject)
        if running is not None and running.task is task:
            del self._running[subject]


class AgentSession:
    """The claims one agent session holds, through one coordinator client.

    ``handle`` names the session for a client that has no session of its own (the 2026-07-28 protocol): the
    answers of a claim give it (``claim_handle``), and a later call that passes it back acts in this session.
    ``sessionless``: the session was made for such a client (its answers say to pass the handle back)."""

    def __init__(
        self,
        coordinator: AsyncCoordinator,
        *,
        ttl: int = DEFAULT_TTL,
        sent: SentReplies | None = None,
        sessionless: bool = False,
    ) -> None:
        self.coordinator = coordinator
        self.ttl = ttl
        self.id = uuid.uuid4().hex
        self.handle = "ch-" + secrets.token_urlsafe(18)
        self.sessionless = sessionless
        self.busy = 0
        """Operations of this session running now (each in a task of its own, which outlives its tool call)."""
        self.last_used = time.monotonic()
        self._sent = sent if sent is not None else SentReplies()
        self._claims: dict[Subject, AsyncClaim] = {}
        self._locks: dict[Subject, asyncio.Lock] = {}
        self._principal: str | None = coordinator.principal
        self._closed = False

    async def _shielded(self, operation: Coroutine[Any, Any, _T]) -> _T:
        """Runs ``operation`` in a task of its own, so that the tool call awaiting it may be cancelled (its client
        gave up) without cutting it in half: a claim taken is kept by the session, a send finishes and is
        recorded."""
        return await asyncio.shield(self._task(operation))

    def _task(self, operation: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
        self.busy += 1
        task = asyncio.ensure_future(operation)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Future[Any]) -> None:
        self.busy -= 1
        self.last_used = time.monotonic()
        if not task.cancelled() and task.exception() is not None:
            log.debug("a tool call's operation failed after its client left: %s", task.exception())

    @property
    def ended(self) -> bool:
        """``close()`` was called: the session takes no more calls."""
        return self._closed

    @property
    def held(self) -> tuple[Subject, ...]:
        """The subjects this session holds now."""
        return tuple(self._claims)

    async def principal(self) -> str:
        """Who this session's claims are held by (asked of the coordinator once when a token says it)."""
        if self._principal is None:
            self._principal = (await self.coordinator.caller()).principal
        return self._principal

    @contextlib.asynccontextmanager
    async def _one_call(self, subject: Subject) -> AsyncIterator[None]:
        """One tool call at a time per message in this session (a model may call tools in parallel)."""
        if self._closed:
            raise RuntimeError("this session has ended")
        self.last_used = time.monotonic()
        lock = self._locks.setdefault(subject, asyncio.Lock())
        async with lock:
            yield

    async def _acquire(
        self, subject: Subject, summary: MessageSummary | None, note: str, thread: Thread | None
    ) -> AsyncClaim | SubjectStatus:
        """The claim, entered and kept, or the status of whoever has the message instead. With ``thread`` (the
        message's thread and when it arrived), a reply written from the mailbox in that thread ends the claim."""
        scoped: dict[str, Any] = (
            {"scope": "thread", "thread_id": subject.id}
            if subject.kind is SubjectKind.THREAD
            else {"message_id": subject.id}
        )
        if thread is not None:
            scoped["thread_id"], scoped["received_at"] = thread
        claim = self.coordinator.reply_to(mailbox=subject.mailbox, ttl=self.ttl, note=note, summary=summary, **scoped)
        try:
            await claim.__aenter__()
        except (ReplyHeld, AlreadyReplied) as refused:
            return refused.status
        self._claims[subject] = claim
        return claim

    async def _drop(self, subject: Subject) -> None:
        """Leaves the claim's block: an unsent claim is released, a finished send left as it is."""
        claim = self._claims.pop(subject, None)
        if claim is not None:
            await claim.__aexit__(None, None, None)

    async def _held_or_acquired(
        self, subject: Subject, summary: MessageSummary | None, note: str, thread: Thread | None = None
    ) -> AsyncClaim | SubjectStatus:
        held = self._claims.get(subject)
        return held if held is not None else await self._acquire(subject, summary, note, thread)

    # -- the tools' operations ---------------------------------------------------------------------------------

    async def claim(
        self,
        subject: Subject,
        *,
        summary: MessageSummary | None = None,
        note: str = "",
        thread: Thread | None = None,
    ) -> Answer:
        return await self._shielded(self._claim(subject, summary, note, thread))

    async def _claim(
        self, subject: Subject, summary: MessageSummary | None, note: str, thread: Thread | None
    ) -> Answer:
        async with self._one_call(subject):
            held = self._claims.get(subject)
            if held is not None and held.loss is not None:
                answer = answers.lost(held.loss, await self.principal())
                await self._drop(subject)
                return answer
            got = held if held is not None else await self._acquire(subject, summary, note, thread)
            if isinstance(got, SubjectStatus):
                return answers.refusal(got, await self.principal(), sessionless=self.sessionless)
            again = held is not None
            return answers.granted(
                subject, got.expires_at, again=again, handle=self.handle, sessionless=self.sessionless
            )

    async def send(
        self,
        subject: Subject,
        reply_fingerprint: str,
        deliver: Deliver,
        *,
        summary: MessageSummary | None = None,
        note: str = "",
        thread: Thread | None = None,
        ready: Ready | None = None,
    ) -> Answer:
        """The guarded send: claim unless held, BeginSend (fenced), ``deliver``, ConfirmSent (or AbortSend).
        ``ready`` (the mail service can be reached) is asked before the claim and the commit point."""
        if self._closed:
            raise RuntimeError("this session has ended")
        self.last_used = time.monotonic()
        running = self._sent.running(subject)
        if running is not None:
            if running.fingerprint == reply_fingerprint:
                return await asyncio.shield(running.task)  # the same send, still running: its answer
            return answers.other_reply_running(subject, await self.principal())
        first = self._sent.first(subject)
        if first is not None and first.fingerprint == reply_fingerprint:
            return first.answer  # a repeat of a send this process made (this principal's)
        if first is not None and first.session == self.id:
            return answers.different_reply(first.answer)
        task = self._task(self._send(subject, reply_fingerprint, deliver, summary, note, thread, ready))
        self._sent.start(subject, self.id, reply_fingerprint, task)  # before any await: a repeat finds it
        return await asyncio.shield(task)

    async def _send(
        self,
        subject: Subject,
        reply_fingerprint: str,
        deliver: Deliver,
        summary: MessageSummary | None,
        note: str,
        thread: Thread | None,
        ready: Ready | None,
    ) -> Answer:
        async with self._one_call(subject):
            first = self._sent.first(subject)
            if ready is not None and subject not in self._claims:
                try:
                    await ready()
                except NotHandedOver as unreachable:
                    return answers.not_reached(subject, unreachable.reason, claimed=False)
            got = await self._held_or_acquired(subject, summary, note, thread)
            me = await self.principal()
            if isinstance(got, SubjectStatus):
                return self._answer_to_a_repeat(got, me, first)
            if got.loss is not None:
                answer = answers.lost(got.loss, me)
                await self._drop(subject)
                return answer
            try:
                await got.send(deliver, got)
            except ClaimLost as loss:
                return answers.lost(loss, me)
            except NotHandedOver as unreachable:
                return answers.not_reached(subject, unreachable.reason, claimed=True)
            except SendRejected as rejected:
                return answers.not_sent(subject, rejected.reason)
            except ReplyRefused as refusal:
                return answers.refused(refusal)
            except SendOutcomeUnknown as unknown:
                answer = answers.in_doubt(subject, str(unknown.__cause__ or unknown))
            except SentButUnconfirmed as unconfirmed:
                answer = answers.in_doubt(subject, str(unconfirmed), sent_message_id=unconfirmed.sent_message_id or "")
            else:
                assert got.status is not None
                answer = answers.sent(got.status)
            finally:
                await self._drop(subject)
            self._sent.record(subject, self.id, reply_fingerprint, answer)
            return answer

    def _answer_to_a_repeat(self, status: SubjectStatus, me: str, first: Any) -> Answer:
        """A send that found the message not free: a repeat of this principal's own confirmed send (after a
        restart, nothing in this process remembers it) answers the reply record, as the first call did."""
        ours = status.state is SubjectState.REPLIED and status.holder == me and not status.replied_by_hand
        if ours and first is None:
            return answers.sent(status)
        return answers.refusal(status, me, sessionless=self.sessionless)

    async def mark_replied(self, subject: Subject, *, sent_message_id: str = "", note: str = "") -> Answer:
        return await self._shielded(self._mark_replied(subject, sent_message_id, note))

    async def _mark_replied(self, subject: Subject, sent_message_id: str, note: str) -> Answer:
        async with self._one_call(subject):
            got = await self._held_or_acquired(subject, None, note)
            me = await self.principal()
            if isinstance(got, SubjectStatus):
                return answers.refusal(got, me, sessionless=self.sessionless)
            try:
                await got.mark_replied(sent_message_id=sent_message_id, note=note)
            except ClaimLost as loss:
                return answers.lost(loss, me)
            finally:
                await self._drop(subject)
            assert got.status is not None
            return answers.marked(got.status)

    async def release(self, subject: Subject) -> Answer:
        return await self._shielded(self._release(subject))

    async def _release(self, subject: Subject) -> Answer:
        async with self._one_call(subject):
            if subject not in self._claims:
                return answers.not_held(subject)
            await self._drop(subject)
            return answers.released(subject)

    async def who_is_answering(self, mailbox: str) -> list[dict[str, Any]]:
        self.last_used = time.monotonic()
        me = await self.principal()
        live = (SubjectState.CLAIMED, SubjectState.SENDING, SubjectState.IN_DOUBT)
        return [answers.described(status, me) async for status in self.coordinator.iter_claims(mailbox, states=live)]

    async def close(self) -> None:
        """The session ended: every claim it still holds is released (nothing sent stays as it is), each once the
        call at work on it, if any, is done (a send in flight finishes first)."""
        self._closed = True
        for subject in tuple(self._claims):
            async with self._locks.setdefault(subject, asyncio.Lock()):
                await self._drop(subject)


__all__ = [
    "DEFAULT_TTL",
    "AgentSession",
    "Answer",
    "Deliver",
    "NotHandedOver",
    "Outcome",
    "Ready",
    "SentReplies",
    "Thread",
    "fingerprint",
]
