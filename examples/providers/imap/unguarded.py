"""The same IMAP agent without the coordinator, as such agents are usually written: every second, the Inbox's
unanswered messages are read, each one not yet seen by this process is answered over SMTP and flagged
``\\Answered``. Two copies both answer what arrives while either drafts, and a person's reply from a mail client
stops nothing: ``./run --unguarded``, to see what the guard prevents."""

from __future__ import annotations

import asyncio
import smtplib
from email.message import EmailMessage
from email.parser import BytesHeaderParser
from email.policy import default
from email.utils import make_msgid, parseaddr

from imapclient import IMAPClient  # type: ignore[import-untyped,unused-ignore]

from examples.providers.common import draft_reply
from inbox_claims.providers.imap import ImapProvider

mail = ImapProvider.from_env()  # the settings only: nothing of its watcher is used
POLL_SECONDS = 1.0


def unanswered() -> list[tuple[int, bytes]]:
    with IMAPClient(mail.host, port=mail.port, ssl=mail.tls) as client:
        client.login(mail.username, mail.password)
        client.select_folder(mail.inbox, readonly=True)
        uids = client.search(["UNANSWERED"])
        fetched = client.fetch(uids, [b"BODY.PEEK[HEADER]"]) if uids else {}
        return [(uid, fetched[uid][b"BODY[HEADER]"]) for uid in sorted(fetched)]


def send(uid: int, header: bytes, body: str) -> None:
    original = BytesHeaderParser(policy=default).parsebytes(header)
    reply = EmailMessage()
    reply["From"], reply["To"] = mail.address, parseaddr(str(original["From"]))[1]
    reply["Subject"] = "Re: " + str(original["Subject"] or "")
    reply["Message-ID"] = make_msgid(domain=mail.domain)
    reply["In-Reply-To"] = str(original["Message-ID"] or "")
    reply.set_content(body)
    with smtplib.SMTP(mail.smtp_host, mail.smtp_port) as smtp:
        smtp.send_message(reply)
    with IMAPClient(mail.host, port=mail.port, ssl=mail.tls) as client:
        client.login(mail.username, mail.password)
        client.select_folder(mail.inbox)
        client.add_flags([uid], [b"\\Answered"])


async def main() -> None:
    seen: set[int] = set()
    while True:
        for uid, header in await asyncio.to_thread(unanswered):
            if uid not in seen:
                seen.add(uid)
                subject = str(BytesHeaderParser(policy=default).parsebytes(header)["Subject"] or "")
                await asyncio.to_thread(send, uid, header, await draft_reply(subject))
        await asyncio.sleep(POLL_SECONDS)


if __name__ == "__main__":
    asyncio.run(main())
