"""What the provider scenario tests share: posting to a webhook app, letting its work finish, waiting for what the
background work does, and the unguarded agent each guarded scenario is compared with."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import httpx

from coordinator.api.auth import hash_token
from inbox_claims import AsyncCoordinator, Subject, SubjectState
from inbox_claims.providers import ClaimStamp, CursorRange, MessageFacts, WebhookRequest
from inbox_claims.providers._httpx import drive
from inbox_claims.providers._seam import Flow
from inbox_claims.providers.gmail import GmailProvider
from tests.providers.fake_gmail import AUDIENCE, JWKS_URL, FakeGmail
from tests.providers.fake_gmail import BASE as GMAIL_BASE

UNCLAIMED = ClaimStamp("ic1-" + "0" * 64, 1)
"""The stamp an unguarded agent's reply carries: it has no claim (the providers' reply needs a stamp)."""


async def post(app: Any, body: bytes, headers: Mapping[str, str] | None = None) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://agent") as http:
        return await http.post("/webhook", content=body, headers=dict(headers or {"content-type": "application/json"}))


async def settle(apps: list[Any]) -> None:
    """Lets every app's background work finish (each app closes)."""
    for app in apps:
        await app.aclose(grace=10)


async def eventually(check: Callable[[], Awaitable[bool] | bool], within: float = 15.0) -> None:
    """Waits until ``check()`` holds (what background work does has no event to await from here)."""
    deadline = time.monotonic() + within
    while True:
        result = check()
        if await result if isinstance(result, Awaitable) else result:
            return
        assert time.monotonic() < deadline, f"not within {within} s"
        await asyncio.sleep(0.05)


def gmail_provider(fake: FakeGmail, *, check_every: float = 0, **options: Any) -> GmailProvider:
    """The Gmail provider pointed at the double (its API base and its keys; its transport unless ``transport=``),
    with the periodic history check every ``check_every`` seconds (0: none)."""
    settings: dict[str, Any] = {"token": fake.token, "api_base": GMAIL_BASE, "jwks_url": JWKS_URL, "transport": fake}
    return GmailProvider(AUDIENCE, fake.address, history_check_interval=check_every, **{**settings, **options})


class LocalCursors:
    """What an agent without the coordinator does with a change log: keeps its position in its own memory (each
    worker its own), so that two workers each read, and answer, the same range."""

    def __init__(self) -> None:
        self.positions: dict[str, tuple[str, int]] = {}

    def take(self, mailbox: str, name: str, through_position: int, ttl: int) -> Flow[CursorRange]:
        value, position = self.positions.get(name, ("", 0))
        if through_position and position >= through_position:
            return CursorRange("COVERED")
        return CursorRange("TAKEN", value, position, token=1)
        yield  # no effect

    def advance(self, mailbox: str, name: str, taken: CursorRange, value: str, position: int) -> Flow[bool]:
        self.positions[name] = (value, position)
        return True
        yield  # no effect


class Unguarded:
    """The same agent without the coordinator: every incoming message its provider reads is answered."""

    def __init__(self, provider: Any) -> None:
        self.provider = provider
        self.cursors = LocalCursors()

    async def deliver(self, body: bytes, headers: Mapping[str, str] | None = None) -> None:
        request = WebhookRequest("POST", "", dict(headers or {"content-type": "application/json"}), body)
        accepted = await drive(self.provider.check(request), self.provider.transport)
        batch = await drive(self.provider.open(accepted, self.cursors), self.provider.transport)
        await drive(batch.commit(), self.provider.transport)
        for facts in batch.facts:
            if not self.incoming(facts):
                continue
            await drive(self.provider._reply(facts, "Your order ships today.", UNCLAIMED), self.provider.transport)

    def incoming(self, facts: MessageFacts) -> bool:
        return "SENT" not in facts.folders


class KeyedUnguarded(Unguarded):
    """The unguarded agent of a provider whose sends take an idempotency key: each reply with a key of its own (an
    agent without claims has no key shared with its other workers, so the provider's key dedups nothing between
    them)."""

    async def deliver(self, body: bytes, headers: Mapping[str, str] | None = None) -> None:
        request = WebhookRequest("POST", "", dict(headers or {}), body)
        accepted = await drive(self.provider.check(request), self.provider.transport)
        batch = await drive(self.provider.open(accepted, self.cursors), self.provider.transport)
        for facts in batch.facts:
            if self.incoming(facts) and not set(facts.from_addresses) & set(self.provider.mailbox_addresses):
                stamp = ClaimStamp("ic1-" + secrets.token_hex(32), 1)
                await drive(self.provider._reply(facts, "Your order ships today.", stamp), self.provider.transport)


async def delivered(app: Any, delivery: tuple[bytes, Mapping[str, str]]) -> int:
    """Posts a signed delivery (its body and headers) to a webhook app; the status it answers."""
    return (await post(app, delivery[0], delivery[1])).status_code


async def settled_by_its_copy(client: AsyncCoordinator, subject: Subject, copy_id: str, reporter: str) -> None:
    """Asserts that the send on ``subject`` was settled by its stamped copy: REPLIED with the copy's id, by the
    principal that reported the copy, the evidence in its note (docs/design.md#providers)."""
    status = await client.status(subject)
    assert status.state is SubjectState.REPLIED
    assert (status.sent_message_id, status.settled_by) == (copy_id, reporter)
    assert copy_id in status.note
    assert "stamp" in status.note


async def state_is(client: AsyncCoordinator, subject: Subject, state: SubjectState) -> bool:
    return (await client.status(subject)).state is state


def token_file(path: Any, principals: Mapping[str, tuple[str, list[str], list[str]]]) -> dict[str, str]:
    """Writes a token file (docs/security.md) for ``{name: (kind, mailboxes, roles)}``; each name's token."""
    tokens = {name: f"token-of-{name}-0123456789abcdef" for name in principals}
    entries = []
    for name, (kind, mailboxes, roles) in principals.items():
        entries.append(
            f'[[principals]]\nid = "{name}"\nkind = "{kind}"\nmailboxes = {mailboxes!r}\nroles = {roles!r}\n'
            f'token_sha256 = ["{hash_token(tokens[name])}"]\n'.replace("'", '"')
        )
    path.write_text("".join(entries))
    return tokens
