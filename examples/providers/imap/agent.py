"""A guarded agent on any IMAP mailbox: one reply per customer message, however many copies of it run (on one
machine or several), none when a person answered from a mail client first, and none lost when one dies mid-reply
(README.md). ``./run`` starts it; everything comes from the environment."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from examples.providers.common import draft_reply

# --- the guarded handler (docs/providers.md shows these lines; tests/tools/test_provider_examples.py counts them)
from inbox_claims import AsyncClaim, AsyncCoordinator
from inbox_claims.providers import MessageFacts
from inbox_claims.providers.imap import ImapProvider, ImapWatcher

coord = AsyncCoordinator.from_env()  # INBOX_COORDINATOR_TARGET, INBOX_PRINCIPAL (or INBOX_TOKEN)
mail = ImapProvider.from_env()  # IMAP_ADDRESS, IMAP_HOST, IMAP_USERNAME, IMAP_PASSWORD, SMTP_HOST, SMTP_PORT


async def answer(message: MessageFacts, claim: AsyncClaim) -> None:  # a granted claim on one incoming message
    await claim.send(mail.reply, message, body=await draft_reply(message.subject_line))  # fenced, stamped


watcher = ImapWatcher(mail, answer, coordinator=coord, ttl=int(os.environ.get("INBOX_CLAIM_TTL", "60")))
# --- end of the guarded handler


async def main() -> None:
    """Watches until SIGTERM or Ctrl-C; then running replies finish."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    async with watcher:
        print(f"watching {mail.address}", flush=True)
        await stop.wait()
    await coord.close()


if __name__ == "__main__":
    asyncio.run(main())
