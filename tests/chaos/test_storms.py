"""Reply storms in the chaos harness (issue 33, docs/reliability.md#reply-storms): a short run with the storm actors
(an out-of-office that marks its answers, an auto-responder and another company's agent that mark nothing and
answer every reply, a mailing list, a customer writing twice quickly, people answering from Gmail), under the
process faults, must show no violation: the reply budget stopped the unmarked ping-pong, no agent answered
automated mail or a conversation that had moved on. The same run with the agents' reply rules off
(``--ignore-reply-rules``: no headers read, refusals ignored) must fail, or the checker could not see a storm.

Both runs start together when the module's first test asks for them (about 70 s of wall time) and are killed at
the end of the module.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from chaos.config import Config, choose_etcd
from coordinator.store.etcd.process import ENV_ETCD_BIN
from tests.chaos.test_chaos import BOUND_S, ChaosRun

pytestmark = pytest.mark.etcd

SEED = 11
STORMS = ("--seed", str(SEED), "--duration", "30", "--agents", "3", "--messages", "24", "--storms", "2",
          "--takeovers", "1", "--faults", "agent_pause,coordinator_kill")  # fmt: skip
NO_RULES = ("--seed", str(SEED), "--duration", "30", "--agents", "3", "--messages", "16", "--storms", "2",
            "--takeovers", "0", "--faults", "none", "--sink-fail-rate", "0", "--ignore-reply-rules")  # fmt: skip


@dataclass
class Runs:
    storms: ChaosRun
    no_rules: ChaosRun


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    override = os.environ.get(ENV_ETCD_BIN)
    faults = ("agent_pause", "coordinator_kill")  # no etcd SIGKILL: safe on every etcd version ./dev test runs
    binary, _ = choose_etcd(Config(seed=SEED, duration=1, etcd_bin=Path(override) if override else None, faults=faults))
    base = tmp_path_factory.mktemp("storms")
    etcd = ("--etcd-bin", str(binary))
    started = Runs(ChaosRun(base / "storms", (*STORMS, *etcd)), ChaosRun(base / "no-rules", (*NO_RULES, *etcd)))
    yield started
    for run in (started.storms, started.no_rules):
        run.stop()


@pytest.mark.timeout(BOUND_S + 30)
def test_storms_are_stopped_and_automated_mail_left_to_people(runs: Runs) -> None:
    code, summary, output = runs.storms.result()
    assert summary["violations"] == {}, output[-6000:]
    assert summary["errors"] == [], output[-6000:]
    assert code == 0, output[-6000:]
    storms = summary["stats"]["storms"]
    replies = storms["agent_replies_per_thread"]
    # The unmarked auto-responders answered every reply: the thread's budget (3) stopped the agents, and said so.
    assert max(int(n) for n in replies["responder"]) == 3, storms
    assert any(refusal.startswith("reply_budget_spent:") for refusal in storms["send_refusals"]), storms
    # The out-of-office's marked answers and the list's posts were left to people: one agent reply at most in the
    # out-of-office's thread (to the person's first message), none to the list.
    assert set(replies["ooo"]) <= {"0", "1"}, storms
    assert set(replies["mailing list"]) == {"0"}, storms
    assert storms["automated_left_to_people"] >= 1, storms
    assert storms["max_agent_replies_per_correspondent"] <= 10, storms
    assert storms["header_reads"]["count"] >= 1, storms
    assert storms["looks_before_send"]["count"] >= 1, storms  # the guard looked at the thread before sends


@pytest.mark.timeout(BOUND_S + 30)
def test_the_checker_catches_storms_when_the_agents_reply_rules_are_off(runs: Runs) -> None:
    code, summary, output = runs.no_rules.result()
    assert code == 1, output[-4000:]
    violations = summary["violations"]
    assert violations.get("reply_to_automated", 0) >= 1, output[-4000:]
    assert violations.get("over_budget", 0) >= 1, output[-4000:]
    assert "replay with" in output
