"""docs/mcp.md's snippets, run as written: the mcpServers JSON's entries (spawned as a desktop client does, with
the test coordinator's address and, for the guard, the fake email server as its upstream) and the agent
client's Python code."""

from __future__ import annotations

import json
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


def entry(document: dict[str, Any], name: str, address: str, **env: str) -> StdioServerParameters:
    config = document["mcpServers"][name]
    assert config["command"] == "inbox-claims-mcp"
    return StdioServerParameters(
        command=the_command(),
        args=config["args"],
        env={**config["env"], "INBOX_COORDINATOR_TARGET": address, "PATH": os.environ.get("PATH", ""), **env},
        cwd=ROOT,
    )


async def test_the_mcp_servers_json_runs_both_entries(
    server: CoordinatorServer, fake: FakeNylas, mailbox: str, tmp_path: Path
) -> None:
    document = json.loads(snippet("mcp-servers", "json"))
    ours = entry(document, "inbox-claims", server.address, NYLAS_API_KEY=API_KEY, NYLAS_API_URI=fake.api_base)
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


async def test_the_agent_client_snippet_runs_as_written(
    server: CoordinatorServer, fake: FakeNylas, mailbox: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INBOX_COORDINATOR_TARGET", server.address)
    monkeypatch.setenv("NYLAS_API_KEY", API_KEY)
    monkeypatch.setenv("NYLAS_API_URI", fake.api_base)
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
