"""The agents' reply budgets as the operator sets them (docs/operations.md#reply-budgets): flags, environment,
the TOML file with per-mailbox overrides; out of range, or an override naming no granted mailbox, refused at start
with a message naming the setting, both by load() and by `serve` itself (exit 2 before anything starts)."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from coordinator.core.storms import Budget, ReplyBudgets
from coordinator.ops.config import ConfigError, load

HOUR, DAY = 3600_000, 86400_000
TOKENS = """
[[principals]]
id = "worker-acme"
kind = "agent"
mailboxes = ["acme-*", "support@globex.example"]
roles = ["report"]
token_sha256 = ["0000000000000000000000000000000000000000000000000000000000000000"]
"""


def _file(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_are_3_per_thread_per_hour_and_10_per_correspondent_per_day() -> None:
    budgets = load({}, environ={}).rules().reply_budgets("any-mailbox")
    assert budgets == ReplyBudgets(Budget(3, HOUR), Budget(10, DAY))


def test_flags_environment_and_file_with_per_mailbox_overrides(tmp_path: Path) -> None:
    config_file = _file(
        tmp_path,
        "coordinator.toml",
        'token_file = "' + str(_file(tmp_path, "tokens.toml", TOKENS)) + '"\n'
        'correspondent_reply_budget = "20/7d"\n'
        "reply_budget_overrides = [\n"
        '  {mailboxes = "acme-eu", thread = "off"},\n'
        '  {mailboxes = "acme-*", thread = "5/30m", correspondent = "50/1d"},\n'
        "]\n",
    )
    config = load(
        {"thread_reply_budget": "2/2h"},
        environ={"INBOX_COORDINATOR_CORRESPONDENT_REPLY_BUDGET": "12/1d"},
        config_file=str(config_file),
    )
    budgets = config.rules().reply_budgets
    assert budgets("globex") == ReplyBudgets(Budget(2, 2 * HOUR), Budget(12, DAY))  # flag, then environment
    assert budgets("acme-eu") == ReplyBudgets(None, Budget(12, DAY))  # the first match wins; the rest default
    assert budgets("acme-us") == ReplyBudgets(Budget(5, 30 * 60_000), Budget(50, DAY))
    assert config.origin("correspondent_reply_budget") == "INBOX_COORDINATOR_CORRESPONDENT_REPLY_BUDGET"
    # The flag's and variable's form of the overrides.
    flagged = load({"reply_budget_overrides": "acme-*=1/1h; support@globex.example=,off"}, environ={})
    assert flagged.rules().reply_budgets("acme-1") == ReplyBudgets(Budget(1, HOUR), Budget(10, DAY))
    assert flagged.rules().reply_budgets("support@globex.example") == ReplyBudgets(Budget(3, HOUR), None)


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("0/1h", 'write "off" to turn the budget off'),
        ("1001/1h", "over the limit of 1000"),
        ("3/30s", "not a budget"),
        ("3/0m", "between 1m and 30d"),
        ("3/31d", "between 1m and 30d"),
        ("three an hour", "not a budget"),
    ],
)
def test_a_budget_out_of_range_is_refused_naming_the_setting(value: str, problem: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load({"thread_reply_budget": value}, environ={})
    assert f"--thread-reply-budget={value}" in str(raised.value)
    assert problem in str(raised.value)
    with pytest.raises(ConfigError) as raised:
        load({"reply_budget_overrides": f"acme-*={value}"}, environ={})
    assert problem in str(raised.value)


def test_an_override_for_a_mailbox_no_principal_is_granted_is_refused(tmp_path: Path) -> None:
    tokens = _file(tmp_path, "tokens.toml", TOKENS)
    for pattern in ("acme-eu", "acme-*", "*", "support@globex.example", "support@*"):
        load({"token_file": str(tokens), "reply_budget_overrides": f"{pattern}=1/1h"}, environ={})
    with pytest.raises(ConfigError) as raised:
        load({"token_file": str(tokens), "reply_budget_overrides": "acmee-eu=1/1h"}, environ={})
    message = str(raised.value)
    assert "'acmee-eu' matches no mailbox the token file grants" in message
    assert "granted: acme-*, support@globex.example" in message
    assert "--reply-budget-overrides" in message
    with pytest.raises(ConfigError, match="given twice"):
        load({"reply_budget_overrides": "acme-*=1/1h;acme-*=2/1h"}, environ={})


async def _serve(tmp_path: Path, env: dict[str, str]) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "coordinator",
        "serve",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "INBOX_COORDINATOR_DATA_DIR": str(tmp_path / "data"), **env},
    )
    _, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, err.decode()


async def test_serve_refuses_to_start_on_a_budget_out_of_range_or_an_override_matching_nothing(
    tmp_path: Path,
) -> None:
    code, err = await _serve(tmp_path, {"INBOX_COORDINATOR_CORRESPONDENT_REPLY_BUDGET": "5000/1d"})
    assert code == 2
    assert "INBOX_COORDINATOR_CORRESPONDENT_REPLY_BUDGET=5000/1d: 5000 replies is over the limit of 1000" in err
    tokens = _file(tmp_path, "tokens.toml", TOKENS)
    code, err = await _serve(
        tmp_path,
        {"INBOX_COORDINATOR_TOKEN_FILE": str(tokens), "INBOX_COORDINATOR_REPLY_BUDGET_OVERRIDES": "globex=1/1h"},
    )
    assert code == 2
    assert "the reply budget override for 'globex' matches no mailbox the token file grants" in err
    assert not (tmp_path / "data").exists()  # refused before anything started
