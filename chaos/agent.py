"""An agent process: a webhook endpoint that answers emails through the real client shim.

It does what docs/design.md#who-uses-it asks of an agent: verify the Nylas signature on the raw body, ack 200 at once,
then (in the background) ``reply_to(notification)`` (delivery dedup and claim in one call), draft for a long-
tailed time while the shim renews the claim, and ``claim.send(fn)`` through the fenced commit point, where ``fn``
posts the reply to the sink with the claim's idempotency key and fencing token.

``--unfenced`` is the negative control, a lease-only lock: the agent still claims (and the claim is still
renewed), but after drafting it posts straight to the sink without passing BeginSend and without looking at
whether it still holds the claim; only afterwards does it record the reply through ``claim.send``. A paused or
taken-over agent then sends a second reply, which the checker must catch. There is no such switch in the
coordinator.

``--ignore-outgoing`` is the negative control of replies written outside the coordinator: the agent hides from
the shim that a notification is about a message the mailbox sent (no folders, a customer as sender), as a client
that never looks would. It then answers a person's reply from Gmail as if a customer had written, and the
coordinator never learns that the person answered, so a drafting agent sends too.

Before it claims, the agent reads the message with its headers from the mail API (``GET
/v3/grants/{grant}/messages/{id}?fields=include_headers``, what the Nylas provider does with an API key: a webhook
carries no headers), so that the client's automated-mail rules see ``Auto-Submitted``, ``List-Id``... and leave
such mail to people (``AutomatedMessage``).

Right before the commit point the agent looks at the thread (unless ``--no-look``): its send is passed to
``claim.send`` as a provider's reply to the message's facts, whose provider is the Nylas provider on the mail API
(the sink), so the guard asks it for the thread's messages received since (``NylasProvider.look``) and records
what it finds (a person's reply: RecordOutgoing; a customer's newer message: RecordIncoming) before BeginSend.

``--ignore-reply-rules`` is the negative control of the reply-storm rules (docs/design.md#reply-storms): the agent
does not read the headers (the client sees no automated mail), and sends anyway when BeginSend refuses (the reply
budget spent, the conversation moved on), as a send path without the rules would. The coordinator has no such
switch: the rules are off in this agent only.

Every step is a line in the agent's JSON-lines log (``--log``), which the harness reads to know which claims a
process holds when it kills or pauses it, and which the checker reads at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from inbox_claims import (
    AlreadyReplied,
    AsyncClaim,
    AsyncCoordinator,
    ClaimLost,
    CoordinatorError,
    CoordinatorUnavailable,
    DuplicateDelivery,
    InboxClaimsError,
    OutgoingMessage,
    ReplyHeld,
    RetryPolicy,
    SendOutcomeUnknown,
    SendRejected,
    SentButUnconfirmed,
    Subject,
)
from inbox_claims import Notification as Envelope
from inbox_claims.errors import AutomatedMessage, ConversationMovedOn, ReplyBudgetSpent, ReplyRefused
from inbox_claims.providers import MessageFacts
from inbox_claims.providers._seam import Flow
from inbox_claims.providers.nylas import NylasProvider
from inbox_claims.providers.nylas import facts_of as nylas_facts
from inbox_claims.types import LossReason, SubjectKind
from inbox_claims.webhooks import WebhookVerificationError, parse_notification, verify_nylas_signature

from .common import JsonlLog, Request, Response, announce, exit_at, http_request, read_jsonl, serve_http
from .workload import SCOPE_FIELD, Scope

# Generous retries: a leader election or a killed coordinator must not make an agent give up a claim.
AGENT_RETRY = RetryPolicy(attempts=10, initial_backoff=0.1, max_backoff=2.0)
APP_RETRIES = 5
"""How often the agent itself tries a notification again after losing its claim or failing to reach the
coordinator (``--no-retry``: never, as in the README's example)."""


SENDER_KINDS = {"human": "human", "outside": "person"}
AUTO_SUBMITTED = ("Auto-Submitted", "auto-replied")
"""What marks an agent's reply (RFC 3834), so that the other side's responders leave it."""


def coordinator_client(targets: str, principal: str, kind: str = "agent") -> AsyncCoordinator:
    """A client of both coordinators: gRPC round-robins over them and skips one that is down."""
    return AsyncCoordinator(
        "ipv4:" + targets,
        principal=principal,
        kind="human" if kind == "human" else "agent",
        timeout=5.0,
        retry=AGENT_RETRY,
        channel_options=[("grpc.lb_policy_name", "round_robin")],
    )


async def post_reply(
    sink: str,
    subject: Subject,
    token: int,
    sender: str,
    *,
    mode: str,
    notification_id: str = "",
    idempotency_key: str = "",
    sent_id: str = "",
    reply_to: str = "",
) -> str:
    """Sends one reply through the sink (``idempotency_key`` defaults to the subject's). Returns the sent message
    id; raises :class:`SendRejected` on a 4xx (it certainly did not go out), anything else when the outcome is
    unknown. ``mode`` is ``fenced``, ``unfenced``, ``human`` (the helpdesk tool, through the coordinator) or
    ``outside`` (a person in Gmail, never through it, whose message id is ``sent_id``): the sender's kind is
    derived from it. An agent's reply is marked ``Auto-Submitted: auto-replied`` (RFC 3834) in Nylas's
    ``custom_headers``, a person's never. ``reply_to``: the message answered (default: the subject's id)."""
    reply_to = reply_to or subject.id
    kind = SENDER_KINDS.get(mode, "agent")
    headers = {
        "Content-Type": "application/json",
        "Idempotency-Key": idempotency_key or subject.idempotency_key,
        "X-Chaos-Token": str(token),
        "X-Chaos-Sender": sender,
        "X-Chaos-Sender-Kind": kind,
        "X-Chaos-Sent-Id": sent_id,
        "X-Chaos-Notification": notification_id,
        "X-Chaos-Subject-Kind": subject.kind.value,
        "X-Chaos-Subject-Id": subject.id,
        "X-Chaos-Mode": mode,
    }
    reply: dict[str, Any] = {"subject": f"Re: {reply_to}", "body": "Thanks!", "reply_to_message_id": reply_to}
    if kind == "agent":
        reply["custom_headers"] = [{"name": AUTO_SUBMITTED[0], "value": AUTO_SUBMITTED[1]}]
    body = json.dumps(reply).encode()
    path = f"/v3/grants/{subject.mailbox}/messages/send"
    status, answer = await http_request(sink, "POST", path, body=body, headers=headers, within=5.0)
    if status == 200:
        return str(json.loads(answer)["data"]["id"])
    if 400 <= status < 500:
        raise SendRejected(f"the mail API answered {status}")
    raise RuntimeError(f"the mail API answered {status}")


class Agent:
    def __init__(self, options: argparse.Namespace) -> None:
        self.name: str = options.name
        self.sink: str = options.sink
        self.secret: str = options.secret
        self.ttl: int = options.ttl
        self.unfenced: bool = options.unfenced
        self.ignore_outgoing: bool = options.ignore_outgoing
        self.ignore_reply_rules: bool = options.ignore_reply_rules
        self.looking = (
            None
            if options.no_look
            else NylasProvider(options.secret, api_key="chaos", api_base=f"http://{options.sink}")
        )
        self.retry: bool = not options.no_retry
        self.mode = "unfenced" if options.unfenced else "fenced"
        self.log = JsonlLog(options.log, agent=self.name, inc=options.incarnation)
        self.coord = coordinator_client(options.coordinators, self.name)
        self.rng = random.Random(f"agent/{options.seed}/{self.name}/{options.incarnation}")
        self.draft_mu = math.log(options.draft_median)
        self.draft_sigma: float = options.draft_sigma
        self.draft_cap: float = options.draft_cap
        self.inflight = 0
        self.redraft: dict[str, int] = {}
        """Notifications whose thread claim was refused because the conversation moved on: the newest date."""
        self.tasks: set[asyncio.Task[None]] = set()

    def draft_seconds(self) -> float:
        """An LLM call: lognormal, so most drafts are quick and a few outlast the TTL (renewal matters)."""
        return min(self.rng.lognormvariate(self.draft_mu, self.draft_sigma), self.draft_cap)

    async def handle(self, request: Request) -> Response:
        if request.method == "GET" and request.path == "/idle":
            return Response(200, json.dumps({"inflight": self.inflight}).encode())
        if request.method != "POST" or request.path != "/webhook":
            return Response(404)
        try:
            verify_nylas_signature(request.body, request.headers.get("x-nylas-signature"), self.secret)
            notification = parse_notification(request.body)
        except (WebhookVerificationError, ValueError) as error:
            self.log.write("bad_webhook", error=str(error))
            return Response(400, b'{"error":"bad webhook"}')
        # The work queue is the log: a delivery is written down before the 200, so that a restarted agent can
        # finish what its previous incarnation accepted (see replay()).
        work_id = uuid.uuid4().hex[:12]
        self.log.write(
            "delivery",
            nid=notification.notification_id,
            attempt=notification.delivery_attempt or 0,
            work=work_id,
            body=request.body.decode(),
        )
        self.spawn(notification, work_id, dedup=True)
        return Response(200, b"{}")  # ack at once; the work happens after

    def spawn(self, notification: Envelope, work_id: str, *, dedup: bool) -> None:
        task = asyncio.create_task(self.process(notification, work_id, dedup=dedup))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def replay(self, log_path: Path) -> None:
        """Takes up the deliveries that an earlier incarnation accepted and never finished (it was killed)."""
        accepted: dict[str, dict[str, Any]] = {}
        for event in read_jsonl(log_path):
            if event.get("ev") == "delivery" and event.get("work"):
                accepted[str(event["work"])] = event
            elif event.get("ev") == "finished":
                accepted.pop(str(event.get("work")), None)
        for work_id, event in accepted.items():
            self.log.write("replay", nid=event["nid"], work=work_id)
            self.spawn(parse_notification(event["body"]), work_id, dedup=False)

    async def process(self, notification: Envelope, work_id: str, *, dedup: bool) -> None:
        """Answers one notification, trying again (bounded) while nobody is known to be answering it."""
        self.inflight += 1
        nid = notification.notification_id
        try:
            for attempt in range(1 + (APP_RETRIES if self.retry else 0)):
                if attempt and nid not in self.redraft:
                    await asyncio.sleep(self.ttl + 2.0)  # any claim of ours from the last attempt has lapsed
                    self.log.write("retry", nid=nid, attempt=attempt)
                if not await self.attempt(notification, dedup=dedup):
                    return
                dedup = False
            self.log.write("gave_up", nid=nid)
        except Exception as error:  # a bug in the harness or the shim: recorded, never silent
            where = "".join(traceback.format_exception(error)[-3:])
            self.log.write("crash", nid=nid, error=f"{type(error).__name__}: {error}", where=where)
        finally:
            self.log.write("finished", nid=nid, work=work_id)
            self.inflight -= 1

    async def attempt(self, notification: Envelope, *, dedup: bool) -> bool:
        """One claim and, if granted, one answer. True: try again later (the claim was lost, not taken over, or
        the coordinator was unreachable): a notification that was acked is never delivered again, so the agent
        itself must see the message answered.

        The first attempt dedups on the notification id. Later ones (and replays) claim the message without it:
        after a lost claim the shim releases it on leaving the block, and the coordinator then counts the
        notification as handled, so the same id would be refused as a duplicate (docs/reliability.md, findings).
        Claiming without it cannot cause a second reply: the claim and the commit point still fence.
        """
        nid = notification.notification_id
        scope: Scope = "thread" if notification.object.get(SCOPE_FIELD) == "thread" else "message"
        newer = self.redraft.pop(nid, None)
        if newer is not None:  # the thread moved on while we drafted: draft again, with its newest message
            notification = dated(notification, newer)
            self.log.write("redraft", nid=nid, date=newer)
        if not self.ignore_reply_rules:
            try:
                notification = await self.with_headers(notification)
            except (OSError, TimeoutError, RuntimeError, ValueError) as error:
                self.log.write("claim_error", nid=nid, error=f"headers: {type(error).__name__}: {error}")
                return True
        if self.ignore_outgoing:
            notification = looks_incoming(notification)
        guard = self.coord.reply_to(
            notification,
            scope=scope,
            ttl=self.ttl,
            note=f"{self.name} drafting",
            notification_id=None if dedup else "",
            on_lost=lambda claim: self.on_lost(claim, nid),
        )
        try:
            async with guard as claim:
                date = notification.object.get("date")
                facts = nylas_facts(notification)
                return await self.answer(
                    claim, nid, notification.message_id or "", date if isinstance(date, int) else 0, facts
                )
        except DuplicateDelivery:
            self.log.write("refused", nid=nid, msg=notification.message_id, why="duplicate")
        except ReplyHeld as held:
            self.log.write("refused", nid=nid, msg=notification.message_id, why="held", holder=held.holder)
            return not dedup and held.holder == self.name  # our own claim from the last attempt, lapsing
        except AlreadyReplied as replied:
            self.log.write("refused", nid=nid, msg=notification.message_id, why="replied", state=replied.state.value)
        except AutomatedMessage as automated:
            # Recorded for people (RecordIncoming) when ``result`` is set: that is when the thread moved on.
            self.log.write("automated", nid=nid, why=automated.why, recorded=automated.result is not None,
                           **({"msg": notification.message_id} if automated.result is not None else {}))  # fmt: skip

        except OutgoingMessage as outgoing:
            result = outgoing.result
            self.log.write(
                "outgoing",
                nid=nid,
                id=notification.message_id,
                thread=notification.thread_id,
                outcome=result.outcome.value if result else "not_recorded",
                subjects=[
                    {"kind": status.subject.kind.value, "id": status.subject.id, "state": status.state.value}
                    for status in (result.subjects if result else ())
                ],
            )
        except CoordinatorUnavailable as error:
            self.log.write("claim_error", nid=nid, error=f"{type(error).__name__}: {error}")
            return True
        except InboxClaimsError as error:
            self.log.write("claim_error", nid=nid, error=f"{type(error).__name__}: {error}")
        finally:
            if guard.token:
                self.log.write("done", nid=nid, token=guard.token)
        return False

    def on_lost(self, claim: AsyncClaim, nid: str) -> None:
        self.log.write("loss_seen", nid=nid, token=claim.token, reason=_reason(claim))

    async def answer(
        self, claim: AsyncClaim, nid: str, message_id: str, date: int, facts: MessageFacts | None = None
    ) -> bool:
        """Drafts and sends. True when the claim was lost because the coordinator could not be reached."""
        subject = claim.subject
        token = claim.token
        where = {"mailbox": subject.mailbox, "kind": subject.kind.value, "id": subject.id}
        expires = claim.expires_at.timestamp() if claim.expires_at else 0.0
        self.log.write(
            "granted", nid=nid, msg=message_id, date=date, token=token, expires=expires,
            dedup=bool(claim.notification_id), **where,
        )  # fmt: skip
        await asyncio.sleep(self.draft_seconds())

        async def send() -> str:
            self.log.write("sending", nid=nid, token=token)
            sent_id = await post_reply(
                self.sink, subject, token, self.name, mode=self.mode, notification_id=nid,
                idempotency_key=claim.idempotency_key,
            )  # fmt: skip
            self.log.write("sent", nid=nid, token=token, sent_id=sent_id)
            return sent_id

        if self.unfenced:
            return await self.answer_unfenced(claim, nid, send)
        if claim.lost.is_set():  # the shim saw the loss first (renewal refused or impossible): do not even try
            self.log.write("lost", nid=nid, token=token, where="renewal", reason=_reason(claim))
            return _reason(claim) not in FINAL_LOSSES
        try:
            self.log.write("begin", nid=nid, token=token)  # before BeginSend: chaos/storms.py orders it after records
            if self.looking is not None and facts is not None:
                sent_id = await claim.send(Looking(self.looking, send, self.log, nid).reply, facts)
            else:
                sent_id = await claim.send(send)
            self.log.write("confirmed", nid=nid, token=token, sent_id=sent_id, **where)
        except ReplyRefused as refused:
            scope = refused.scope if isinstance(refused, ReplyBudgetSpent) else ""
            self.log.write(
                "send_refused", nid=nid, msg=message_id, token=token, refusal=refused.kind.value, scope=scope,
                reason=refused.reason, **where,
            )  # fmt: skip
            if self.ignore_reply_rules:
                await send()
            elif isinstance(refused, ConversationMovedOn) and claim.subject.kind is SubjectKind.THREAD:
                # A thread claim answers the whole conversation, and the newer message's handler was told the
                # thread was held (ReplyHeld) and left it: the holder drafts again, with the newest message.
                self.redraft[nid] = int(refused.newer_received_at.timestamp()) if refused.newer_received_at else 0
                return True
        except ClaimLost as lost:
            self.log.write("lost", nid=nid, token=token, where="begin_send", reason=lost.reason.value)
            return lost.reason.value not in FINAL_LOSSES
        except SendRejected as rejected:
            self.log.write("rejected", nid=nid, token=token, reason=rejected.reason)
        except SendOutcomeUnknown as unknown:
            self.log.write("unknown", nid=nid, token=token, error=repr(unknown.__cause__))
        except SentButUnconfirmed as unconfirmed:
            self.log.write("unconfirmed", nid=nid, token=token, error=str(unconfirmed))
        except CoordinatorError as error:
            # BeginSend failed: the send function never ran (e.g. FAILED_PRECONDITION for a BeginSend retried after
            # its own first attempt had committed and the subject had gone IN_DOUBT). Nothing went out: try again.
            self.log.write("send_error", nid=nid, token=token, error=f"{type(error).__name__}: {error}")
            return True
        return False

    async def answer_unfenced(self, claim: AsyncClaim, nid: str, send: Callable[[], Awaitable[str]]) -> bool:
        """The lease-only lock: send first, whatever the claim's state, then record."""
        token = claim.token
        subject = claim.subject
        try:
            sent_id = await send()
        except Exception as error:
            self.log.write("unknown", nid=nid, token=token, error=repr(error))
            return False
        try:
            await claim.send(lambda: sent_id)
            self.log.write(
                "confirmed",
                nid=nid,
                token=token,
                sent_id=sent_id,
                mailbox=subject.mailbox,
                kind=subject.kind.value,
                id=subject.id,
            )
        except ClaimLost as lost:
            self.log.write("lost", nid=nid, token=token, where="after_unfenced_send", reason=lost.reason.value)
        except InboxClaimsError as error:
            self.log.write("unconfirmed", nid=nid, token=token, error=str(error))
        return False

    async def with_headers(self, notification: Envelope) -> Envelope:
        """The notification with its message's headers, read from the mail API as the Nylas provider reads them;
        as it is when the message is gone (404)."""
        mailbox, message_id = notification.mailbox, notification.message_id
        if not mailbox or not message_id:
            return notification
        path = f"/v3/grants/{mailbox}/messages/{message_id}?fields=include_headers"
        started = time.monotonic()
        status, body = await http_request(self.sink, "GET", path, within=5.0)
        self.log.write("headers_read", msg=message_id, status=status, ms=round((time.monotonic() - started) * 1000, 2))
        if status == 404:
            return notification
        if status != 200:
            raise RuntimeError(f"reading {message_id} with its headers answered HTTP {status}")
        document = json.loads(json.dumps(dict(notification.raw)))
        document["data"]["object"]["headers"] = json.loads(body)["data"].get("headers", [])
        return parse_notification(document)


# Losses after which someone else answers (or answered): the agent does not try the notification again.
FINAL_LOSSES = {LossReason.TAKEN_OVER.value, LossReason.ANSWERED_OUTSIDE.value}


def looks_incoming(notification: Envelope) -> Envelope:
    """The notification with what tells an outgoing message removed (``--ignore-outgoing``)."""
    document = json.loads(json.dumps(dict(notification.raw)))
    document["data"]["object"]["folders"] = ["INBOX"]
    document["data"]["object"]["from"] = [{"email": "customer@example.com"}]
    return parse_notification(document)


class Looking:
    """The agent's send as a provider's reply (``claim.send(Looking(provider, send).reply, facts)``), so that the
    guard looks at the thread through ``provider.look`` right before the commit point."""

    def __init__(self, provider: NylasProvider, send: Callable[[], Awaitable[str]], log: JsonlLog, nid: str) -> None:
        self.provider = provider
        self.mailbox_addresses = provider.mailbox_addresses
        self._send = send
        self._log = log
        self._nid = nid

    def look(self, message: MessageFacts) -> Flow[tuple[MessageFacts, ...]]:
        started = time.monotonic()
        found = yield from self.provider.look(message)
        ms = round((time.monotonic() - started) * 1000, 2)
        self._log.write("looked", nid=self._nid, ms=ms, found=[facts.message_id for facts in found])
        return found

    async def reply(self, message: MessageFacts) -> str:
        return await self._send()


def dated(notification: Envelope, date: int) -> Envelope:
    """The notification as if about the thread's newest message (received at ``date``): a thread claim made
    from it is one for the conversation as it is now."""
    document = json.loads(json.dumps(dict(notification.raw)))
    if date:
        document["data"]["object"]["date"] = date
    return parse_notification(document)


def _reason(claim: AsyncClaim) -> str:
    return claim.loss.reason.value if claim.loss is not None else "unknown"


async def run(options: argparse.Namespace) -> None:
    agent = Agent(options)
    if agent.retry:
        agent.replay(options.log)
    host, _, port = options.listen.rpartition(":")
    await serve_http(host, int(port), agent.handle)
    agent.log.write("started", mode=agent.mode, ttl=agent.ttl)
    announce(f"ready {options.listen}")
    await exit_at(time.time() + options.lifetime)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos agent")
    parser.add_argument("--name", required=True)
    parser.add_argument("--incarnation", type=int, default=1)
    parser.add_argument("--listen", required=True, help="HOST:PORT of the webhook endpoint")
    parser.add_argument("--coordinators", required=True, help="HOST:PORT,HOST:PORT")
    parser.add_argument("--sink", required=True, help="HOST:PORT of the mail API")
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--secret", required=True, help="the webhook signing secret")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ttl", type=int, default=5)
    parser.add_argument("--draft-median", type=float, default=1.2)
    parser.add_argument("--draft-sigma", type=float, default=1.0)
    parser.add_argument("--draft-cap", type=float, default=20.0)
    parser.add_argument("--unfenced", action="store_true", help="NEGATIVE CONTROL: send without the commit point")
    parser.add_argument(
        "--ignore-outgoing", action="store_true", help="NEGATIVE CONTROL: treat messages the mailbox sent as incoming"
    )
    parser.add_argument(
        "--ignore-reply-rules",
        action="store_true",
        help="NEGATIVE CONTROL: answer automated mail and send when BeginSend refuses (budget, moved on)",
    )
    parser.add_argument("--no-look", action="store_true", help="do not look at the thread before the commit point")
    parser.add_argument(
        "--no-retry", action="store_true", help="never try a notification again after the coordinator was unreachable"
    )
    parser.add_argument("--lifetime", type=float, default=3600.0)
    options = parser.parse_args(argv)
    asyncio.run(run(options))
    return 0
