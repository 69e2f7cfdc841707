"""The human tool: a helpdesk operator (principal kind human) who takes messages over from agents and answers.

At seeded random times it lists the CLAIMED subjects of a mailbox, picks one an agent holds, calls Takeover
(the agent's token goes stale at once), types for a moment, then sends through the same sink with its own token:
BeginSend, the sink, ConfirmSent. Every step is a line in its JSON-lines log.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path

from inbox_claims import AsyncCoordinator, InboxClaimsError, SubjectState, SubjectStatus
from inbox_claims.types import HolderKind

from .agent import coordinator_client, post_reply
from .common import JsonlLog, announce, exit_at


async def run(options: argparse.Namespace) -> None:
    log = JsonlLog(options.log, agent=options.name, inc=1)
    coord = coordinator_client(options.coordinators, options.name, kind="human")
    rng = random.Random(f"human/{options.seed}")
    mailboxes: list[str] = options.mailboxes.split(",")
    start, stop = options.start_at, options.stop_at
    times = sorted(rng.uniform(start, stop) for _ in range(options.takeovers))
    watchdog = asyncio.create_task(exit_at(time.time() + options.lifetime))
    announce("ready")
    for at in times:
        await asyncio.sleep(max(at - time.time(), 0.0))
        try:
            await take_one(coord, log, rng, mailboxes, options)
        except InboxClaimsError as error:
            log.write("error", error=f"{type(error).__name__}: {error}")
    log.write("finished")
    await coord.close()
    watchdog.cancel()


async def take_one(
    coord: AsyncCoordinator, log: JsonlLog, rng: random.Random, mailboxes: list[str], options: argparse.Namespace
) -> None:
    candidates: list[SubjectStatus] = []
    for _ in range(10):  # look again for a while: agents hold claims for seconds at a time
        for mailbox in mailboxes:
            page = await coord.list_claims(mailbox, states=[SubjectState.CLAIMED], page_size=200)
            candidates += [s for s in page.subjects if s.holder_kind is HolderKind.AGENT]
        if candidates:
            break
        await asyncio.sleep(1.0)
    else:
        log.write("no_candidate")
        return
    target = rng.choice(candidates)
    subject = target.subject
    result = await coord.takeover(subject, ttl=30, note=f"{options.name} is answering")
    log.write(
        "takeover",
        outcome=result.outcome.value,
        kind=subject.kind.value,
        mailbox=subject.mailbox,
        id=subject.id,
        previous_holder=result.previous_holder,
        previous_token=result.previous_token,
        token=result.status.fencing_token if result.holds else 0,
    )
    if not result.holds:
        return
    token = result.status.fencing_token
    await asyncio.sleep(rng.uniform(0.3, 1.5))  # typing
    begin = await coord.begin_send(subject, token)
    if begin.stale:
        log.write("lost", token=token, where="begin_send", reason="stale_token", id=subject.id)
        return
    log.write("sending", token=token, id=subject.id)
    try:
        sent_id = await post_reply(options.sink, subject, token, options.name, mode="human")
    except Exception as error:  # the outcome is unknown: leave it SENDING, it becomes IN_DOUBT
        log.write("unknown", token=token, id=subject.id, error=repr(error))
        return
    log.write("sent", token=token, sent_id=sent_id, id=subject.id)
    confirm = await coord.confirm_sent(subject, token, sent_id)
    if confirm.ok:
        log.write(
            "confirmed", token=token, sent_id=sent_id, id=subject.id, kind=subject.kind.value, mailbox=subject.mailbox
        )
    else:
        log.write("unconfirmed", token=token, id=subject.id, state=confirm.status.state.value)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos human")
    parser.add_argument("--name", default="ana")
    parser.add_argument("--coordinators", required=True)
    parser.add_argument("--sink", required=True)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--mailboxes", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--takeovers", type=int, default=3)
    parser.add_argument("--start-at", type=float, required=True, help="epoch seconds")
    parser.add_argument("--stop-at", type=float, required=True, help="epoch seconds")
    parser.add_argument("--lifetime", type=float, default=3600.0)
    options = parser.parse_args(argv)
    asyncio.run(run(options))
    return 0
