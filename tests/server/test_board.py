"""The claims board in a real headless Chromium (Debian's package, driven by Playwright), against a real
coordinator and etcd: two people's browsers on one mailbox, an agent claiming, a takeover, a reply by hand, a
refused sign-in, and a screenshot of a 50-row board written as a test artifact."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from playwright.async_api import Browser, Locator, Page, async_playwright, expect

from coordinator.auth import TokenAuthenticator
from coordinator.etcd_process import EtcdServer
from coordinator.server import CoordinatorServer
from inbox_claims._proto import coordinator_pb2 as pb
from tests.helpers import Actor, message, new_request_id
from tests.server.test_auth import TOKENS, _token_file
from tests.server.test_http import serve

CHROMIUM = os.environ.get("INBOX_CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))
ARTIFACTS.mkdir(parents=True, exist_ok=True)
LIVE = 1_000  # ms: what the board promises for an update to show

if not Path(CHROMIUM).exists():  # pragma: no cover - .ci/run installs it; say so loudly rather than skip
    raise RuntimeError(f"no Chromium at {CHROMIUM}: apt-get install chromium (or set INBOX_CHROMIUM)")


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
        )
        yield launched
        await launched.close()


@pytest.fixture
async def server(etcd: EtcdServer, prefix: str) -> AsyncIterator[CoordinatorServer]:
    started = await serve(etcd, prefix)
    yield started
    await started.stop(grace=0.5)


def board_url(server: CoordinatorServer, mailbox: str) -> str:
    assert server.http is not None
    return f"http://{server.http.address}/?mailbox={mailbox}"


async def open_board(
    browser: Browser, url: str, *, name: str = "", token: str = "", width: int = 1400, height: int = 900
) -> Page:
    page = await browser.new_page(viewport={"width": width, "height": height})
    await page.goto(url)
    if token:
        await page.fill("#token", token)
    else:
        await page.fill("#name", name)
    await page.click("text=Show the board")
    return page


def row(page: Page, message_id: str) -> Locator:
    return page.locator("#claims tbody tr", has_text=f"message {message_id}")


async def claim(
    actor: Actor, subject: pb.Subject, subject_line: str, sender: str, **fields: object
) -> pb.ClaimReplyResponse:
    summary = pb.MessageSummary(
        subject_line=subject_line, sender=sender, received_at=Timestamp(seconds=int(time.time()) - 600)
    )
    return await actor.stub.ClaimReply(
        pb.ClaimReplyRequest(request_id=new_request_id(), subject=subject, summary=summary, **fields),  # type: ignore[arg-type]
        metadata=actor.metadata,
    )


async def test_two_people_see_an_agent_claim_a_takeover_and_a_reply_by_hand_live(
    server: CoordinatorServer, browser: Browser, mailbox: str
) -> None:
    ana = await open_board(browser, board_url(server, mailbox), name="ana")
    bo = await open_board(browser, board_url(server, mailbox), name="bo")
    for page in (ana, bo):
        await expect(page.locator("#empty")).to_be_visible()
    async with grpc.aio.insecure_channel(server.address) as channel:
        agent = Actor(channel, "agent-a")
        subject = message(mailbox, "msg-refund")
        granted = await claim(agent, subject, "Refund for order 1182?", "Bea Costa <bea@example.org>", ttl_seconds=120)
        token = granted.status.fencing_token
        # Both people see the agent's claim, with which email it is, within a second.
        for page in (ana, bo):
            found = row(page, "msg-refund")
            await expect(found).to_contain_text("Refund for order 1182?", timeout=LIVE)
            await expect(found).to_contain_text("agent-a (an agent) is writing a reply", timeout=LIVE)
            await expect(found.locator(".left")).to_have_text(re.compile(r"^\d+:\d\d$"), timeout=LIVE)

        # Ana takes it over: Bo sees it within a second, and the agent can no longer send.
        await row(ana, "msg-refund").get_by_role("button", name="Take over").click()
        await expect(ana.locator("#status-line")).to_contain_text("agent-a has stopped and cannot send")
        await expect(row(bo, "msg-refund")).to_contain_text("ana is answering this", timeout=LIVE)
        # Her own page's stream brings the same change, before or after her answer: the answer stays on screen.
        await expect(row(ana, "msg-refund")).to_contain_text("ana is answering this", timeout=LIVE)
        await expect(ana.locator("#status-line")).to_contain_text("agent-a has stopped and cannot send")
        assert (await agent.begin(subject, token)).result == pb.FENCE_RESULT_STALE_TOKEN

        # Ana answers in her mail client and says so: both see it, and a redelivery gets ALREADY_REPLIED.
        await row(ana, "msg-refund").get_by_role("button", name="I replied").click()
        await ana.fill("#ask-note", "replied from Gmail")
        await ana.click("#ask-ok")
        for page in (ana, bo):
            await expect(row(page, "msg-refund")).to_contain_text("Answered by hand by ana", timeout=LIVE)
        later = await agent.claim(subject, notification_id="message.updated-1")
        assert later.result == pb.ClaimReplyResponse.ALREADY_REPLIED
        # The state filter hides what is answered; the row comes back with it.
        await bo.locator('#filters input[value="SUBJECT_STATE_REPLIED"]').uncheck()
        await expect(row(bo, "msg-refund")).to_be_hidden()
        await bo.locator('#filters input[value="SUBJECT_STATE_REPLIED"]').check()
        await expect(row(bo, "msg-refund")).to_be_visible()


async def test_a_reply_from_the_mailbox_shows_who_answered_and_that_the_agent_stopped(
    server: CoordinatorServer, browser: Browser, mailbox: str
) -> None:
    page = await open_board(browser, board_url(server, mailbox), name="bo")
    await expect(page.locator("#empty")).to_be_visible()
    asked = Timestamp(seconds=int(time.time()) - 600)
    async with grpc.aio.insecure_channel(server.address) as channel:
        agent = Actor(channel, "agent-a")
        drafting, sending = message(mailbox, "msg-drafting"), message(mailbox, "msg-sending")
        await claim(
            agent, drafting, "Refund for order 1182?", "Bea Costa <bea@example.org>", thread_id="t-1", received_at=asked
        )
        held = await claim(
            agent, sending, "Where is my parcel?", "Cem <cem@example.org>", thread_id="t-2", received_at=asked
        )
        await agent.begin(sending, held.status.fencing_token)
        await expect(row(page, "msg-drafting")).to_contain_text("agent-a (an agent) is writing a reply", timeout=LIVE)

        async def from_gmail(thread_id: str, message_id: str) -> pb.RecordOutgoingResponse:
            request = pb.RecordOutgoingRequest(
                request_id=new_request_id(),
                mailbox=mailbox,
                message_id=message_id,
                thread_id=thread_id,
                sent_at=Timestamp(seconds=int(time.time()) - 60),
                sender="ana@shop.example",
            )
            return await agent.stub.RecordOutgoing(request, metadata=agent.metadata)

        await from_gmail("t-2", "copy-1")  # the send's own copy, before its confirmation: nothing changes
        assert (await from_gmail("t-1", "gmail-1")).result == pb.RecordOutgoingResponse.ANSWERED_OUTSIDE
        assert (await from_gmail("t-2", "gmail-2")).result == pb.RecordOutgoingResponse.ANSWERED_OUTSIDE
        ended = row(page, "msg-drafting")
        await expect(ended).to_contain_text(
            re.compile(
                r"Answered from the mailbox by ana@shop\.example at .+\. agent-a stopped because a person answered\."
            ),
            timeout=LIVE,
        )
        await expect(ended.locator(".holder")).to_contain_text("ana@shop.example")
        await expect(row(page, "msg-sending")).to_contain_text(
            "agent-a is sending the reply right now. Also answered from the mailbox by ana@shop.example", timeout=LIVE
        )
        await expect(row(page, "msg-sending")).to_contain_text(": both replies go out.")
        await page.screenshot(path=ARTIFACTS / "board-answered-from-the-mailbox.png")


async def test_a_person_claims_gives_back_and_settles_an_unconfirmed_send_from_the_keyboard(
    server: CoordinatorServer, browser: Browser, mailbox: str
) -> None:
    ana = await open_board(browser, board_url(server, mailbox), name="ana")
    await ana.fill("#claim-id", "msg-phone")
    await ana.keyboard.press("Enter")
    await expect(row(ana, "msg-phone")).to_contain_text("ana is answering this", timeout=LIVE)
    async with grpc.aio.insecure_channel(server.address) as channel:
        agent = Actor(channel, "agent-a")
        assert (await agent.claim(message(mailbox, "msg-phone"))).result == pb.ClaimReplyResponse.HELD
        stuck = message(mailbox, "msg-stuck")
        await agent.begin(stuck, (await claim(agent, stuck, "Invoice 77", "carl@example.net")).status.fencing_token)
        found = row(ana, "msg-stuck")
        await expect(found).to_contain_text("check the Sent folder and tell us", timeout=5_000)
        # Keyboard only: the first row is the one that needs a person; Enter reaches its buttons.
        await ana.keyboard.press("Tab")
        await ana.locator("#claims tbody tr").first.focus()
        await ana.keyboard.press("Enter")
        await expect(found.get_by_role("button", name="It was sent")).to_be_focused()
        await ana.keyboard.press("Tab")
        await ana.keyboard.press("Enter")  # "It was not sent"
        await ana.keyboard.press("Enter")  # in the dialog's note field: Enter confirms
        await expect(found).to_be_hidden(timeout=LIVE)  # FREE again: off the board
        assert (await agent.status(stuck)).state == pb.SUBJECT_STATE_FREE
    await row(ana, "msg-phone").get_by_role("button", name="Give it back").click()
    await expect(row(ana, "msg-phone")).to_have_count(0, timeout=LIVE)


async def test_token_sign_in_is_refused_for_another_tenants_mailbox(
    etcd: EtcdServer, prefix: str, tmp_path: Path, browser: Browser
) -> None:
    secured = await serve(etcd, prefix, authenticator=TokenAuthenticator(_token_file(tmp_path / "tokens.toml")))
    try:
        refused = await open_board(browser, board_url(secured, "globex"), token=TOKENS["ana"])
        await expect(refused.locator("#signin-error")).to_contain_text("You are not allowed to see the mailbox globex")
        await expect(refused.locator("#board")).to_be_hidden()
        wrong = await open_board(browser, board_url(secured, "acme-1"), token="not-a-token")
        await expect(wrong.locator("#signin-error")).to_contain_text("Your sign-in was refused")
        allowed = await open_board(browser, board_url(secured, "acme-1"), token=TOKENS["ana"])
        await expect(allowed.locator("#board")).to_be_visible()
        await expect(allowed.locator("#who")).to_contain_text("Signed in as ana (may take over from agents")
    finally:
        await secured.stop(grace=0.5)


async def test_a_person_without_the_takeover_role_is_offered_no_takeover_and_told_why(
    etcd: EtcdServer, prefix: str, tmp_path: Path, browser: Browser
) -> None:
    secured = await serve(etcd, prefix, authenticator=TokenAuthenticator(_token_file(tmp_path / "tokens.toml")))
    try:
        async with grpc.aio.insecure_channel(secured.address) as channel:
            agent = Actor(channel, "agent-a", token=TOKENS["agent-a"])
            await claim(agent, message("acme-1", "msg-parcel"), "Where is my parcel?", "carl@example.net")
            bo = await open_board(browser, board_url(secured, "acme-1"), token=TOKENS["bo"])
            ana = await open_board(browser, board_url(secured, "acme-1"), token=TOKENS["ana"])
            await expect(bo.locator("#who")).to_have_text("Signed in as bo · acme-1")
            # Ana (role takeover) is offered it; Bo (no role) is not, and reads why.
            await expect(row(ana, "msg-parcel").get_by_role("button", name="Take over")).to_be_visible(timeout=LIVE)
            bo_row = row(bo, "msg-parcel")
            await expect(bo_row).to_contain_text("You are not allowed to take over from agents", timeout=LIVE)
            await expect(bo_row.get_by_role("button")).to_have_count(0)
            # Taking over makes it Ana's: only she may now say it is answered or give it back.
            await row(ana, "msg-parcel").get_by_role("button", name="Take over").click()
            await expect(row(ana, "msg-parcel").get_by_role("button", name="I replied")).to_be_visible(timeout=LIVE)
            await expect(bo_row).to_contain_text("Only ana can say it is answered or give it back", timeout=LIVE)
            await expect(bo_row.get_by_role("button")).to_have_count(0)
    finally:
        await secured.stop(grace=0.5)


SUBJECT_LINES = [
    "Refund for order 1182?",
    "Where is my parcel?",
    "Invoice 77 is wrong",
    "Cancel my subscription",
    "Login does not work",
    "Change of address",
    "Damaged item received",
    "Question about pricing",
    "Thank you!",
    "Urgent: double charge",
]
SENDERS = ["Bea Costa <bea@example.org>", "carl@example.net", "Dana Wu <dana@example.com>", "Eli <eli@example.io>"]


async def populate(channel: grpc.aio.Channel, mailbox: str, count: int) -> None:
    """``count`` rows in every state a board shows: agents drafting, people answering, sends, replies."""
    agents = [Actor(channel, f"agent-{n}") for n in (1, 2, 3)]
    people = [Actor(channel, name, kind="human") for name in ("ana", "bo")]
    for n in range(count):
        subject = message(mailbox, f"msg-{n:04d}")
        holder = people[n % 2] if n % 5 == 1 else agents[n % 3]
        granted = await claim(
            holder,
            subject,
            SUBJECT_LINES[n % len(SUBJECT_LINES)],
            SENDERS[n % len(SENDERS)],
            ttl_seconds=60 + 37 * n % 1500,
            note="calling them back" if n % 5 == 1 else "",
        )
        token = granted.status.fencing_token
        if n % 7 == 3:
            await holder.begin(subject, token)
            await holder.confirm(subject, token, sent_message_id=f"sent-{n}")
        elif n % 7 == 5 and holder in people:
            await holder.mark_replied(subject, token, note="answered by phone")
        elif n % 11 == 6:
            await holder.begin(subject, token)


async def test_a_board_of_50_rows_is_readable_and_written_as_a_screenshot(
    server: CoordinatorServer, browser: Browser, mailbox: str
) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        await populate(channel, mailbox, 50)
    page = await open_board(browser, board_url(server, mailbox), name="ana", height=1000)
    await expect(page.locator("#claims tbody tr")).to_have_count(50, timeout=5_000)
    states = await page.locator("#claims tbody tr").evaluate_all("rows => rows.map(r => r.dataset.state)")
    order = ["SUBJECT_STATE_IN_DOUBT", "SUBJECT_STATE_SENDING", "SUBJECT_STATE_CLAIMED", "SUBJECT_STATE_REPLIED"]
    assert [order.index(state) for state in states] == sorted(order.index(state) for state in states)
    text = await page.locator("#board").inner_text()
    assert "fencing" not in text.lower()
    assert "token" not in text.lower()  # words for people: what a claim means for them, not how it works
    shot = await page.screenshot(path=str(ARTIFACTS / "board-50-rows.png"), full_page=False)
    assert len(shot) > 20_000


async def test_a_board_of_1000_rows_stays_live_and_filterable(
    server: CoordinatorServer, browser: Browser, mailbox: str
) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        agents = [Actor(channel, f"agent-{n}") for n in range(8)]

        async def claim_many(agent: Actor, first: int) -> None:
            for n in range(first, 1000, len(agents)):
                await claim(
                    agent, message(mailbox, f"bulk-{n:04d}"), SUBJECT_LINES[n % 10], SENDERS[n % 4], ttl_seconds=600
                )

        await asyncio.gather(*(claim_many(agent, i) for i, agent in enumerate(agents)))
        page = await open_board(browser, board_url(server, mailbox), name="ana")
        await expect(page.locator("#claims tbody tr")).to_have_count(1000, timeout=10_000)
        # One more claim among a thousand rows still shows within a second, countdown running.
        await claim(
            agents[0], message(mailbox, "the-new-one"), "Brand new question", "new@example.org", ttl_seconds=600
        )
        await expect(row(page, "the-new-one")).to_contain_text("Brand new question", timeout=LIVE)
        # Find narrows a thousand rows to what a person is looking for.
        await page.keyboard.press("/")
        await page.keyboard.type("brand new")
        await expect(page.locator("#claims tbody tr:not([hidden])")).to_have_count(1)
        await expect(page.locator("[data-count=SUBJECT_STATE_CLAIMED]")).to_have_text("(1001)")


async def test_the_board_catches_up_after_the_coordinator_restarts(
    etcd: EtcdServer, prefix: str, browser: Browser, mailbox: str
) -> None:
    first = await serve(etcd, prefix)
    assert first.http is not None
    address = first.http.address
    page = await open_board(browser, f"http://{address}/?mailbox={mailbox}", name="ana")
    async with grpc.aio.insecure_channel(first.address) as channel:
        agent = Actor(channel, "agent-a")
        before = await claim(agent, message(mailbox, "before"), "Before the restart", "a@example.org")
        await expect(row(page, "before")).to_be_visible(timeout=LIVE)
    await first.stop(grace=0.5)
    await expect(page.locator("#status-line")).to_contain_text("reconnecting", timeout=5_000)
    # While no HTTP face is up, another coordinator changes the mailbox.
    writer = await serve(etcd, prefix, http_listen="")
    async with grpc.aio.insecure_channel(writer.address) as channel:
        agent = Actor(channel, "agent-a")
        await agent.release(message(mailbox, "before"), before.status.fencing_token)
        await claim(agent, message(mailbox, "during"), "While the board was away", "b@example.org")
    await writer.stop(grace=0.5)
    second = await serve(etcd, prefix, http_listen=address)
    try:
        # It resumes from the last revision it saw: the release and the new claim, no reload.
        await expect(row(page, "during")).to_contain_text("While the board was away", timeout=15_000)
        await expect(row(page, "before")).to_have_count(0)
        await expect(page.locator("#status-line")).to_have_text("")
    finally:
        await second.stop(grace=0.5)


async def test_text_from_an_email_is_shown_isolated_and_without_invisible_formatting(
    server: CoordinatorServer, browser: Browser, mailbox: str
) -> None:
    page = await open_board(browser, board_url(server, mailbox), name="ana")
    async with grpc.aio.insecure_channel(server.address) as channel:
        agent = Actor(channel, "agent-a")
        # The coordinator drops the override from the summary; a note may still carry one (older records too).
        sender = "\u0628\u064a\u0627 \u0643\u0648\u0633\u062a\u0627 <bea@example.org>"
        await claim(
            agent, message(mailbox, "msg-disguised"), "Invoice \u202egnp.exe", sender, note="see \u202eattached"
        )
        found = row(page, "msg-disguised")
        await expect(found).to_contain_text("Invoice gnp.exe", timeout=LIVE)
        texts = await found.evaluate(
            """(tr) => ({
                subject: tr.querySelector(".subject").textContent,
                note: tr.querySelector(".note").textContent,
                isolated: [...tr.querySelectorAll("bdi")].map((bdi) => bdi.textContent),
            })"""
        )
    assert texts["subject"] == "Invoice gnp.exe"
    assert texts["note"] == "see attached"
    # The right-to-left sender sits in an isolate of its own, apart from the date and the message id beside it.
    assert sender in texts["isolated"]
    assert "Invoice gnp.exe" in texts["isolated"]
