"""docs/mcp.md's snippets, run as written: the mcpServers JSON's entries (spawned as a desktop client does, with
the test coordinator's address and, for the guard, the fake email server as its upstream) and the agent
client's Python code."""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from mcp import Client, StdioServerParameters

from coordinator.ops.server import CoordinatorServer
from examples.agent.fake_nylas import FakeNylas
from inbox_claims.cli import resolve_settings
from inbox_claims.mcp._cli import AGENT_DEFAULTS, MCP_CONFIG, _nylas_api_base, build_parser, main
from inbox_claims.mcp._presets import PRESETS, UNPRESETTABLE
from tests.mcp.fake_email import SEND_TOOL, Outbox
from tests.mcp.support import API_KEY

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "mcp.md"


def snippet(marker: str, language: str) -> str:
    """The code block right after ``<!-- marker -->``."""
    found = re.search(rf"<!-- {marker} -->\n```{language}\n(.*?)\n```", DOC.read_text(), re.DOTALL)
    assert found is not None, f"docs/mcp.md has no {language} block after <!-- {marker} -->"
    return found[1]


def the_command() -> str:
    """Where the installed console script is (this interpreter's bin directory, else PATH)."""
    beside = Path(sys.executable).parent / "inbox-claims-mcp"
    found = str(beside) if beside.exists() else shutil.which("inbox-claims-mcp")
    assert found, "inbox-claims-mcp is not installed (pip install -e '.[dev]')"
    return found


DESKTOP_PATH = "/usr/bin:/bin"
"""The PATH a desktop app starts an MCP server with (not the shell's: no virtualenv, no ~/.local/bin)."""


def entry(document: dict[str, Any], name: str, address: str, **env: str) -> StdioServerParameters:
    """The entry as a desktop app starts it: the command by its absolute path (this machine's in place of the
    example's), the entry's environment and a desktop app's PATH, nothing of this process's environment."""
    config = document["mcpServers"][name]
    assert config["command"] == "/home/you/.local/bin/inbox-claims-mcp"  # absolute, as the text says it must be
    return StdioServerParameters(
        command=the_command(),
        args=config["args"],
        env={**config["env"], "INBOX_COORDINATOR_TARGET": address, "PATH": DESKTOP_PATH, **env},
        cwd=ROOT,
    )


async def test_the_mcp_servers_json_runs_both_entries(
    server: CoordinatorServer, fake: FakeNylas, mailbox: str, tmp_path: Path
) -> None:
    document = json.loads(snippet("mcp-servers", "json"))
    ours = entry(document, "inbox-claims", server.address, NYLAS_API_KEY=API_KEY, NYLAS_API_BASE=fake.api_base)
    guard = entry(document, "email", server.address)
    outbox = Outbox(tmp_path / "outbox.jsonl")
    dash = guard.args.index("--")
    guard.args = [*guard.args[: dash + 1], sys.executable, "-m", "tests.mcp.fake_email", "--outbox", str(outbox.path)]
    reply = {"to": [{"email": "bea@example.org"}], "subject": "Re: Order", "body": "Shipped."}
    async with Client(ours) as claims, Client(guard) as email:
        sent = await claims.call_tool("send_reply", {"mailbox": mailbox, "message_id": "msg-1", **reply})
        guarded = await email.call_tool(
            SEND_TOOL,
            {
                "grant_id": mailbox,
                "to": ["bea@example.org"],
                "subject": "Re",
                "body": "Hi",
                "reply_to_message_id": "msg-1",
            },
        )

    assert sent.structured_content is not None
    assert sent.structured_content["outcome"] == "sent"
    # The same message by the same agent, already answered through send_reply: said so, and not sent again.
    assert guarded.is_error
    assert "The message is answered: do not send it again." in str(guarded.content)
    assert len(fake.sends) == 1
    assert outbox.sends == []


async def test_a_bare_command_name_is_what_a_desktop_app_cannot_start() -> None:
    """Why the JSON gives an absolute path: the desktop app's PATH does not lead to where the command is installed."""
    assert shutil.which("inbox-claims-mcp", path=DESKTOP_PATH) is None
    bare = StdioServerParameters(command="inbox-claims-mcp", args=["serve"], env={"PATH": DESKTOP_PATH})
    with pytest.raises(FileNotFoundError):
        async with Client(bare):
            pass


def changes(before: list[str], after: list[str]) -> tuple[int, int, int]:
    """Lines (changed, added, removed) from ``before`` to ``after``, as a side-by-side diff counts them."""
    changed = added = removed = 0
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, before, after, autojunk=False).get_opcodes():
        if op == "replace":
            changed += min(i2 - i1, j2 - j1)
            added += max(0, (j2 - j1) - (i2 - i1))
            removed += max(0, (i2 - i1) - (j2 - j1))
        elif op == "insert":
            added += j2 - j1
        elif op == "delete":
            removed += i2 - i1
    return changed, added, removed


def test_the_lines_changed_that_the_docs_claim_are_counted() -> None:
    before = snippet("email-before", "json").splitlines()
    whole = snippet("mcp-servers", "json").splitlines()
    start = next(number for number, line in enumerate(whole) if line.strip().startswith('"email"'))
    after = whole[start : whole.index("    }", start) + 1]
    changed, added, removed = changes(before, after)
    said = f"{changed} lines changed and {added} added"

    assert removed == 0
    for document in (DOC, ROOT / "README.md"):
        claim = re.search(r"<!-- lines-changed -->(.*?)(?:\(|;|$)", document.read_text(), re.MULTILINE | re.DOTALL)
        assert claim is not None, document
        assert said in " ".join(claim[1].split()), (document.name, said)
    assert "by one line" not in (ROOT / "README.md").read_text()


async def test_the_agent_client_snippet_runs_as_written(
    server: CoordinatorServer, fake: FakeNylas, mailbox: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INBOX_COORDINATOR_TARGET", server.address)
    monkeypatch.setenv("NYLAS_API_KEY", API_KEY)
    monkeypatch.setenv("NYLAS_API_BASE", fake.api_base)
    monkeypatch.setenv("PATH", f"{Path(the_command()).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    namespace: dict[str, Any] = {}
    exec(compile(snippet("agent-client", "python"), str(DOC), "exec"), namespace)

    first = await namespace["answer"](mailbox, "msg-1", "It ships today.")
    second = await namespace["answer"](mailbox, "msg-1", "It ships today!")

    assert first.startswith("Sent at ")
    assert second.startswith("not replying: Already answered by another session of support-agent-1 (this agent) at ")
    assert len(fake.sends) == 1


def test_the_presets_table_lists_every_preset_as_the_code_has_it() -> None:
    rows = snippet_table("presets")
    assert [row[0].strip("`") for row in rows] == list(PRESETS)
    for row in rows:
        preset = PRESETS[row[0].strip("`")]
        fenced = re.findall(r"`([\w-]+)`: `message=", row[2])
        assert fenced == [tool.name for tool in preset.tools], row[0]
        for tool in preset.tools:
            assert f"message={tool.message}" in row[2], row[0]
        unfenced = [] if row[3].startswith("none") else re.findall(r"`([\w-]+)`", row[3].split(" (new mail")[0])
        assert unfenced == list(preset.unfenced), row[0]
        checked = [] if row[5].startswith("none") else [" ".join(re.findall(r"`?([^`\s]+)`?", row[5]))]
        assert checked == list(preset.versions), row[0]
    for name in UNPRESETTABLE:
        assert f"`--preset {name}` is refused" in DOC.read_text()


def snippet_table(marker: str) -> list[list[str]]:
    """The rows of the markdown table right after ``<!-- marker -->``, each a list of its cells."""
    found = re.search(rf"<!-- {marker} -->\n\|.*\|\n\|[- |]+\|\n((?:\|.*\|\n)+)", DOC.read_text())
    assert found is not None, f"docs/mcp.md has no table after <!-- {marker} -->"
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in found[1].splitlines()]


def test_serve_help_says_what_the_command_does_and_it_does_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    for variable in ("INBOX_PRINCIPAL", "INBOX_TOKEN", "INBOX_PRINCIPAL_KIND", "INBOX_CLAIMS_MCP_CONFIG"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))  # no config file
    with pytest.raises(SystemExit) as unnamed:
        main(["serve"])
    options = build_parser().parse_args(["serve", "--principal", "agent-a"])
    kind = resolve_settings(options, file=MCP_CONFIG, defaults=AGENT_DEFAULTS, login_name=False)["kind"]

    assert "who this agent is, in development mode: required, unless --token says it (no login-name default)" in said
    assert "login name)" not in said.replace("no login-name default)", "")
    assert said.count("(default agent)") == 1
    assert "default human" not in said
    assert "[$NYLAS_API_BASE]" in said
    assert "NYLAS_API_URI" not in said
    assert unnamed.value.code == 2  # as the help says: no principal, no start
    assert "say who this agent is: --principal NAME (INBOX_PRINCIPAL) or --token TOKEN" in capsys.readouterr().err
    assert kind == "agent"


def test_the_nylas_base_url_has_one_name_and_the_old_one_is_read_with_a_line_saying_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("NYLAS_API_BASE", raising=False)
    monkeypatch.setenv("NYLAS_API_URI", "https://api.eu.nylas.com")
    with caplog.at_level(logging.WARNING, logger="inbox_claims.mcp"):
        old = _nylas_api_base()
    deprecated = caplog.text
    monkeypatch.setenv("NYLAS_API_BASE", "http://127.0.0.1:9")
    caplog.clear()
    new = _nylas_api_base()

    assert old == "https://api.eu.nylas.com"
    assert "NYLAS_API_URI is deprecated: set NYLAS_API_BASE instead" in deprecated
    assert new == "http://127.0.0.1:9"
    assert caplog.text == ""
    assert "NYLAS_API_URI" not in DOC.read_text()
