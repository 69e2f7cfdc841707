"""Any mailbox over IMAP and SMTP behind the provider seam (docs/providers.md, "IMAP and SMTP"). Needs ``imapclient``
(the ``imap`` extra); SMTP is the standard library's ``smtplib``.

* No webhook: :class:`ImapWatcher` watches the mailbox itself. One IDLE connection per folder (the Inbox and the
  ``\\Sent`` special-use folder, RFC 6154), re-issued before the server's timeout (RFC 2177: 29 minutes; shorter by
  ``idle_seconds``), reconnecting after any drop; and a periodic check (``check_every``) as the fallback. Each wake
  is a delivery of the seam, admitted by the same code as a webhook's (:func:`inbox_claims.asgi.webhook_app`).
* Each folder's position is a coordinator cursor, ``imap:<folder>:<UIDVALIDITY>`` (docs/design.md#cursors): the
  last UID read, shared by every watcher of the mailbox, so that several watchers read each new message once and a
  restarted one starts where the mailbox was. A new UIDVALIDITY (the folder rebuilt) is a new cursor: its first round
  reads only the last day, as Gmail's resync does.
* The dedup key is ``imap:<folder>:<UIDVALIDITY>:<UID>``: UIDVALIDITY + UID name one message for good (RFC 3501
  2.3.1.1); the folder is in it because two folders may share a UIDVALIDITY (Dovecot derives it from the clock).
  The message id (the claim's subject) is the message's ``Message-ID``, the one id every folder and copy shares.
* A watcher that died mid-message left its claim to lapse: each periodic check (and a watcher's start) also reads the
  Inbox's unanswered messages of the last day behind the cursor, whose redelivery may claim again
  (docs/design.md#delivery-dedup); a message answered is flagged ``\\Answered``, as mail clients do.
* Outgoing: in the ``\\Sent`` folder, or from the mailbox's own addresses. The thread is the root of ``References``
  (else ``In-Reply-To``, else the message's own ``Message-ID``).
* Send: SMTP, with ``Message-ID: <key.token@domain>`` derived from the claim and ``X-Inbox-Claim`` (the stamp), then
  one APPEND of that message to Sent (``append_to_sent``; off for a server that files submitted mail itself): the copy
  whose stamp settles a send left IN_DOUBT.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import smtplib
import socket
import ssl as ssl_module
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime
from email.message import EmailMessage
from email.parser import BytesHeaderParser
from email.policy import default as default_policy
from email.utils import formatdate, getaddresses, parsedate_to_datetime
from typing import Any

from imapclient import IMAPClient  # type: ignore[import-untyped,unused-ignore]
from imapclient.exceptions import IMAPClientError  # type: ignore[import-untyped,unused-ignore]

from .._async import AsyncClaim, AsyncCoordinator
from .._current import agent_headers
from .._effects import Invoke, Sleep
from .._errors import InboxClaimsError, SendRejected
from ._httpx import current_stamp
from ._seam import (
    STAMP_HEADER,
    Accepted,
    Answer,
    Batch,
    ClaimStamp,
    CursorRange,
    Cursors,
    Flow,
    MessageFacts,
    ProviderError,
    ReplyContext,
    WebhookRequest,
    display,
    message_ids,
    parse_stamp,
    reply_subject,
)

__all__ = ["IDLE_SECONDS", "ImapProvider", "ImapSendOutcomeUnknown", "ImapSendRejected", "ImapWatcher", "Wake"]

log = logging.getLogger("inbox_claims.providers.imap")

IDLE_SECONDS = 29 * 60
"""RFC 2177: a client re-issues IDLE at least every 29 minutes, as servers may log it off after 30."""
CHECK_EVERY = 300.0
RANGE_TTL = 10
"""A folder's range lease: one read of what is new and its admission take well under a second; a watcher killed while
holding one leaves the folder to the others after this. A range that lapses under a slow holder is read twice, and
the second reading's claims are refused as duplicate deliveries."""
RESYNC_SECONDS = 24 * 3600
BUSY_WAIT_S = 0.25
BUSY_LOOKS = 16
RECONNECT_MAX_S = 10.0
IDLE_POLL_S = 1.0
"""How often an IDLE connection looks up from its wait: how soon a watcher closing is heard."""
_FETCH = [b"BODY.PEEK[HEADER]", b"FLAGS"]
QUIET_S = 1.0
"""A command connection unused for longer is tried (NOOP) before it is used."""
RETRY_MAX_S = 30.0
"""The longest wait before a watcher's failed read is tried again."""
_IMAP_ERRORS = (OSError, IMAPClientError, socket.timeout)


class ImapSendRejected(SendRejected):
    """The SMTP server refused the message (a refused sender or recipient, a refused DATA): nothing went out."""


class ImapSendOutcomeUnknown(InboxClaimsError):
    """The connection failed while the message was being handed over: it may have gone out. The subject stays
    SENDING, then IN_DOUBT, until its stamped copy in Sent settles it (RecordOutgoing) or a person does."""


@dataclass(frozen=True, slots=True)
class Wake:
    """A delivery the watcher opens itself: a folder changed (IDLE), or the periodic check (``recover``: also the
    Inbox's unanswered messages behind the cursor, whose claims may have lapsed)."""

    recover: bool = False


def _drop(client: IMAPClient) -> None:
    """Closes a connection, whatever state it is in (its socket too when the logout or shutdown fails)."""
    try:
        client.shutdown()
    except _IMAP_ERRORS:
        with contextlib.suppress(OSError):
            client.socket().close()


def _threaded(fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
    # imapclient and smtplib block: each call runs in a worker thread, awaited by the asyncio client.
    return asyncio.to_thread(fn, *args)


def _io(fn: Callable[..., Any], *args: Any) -> Invoke:
    return Invoke(_threaded, (fn, *args), {})


def _date(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


class ImapProvider:
    """One mailbox over IMAP (reads) and SMTP (replies); ``address`` is the mailbox's address, the mailbox the
    claims are in."""

    name = "imap"

    def __init__(
        self,
        address: str,
        *,
        host: str,
        username: str,
        password: str,
        port: int = 993,
        tls: bool = True,
        smtp_host: str | None = None,
        smtp_port: int = 587,
        smtp_tls: str = "starttls",
        smtp_username: str | None = None,
        smtp_password: str | None = None,
        inbox: str = "INBOX",
        sent_folder: str | None = None,
        append_to_sent: bool = True,
        mailbox_addresses: Sequence[str] = (),
        idle_seconds: float = IDLE_SECONDS,
        check_every: float = CHECK_EVERY,
        smtp_timeout: float = 30.0,
        imap_timeout: float = 30.0,
        ssl_context: ssl_module.SSLContext | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if "@" not in address:
            raise ValueError(f"address must be the mailbox's email address, not {address!r}")
        if not 0 < idle_seconds <= IDLE_SECONDS:
            raise ValueError(f"idle_seconds must be above 0 and at most {IDLE_SECONDS} (RFC 2177), not {idle_seconds}")
        if smtp_tls not in ("starttls", "tls", "none"):
            raise ValueError(f"smtp_tls must be 'starttls', 'tls' or 'none', not {smtp_tls!r}")
        self.address = address.lower()
        self.host, self.port, self.tls = host, port, tls
        self.username, self.password = username, password
        self.smtp_host = smtp_host or host
        self.smtp_port, self.smtp_tls, self.smtp_timeout = smtp_port, smtp_tls, smtp_timeout
        self.imap_timeout = imap_timeout
        self.smtp_username = username if smtp_username is None else smtp_username
        self.smtp_password = password if smtp_password is None else smtp_password
        self.inbox = inbox
        self.sent_folder = sent_folder
        self.append_to_sent = append_to_sent
        self.mailbox_addresses = (self.address, *(a.lower() for a in mailbox_addresses))
        self.idle_seconds = idle_seconds
        self.periodic_interval = check_every
        self.ssl_context = ssl_context
        self.clock = clock
        self.domain = self.address.rpartition("@")[2]
        self._lock = threading.Lock()
        self._client: IMAPClient | None = None
        self._used = 0.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> ImapProvider:
        """From ``IMAP_ADDRESS``, ``IMAP_HOST``, ``IMAP_USERNAME``, ``IMAP_PASSWORD``, ``IMAP_PORT`` (993),
        ``IMAP_TLS`` (``yes``), ``SMTP_HOST`` (the IMAP host), ``SMTP_PORT`` (587), ``SMTP_TLS`` (``starttls``,
        ``tls`` or ``none``), ``IMAP_CHECK_EVERY`` (the periodic check, seconds: 300), ``IMAP_IDLE_SECONDS`` (1740)
        and ``INBOX_MAILBOX_ADDRESSES``."""
        env = os.environ if environ is None else environ
        for name in ("IMAP_ADDRESS", "IMAP_HOST", "IMAP_USERNAME", "IMAP_PASSWORD"):
            if not env.get(name):
                raise ValueError(f"set {name} (docs/providers.md, IMAP and SMTP)")
        arguments: dict[str, Any] = {
            "host": env["IMAP_HOST"],
            "username": env["IMAP_USERNAME"],
            "password": env["IMAP_PASSWORD"],
            "port": int(env.get("IMAP_PORT") or 993),
            "tls": (env.get("IMAP_TLS") or "yes").lower() not in ("no", "false", "0"),
            "smtp_host": env.get("SMTP_HOST") or None,
            "smtp_port": int(env.get("SMTP_PORT") or 587),
            "smtp_tls": env.get("SMTP_TLS") or "starttls",
            "check_every": float(env.get("IMAP_CHECK_EVERY") or CHECK_EVERY),
            "idle_seconds": float(env.get("IMAP_IDLE_SECONDS") or IDLE_SECONDS),
            "mailbox_addresses": [a.strip() for a in env.get("INBOX_MAILBOX_ADDRESSES", "").split(",") if a.strip()],
        }
        arguments.update(overrides)
        return cls(env["IMAP_ADDRESS"], **arguments)

    # -- IMAP connections -----------------------------------------------------------------------------------

    def connect(self) -> IMAPClient:
        """A new logged-in connection (the watcher's IDLE connections, one per folder)."""
        client = IMAPClient(
            self.host, port=self.port, ssl=self.tls, ssl_context=self.ssl_context, timeout=self.imap_timeout
        )
        try:
            client.login(self.username, self.password)
        except BaseException:
            with contextlib.suppress(*_IMAP_ERRORS):
                client.shutdown()
            raise
        return client

    @contextlib.contextmanager
    def _session(self) -> Iterator[IMAPClient]:
        """The one command connection (reads, APPEND, flags), made again after any failure. One quiet for a while is
        tried with a NOOP first: a NAT or the server may have cut it, and an APPEND is not one to try twice."""
        with self._lock:
            if self._client is not None and time.monotonic() - self._used > QUIET_S:
                try:
                    self._client.noop()
                except _IMAP_ERRORS:
                    _drop(self._client)
                    self._client = None
            if self._client is None:
                self._client = self.connect()
            try:
                yield self._client
            except _IMAP_ERRORS:
                client, self._client = self._client, None
                _drop(client)
                raise
            finally:
                self._used = time.monotonic()

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(*_IMAP_ERRORS):
                client.logout()

    def sent(self) -> str:
        """The Sent folder: as given, else the one the server marks ``\\Sent`` (RFC 6154), else ``Sent``."""
        if self.sent_folder is None:
            with self._session() as client:
                found = client.find_special_folder(b"\\Sent")
            self.sent_folder = str(found) if found else "Sent"
        return self.sent_folder

    def folders(self) -> tuple[str, str]:
        """Sent first: a person's reply of a batch is recorded before the work on what it answered starts."""
        return self.sent(), self.inbox

    def _status(self, folder: str) -> tuple[int, int]:
        with self._session() as client:
            status = client.folder_status(folder, [b"UIDVALIDITY", b"UIDNEXT"])
        return int(status[b"UIDVALIDITY"]), int(status[b"UIDNEXT"])

    def _read(self, folder: str, validity: int, after: int, first: bool, recover: bool) -> dict[int, dict[bytes, Any]]:
        """The headers and flags of ``folder``'s messages past UID ``after`` (a first round: the last day's
        unanswered ones), and with ``recover`` the unanswered ones of the last day at or before it."""
        since = date.fromtimestamp(self.clock() - RESYNC_SECONDS)
        with self._session() as client:
            selected = client.select_folder(folder, readonly=True)
            if int(selected[b"UIDVALIDITY"]) != validity:
                raise ProviderError(f"{folder}'s UIDVALIDITY changed while it was read; read again")
            # A first round leaves what a mail client already flagged answered: someone did answer it.
            uids = [u for u in client.search(["UNANSWERED", "SINCE", since]) if u > after] if first else []
            if not first:
                # "N:*" answers the last message even when its UID is below N (RFC 3501 6.4.8).
                uids = [u for u in client.search(["UID", f"{after + 1}:*"]) if u > after]
            if recover and after:
                uids += [u for u in client.search(["UNANSWERED", "SINCE", since]) if u <= after]
            return dict(client.fetch(sorted(set(uids)), _FETCH)) if uids else {}

    # -- the seam ------------------------------------------------------------------------------------------------

    def check(self, request: WebhookRequest) -> Flow[Answer | Accepted]:
        return Answer(404, "an IMAP mailbox has no webhook: run ImapWatcher")
        yield  # no effect

    def acknowledge(self) -> Answer:
        return Answer(200, "read")

    def periodic(self) -> Accepted:
        """The periodic check: every folder past its cursor, and the Inbox's unanswered messages behind it."""
        return Accepted(Wake(recover=True))

    def open(self, accepted: Accepted, cursors: Cursors) -> Flow[Batch]:
        wake = accepted.delivery if isinstance(accepted.delivery, Wake) else Wake()
        folders = yield _io(self.folders)
        facts: list[MessageFacts] = []
        moves: list[tuple[str, CursorRange, int]] = []
        for folder in folders:
            validity, next_uid = yield _io(self._status, folder)
            name = f"imap:{folder}:{validity}"
            recover = wake.recover and folder == self.inbox
            range_ = yield from self._take(cursors, name, 0 if recover else next_uid - 1, wake.recover)
            if range_ is None:
                continue
            found = yield _io(self._read, folder, validity, range_.position, not range_.value, recover)
            for uid, item in sorted(found.items()):
                facts.append(self.facts(folder, validity, uid, item))
            # Past every UID the read covered: what it left (older than a day, answered, expunged) it left for good.
            end = max([range_.position, next_uid - 1, *(uid for uid in found if uid > range_.position)])
            moves.append((name, range_, end))

        def commit() -> Flow[None]:
            for name, range_, end in moves:
                yield from cursors.advance(self.address, name, range_, str(end), end)

        def abandon() -> Flow[None]:
            for name, range_, _end in moves:
                yield from cursors.advance(self.address, name, range_, range_.value, range_.position)

        return Batch(tuple(facts), commit, abandon)

    def _take(self, cursors: Cursors, name: str, through: int, periodic: bool) -> Flow[CursorRange | None]:
        for _ in range(BUSY_LOOKS):
            range_ = yield from cursors.take(self.address, name, through, RANGE_TTL)
            if range_.outcome == "TAKEN":
                return range_
            if range_.outcome == "COVERED" or periodic:
                return None  # nothing new; or another watcher reads the folder now, and the next check comes
            yield Sleep(BUSY_WAIT_S)  # another watcher reads this folder now: what it records may cover ours
        raise ProviderError(f"another watcher held the cursor {name} too long")

    def facts(self, folder: str, validity: int, uid: int, item: Mapping[bytes, Any]) -> MessageFacts:
        """The facts of one message (its headers and flags, as :meth:`_read` fetched them)."""
        headers = BytesHeaderParser(policy=default_policy).parsebytes(item.get(b"BODY[HEADER]") or b"")

        def text(name: str) -> str:
            value = headers.get(name)
            return str(value).strip() if value is not None else ""

        senders = getaddresses([text("From")])
        name, address = senders[0] if senders else ("", "")
        reply_to = tuple(a for _, a in getaddresses([text("Reply-To")]) if a) or ((address,) if address else ())
        own_id = (message_ids(text("Message-ID")) or ("",))[0]
        references = message_ids(text("References"))
        in_reply_to = message_ids(text("In-Reply-To"))
        root = (references or in_reply_to or (own_id,))[0]
        sent = folder == self.sent_folder
        subject = text("Subject")
        stamp: ClaimStamp | None = parse_stamp(text(STAMP_HEADER)) or parse_stamp(own_id)
        return MessageFacts(
            provider=self.name,
            event="message.created",
            mailbox=self.address,
            dedup_key=f"imap:{folder}:{validity}:{uid}",
            message_id=own_id or f"imap:{folder}:{validity}:{uid}",
            thread_id=root or None,
            received_at=_date(text("Date")),
            sender=display(name, address),
            subject_line=subject,
            from_addresses=(address.lower(),) if address else (),
            folders=(folder, "SENT") if sent else (folder,),
            stamp=stamp,
            reply=ReplyContext(
                to=reply_to,
                subject=reply_subject(subject),
                internet_message_id=own_id or None,
                references=references or in_reply_to,
            ),
            source={"folder": folder, "uidvalidity": validity, "uid": uid, "flags": item.get(b"FLAGS", ())},
        )

    # -- send ------------------------------------------------------------------------------------------------

    def reply(self, message: MessageFacts, body: str) -> Any:
        """``await claim.send(provider.reply, message, body=...)``: the reply over SMTP, its ``Message-ID`` derived
        from the current claim; then its copy in Sent and the original flagged ``\\Answered``. Its Message-ID."""
        return _threaded(self.send_reply, message, body, current_stamp())

    def compose(self, message: MessageFacts, body: str, stamp: ClaimStamp) -> EmailMessage:
        """The reply: threaded (``In-Reply-To``, ``References``), stamped, and marked as an automatic answer."""
        mail = EmailMessage()
        mail["From"] = self.address
        mail["To"] = ", ".join(message.reply.to)
        mail["Subject"] = message.reply.subject
        mail["Date"] = formatdate(self.clock(), localtime=False)
        mail["Message-ID"] = stamp.message_id(self.domain)
        if message.reply.internet_message_id:
            mail["In-Reply-To"] = message.reply.internet_message_id
            mail["References"] = " ".join((*message.reply.references, message.reply.internet_message_id))
        for name, value in agent_headers():  # RFC 3834: no auto-responder answers it back; a person's reply unmarked
            mail[name] = value
        mail[STAMP_HEADER] = str(stamp)
        mail.set_content(body)
        return mail

    def send_reply(self, message: MessageFacts, body: str, stamp: ClaimStamp) -> str:
        """The blocking send of :meth:`reply` (run in a thread)."""
        if not message.reply.to:
            raise ImapSendRejected("the message names no one to answer (no From or Reply-To): nothing was sent")
        mail = self.compose(message, body, stamp)
        self.submit(mail)
        with contextlib.suppress(*_IMAP_ERRORS):  # the send is done: a failed copy or flag changes nothing of it
            if self.append_to_sent:
                self.file_copy(mail)
            self.flag_answered(message)
        return str(mail["Message-ID"])

    def submit(self, mail: EmailMessage) -> None:
        """Hands the message to the SMTP server. Refused before or at DATA: nothing went out (ImapSendRejected); the
        connection lost once DATA was under way: it may have (ImapSendOutcomeUnknown)."""
        try:
            smtp = self._smtp()
        except (OSError, smtplib.SMTPException) as error:
            raise ImapSendRejected(
                f"could not reach or log in to the SMTP server, nothing was sent: {error}"
            ) from error
        with smtp:
            try:
                smtp.send_message(mail)
            except (smtplib.SMTPRecipientsRefused, smtplib.SMTPSenderRefused, smtplib.SMTPDataError) as error:
                raise ImapSendRejected(f"the SMTP server refused the reply, nothing was sent: {error}") from error
            except (OSError, smtplib.SMTPException) as error:
                raise ImapSendOutcomeUnknown(
                    f"the SMTP connection failed mid-send, it may have gone out: {error}"
                ) from error

    def _smtp(self) -> smtplib.SMTP:
        """A connection to the submission server, encrypted as ``smtp_tls`` says and logged in where it offers AUTH.
        The certificate is verified (``ssl_context``, else the system's): smtplib's own STARTTLS context does not."""
        context = self.ssl_context or ssl_module.create_default_context()
        if self.smtp_tls == "tls":
            smtp: smtplib.SMTP = smtplib.SMTP_SSL(
                self.smtp_host, self.smtp_port, timeout=self.smtp_timeout, context=context
            )
        else:
            smtp = smtplib.SMTP(self.smtp_host, self.smtp_port, timeout=self.smtp_timeout)
        try:
            smtp.ehlo()
            if self.smtp_tls == "starttls":
                smtp.starttls(context=context)
                smtp.ehlo()
            if self.smtp_username and smtp.has_extn("auth"):
                smtp.login(self.smtp_username, self.smtp_password)
        except BaseException:
            smtp.close()
            raise
        return smtp

    def file_copy(self, mail: EmailMessage) -> None:
        """The reply's one copy in Sent (read, as the mail clients file theirs)."""
        folder = self.sent()
        with self._session() as client:
            client.append(folder, mail.as_bytes(), flags=(b"\\Seen",))

    def flag_answered(self, message: MessageFacts) -> None:
        source = message.source if isinstance(message.source, Mapping) else {}
        if not source.get("uid"):
            return
        with self._session() as client:
            selected = client.select_folder(source["folder"])
            if int(selected[b"UIDVALIDITY"]) == source["uidvalidity"]:
                client.add_flags([source["uid"]], [b"\\Answered"])


FactsHandler = Callable[[MessageFacts, AsyncClaim], Awaitable[object]]


class ImapWatcher:
    """Watches one IMAP mailbox and answers it through the coordinator: ``await watcher.start()`` ...
    ``await watcher.aclose()`` (or ``async with``). Options as :func:`inbox_claims.asgi.webhook_app`'s."""

    def __init__(
        self, provider: ImapProvider, handle: FactsHandler, *, coordinator: AsyncCoordinator, **options: Any
    ) -> None:
        from ..asgi import webhook_app  # the admission every provider shares; asgi imports the providers

        options.setdefault("admission_timeout", 30.0)
        self.provider = provider
        self.app = webhook_app(provider, handle, coordinator=coordinator, **options)
        self._wanted = asyncio.Event()
        self._stopping = threading.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._threads: list[threading.Thread] = []
        self._idling: set[str] = set()
        self.checks = 0
        """Deliveries opened so far (each wake, each periodic check)."""

    @property
    def idling(self) -> frozenset[str]:
        """The folders whose IDLE connection is up now."""
        return frozenset(self._idling)

    async def __aenter__(self) -> ImapWatcher:
        await self.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """The first check (with the recovery of lapsed claims), then the IDLE connections and the periodic check."""
        loop = asyncio.get_running_loop()
        self.app.start()
        await self._deliver(Wake(recover=True))
        self._tasks.append(loop.create_task(self._checks(), name="imap checks"))
        for sent in (True, False):
            # A thread of its own: an IDLE waits for as long as the watcher runs, and would hold one of the few
            # workers of asyncio's default pool that every read and send runs in. It finds its folder once connected:
            # a watcher started while the server is down waits for it, and reads what it missed once it is up.
            thread = threading.Thread(
                target=self._idle, args=(sent, _threadsafe(loop, self._wanted.set)), name="imap idle"
            )
            thread.daemon = True
            thread.start()
            self._threads.append(thread)

    async def _deliver(self, wake: Wake) -> Answer:
        self.checks += 1
        answer = await self.app.deliver(Accepted(wake))
        if answer.status >= 300:
            log.warning("imap: the mailbox could not be read now (%s); the next wake or check reads it", answer.body)
        return answer

    async def _checks(self) -> None:
        retry = 0.5
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            answer = await self._deliver(Wake())
            if answer.status < 300:
                retry = 0.5
                continue
            # Nothing else may wake the watcher for a long time (the next mail, the periodic check): read again.
            await asyncio.sleep(retry)
            retry = min(retry * 2, RETRY_MAX_S)
            self._wanted.set()

    def _idle(self, sent: bool, wake: Callable[[], None]) -> None:
        """IDLE on the Sent folder or the Inbox, in a thread: wakes the watcher on new mail and after every
        (re)connection."""
        backoff = 0.5
        folder = "Sent" if sent else self.provider.inbox
        while not self._stopping.is_set():
            try:
                folder = self.provider.sent() if sent else self.provider.inbox
                client = self.provider.connect()
            except _IMAP_ERRORS as error:
                log.warning("imap: cannot connect for IDLE on %s (%s); again in %.1f s", folder, error, backoff)
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, RECONNECT_MAX_S)
                continue
            backoff = 0.5
            try:
                selected = client.select_folder(folder, readonly=True)
                wake()  # what arrived while this connection was down
                seen = selected.get(b"UIDNEXT")
                while not self._stopping.is_set():
                    client.idle()
                    self._idling.add(folder)
                    began = time.monotonic()
                    while not self._stopping.is_set() and time.monotonic() - began < self.provider.idle_seconds:
                        if any(b"EXISTS" in response for response in client.idle_check(timeout=IDLE_POLL_S)):
                            wake()
                    client.idle_done()  # re-issued before the server's timeout (RFC 2177)
                    # An EXISTS the server sent as IDLE began (before its "+") is not one idle_check returns: the
                    # folder's next UID, between two IDLEs, tells of any mail that came since the last look.
                    now = client.folder_status(folder, [b"UIDNEXT"]).get(b"UIDNEXT")
                    if now != seen:
                        wake()
                    seen = now
            except _IMAP_ERRORS as error:
                log.warning("imap: the IDLE connection on %s dropped (%s); reconnecting", folder, error)
            finally:
                self._idling.discard(folder)
                _drop(client)

    async def aclose(self, grace: float | None = None) -> None:
        """Stops watching, lets running work finish (``shutdown_grace``), closes the connections."""
        self._stopping.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        await self.app.aclose(grace)
        for thread in self._threads:  # each looks up from its IDLE every IDLE_POLL_S
            await asyncio.to_thread(thread.join, 30)
        self._threads.clear()
        await asyncio.to_thread(self.provider.close)


def _threadsafe(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` made callable from another thread: run in ``loop``."""

    def call() -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nothing is waiting any more
            loop.call_soon_threadsafe(fn)

    return call
