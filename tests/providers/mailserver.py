"""A real mail server on loopback for the IMAP provider's tests: Debian's Dovecot (IMAP, IDLE, RFC 6154 special-use
folders) started from a temporary configuration, mail store and passwd-file users, and an SMTP server (aiosmtpd) that
delivers each message into every local recipient's Dovecot mailbox with ``dovecot-lda`` (plain delivery, no Sieve).

It runs as root (CI, these machines) and as an ordinary user: as root the mail belongs to ``nobody`` (Dovecot refuses
to keep mail as root) and Dovecot's own services run as the packaged ``dovenull``/``dovecot`` users; as anyone else,
everything runs as that user. Dovecot's log is kept in the server's directory and dumped when a test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from email.message import EmailMessage
from email.utils import formatdate, make_msgid
from pathlib import Path
from typing import Any

from aiosmtpd.controller import Controller
from aiosmtpd.smtp import SMTP, AuthResult, Envelope, LoginPassword, Session
from imapclient import IMAPClient

from coordinator.store.etcd.ports import free_port

DOVECOT = shutil.which("dovecot") or "/usr/sbin/dovecot"
LDA = "/usr/lib/dovecot/dovecot-lda"
PASSWORD = "secret-password"
DOMAIN = "example.test"


EX_TEMPFAIL = 75
"""dovecot-lda's exit status for "try again later" (Dovecot's auth is down): an MTA queues the message."""


class TempFail(Exception):
    pass


def installed() -> bool:
    return os.access(DOVECOT, os.X_OK) and os.access(LDA, os.X_OK)


def _config(root: Path, port: int, mail_user: pwd.struct_passwd, as_root: bool) -> str:
    services = (
        "" if as_root else f"default_internal_user = {mail_user.pw_name}\ndefault_login_user = {mail_user.pw_name}\n"
    )
    return f"""
base_dir = {root}/run
state_dir = {root}/state
log_path = {root}/dovecot.log
info_log_path = {root}/dovecot.log
listen = 127.0.0.1
protocols = imap
ssl = no
disable_plaintext_auth = no
auth_mechanisms = plain login
mail_location = maildir:{root}/mail/%n
first_valid_uid = 1
first_valid_gid = 1
{services}
namespace inbox {{
  inbox = yes
  separator = /
  mailbox Sent {{
    special_use = \\Sent
    auto = subscribe
  }}
  mailbox Drafts {{
    special_use = \\Drafts
    auto = subscribe
  }}
}}
passdb {{
  driver = passwd-file
  args = scheme=PLAIN username_format=%u {root}/users
}}
userdb {{
  driver = passwd-file
  args = username_format=%u {root}/users
  default_fields = uid={mail_user.pw_uid} gid={mail_user.pw_gid} home={root}/home/%n
}}
service imap-login {{
  inet_listener imap {{
    address = 127.0.0.1
    port = {port}
  }}
  inet_listener imaps {{
    port = 0
  }}
  chroot =
}}
service anvil {{
  chroot =
}}
protocol lda {{
  postmaster_address = postmaster@{DOMAIN}
}}
"""


class Dovecot:
    """One Dovecot, its users ``name@example.test`` (password :data:`PASSWORD`); ``restart`` keeps its port and
    its mail (a server restarted under its watchers)."""

    def __init__(self, users: list[str]) -> None:
        self.as_root = os.geteuid() == 0
        self.mail_user = pwd.getpwnam("nobody") if self.as_root else pwd.getpwuid(os.geteuid())
        # Not under pytest's tmp_path: as root, ``nobody`` must reach the mail store, and pytest's is mode 0700.
        self.root = Path(tempfile.mkdtemp(prefix="inbox-dovecot-"))
        self.root.chmod(0o755)
        self.port = free_port()
        self.users = [f"{name}@{DOMAIN}" if "@" not in name else name for name in users]
        for folder in ("run", "state", "mail", "home"):
            (self.root / folder).mkdir()
        for folder in ("mail", "home"):
            os.chown(self.root / folder, self.mail_user.pw_uid, self.mail_user.pw_gid)
        (self.root / "users").write_text("".join(f"{user}:{{PLAIN}}{PASSWORD}::::::\n" for user in self.users))
        self.config = self.root / "dovecot.conf"
        self.config.write_text(_config(self.root, self.port, self.mail_user, self.as_root))
        self.log = self.root / "dovecot.log"

    def start(self) -> None:
        # Its daemons inherit the descriptors it starts with: a pipe here would never reach its end.
        with (self.root / "dovecot.out").open("ab") as out:
            subprocess.run([DOVECOT, "-c", str(self.config)], check=True, stdout=out, stderr=out, timeout=30)
        deadline = time.monotonic() + 15
        while True:
            try:
                with self.imap(self.users[0]):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"Dovecot did not listen on {self.port}:\n{self.log_text()}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM to the master (it ends its processes and removes its pid file); ``dovecot stop`` does the same
        and then sleeps before it looks again, seconds a test waits for nothing."""
        pid_file = self.root / "run" / "master.pid"
        try:
            os.kill(int(pid_file.read_text().split()[0]), signal.SIGTERM)
        except (FileNotFoundError, ProcessLookupError, ValueError):
            return
        deadline = time.monotonic() + 15
        while pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.02)

    def restart(self) -> None:
        self.stop()
        self.start()

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else "(no log)"

    def logins(self, user: str) -> int:
        """How many times ``user`` logged in so far (Dovecot's log)."""
        return self.log_text().count(f"Login: user=<{user}>")

    def imap(self, user: str) -> IMAPClient:
        """A logged-in IMAP connection of ``user`` (what a person's mail client or the test reads with)."""
        client = IMAPClient("127.0.0.1", port=self.port, ssl=False, timeout=10)
        client.login(user, PASSWORD)
        return client

    def deliver(self, recipient: str, raw: bytes, folder: str = "INBOX") -> None:
        """``dovecot-lda``: the message into ``recipient``'s ``folder``, as the MTA's local delivery does (it writes
        the mail store itself: it delivers while Dovecot is stopped, too)."""
        done = subprocess.run(
            [LDA, "-c", str(self.config), "-d", recipient, "-f", "postmaster@" + DOMAIN, "-m", folder],
            input=raw,
            capture_output=True,
            timeout=30,
        )
        if done.returncode == EX_TEMPFAIL:
            raise TempFail(f"dovecot-lda for {recipient}: {done.stderr.decode()}")
        if done.returncode != 0:
            raise RuntimeError(f"dovecot-lda for {recipient} exited {done.returncode}: {done.stderr.decode()}")

    def messages(self, user: str, folder: str = "INBOX") -> list[dict[bytes, Any]]:
        """Every message of ``user``'s ``folder``, parsed headers included (the end count of a scenario)."""
        with self.imap(user) as client:
            client.select_folder(folder, readonly=True)
            uids = client.search("ALL")
            fetched = client.fetch(uids, ["RFC822.HEADER", "FLAGS"]) if uids else {}
            return [fetched[uid] for uid in sorted(fetched)]


@dataclass
class Delivering:
    """The SMTP server's handler: each accepted message into every local recipient's mailbox."""

    dovecot: Dovecot
    received: list[tuple[str, list[str], str]] = field(default_factory=list)
    """Each message accepted: its sender, its recipients and who logged in to submit it ("": nobody)."""
    files_sent: bool = False
    """File a copy of each message a local user submits in their Sent folder, as Gmail's and Microsoft 365's SMTP
    submission do (the copy that settles a send whose answer was lost)."""
    lose_answers: float = 0.0
    """Seconds to wait, after delivering, before answering DATA: longer than the client waits, its answer is lost."""
    queued: set[asyncio.Task[None]] = field(default_factory=set)

    async def _retry(self, recipient: str, raw: bytes, folder: str) -> None:
        while True:
            await asyncio.sleep(0.2)
            try:
                return await asyncio.to_thread(self.dovecot.deliver, recipient, raw, folder)
            except TempFail:
                continue

    async def handle_RCPT(
        self, server: SMTP, session: Session, envelope: Envelope, address: str, options: list[str]
    ) -> str:
        if address.lower() not in self.dovecot.users:
            return f"550 5.1.1 <{address}>: no such mailbox here"
        envelope.rcpt_tos.append(address.lower())
        return "250 OK"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        raw = envelope.original_content or b""
        sender = str(envelope.mail_from).lower()
        targets = [(recipient, "INBOX") for recipient in envelope.rcpt_tos]
        if self.files_sent and sender in self.dovecot.users:
            targets.append((sender, "Sent"))
        for recipient, folder in targets:
            try:
                await asyncio.to_thread(self.dovecot.deliver, recipient, raw, folder)
            except TempFail:  # Dovecot is down: queued, delivered once it is back, as an MTA's queue does
                task = asyncio.get_running_loop().create_task(self._retry(recipient, raw, folder))
                self.queued.add(task)
                task.add_done_callback(self.queued.discard)
        login = session.auth_data if session.authenticated and isinstance(session.auth_data, str) else ""
        self.received.append((sender, list(envelope.rcpt_tos), login))
        if self.lose_answers:
            await asyncio.sleep(self.lose_answers)
        return "250 2.0.0 delivered"


class MailServer:
    """Dovecot and its SMTP server, on loopback."""

    def __init__(self, users: list[str]) -> None:
        self.dovecot = Dovecot(users)
        self.smtp_port = free_port()
        self.handler = Delivering(self.dovecot)
        # AUTH offered (PLAIN, LOGIN) without TLS on loopback; a customer's mail is sent without it, as from outside.
        self.smtp = Controller(
            self.handler,
            hostname="127.0.0.1",
            port=self.smtp_port,
            authenticator=self._authenticate,
            auth_require_tls=False,
        )

    def _authenticate(
        self, server: SMTP, session: Session, envelope: Envelope, mechanism: str, data: object
    ) -> AuthResult:
        login = data.login.decode().lower() if isinstance(data, LoginPassword) else ""
        good = isinstance(data, LoginPassword) and login in self.dovecot.users and data.password.decode() == PASSWORD
        return AuthResult(success=good, handled=False, auth_data=login)

    def start(self) -> None:
        self.dovecot.start()
        self.smtp.start()

    def stop(self) -> None:
        self.smtp.stop()
        self.dovecot.stop()
        self.dovecot.remove()

    def send(self, sender: str, to: str, subject: str, body: str, **headers: str) -> str:
        """A customer's mail, sent over SMTP; its Message-ID."""
        import smtplib

        message = EmailMessage()
        message["From"], message["To"], message["Subject"] = sender, to, subject
        message["Date"] = formatdate(localtime=False)
        message["Message-ID"] = make_msgid(domain=sender.rpartition("@")[2] or DOMAIN)
        for name, value in headers.items():
            message[name.replace("_", "-")] = value
        message.set_content(body)
        with smtplib.SMTP("127.0.0.1", self.smtp_port, timeout=10) as smtp:
            smtp.send_message(message)
        return str(message["Message-ID"])


@contextlib.asynccontextmanager
async def quiet_cutting_proxy(port: int, cutoff: float) -> AsyncIterator[int]:
    """A TCP proxy to ``127.0.0.1:port`` that cuts a connection quiet for ``cutoff`` seconds in either direction, as
    a NAT or a server's idle timeout does; its own port."""

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await asyncio.wait_for(reader.read(65536), cutoff):
                writer.write(data)
                await writer.drain()
        except (TimeoutError, OSError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    open_writers: set[asyncio.StreamWriter] = set()

    async def serve(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        open_writers.add(client_writer)
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", port)
        open_writers.add(server_writer)
        up = asyncio.ensure_future(pump(client_reader, server_writer))
        down = asyncio.ensure_future(pump(server_reader, client_writer))
        await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        server_writer.close()
        client_writer.close()
        await asyncio.gather(up, down, return_exceptions=True)

    listening = free_port()
    server = await asyncio.start_server(serve, "127.0.0.1", listening)
    try:
        yield listening
    finally:
        server.close()
        for writer in open_writers:  # what is still connected: the proxy's end of it closed
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 5)


def mail_server(users: list[str]) -> Iterator[MailServer]:
    """The fixture's body: a started mail server, stopped (its store removed) after the test."""
    server = MailServer(users)
    server.start()
    try:
        yield server
    finally:
        server.stop()
