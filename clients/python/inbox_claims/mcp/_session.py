"""The claims of one agent session, and the guarded send that both our server and the guard use.

A session is what one agent conversation holds: over stdio, the server process; over HTTP, one MCP session
(or, for clients without sessions, the server's principal), until it has been idle for the session timeout.
Its claims are ``AsyncClaim``s of the public client, entered by one tool call and left by another: renewed
at a third of their TTL while the session lives, released when it ends, and expiring by their TTL when the
process dies.

"The same call" of a send is the same reply (its fingerprint) to the same message. Its first answer is kept
for the process (``SentReplies``), so a model that retries gets it again; after a restart the coordinator's
state answers: a message REPLIED by this principal answers with its reply record, which is what the first
call answered too, and nothing is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from typing import Any

from .._async import AsyncClaim, AsyncCoordinator
from .._errors import AlreadyReplied, ClaimLost, ReplyHeld, SendOutcomeUnknown, SendRejected, SentButUnconfirmed
from .._types import MessageSummary, Subject, SubjectKind, SubjectState, SubjectStatus
from . import _answers as answers
from ._answers import Answer, Outcome

DEFAULT_TTL = 120
"""Seconds a session's claim lasts past its last renewal: how long after a crash the message frees."""

Deliver = Callable[[AsyncClaim], Awaitable[str | None]]
# A message's thread id and when it arrived: with both, a reply written from the mailbox in the thread ends a claim.
Thread = tuple[str, datetime]
"""The send itself, called after BeginSend with the claim (for its idempotency key); returns the sent message's
id. Raise ``SendRejected`` when it certainly did not send; any other exception leaves the outcome unknown."""


def fingerprint(arguments: Any) -> str:
    """What makes two sends "the same call": their arguments, canonical JSON, hashed."""
    canonical = json.dumps(arguments, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


@dataclasses.dataclass(frozen=True)
class _FirstSend:
    session: str
    fingerprint: str
    answer: Answer


class SentReplies:
    """The first answer of every send made in this process, by subject (sent, or of unknown outcome)."""

    def __init__(self) -> None:
        self._first: dict[Subject, _FirstSend] = {}

    def first(self, subject: Subject) -> _FirstSend | None:
        return self._first.get(subject)

    def record(self, subject: Subject, session: str, fingerprint: str, answer: Answer) -> None:
        self._first.setdefault(subject, _FirstSend(session, fingerprint, answer))


class AgentSession:
    """The claims one agent session holds, through one coordinator client."""

    def __init__(
        self, coordinator: AsyncCoordinator, *, ttl: int = DEFAULT_TTL, sent: SentReplies | None = None
    ) -> None:
        self.coordinator = coordinator
        self.ttl = ttl
        self.id = uuid.uuid4().hex
        self.last_used = time.monotonic()
        self._sent = sent if sent is not None else SentReplies()
        self._claims: dict[Subject, AsyncClaim] = {}
        self._locks: dict[Subject, asyncio.Lock] = {}
        self._principal: str | None = coordinator.principal
        self._closed = False

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
        async with self._one_call(subject):
            held = self._claims.get(subject)
            if held is not None and held.loss is not None:
                answer = answers.lost(held.loss, await self.principal())
                await self._drop(subject)
                return answer
            got = held if held is not None else await self._acquire(subject, summary, note, thread)
            if isinstance(got, SubjectStatus):
                return answers.refusal(got, await self.principal())
            return answers.granted(subject, got.expires_at, again=held is not None)

    async def send(
        self,
        subject: Subject,
        reply_fingerprint: str,
        deliver: Deliver,
        *,
        summary: MessageSummary | None = None,
        note: str = "",
        thread: Thread | None = None,
    ) -> Answer:
        """The guarded send: claim unless held, BeginSend (fenced), ``deliver``, ConfirmSent (or AbortSend)."""
        async with self._one_call(subject):
            first = self._sent.first(subject)
            if first is not None and first.session == self.id:
                return first.answer if first.fingerprint == reply_fingerprint else answers.different_reply(first.answer)
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
            except SendRejected as rejected:
                return answers.not_sent(subject, rejected.reason)
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
        return answers.refusal(status, me)

    async def mark_replied(self, subject: Subject, *, sent_message_id: str = "", note: str = "") -> Answer:
        async with self._one_call(subject):
            got = await self._held_or_acquired(subject, None, note)
            me = await self.principal()
            if isinstance(got, SubjectStatus):
                return answers.refusal(got, me)
            try:
                await got.mark_replied(sent_message_id=sent_message_id, note=note)
            except ClaimLost as loss:
                return answers.lost(loss, me)
            finally:
                await self._drop(subject)
            assert got.status is not None
            return answers.marked(got.status)

    async def release(self, subject: Subject) -> Answer:
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
        """The session ended: every claim it still holds is released (nothing sent stays as it is)."""
        self._closed = True
        for subject in tuple(self._claims):
            await self._drop(subject)


__all__ = ["DEFAULT_TTL", "AgentSession", "Answer", "Deliver", "Outcome", "SentReplies", "Thread", "fingerprint"]
