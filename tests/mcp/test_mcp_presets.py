"""Each guard preset against the tool list of the published package it is for (recorded in tests/mcp/data/tools
by scripts/record_mcp_tools.py), and in front of a fake of that server (tests/mcp/preset_servers.py: the
recorded tools, and their way of answering), against a real coordinator and etcd: two agent sessions racing the
reply, and a retry, send one reply per message; the tools that send without naming the message they answer are
refused, nothing sent, or passed through unclaimed when the guard allows them. The guard refuses to start in
front of a server that does not list the tools it was told to fence."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

from coordinator.ops.server import CoordinatorServer
from inbox_claims import AsyncCoordinator, Subject, SubjectState
from inbox_claims.mcp import SendTool, check_tools
from inbox_claims.mcp._cli import main
from inbox_claims.mcp._guard import schema_has
from inbox_claims.mcp._presets import PRESETS, UNPRESETTABLE, Preset
from tests.mcp.preset_servers import DATA, FAKES, FakeServer, Recorder, recorded
from tests.mcp.support import guarded, text


def behind(
    server: CoordinatorServer, principal: str, preset: Preset, fake: FakeServer, recorder: Recorder, **options: Any
) -> Any:
    return guarded(
        server.address,
        principal,
        recorder.server(fake),
        preset.tools,
        mailbox=fake.mailbox,
        unfenced=preset.unfenced,
        upstream_mode="legacy",  # the servers these presets are for speak the handshake era
        **options,
    )


RECORDS = sorted(path.stem for path in DATA.glob("*.json"))


def test_every_preset_has_the_record_of_its_package() -> None:
    assert sorted(PRESETS) == RECORDS


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_checked_against_the_published_packages_tool_list(name: str) -> None:
    preset, record = PRESETS[name], recorded(name)
    assert record["preset"] == name
    if not record["listed"]:
        # Nothing published lists its tools here (AgentMail's bridge needs the hosted server; Nylas has no package):
        # the preset says so, and where its schemas were read instead.
        assert preset.versions == ()
        assert record["why"]
        assert re.search(r" at [0-9a-f]{7}\b", preset.source), name
        return
    assert preset.versions == (f"{record['package']} {record['version']}",)
    listed = {tool["name"]: tool for tool in record["tools"]}
    # The guard's own check at start, on the package's list: nothing missing.
    assert check_tools(preset.tools, preset.unfenced)(record["tools"]) is None
    for tool in preset.tools:
        for path in (tool.message, tool.mailbox, tool.thread):
            assert path is None or schema_has(listed[tool.name]["inputSchema"], path), (name, tool.name, path)
        assert tool.mailbox is not None or FAKES[name].mailbox is not None, name
    assert set(preset.unfenced) <= set(listed)


def test_every_fake_sends_through_the_tools_its_preset_names() -> None:
    assert set(FAKES) == set(PRESETS)
    for name, preset in PRESETS.items():
        fake = FAKES[name]
        listed = {tool["name"] for tool in fake.listed()}
        assert {tool.name for tool in preset.tools} <= listed, name
        assert {call for call, _ in fake.unfenced} == set(preset.unfenced), name


@pytest.mark.parametrize("name", [name for name in RECORDS if recorded(name)["listed"]])
def test_the_guards_answer_to_each_recorded_tool_list(name: str) -> None:
    """Every preset against this package's list: its own preset passes; the others are refused, naming what is
    missing, what is there, and the closest name."""
    tools = recorded(name)["tools"]
    for other, preset in PRESETS.items():
        answer = check_tools(preset.tools, scope="message")(tools)
        if other == name:
            assert answer is None
            continue
        missing = [tool for tool in preset.tools if tool.name not in {listed["name"] for listed in tools}]
        if not missing:  # another server's tool of the same name (send_email): its arguments are checked instead
            assert answer is None or "takes no argument" in answer, (name, other, answer)
            continue
        assert answer is not None
        assert f"it lists no tool {missing[0].name}, which --preset {other} names" in answer
        assert "the closest is" in answer or "none is close" in answer
        assert all(listed["name"] in answer for listed in tools)


def test_the_resend_preset_of_before_is_refused_by_resend_mcp_2_22_0() -> None:
    """reply-to-inbox-thread-email (what the preset named before) is not a tool of the published resend-mcp."""
    before = SendTool("reply-to-inbox-thread-email", message="emailId", mailbox="inboxId", origin="--preset resend")
    answer = check_tools([before])(recorded("resend")["tools"])
    assert answer is not None
    assert answer.startswith("it lists no tool reply-to-inbox-thread-email, which --preset resend names as the tool")
    assert "send-email" in answer


@pytest.mark.parametrize("name", sorted(PRESETS))
async def test_racing_and_repeated_replies_through_a_preset_send_once(
    server: CoordinatorServer, mailbox: str, name: str
) -> None:
    preset, fake, recorder = PRESETS[name], FAKES[name], Recorder()
    mailbox = fake.mailbox or mailbox
    tool, arguments = fake.reply(mailbox, "msg-1")
    async with (
        behind(server, "agent-a", preset, fake, recorder) as first,
        behind(server, "agent-b", preset, fake, recorder) as second,
    ):
        raced = await asyncio.gather(first.call_tool(tool, arguments), second.call_tool(tool, arguments))
        again = [await client.call_tool(tool, arguments) for client in (first, second)]
        refused = {call: await first.call_tool(call, arguments) for call, arguments in fake.unfenced}

    assert len(recorder.sends) == 1, recorder.sends
    assert sorted(result.is_error for result in raced) == [False, True]
    winner = "agent-a" if not raced[0].is_error else "agent-b"
    assert [result.is_error for result in again] == [winner != "agent-a", winner != "agent-b"]
    assert "do not" in text(next(result for result in raced if result.is_error))
    async with AsyncCoordinator(server.address, principal="observer") as observer:
        status = await observer.status(Subject.message(mailbox, "msg-1"))
    assert (status.state, status.holder) == (SubjectState.REPLIED, winner)
    assert status.sent_message_id == (recorder.sends[0]["id"] if fake.sent_ids else "")
    for call, result in refused.items():
        assert result.is_error, call
        assert text(result).startswith(f"Not sent: {call} sends mail without saying which email it answers")
        assert f"use {preset.tools[0].name}" in text(result)


async def test_a_reply_through_a_tool_that_takes_headers_is_marked_automatic_keeping_its_own(
    server: CoordinatorServer,
) -> None:
    """resend's send-email takes any MIME header: the guard adds Auto-Submitted: auto-replied (RFC 3834), keeps
    In-Reply-To (and the agent's References) as written; a tool without headers is sent as it was called."""
    preset, fake, recorder = PRESETS["resend"], FAKES["resend"], Recorder()
    assert fake.mailbox is not None
    tool, arguments = fake.reply(fake.mailbox, "<msg-7@example.org>")
    arguments["headers"]["References"] = "<msg-6@example.org> <msg-7@example.org>"
    async with behind(server, "agent-a", preset, fake, recorder) as agent:
        result = await agent.call_tool(tool, arguments)
    assert not result.is_error, text(result)
    [sent] = recorder.sends
    assert sent["arguments"]["headers"] == {
        "In-Reply-To": "<msg-7@example.org>",
        "References": "<msg-6@example.org> <msg-7@example.org>",
        "Auto-Submitted": "auto-replied",
    }
    assert {key: value for key, value in sent["arguments"].items() if key != "headers"} == {
        key: value for key, value in arguments.items() if key != "headers"
    }


@pytest.mark.parametrize("name", sorted(name for name in PRESETS if FAKES[name].new_mail or FAKES[name].unfenced))
async def test_mail_naming_no_message_is_refused_or_passed_through_unclaimed_when_allowed(
    server: CoordinatorServer, name: str
) -> None:
    preset, fake, recorder = PRESETS[name], FAKES[name], Recorder()
    calls = [*fake.unfenced, *([fake.new_mail] if fake.new_mail else [])]
    async with behind(server, "agent-a", preset, fake, recorder) as strict:
        refused = [await strict.call_tool(call, arguments) for call, arguments in calls]
    assert all(result.is_error for result in refused)
    assert recorder.sends == []
    if fake.new_mail:
        tool = preset.tools[0]
        assert text(refused[-1]).startswith(f"Invalid arguments for {tool.name}: {tool.message}: missing")

    async with behind(server, "agent-a", preset, fake, recorder, allow_unfenced=True) as lenient:
        passed = [await lenient.call_tool(call, arguments) for call, arguments in calls]
    assert not any(result.is_error for result in passed)
    assert [send["tool"] for send in recorder.sends] == [call for call, _ in calls]


async def test_gmails_failure_in_plain_text_aborts_the_send_and_frees_the_message(server: CoordinatorServer) -> None:
    preset, fake, recorder = PRESETS["gmail"], FAKES["gmail"], Recorder()
    assert fake.mailbox is not None
    tool, arguments = fake.reply(fake.mailbox, "msg-9")
    subject = Subject.message(fake.mailbox, "msg-9")
    async with (
        behind(server, "agent-a", preset, fake, recorder) as client,
        AsyncCoordinator(server.address, principal="observer") as observer,
    ):
        recorder.failing = True
        failed = await client.call_tool(tool, arguments)
        after_failure = (await observer.status(subject)).state
        recorder.failing = False
        sent = await client.call_tool(tool, arguments)
        status = await observer.status(subject)

    assert text(failed) == "Error: the provider refused the recipient"  # the server's own words, passed on
    assert after_failure is SubjectState.FREE
    assert text(sent) == "Email sent successfully with ID: sent-1"
    assert (status.state, status.sent_message_id) == (SubjectState.REPLIED, "sent-1")
    assert len(recorder.sends) == 1


def test_a_server_without_a_preset_is_refused_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["guard", "--principal", "agent-a", "--preset", "postmark", "--", "npx", "-y", "postmark-mcp"])
    assert exited.value.code == 2
    said = capsys.readouterr().err
    assert "no preset postmark: Postmark's MCP server" in said
    assert UNPRESETTABLE["postmark"][:60] in said


def test_a_preset_of_one_mailbox_needs_the_mailbox_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["guard", "--principal", "agent-a", "--preset", "gmail", "--", "npx", "gmail-mcp"])
    assert exited.value.code == 2
    assert "send_email take(s) no mailbox argument: say which mailbox this server sends from" in capsys.readouterr().err


def test_the_guards_help_says_which_published_versions_each_preset_was_checked_against(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["guard", "--help"])
    said = " ".join(re.sub(r"-\n\s+", "-", capsys.readouterr().out).split())

    for name, preset in PRESETS.items():
        assert f"{name}: {', '.join(preset.versions) or 'no recorded list'}" in said, name
