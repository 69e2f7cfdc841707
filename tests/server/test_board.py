"""The claims board in a real headless Chromium (Debian's package, driven by Playwright), against a real
coordinator and etcd: two people's browsers on one mailbox, an agent claiming, a takeover (from an agent, and
from a colleague after a confirmation), a reply by hand, a person's claim counting down, warning and kept, an
email found among the mailbox's recent ones and answered, look-alike emails told apart, a settled send credited
to who settled it, the focus after every action, the layout at phone (390x844) and laptop (1280x800) size, an
axe-core accessibility check, and screenshots written as test artifacts (docs/board*.png come from them)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from playwright.async_api import Browser, Locator, Page, async_playwright, expect

from coordinator.api.auth import TokenAuthenticator
from coordinator.ops.server import CoordinatorServer
from coordinator.store.etcd.process import EtcdServer
from inbox_wire.v1 import coordinator_pb2 as pb
from tests.helpers import Actor, message, missing_on_this_machine, new_request_id
from tests.server.test_auth import TOKENS, _token_file
from tests.server.test_http import serve

CHROMIUM = os.environ.get("INBOX_CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))
ARTIFACTS.mkdir(parents=True, exist_ok=True)
# ms: how long a test waits for an update to show. A bound that only a board that stopped updating misses, not a
# speed target (a loaded CI machine once took over a second for one row among a thousand); speed is for bench/.
LIVE = 10_000
PHONE, LAPTOP = (390, 844), (1280, 800)
PAGE_ERRORS: list[str] = []  # uncaught errors of the board's script, in any page of any test
# axe-core from the npm registry (tests/server/board_a11y/package.json), injected into the page by the test.
AXE = Path(__file__).resolve().parent / "board_a11y"

if not Path(CHROMIUM).exists():  # pragma: no cover - .ci/run installs it; say so loudly rather than skip
    raise RuntimeError(f"no Chromium at {CHROMIUM}: apt-get install chromium (or set INBOX_CHROMIUM)")


@pytest.fixture(autouse=True)
def no_page_errors() -> Iterator[None]:
    """Every test ends with the board's script never having thrown."""
    PAGE_ERRORS.clear()
    yield
    assert PAGE_ERRORS == []


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
    browser: Browser,
    url: str,
    *,
    name: str = "",
    token: str = "",
    size: tuple[int, int] = (1400, 900),
    script: Path | None = None,
) -> Page:
    """The board signed in; ``script``: a file run in the page before its own (as a browser extension would,
    so that the board's Content-Security-Policy, which allows no inline script, stays as it is)."""
    page = await browser.new_page(viewport={"width": size[0], "height": size[1]})
    page.on("pageerror", lambda error: PAGE_ERRORS.append(f"{url}: {error}"))
    if script is not None:
        await page.add_init_script(path=str(script))
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
    actor: Actor, subject: pb.Subject, subject_line: str, sender: str, *, received_ago: int = 600, **fields: object
) -> pb.ClaimReplyResponse:
    summary = pb.MessageSummary(
        subject_line=subject_line, sender=sender, received_at=Timestamp(seconds=int(time.time()) - received_ago)
    )
    return await actor.stub.ClaimReply(
        pb.ClaimReplyRequest(request_id=new_request_id(), subject=subject, summary=summary, **fields),  # type: ignore[arg-type]
        metadata=actor.metadata,
    )


async def focused_text(page: Page) -> str:
    """What has the keyboard focus: a button's label, or a row's text; "BODY" when it fell to the page."""
    text: str = await page.evaluate(
        "() => { const e = document.activeElement; return !e || e === document.body ? 'BODY' : e.innerText; }"
    )
    return text


@pytest.fixture(params=[PHONE, LAPTOP], ids=["phone-390x844", "laptop-1280x800"])
def screen(request: pytest.FixtureRequest) -> tuple[int, int]:
    """The two screens each workflow is tried on: a phone (the card layout) and a laptop (the table)."""
    width, height = request.param
    return width, height


async def test_two_people_see_an_agent_claim_a_takeover_and_a_reply_by_hand_live(
    server: CoordinatorServer, browser: Browser, mailbox: str, screen: tuple[int, int]
) -> None:
    ana = await open_board(browser, board_url(server, mailbox), name="ana", size=screen)
    bo = await open_board(browser, board_url(server, mailbox), name="bo", size=screen)
    for page in (ana, bo):
        await expect(page.locator("#empty")).to_be_visible()
    async with grpc.aio.insecure_channel(server.address) as channel:
        agent = Actor(channel, "agent-a")
        subject = message(mailbox, "msg-refund")
        granted = await claim(agent, subject, "Refund for order 1182?", "Bea Costa <bea@example.org>", ttl_seconds=15)
        token = granted.status.fencing_token
        # Both people see the agent's claim, with which email it is, within a second. Its short TTL, renewed
        # while it works, is no emergency: no red countdown.
        for page in (ana, bo):
            found = row(page, "msg-refund")
            await expect(found).to_contain_text("Refund for order 1182?", timeout=LIVE)
            await expect(found).to_contain_text("agent-a (an agent) is writing a reply", timeout=LIVE)
            await expect(found.locator(".left")).to_have_text("kept while it works", timeout=LIVE)
            await expect(found.locator(".left.urgent, .left.soon")).to_have_count(0)

        # Ana takes it over: Bo sees it within a second, and the agent can no longer send.
        await row(ana, "msg-refund").get_by_role("button", name="Take over").click()
        await expect(ana.locator("#status-line")).to_contain_text(
            "agent-a can no longer send it and will stop at its next step"
        )
        await expect(row(bo, "msg-refund")).to_contain_text("ana is answering this", timeout=LIVE)
        # Her own page's stream brings the same change, before or after her answer: the answer stays on screen,
        # and the focus lands on what she does next.
        await expect(row(ana, "msg-refund")).to_contain_text("You are answering this", timeout=LIVE)
        await expect(ana.locator("#status-line")).to_contain_text("will stop at its next step")
        await expect(row(ana, "msg-refund").get_by_role("button", name="I replied")).to_be_focused(timeout=LIVE)
        assert (await agent.begin(subject, token)).result == pb.FENCE_RESULT_STALE_TOKEN

        # Ana answers in her mail client and says so: the dialog opens on its first field, both see it, and a
        # redelivery gets ALREADY_REPLIED.
        await ana.keyboard.press("Enter")
        await expect(ana.locator("#ask-note")).to_be_focused()
        await expect(ana.locator("#ask")).not_to_contain_text("Id of the message")
        await ana.keyboard.type("replied from Gmail")
        await ana.keyboard.press("Enter")
        for page in (ana, bo):
            await expect(row(page, "msg-refund")).to_contain_text("Answered by hand by ana", timeout=LIVE)
        await expect(row(ana, "msg-refund")).to_be_focused(timeout=LIVE)  # no button left: the row itself
        later = await agent.claim(subject, notification_id="message.updated-1")
        assert later.result == pb.ClaimReplyResponse.ALREADY_REPLIED
        # The state filter hides what is answered; the row comes back with it.
        await bo.locator('#filters input[value="SUBJECT_STATE_REPLIED"]').uncheck()
        await expect(row(bo, "msg-refund")).to_be_hidden()
        await bo.locator('#filters input[value="SUBJECT_STATE_REPLIED"]').check()
        await expect(row(bo, "msg-refund")).to_be_visible()


async def test_a_reply_from_the_mailbox_shows_who_answered_and_that_the_agent_stopped(
    server: CoordinatorServer, browser: Browser, mailbox: str, screen: tuple[int, int]
) -> None:
    page = await open_board(browser, board_url(server, mailbox), name="bo", size=screen)
    colleague = await open_board(browser, board_url(server, mailbox), name="ana", size=screen)
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
        # Who the message's From line names, and beside it who reported it (what vouches for it).
        await expect(ended).to_contain_text(
            re.compile(
                r"Answered from the mailbox by ana@shop\.example \(as its From line says; recorded by agent-a\) "
                r"at .+\. agent-a stopped because a person answered\."
            ),
            timeout=LIVE,
        )
        await expect(ended.locator(".holder")).to_contain_text("ana@shop.example")
        await expect(row(page, "msg-sending")).to_contain_text(
            "agent-a is sending the reply right now. Also answered from the mailbox by ana@shop.example", timeout=LIVE
        )
        await expect(row(page, "msg-sending")).to_contain_text(": both replies go out.")
        await page.screenshot(path=ARTIFACTS / "board-answered-from-the-mailbox.png")
        # That reply did not answer the refund question: bo (development mode: every role) undoes it.
        await ended.get_by_role("button", name="It was not answered").click()
        dialog = page.locator("#ask")
        await expect(dialog).to_contain_text("recorded by agent-a")
        await page.fill("#ask-note", "Ana answered the parcel question only")
        await dialog.get_by_role("button", name="Yes, it was not answered").click()
        await expect(ended).to_have_count(0, timeout=LIVE)  # FREE: off the board
        await expect(page.locator("#status-line")).to_contain_text(
            re.compile(r"Undone, with your name, at .+: that reply no longer counts as the answer to “Refund for order")
        )
        # Everyone else watching is told who undid what, and when.
        await expect(row(colleague, "msg-drafting")).to_have_count(0, timeout=LIVE)
        await expect(colleague.locator("#status-line")).to_contain_text(
            re.compile(
                r"bo undid “answered from the mailbox by ana@shop\.example \(as its From line says; recorded by "
                r"agent-a\) at .+” for “Refund for order 1182\?” at .+ \(Ana answered the parcel question only\)"
            )
        )
        await expect(colleague.locator("#status-line")).to_contain_text("the email can be answered again")
        status = await agent.status(drafting)
        assert status.state == pb.SUBJECT_STATE_FREE


async def test_a_person_settles_unconfirmed_sends_from_the_keyboard_credited_and_asked_nothing_unknowable(
    server: CoordinatorServer, browser: Browser, mailbox: str, screen: tuple[int, int]
) -> None:
    ana = await open_board(browser, board_url(server, mailbox), name="ana", size=screen)
    async with grpc.aio.insecure_channel(server.address) as channel:
        agent = Actor(channel, "support-agent-1")
        for name, line in (("msg-stuck", "Invoice 77"), ("msg-lost", "Cancel my plan")):
            stuck = message(mailbox, name)
            await agent.begin(stuck, (await claim(agent, stuck, line, "carl@example.net")).status.fencing_token)
        for name in ("msg-stuck", "msg-lost"):
            await expect(row(ana, name)).to_contain_text("check the Sent folder and tell us", timeout=5_000)
        # Keyboard only: the rows that need a person come first; Enter reaches their buttons.
        await ana.locator("#claims tbody tr").first.focus()
        first = await ana.locator("#claims tbody tr").first.get_attribute("data-key") or ""
        found, other = ("msg-stuck", "msg-lost") if first.endswith("msg-stuck") else ("msg-lost", "msg-stuck")
        await ana.keyboard.press("Enter")
        await expect(row(ana, found).get_by_role("button", name="It was sent")).to_be_focused()
        await ana.keyboard.press("Tab")
        await ana.keyboard.press("Enter")  # "It was not sent": asks only what a person can know
        dialog = ana.locator("#ask")
        await expect(dialog).to_contain_text("the reply is not there")
        await expect(dialog.get_by_role("textbox")).to_have_count(1)
        await expect(dialog).not_to_contain_text("Id of the message")
        await expect(ana.locator("#ask-note")).to_be_focused()
        await ana.keyboard.press("Enter")  # in the dialog's note field: Enter confirms
        await expect(row(ana, found)).to_have_count(0, timeout=LIVE)  # FREE again: off the board
        assert (await agent.status(message(mailbox, found))).state == pb.SUBJECT_STATE_FREE
        # The focus moved on to the next row needing a person, never to the page.
        await expect(row(ana, other).get_by_role("button", name="It was sent")).to_be_focused(timeout=LIVE)
        await ana.keyboard.press("Enter")
        await expect(ana.locator("#ask-note")).to_be_focused()
        await ana.keyboard.type("found it in Sent")
        await ana.keyboard.press("Enter")
        # The reply is credited to Ana, who settled it, not to the agent that never confirmed it.
        settled = row(ana, other)
        await expect(settled).to_contain_text("ana checked: the reply support-agent-1 started went out", timeout=LIVE)
        await expect(settled.locator("td.holder")).to_have_text(re.compile(r"^ana\s*person$"))
        status = await agent.status(message(mailbox, other))
        assert (status.state, status.holder, status.settled_by) == (pb.SUBJECT_STATE_REPLIED, "support-agent-1", "ana")
        await expect(settled).to_be_focused(timeout=LIVE)


async def test_a_persons_claim_counts_down_warns_before_it_ends_and_is_kept_or_given_back(
    server: CoordinatorServer, browser: Browser, mailbox: str, screen: tuple[int, int]
) -> None:
    ana = await open_board(browser, board_url(server, mailbox), name="ana", size=screen)
    async with grpc.aio.insecure_channel(server.address) as channel:
        person, agent = Actor(channel, "ana", kind="human"), Actor(channel, "agent-a")
        # Her claim has less than the warning's two minutes left (as after 13 of her 15 minutes).
        await claim(person, message(mailbox, "msg-mine"), "Change of address", "dana@example.com", ttl_seconds=100)
        await claim(agent, message(mailbox, "msg-next"), "Login does not work", "eli@example.io", ttl_seconds=600)
        mine = row(ana, "msg-mine")
        await expect(mine.locator(".left")).to_have_text(re.compile(r"^1:[34]\d$"), timeout=LIVE)
        await expect(mine).to_have_class(re.compile(r"\bending\b"))
        status_line = ana.locator("#status-line")
        await expect(status_line).to_contain_text("Your claim on “Change of address” ends in 1:", timeout=2_000)
        await expect(status_line).to_contain_text("Keep it longer")
        await expect(status_line).to_have_class(re.compile("warning"))

        # Keeping it is a renewal, as an agent's: 15 more minutes, the warning gone, the focus where it was.
        await mine.get_by_role("button", name="Keep it longer").click()
        await expect(mine.locator(".left")).to_have_text(re.compile(r"^1[45]:\d\d$"), timeout=LIVE)
        await expect(mine).not_to_have_class(re.compile(r"\bending\b"))
        await expect(status_line).to_have_text("It is yours for 15 more minutes.")
        await expect(mine.get_by_role("button", name="Keep it longer")).to_be_focused()
        assert (await person.status(message(mailbox, "msg-mine"))).ttl_seconds == 900

        # Giving it back frees it; the focus moves to the next row, not to the page.
        await mine.get_by_role("button", name="Give it back").click()
        await expect(mine).to_have_count(0, timeout=LIVE)
        await expect(row(ana, "msg-next").get_by_role("button", name="Take over")).to_be_focused(timeout=LIVE)

        # A claim left to run out says so when it ends, in words for her.
        await claim(person, message(mailbox, "msg-short"), "Thank you!", "bea@example.org", ttl_seconds=5)
        await expect(row(ana, "msg-short")).to_be_visible(timeout=LIVE)
        await expect(row(ana, "msg-short")).to_have_count(0, timeout=10_000)
        await expect(status_line).to_contain_text("Your time on “Thank you!” ran out before you said it was answered")


async def test_a_person_takes_a_message_from_a_colleague_after_confirming_it(
    server: CoordinatorServer, browser: Browser, mailbox: str, screen: tuple[int, int]
) -> None:
    ana = await open_board(browser, board_url(server, mailbox), name="ana", size=screen)
    bo = await open_board(browser, board_url(server, mailbox), name="bo", size=screen)
    async with grpc.aio.insecure_channel(server.address) as channel:
        colleague = Actor(channel, "bo", kind="human")
        held = await claim(colleague, message(mailbox, "msg-parcel"), "Where is my parcel?", "carl@example.net")
        take = row(ana, "msg-parcel").get_by_role("button", name="Take it from bo")
        await expect(take).to_be_visible(timeout=LIVE)
        # The confirmation names the colleague and what it means for them; cancelling changes nothing.
        await take.click()
        dialog = ana.locator("#ask")
        await expect(dialog).to_contain_text("Take “Where is my parcel?” from bo?")
        await expect(dialog.get_by_role("textbox")).to_have_count(0)
        await expect(dialog.get_by_role("button", name="Take it from bo")).to_be_focused()
        await dialog.get_by_role("button", name="Cancel").click()
        await expect(take).to_be_focused()
        assert (await colleague.status(message(mailbox, "msg-parcel"))).holder == "bo"

        await take.click()
        await dialog.get_by_role("button", name="Take it from bo").click()
        await expect(ana.locator("#status-line")).to_contain_text("You are answering it now; bo no longer has it")
        await expect(row(ana, "msg-parcel")).to_contain_text("You are answering this", timeout=LIVE)
        await expect(row(ana, "msg-parcel").get_by_role("button", name="I replied")).to_be_focused(timeout=LIVE)
        # Bo's board says so, and his "I replied" from before is refused: nothing recorded over Ana's claim.
        await expect(row(bo, "msg-parcel")).to_contain_text("ana is answering this", timeout=LIVE)
        await expect(bo.locator("#status-line")).to_contain_text("“Where is my parcel?” was taken over from you")
        late = await colleague.mark_replied(message(mailbox, "msg-parcel"), held.status.fencing_token, note="done")
        assert late.result == pb.FENCE_RESULT_STALE_TOKEN


async def test_answering_an_email_yourself_starts_from_the_recent_emails_not_an_id(
    server: CoordinatorServer, browser: Browser, mailbox: str, screen: tuple[int, int]
) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        agent = Actor(channel, "agent-a")
        # An agent got two emails: it gave one back (a person should answer it) and is drafting the other.
        given_back = await claim(
            agent, message(mailbox, "msg-parcel"), "Where is my parcel?", "Carl <carl@example.net>",
            notification_id="n-parcel", received_ago=900,
        )  # fmt: skip
        await agent.release(message(mailbox, "msg-parcel"), given_back.status.fencing_token)
        await claim(
            agent, message(mailbox, "msg-refund"), "Refund for order 1182?", "Bea <bea@example.org>",
            notification_id="n-refund", received_ago=60,
        )  # fmt: skip
        ana = await open_board(browser, board_url(server, mailbox), name="ana", size=screen)
        await expect(ana.get_by_text("message id")).to_have_count(0)  # nobody types an id
        await ana.get_by_text("Answer an email yourself").click()
        await expect(ana.locator("#answer-query")).to_be_focused()
        results = ana.locator("#answer-results li")
        # Newest first, each with what is happening to it now and what she may do.
        await expect(results).to_have_count(2, timeout=LIVE)
        await expect(results.nth(0)).to_contain_text("Refund for order 1182?")
        await expect(results.nth(0)).to_contain_text("agent-a (an agent) is writing a reply")
        await expect(results.nth(0).get_by_role("button", name="Take over")).to_be_visible()
        await expect(results.nth(1)).to_contain_text("Where is my parcel?")
        await expect(results.nth(1)).to_contain_text("Nobody is answering it.")

        await ana.fill("#answer-query", "parcel")
        await ana.keyboard.press("Enter")
        await expect(results).to_have_count(1)
        await results.get_by_role("button", name="I'm answering this").click()
        # The row names the email (its subject line came with the search), and the focus is on what comes next.
        mine = row(ana, "msg-parcel")
        await expect(mine).to_contain_text("Where is my parcel?", timeout=LIVE)
        await expect(mine).to_contain_text("You are answering this")
        await expect(mine).to_contain_text("15:00", timeout=2_000)
        await expect(mine.get_by_role("button", name="I replied")).to_be_focused(timeout=LIVE)
        await expect(results.first).to_contain_text("You are answering this")
        status = await agent.status(message(mailbox, "msg-parcel"))
        assert (status.holder, status.summary.subject_line) == ("ana", "Where is my parcel?")


async def test_look_alike_emails_are_told_apart_by_when_they_came_in(
    server: CoordinatorServer, browser: Browser, mailbox: str, screen: tuple[int, int]
) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        agent = Actor(channel, "agent-a")
        for name, ago in (("msg-first", 3_600), ("msg-second", 120)):
            await claim(
                agent, message(mailbox, name), "Invoice 77 is wrong", "Dana <dana@example.com>", received_ago=ago
            )
        await claim(agent, message(mailbox, "msg-alone"), "Thank you!", "Dana <dana@example.com>")
    page = await open_board(browser, board_url(server, mailbox), name="ana", size=screen)
    first, second = row(page, "msg-first").locator(".alike"), row(page, "msg-second").locator(".alike")
    await expect(first).to_contain_text("Same subject and sender as 1 other here; this one came in", timeout=LIVE)
    await expect(second).to_contain_text("Same subject and sender as 1 other here; this one came in")
    assert await first.inner_text() != await second.inner_text()
    await expect(row(page, "msg-alone").locator(".alike")).to_be_hidden()
    # Each row names its message whole, never cut short.
    await expect(row(page, "msg-second").locator(".id")).to_have_text("message msg-second")


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
    etcd: EtcdServer, prefix: str, tmp_path: Path, browser: Browser, screen: tuple[int, int]
) -> None:
    secured = await serve(etcd, prefix, authenticator=TokenAuthenticator(_token_file(tmp_path / "tokens.toml")))
    try:
        async with grpc.aio.insecure_channel(secured.address) as channel:
            agent = Actor(channel, "agent-a", token=TOKENS["agent-a"])
            await claim(agent, message("acme-1", "msg-parcel"), "Where is my parcel?", "carl@example.net")
            bo = await open_board(browser, board_url(secured, "acme-1"), token=TOKENS["bo"], size=screen)
            ana = await open_board(browser, board_url(secured, "acme-1"), token=TOKENS["ana"], size=screen)
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
            received_ago=300 + 233 * n % 7000,
            notification_id=f"notification-{n:04d}" if holder in agents else "",
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
    page = await open_board(browser, board_url(server, mailbox), name="ana", size=(1400, 1000))
    await expect(page.locator("#claims tbody tr")).to_have_count(50, timeout=5_000)
    states = await page.locator("#claims tbody tr").evaluate_all("rows => rows.map(r => r.dataset.state)")
    order = ["SUBJECT_STATE_IN_DOUBT", "SUBJECT_STATE_SENDING", "SUBJECT_STATE_CLAIMED", "SUBJECT_STATE_REPLIED"]
    assert [order.index(state) for state in states] == sorted(order.index(state) for state in states)
    text = await page.locator("#board").inner_text()
    assert "fencing" not in text.lower()
    assert "token" not in text.lower()  # words for people: what a claim means for them, not how it works
    shot = await page.screenshot(path=str(ARTIFACTS / "board-50-rows.png"), animations="disabled")
    assert len(shot) > 20_000


@pytest.fixture(scope="module")
def axe_script() -> Path:
    """axe-core's axe.min.js, installed from the npm registry by tests/server/board_a11y/package-lock.json."""
    script = AXE / "node_modules" / "axe-core" / "axe.min.js"
    if not script.exists():
        npm = shutil.which("npm")
        if npm is None:  # pragma: no cover - .ci/run installs npm
            missing_on_this_machine("npm, to install axe-core for the board's accessibility check")
        subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=AXE, check=True, timeout=300)
    return script


_SERIOUS = """async () => (await axe.run(document, { resultTypes: ["violations"] })).violations
    .filter((v) => v.impact === "serious" || v.impact === "critical")
    .map((v) => ({ id: v.id, impact: v.impact, help: v.help, nodes: v.nodes.map((n) => n.target.join(" ")) }))"""


async def axe_violations(page: Page) -> list[dict[str, Any]]:
    """axe-core's serious and critical violations on the page as it is now (every rule axe runs by default); the
    page was opened with ``script=axe_script``."""
    found: list[dict[str, Any]] = await page.evaluate(_SERIOUS)
    return found


@pytest.mark.parametrize("size", [PHONE, LAPTOP], ids=["phone-390x844", "laptop-1280x800"])
async def test_every_action_is_on_screen_and_accessible_at_phone_and_laptop_size(
    server: CoordinatorServer, browser: Browser, mailbox: str, size: tuple[int, int], axe_script: Path
) -> None:
    width, height = size
    async with grpc.aio.insecure_channel(server.address) as channel:
        await populate(channel, mailbox, 14)
        person = Actor(channel, "ana", kind="human")
        await claim(person, message(mailbox, "msg-ana"), "Damaged item received", "eli@example.io", ttl_seconds=600)
        agent = Actor(channel, "agent-9")
        stuck = message(mailbox, "msg-stuck")
        await agent.begin(
            stuck, (await claim(agent, stuck, "Urgent: double charge", "bea@example.org")).status.fencing_token
        )
    page = await open_board(browser, board_url(server, mailbox), name="ana", size=size, script=axe_script)
    await expect(page.locator("#claims tbody tr")).to_have_count(16, timeout=5_000)
    await expect(row(page, "msg-stuck").get_by_role("button", name="It was not sent")).to_be_visible(timeout=5_000)
    await page.wait_for_timeout(200)  # the first sort
    assert await page.evaluate("document.documentElement.scrollWidth") <= width, "the page scrolls sideways"
    # Every control of every row is within the screen's width (reachable by scrolling down, never sideways).
    boxes = await page.locator("#claims button, #board summary, #search").evaluate_all(
        "els => els.map(e => { const r = e.getBoundingClientRect(); return [e.innerText, r.left, r.right]; })"
    )
    off = [(label, left, right) for label, left, right in boxes if left < 0 or right > width]
    assert boxes
    assert off == [], off
    layout = await page.locator("#claims tbody tr").first.evaluate("tr => getComputedStyle(tr).display")
    assert layout == ("block" if width < 700 else "table-row")  # cards on a phone, a table on a laptop
    name = "phone" if width < 700 else "laptop"
    await page.screenshot(path=str(ARTIFACTS / f"board-{name}-{width}x{height}.png"), animations="disabled")
    assert await axe_violations(page) == []

    # The dialogs fit the screen, and are accessible too.
    await row(page, "msg-stuck").get_by_role("button", name="It was not sent").click()
    dialog = await page.locator("#ask").bounding_box()
    assert dialog is not None
    assert dialog["x"] >= 0
    assert dialog["x"] + dialog["width"] <= width
    assert await axe_violations(page) == []
    await page.get_by_role("button", name="Cancel").click()
    # So is the search for an email to answer.
    await page.get_by_text("Answer an email yourself").click()
    await expect(page.locator("#answer-note")).not_to_have_text("Looking…")
    assert await page.evaluate("document.documentElement.scrollWidth") <= width
    await page.screenshot(path=str(ARTIFACTS / f"board-{name}-answer-{width}x{height}.png"), animations="disabled")
    assert await axe_violations(page) == []


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
        # One more claim among a thousand rows still shows, countdown running.
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


async def test_a_conversation_where_agents_stopped_goes_first_and_asks_for_a_person(
    server: CoordinatorServer, browser: Browser, mailbox: str
) -> None:
    """docs/design.md#reply-storms: an agent's fourth reply in a thread within the hour is refused; while its claim
    is held, the board says so in the coordinator's words and puts the row first, waiting for a person."""
    page = await open_board(browser, board_url(server, mailbox), name="bo", size=LAPTOP)
    async with grpc.aio.insecure_channel(server.address) as channel:
        agent = Actor(channel, "agent-a")
        await claim(agent, message(mailbox, "msg-other"), "Invoice copy", "Dan <dan@example.org>")
        for n in range(3):
            subject = message(mailbox, f"msg-{n}")
            asked = Timestamp(seconds=int(time.time()) - 600 + n)
            held = await claim(
                agent, subject, "Out of office", "Bot <ooo@example.org>", thread_id="t-1", received_at=asked
            )
            assert (await agent.begin(subject, held.status.fencing_token)).result == pb.FENCE_RESULT_OK
            await agent.confirm(subject, held.status.fencing_token)
        fourth = message(mailbox, "msg-3")
        asked = Timestamp(seconds=int(time.time()) - 500)
        held = await claim(
            agent, fourth, "Re: Out of office", "Bot <ooo@example.org>", thread_id="t-1", received_at=asked
        )
        refused = await agent.begin(fourth, held.status.fencing_token)
        assert refused.result == pb.FENCE_RESULT_REFUSED
        stopped = row(page, "msg-3")
        await expect(stopped).to_contain_text(
            "agents stopped: 3 agent replies to this conversation in the last hour — a person should look", timeout=LIVE
        )
        await expect(stopped).to_contain_text("waiting for a person")
        await expect(page.locator("#claims tbody tr").first).to_contain_text("agents stopped")
        await page.screenshot(path=ARTIFACTS / "board-agents-stopped.png")
        # The agent lets go of it, as the clients do: everyone watching is told, in the coordinator's words.
        await agent.release(fourth, held.status.fencing_token)
        await expect(stopped).to_have_count(0, timeout=LIVE)
        await expect(page.locator("#status-line")).to_contain_text(
            "agent-a let go of “Re: Out of office”: agents stopped: 3 agent replies to this conversation in the last "
            "hour — a person should look. It waits for a person under “Waiting for a person”."
        )


async def test_what_agents_leave_waits_for_a_person_until_someone_answers_or_the_budget_frees(
    server: CoordinatorServer, browser: Browser, mailbox: str
) -> None:
    """docs/design.md#reply-storms: a conversation where agents were stopped stays under "Waiting for a person"
    after the agent let go of it (until the budget frees), and automated mail nobody claims is listed with why
    agents leave it; a person can claim either from there."""
    page = await open_board(browser, board_url(server, mailbox), name="bo", size=LAPTOP)
    async with grpc.aio.insecure_channel(server.address) as channel:
        agent, reporter = Actor(channel, "agent-a"), Actor(channel, "mail-reporter")
        now = int(time.time())
        ooo = pb.RecordIncomingRequest(
            request_id=new_request_id(),
            mailbox=mailbox,
            message_id="ooo-1",
            thread_id="t-ooo",
            notification_id="n-ooo",
            received_at=Timestamp(seconds=now - 300),
            automated="Auto-Submitted: auto-replied",
            summary=pb.MessageSummary(subject_line="Automatic reply: away until Monday", sender="Cy <cy@example.org>"),
        )
        assert (await reporter.stub.RecordIncoming(ooo, metadata=reporter.metadata)).status.automated
        for n in range(3):
            subject = message(mailbox, f"msg-{n}")
            asked = Timestamp(seconds=now - 600 + n)
            held = await claim(agent, subject, "Refund?", "Ana <ana@example.org>", thread_id="t-1", received_at=asked)
            assert (await agent.begin(subject, held.status.fencing_token)).result == pb.FENCE_RESULT_OK
            await agent.confirm(subject, held.status.fencing_token)
        fourth = message(mailbox, "msg-3")
        asked = Timestamp(seconds=now - 500)
        held = await claim(agent, fourth, "Re: Refund?", "Ana <ana@example.org>", thread_id="t-1", received_at=asked)
        assert (await agent.begin(fourth, held.status.fencing_token)).result == pb.FENCE_RESULT_REFUSED
        await agent.release(fourth, held.status.fencing_token)  # as the clients do at once
        await expect(row(page, "msg-3")).to_have_count(0, timeout=LIVE)
        waiting = page.locator("#waiting")
        stopped = waiting.locator("li.stopped", has_text="Re: Refund?")
        await expect(stopped).to_contain_text(
            "agents stopped: 3 agent replies to this conversation in the last hour — a person should look", timeout=LIVE
        )
        await expect(stopped).to_contain_text("agent-a was stopped at")
        await expect(stopped).to_contain_text("agents may answer again from")
        await expect(stopped).to_contain_text("Nobody is answering it.")
        automated = waiting.locator("li.automated", has_text="Automatic reply: away until Monday")
        await expect(automated).to_contain_text(
            "automated message (Auto-Submitted: auto-replied): agents leave it; you can still answer it."
        )
        await expect(page.locator("#waiting-count")).to_have_text("2")
        await page.screenshot(path=ARTIFACTS / "board-waiting-for-a-person.png")
        # A person takes the automated one up: it leaves the list for the board's table; the stopped
        # conversation stays listed (the budget has not freed), saying who answers it now.
        await automated.get_by_role("button", name="I'm answering this").click()
        await expect(row(page, "ooo-1")).to_contain_text("You are answering this", timeout=LIVE)
        await expect(automated).to_have_count(0, timeout=LIVE)
        await stopped.get_by_role("button", name="I'm answering this").click()
        await expect(stopped).to_contain_text("Now: You are answering this", timeout=LIVE)
