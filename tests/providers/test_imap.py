"""Any mailbox over IMAP and SMTP, against a real Dovecot and a real SMTP server delivering into it
(tests/providers/mailserver.py), through real coordinators on real etcd. Customers' mail arrives by SMTP; agents
watch the shared mailbox (IDLE, the periodic check); and at the end each customer's own mailbox is read to count the
replies it received: one per customer message guarded, at least two unguarded. Also: a person answering from a mail
client (an SMTP send and its copy appended to Sent) while the agent drafts, a send whose SMTP answer was lost settled
by the copy the server filed in Sent, a watcher killed mid-message and restarted (none lost, none answered twice),
and Dovecot restarted under the watchers (they reconnect, and miss nothing)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from email.message import EmailMessage
from email.parser import BytesHeaderParser
from email.policy import default
from email.utils import formatdate, make_msgid
from pathlib import Path
from typing import Any

import pytest

from coordinator.ops.server import CoordinatorServer
from inbox_claims import AsyncClaim, AsyncCoordinator, Subject, SubjectState
from inbox_claims._effects import Invoke, Sleep
from inbox_claims.providers import Accepted, MessageFacts
from inbox_claims.providers._seam import Flow
from inbox_claims.providers.imap import ImapProvider, ImapSendRejected, ImapWatcher, Wake
from tests.providers.mailserver import MailServer, mail_server, quiet_cutting_proxy
from tests.providers.support import UNCLAIMED, LocalCursors, eventually, settled_by_its_copy

pytestmark = pytest.mark.etcd
SUPPORT = "support@example.test"
CUSTOMERS = ["bea@example.test", "carl@example.test", "dan@example.test"]
BODY = "Your order ships today."
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def mail(request: pytest.FixtureRequest) -> Iterator[MailServer]:
    made = mail_server(["support", "bea", "carl", "dan"])
    server = next(made)
    yield server
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        print(f"--- Dovecot's log ---\n{server.dovecot.log_text()}")
    with pytest.raises(StopIteration):
        next(made)


def provider(mail: MailServer, **options: Any) -> ImapProvider:
    settings: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": mail.dovecot.port,
        "tls": False,
        "username": SUPPORT,
        "password": "secret-password",
        "smtp_port": mail.smtp_port,
        "smtp_tls": "none",
        "idle_seconds": 2.0,  # re-IDLE often: every test crosses it
        # No periodic check within a test: what the watchers read, IDLE told them (or a reconnection's wake).
        "check_every": 300.0,
        "imap_timeout": 5.0,  # a server going down mid-command is given up on soon
    }
    return ImapProvider(SUPPORT, **{**settings, **options})


Handle = Callable[[MessageFacts, AsyncClaim], Any]


@pytest.fixture
async def watch(mail: MailServer, clients: dict[str, AsyncCoordinator]) -> AsyncIterator[Callable[..., Any]]:
    """Starts a watcher of the support mailbox for a client (stopped after the test, before the clients close)."""
    started: list[ImapWatcher] = []

    async def start(client: AsyncCoordinator, handle: Handle | None = None, **options: Any) -> ImapWatcher:
        mailbox = provider(mail, **options)

        async def answer(message: MessageFacts, claim: AsyncClaim) -> None:
            await claim.send(mailbox.reply, message, body=BODY)

        watcher = ImapWatcher(mailbox, handle or answer, coordinator=client, ttl=5)
        await watcher.start()
        started.append(watcher)
        return watcher

    yield start
    for watcher in started:
        await watcher.aclose(grace=10)


def headers(item: dict[bytes, Any]) -> Any:
    return BytesHeaderParser(policy=default).parsebytes(item[b"RFC822.HEADER"])


def replies(mail: MailServer, customer: str) -> list[Any]:
    """The replies from the support mailbox in ``customer``'s own Inbox."""
    found = [headers(item) for item in mail.dovecot.messages(customer)]
    return [h for h in found if SUPPORT in str(h["From"])]


def counts(mail: MailServer, customers: list[str]) -> list[int]:
    return [len(replies(mail, customer)) for customer in customers]


async def quiet(watchers: list[ImapWatcher]) -> None:
    """Lets every watcher's work finish (each closes)."""
    for watcher in watchers:
        await watcher.aclose(grace=10)


async def run_flow(flow: Flow[Any]) -> Any:
    """A provider flow without a coordinator (the unguarded agent's)."""
    answer: Any = None
    while True:
        try:
            effect = flow.send(answer)
        except StopIteration as done:
            return done.value
        if isinstance(effect, Invoke):
            answer = await effect.fn(*effect.args, **effect.kwargs)
        elif isinstance(effect, Sleep):
            await asyncio.sleep(effect.seconds)
            answer = None
        else:
            raise AssertionError(f"an unguarded flow performs no {effect!r}")


async def unguarded_replies(mail: MailServer, customer: str, agents: int = 2) -> int:
    """The replies ``customer`` gets to one message from ``agents`` copies of the agent without the coordinator,
    each reading the mailbox with its own memory of it."""
    mailboxes = [provider(mail) for _ in range(agents)]
    asked = mail.send(customer, SUPPORT, "Is it in stock?", "Item 7, please.")
    # Both read the Inbox before either answers, as two copies polling it do while either drafts.
    batches = [await run_flow(mailbox.open(Accepted(Wake()), LocalCursors())) for mailbox in mailboxes]
    for mailbox, batch in zip(mailboxes, batches, strict=True):
        for facts in batch.facts:
            if "SENT" not in facts.folders and facts.from_addresses != (SUPPORT,):
                await asyncio.to_thread(mailbox.send_reply, facts, BODY, UNCLAIMED)
        mailbox.close()
    return len([h for h in replies(mail, customer) if h["In-Reply-To"] == asked])


def original(mail: MailServer, customer: str, subject: str) -> tuple[Subject, str]:
    """The claim's subject of the customer's message and its ``Message-ID``, read from the support Inbox."""
    for item in mail.dovecot.messages(SUPPORT):
        found = headers(item)
        if str(found["Subject"]) == subject and customer in str(found["From"]):
            return Subject.message(SUPPORT, str(found["Message-ID"])), str(found["Message-ID"])
    raise AssertionError(f"no message {subject!r} from {customer} in the support Inbox")


async def test_three_customers_two_agents_three_watchers_one_reply_each(
    mail: MailServer, watch: Callable[..., Any], clients: dict[str, AsyncCoordinator]
) -> None:
    watchers = [await watch(clients["a1"]), await watch(clients["a2"]), await watch(clients["b"])]
    for customer in CUSTOMERS:
        mail.send(customer, SUPPORT, "Where is my order?", f"Hello, this is {customer}.")
    await eventually(lambda: min(counts(mail, CUSTOMERS)) >= 1, within=30)
    await quiet(watchers)
    assert counts(mail, CUSTOMERS) == [1, 1, 1]
    for customer in CUSTOMERS:
        (reply,) = replies(mail, customer)
        assert reply["Auto-Submitted"] == "auto-replied"
        subject, message_id = original(mail, customer, "Where is my order?")
        assert (reply["In-Reply-To"], reply["References"]) == (message_id, message_id)
        status = await clients["a1"].status(subject)
        assert (status.state, status.sent_message_id) == (SubjectState.REPLIED, reply["Message-ID"])
    # One copy of each reply in Sent (appended once), each the agent's own when read back: none answered.
    sent = [headers(item) for item in mail.dovecot.messages(SUPPORT, "Sent")]
    assert sorted(str(h["Message-ID"]) for h in sent) == sorted(
        str(replies(mail, c)[0]["Message-ID"]) for c in CUSTOMERS
    )
    # Each reply was submitted logged in as the mailbox (the server offers AUTH).
    assert sorted(r for r in mail.handler.received if r[0] == SUPPORT) == sorted(
        (SUPPORT, [customer], SUPPORT) for customer in CUSTOMERS
    )
    # The originals are flagged answered, as a mail client flags what it answered.
    assert all(b"\\Answered" in item[b"FLAGS"] for item in mail.dovecot.messages(SUPPORT))

    assert await unguarded_replies(mail, "bea@example.test") >= 2


async def test_a_person_answering_from_a_mail_client_while_the_agent_drafts_stops_its_send(
    mail: MailServer, watch: Callable[..., Any], clients: dict[str, AsyncCoordinator]
) -> None:
    drafting = asyncio.Event()
    mailbox = provider(mail)

    async def slow(message: MessageFacts, claim: AsyncClaim) -> None:
        await drafting.wait()
        await claim.send(mailbox.reply, message, body=BODY)

    watchers = [await watch(clients["a1"], slow), await watch(clients["b"], slow)]
    customer = "carl@example.test"
    mail.send(customer, SUPPORT, "Refund for order 1042", "Please refund it.")
    await eventually(lambda: len(mail.dovecot.messages(SUPPORT)) == 1)
    subject, message_id = original(mail, customer, "Refund for order 1042")
    await eventually(_state(clients["a1"], subject, SubjectState.CLAIMED), within=20)
    # A person answers it from a mail client: sent over SMTP, its copy appended to Sent, the original flagged.
    person = EmailMessage()
    person["From"], person["To"], person["Subject"] = SUPPORT, customer, "Re: Refund for order 1042"
    person["Date"] = formatdate(localtime=False)
    person["Message-ID"] = make_msgid(domain="example.test")
    person["In-Reply-To"] = person["References"] = message_id
    person.set_content("Refunded today. -- Ana")
    import smtplib

    with smtplib.SMTP("127.0.0.1", mail.smtp_port) as smtp:
        smtp.send_message(person)
    with mail.dovecot.imap(SUPPORT) as client:
        client.append("Sent", person.as_bytes(), flags=(b"\\Seen",))
    await eventually(_outside(clients["a1"], subject), within=20)
    drafting.set()
    await quiet(watchers)
    assert [str(h["Message-ID"]) for h in replies(mail, customer)] == [person["Message-ID"]]  # the agent sent none

    assert await unguarded_replies(mail, "dan@example.test") >= 2


def _state(client: AsyncCoordinator, subject: Subject, state: SubjectState) -> Callable[[], Any]:
    async def check() -> bool:
        return (await client.status(subject)).state is state

    return check


def _outside(client: AsyncCoordinator, subject: Subject) -> Callable[[], Any]:
    async def check() -> bool:
        status = await client.status(subject)
        return status.state is SubjectState.REPLIED and status.replied_outside

    return check


async def test_a_send_whose_smtp_answer_was_lost_is_settled_by_the_copy_the_server_filed_in_sent(
    mail: MailServer, watch: Callable[..., Any], clients: dict[str, AsyncCoordinator]
) -> None:
    # The server files what is submitted in Sent (as Gmail's and Microsoft 365's do) and its answer to DATA is lost.
    mail.handler.files_sent = True
    mail.handler.lose_answers = 3.0
    watcher = await watch(clients["a1"], append_to_sent=False, smtp_timeout=1.0)
    customer = "bea@example.test"
    mail.send(customer, SUPPORT, "Where is my order?", "Order 7.")
    await eventually(lambda: len(mail.dovecot.messages(SUPPORT, "Sent")) == 1, within=20)
    subject, _ = original(mail, customer, "Where is my order?")
    await eventually(_state(clients["a1"], subject, SubjectState.REPLIED), within=20)
    mail.handler.lose_answers = 0
    await quiet([watcher])
    (copy,) = [headers(item) for item in mail.dovecot.messages(SUPPORT, "Sent")]
    await settled_by_its_copy(clients["a1"], subject, str(copy["Message-ID"]), "agent-a")
    assert len(replies(mail, customer)) == 1


async def test_a_send_the_smtp_server_refuses_frees_the_message_and_reaches_no_one(
    mail: MailServer, watch: Callable[..., Any], clients: dict[str, AsyncCoordinator]
) -> None:
    mailbox = provider(mail, smtp_password="not-the-password")  # the server refuses its login
    refused: list[BaseException] = []

    async def answer(message: MessageFacts, claim: AsyncClaim) -> None:
        try:
            await claim.send(mailbox.reply, message, body=BODY)
        except ImapSendRejected as error:
            refused.append(error)

    watcher = await watch(clients["a1"], answer)
    mail.send("bea@example.test", SUPPORT, "Where is my order?", "Order 9.")
    await eventually(lambda: len(refused) == 1, within=20)
    await quiet([watcher])
    assert "log in to the SMTP server, nothing was sent" in str(refused[0])
    subject, _ = original(mail, "bea@example.test", "Where is my order?")
    assert (await clients["a1"].status(subject)).state is SubjectState.FREE  # another agent (or a person) may answer
    assert counts(mail, ["bea@example.test"]) == [0]
    assert [r for r in mail.handler.received if r[0] == SUPPORT] == []


async def test_dovecot_restarted_under_the_watchers_they_reconnect_and_miss_nothing(
    mail: MailServer, watch: Callable[..., Any], clients: dict[str, AsyncCoordinator]
) -> None:
    watchers = [await watch(clients["a1"]), await watch(clients["b"])]
    mail.send("bea@example.test", SUPPORT, "Before", "One.")
    await eventually(lambda: counts(mail, ["bea@example.test"]) == [1], within=30)
    mail.dovecot.stop()
    mail.send("carl@example.test", SUPPORT, "While it was down", "Two.")  # dovecot-lda writes the store itself
    await asyncio.sleep(1.5)  # the watchers' connections fail and retry meanwhile
    mail.dovecot.start()
    mail.send("dan@example.test", SUPPORT, "After", "Three.")
    await eventually(lambda: min(counts(mail, CUSTOMERS)) >= 1, within=60)
    await quiet(watchers)
    assert counts(mail, CUSTOMERS) == [1, 1, 1]


async def test_a_first_watcher_answers_the_unanswered_mail_of_the_last_day_and_moves_past_the_rest(
    mail: MailServer, watch: Callable[..., Any], clients: dict[str, AsyncCoordinator]
) -> None:
    answered = mail.send("bea@example.test", SUPPORT, "Answered already", "One.")
    mail.send("carl@example.test", SUPPORT, "Not answered yet", "Two.")
    with mail.dovecot.imap(SUPPORT) as client:  # a person answered the first from a mail client before
        client.select_folder("INBOX")
        client.add_flags(client.search(["HEADER", "Message-ID", answered]), [b"\\Answered"])
    watcher = await watch(clients["a1"])
    await eventually(lambda: counts(mail, ["carl@example.test"]) == [1], within=30)
    await quiet([watcher])
    assert counts(mail, ["bea@example.test", "carl@example.test"]) == [0, 1]
    with mail.dovecot.imap(SUPPORT) as client:
        validity = client.folder_status("INBOX", [b"UIDVALIDITY"])[b"UIDVALIDITY"]
    assert await clients["a1"].get_cursor(SUPPORT, f"imap:INBOX:{validity}") == ("2", 2)


async def test_idle_is_issued_again_before_a_connection_quiet_too_long_is_cut(
    mail: MailServer, watch: Callable[..., Any], clients: dict[str, AsyncCoordinator]
) -> None:
    # Between the watchers and Dovecot, what a NAT (or a server's IDLE timeout) does: cut a connection quiet for 2 s.
    async with quiet_cutting_proxy(mail.dovecot.port, cutoff=2.0) as port:
        watcher = await watch(clients["a1"], port=port, idle_seconds=0.5)
        await eventually(lambda: len(watcher.idling) == 2)
        logins = mail.dovecot.logins(SUPPORT)
        await asyncio.sleep(5)  # more than two cutoffs
        assert mail.dovecot.logins(SUPPORT) == logins  # IDLE again every 0.5 s: nothing cut, no new login
        mail.send("bea@example.test", SUPPORT, "Still there?", "One.")
        await eventually(lambda: counts(mail, ["bea@example.test"]) == [1], within=30)
        await quiet([watcher])
        # The same watcher issuing IDLE again less often than the cutoff is cut, and logs in again.
        lazy = await watch(clients["a1"], port=port, idle_seconds=4.0)
        await eventually(lambda: len(lazy.idling) == 2)
        logins = mail.dovecot.logins(SUPPORT)
        await asyncio.sleep(5)
        assert mail.dovecot.logins(SUPPORT) >= logins + 2  # both IDLE connections cut, made again
        await quiet([lazy])


def agent_env(mail: MailServer, server: CoordinatorServer, principal: str = "agent-a") -> dict[str, str]:
    """The environment examples/providers/imap/README.md names, for this mail server and coordinator."""
    return {
        **os.environ,
        "PYTHON": sys.executable,
        "INBOX_COORDINATOR_TARGET": server.address,
        "INBOX_PRINCIPAL": principal,
        "INBOX_CLAIM_TTL": "5",
        "IMAP_ADDRESS": SUPPORT,
        "IMAP_HOST": "127.0.0.1",
        "IMAP_PORT": str(mail.dovecot.port),
        "IMAP_TLS": "no",
        "IMAP_USERNAME": SUPPORT,
        "IMAP_PASSWORD": "secret-password",
        "SMTP_PORT": str(mail.smtp_port),
        "SMTP_TLS": "none",
        "IMAP_CHECK_EVERY": "1",
        "LLM_DELAY": "1",
    }


async def test_the_example_two_guarded_processes_reply_once_two_unguarded_at_least_twice(
    mail: MailServer, server: CoordinatorServer, tmp_path: Path
) -> None:
    run = str(ROOT / "examples" / "providers" / "imap" / "run")

    async def pair(*arguments: str) -> list[asyncio.subprocess.Process]:
        with (tmp_path / "agents.log").open("ab") as log:
            return [
                await asyncio.create_subprocess_exec(
                    run, *arguments, env=agent_env(mail, server, f"agent-{n}"), stdout=subprocess.PIPE, stderr=log
                )
                for n in (1, 2)
            ]

    async def stop(processes: list[asyncio.subprocess.Process]) -> None:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            await asyncio.wait_for(process.wait(), 30)

    guarded = await pair()
    try:
        for process in guarded:
            assert process.stdout is not None
            assert (await process.stdout.readline()).startswith(b"watching")
        mail.send("bea@example.test", SUPPORT, "Where is my order?", "Order 1042.")
        await eventually(lambda: counts(mail, ["bea@example.test"]) == [1], within=30)
    finally:
        await stop(guarded)
    assert counts(mail, ["bea@example.test"]) == [1], (tmp_path / "agents.log").read_text()

    unguarded = await pair("--unguarded")
    try:
        await asyncio.sleep(1.0)  # both poll the Inbox (the guarded pair flagged bea's message answered)
        mail.send("carl@example.test", SUPPORT, "Where is my order?", "Order 1043.")
        await eventually(lambda: counts(mail, ["carl@example.test"])[0] >= 2, within=30)
    finally:
        await stop(unguarded)


def facts_of(raw: str, folder: str = "INBOX") -> MessageFacts:
    mailbox = ImapProvider(SUPPORT, host="imap.example.test", username=SUPPORT, password="x", sent_folder="Sent")
    return mailbox.facts(folder, 7, 42, {b"BODY[HEADER]": raw.replace("\n", "\r\n").encode(), b"FLAGS": ()})


def test_the_facts_of_a_message_thread_on_its_root_and_answer_its_reply_to() -> None:
    facts = facts_of(
        "From: Bea <bea@example.test>\nReply-To: orders@example.test\nSubject: Re: Order\n"
        "Message-ID: <c@example.test>\nIn-Reply-To: <b@example.test>\nReferences: <a@example.test> <b@example.test>\n"
        "Date: Fri, 04 Dec 2026 04:00:00 +0000\n\n"
    )
    assert (facts.dedup_key, facts.message_id, facts.thread_id) == (
        "imap:INBOX:7:42",
        "<c@example.test>",
        "<a@example.test>",
    )
    assert (facts.sender, facts.from_addresses, facts.folders) == (
        "Bea <bea@example.test>",
        ("bea@example.test",),
        ("INBOX",),
    )
    assert facts.reply.to == ("orders@example.test",)
    assert facts.reply.references == ("<a@example.test>", "<b@example.test>")
    assert facts.received_at is not None
    assert facts.received_at.hour == 4
    assert facts.stamp is None


def test_a_reply_in_sent_is_outgoing_and_its_derived_message_id_is_the_stamp() -> None:
    key = "ic1-" + "ab" * 32
    facts = facts_of(f"From: support@example.test\nMessage-ID: <{key}.17@example.test>\nIn-Reply-To: <a@x>\n\n", "Sent")
    assert facts.folders == ("Sent", "SENT")
    assert facts.stamp is not None
    assert (facts.stamp.key, facts.stamp.token) == (key, 17)
    assert facts.thread_id == "<a@x>"
    first = facts_of("From: dan@example.test\nSubject: Hi\n\n")  # no Message-ID: its UID names it
    assert (first.message_id, first.thread_id) == ("imap:INBOX:7:42", None)


def test_bad_settings_are_refused_with_what_to_set() -> None:
    with pytest.raises(ValueError, match="the mailbox's email address"):
        ImapProvider("support", host="h", username="u", password="p")
    with pytest.raises(ValueError, match="RFC 2177"):
        ImapProvider(SUPPORT, host="h", username="u", password="p", idle_seconds=30 * 60)
    with pytest.raises(ValueError, match="set IMAP_HOST"):
        ImapProvider.from_env({"IMAP_ADDRESS": SUPPORT})


async def test_watchers_started_while_dovecot_is_down_answer_what_arrived_once_it_is_up(
    mail: MailServer, watch: Callable[..., Any], clients: dict[str, AsyncCoordinator]
) -> None:
    mail.dovecot.stop()
    mail.send("bea@example.test", SUPPORT, "Sent while the server was down", "One.")  # queued by the SMTP server
    watchers = [await watch(clients["a1"]), await watch(clients["b"])]  # their first read fails; they start anyway
    mail.dovecot.start()
    await eventually(lambda: counts(mail, ["bea@example.test"]) == [1], within=60)
    await quiet(watchers)
    assert counts(mail, ["bea@example.test"]) == [1]


async def test_a_watcher_killed_mid_message_and_restarted_loses_none_and_answers_none_twice(
    mail: MailServer, server: CoordinatorServer, clients: dict[str, AsyncCoordinator], tmp_path: Path
) -> None:
    log = (tmp_path / "agents.log").open("ab")
    env = agent_env(mail, server)
    run = str(ROOT / "examples" / "providers" / "imap" / "run")
    # asyncio's subprocesses: every wait of this test leaves the event loop free (the coordinator runs in it).
    drafting_forever = await asyncio.create_subprocess_exec(
        run, env={**env, "LLM_DELAY": "600"}, stdout=subprocess.PIPE, stderr=log
    )
    try:
        assert drafting_forever.stdout is not None
        assert (await drafting_forever.stdout.readline()).startswith(b"watching")
        mail.send("bea@example.test", SUPPORT, "First", "One.")
        await eventually(lambda: len(mail.dovecot.messages(SUPPORT)) == 1)
        first, _ = original(mail, "bea@example.test", "First")
        await eventually(_state(clients["a1"], first, SubjectState.CLAIMED), within=20)
    finally:
        drafting_forever.kill()  # mid-message: its claim is held, nothing sent
        await drafting_forever.wait()
    mail.send("carl@example.test", SUPPORT, "While it was dead", "Two.")
    restarted = await asyncio.create_subprocess_exec(
        run, env={**env, "LLM_DELAY": "0.2"}, stdout=subprocess.DEVNULL, stderr=log
    )
    try:
        await eventually(lambda: counts(mail, CUSTOMERS[:2]) == [1, 1], within=40)
        mail.send("dan@example.test", SUPPORT, "After", "Three.")
        await eventually(lambda: counts(mail, CUSTOMERS) == [1, 1, 1], within=30)
    finally:
        restarted.send_signal(signal.SIGTERM)
        exited = await asyncio.wait_for(restarted.wait(), 30)
        log.close()
        print((tmp_path / "agents.log").read_text())
    assert exited == 0
    assert counts(mail, CUSTOMERS) == [1, 1, 1]
    assert (await clients["a1"].status(first)).state is SubjectState.REPLIED
