"""The benchmarks still run: ``python -m bench all --quick`` runs each for about a second, small sizes, and
each prints its table. Redis and PostgreSQL baselines run where their servers and client libraries are
installed (the run says which it skipped)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.etcd  # starts etcd (or a coordinator with its own) itself

ROOT = Path(__file__).resolve().parents[2]

# Each benchmark's heading, and a line of its table that only a finished measurement prints.
EXPECTED = {
    "claims": ("== claims:", "coordinator ClaimReply, group commit"),
    "contended": ("== contended:", "coordinator contended, group commit"),
    "dedup": ("== dedup:", "coordinator dedup, group commit"),
    "cycle": ("== cycle:", "coordinator cycle, group commit"),
    "watch": ("== watch:", "watchers: coordinator p99"),
    "memory": ("== memory:", "watchers over"),
    "embedded-db": ("== embedded-db:", "growth per cycle:"),
    "mcp": ("== mcp:", "guarded/direct: median"),
    "providers": ("== providers:", "gmail    coordinator"),
    "guard-traces": ("== guard-traces:", "| sampled-1 |"),
    "profile": ("== profile:", "by where the time was spent"),
}


@pytest.fixture(scope="module")
def quick_run() -> str:
    result = subprocess.run(
        [sys.executable, "-m", "bench", "all", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, f"bench all --quick failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result.stdout


@pytest.mark.parametrize("benchmark", sorted(EXPECTED))
def test_benchmark_prints_its_table(quick_run: str, benchmark: str) -> None:
    heading, row = EXPECTED[benchmark]
    section = quick_run.split(heading, 1)
    assert len(section) == 2, f"{benchmark} printed no heading; output:\n{quick_run[-3000:]}"
    body = section[1].split("\n== ", 1)[0]
    assert row in body, f"{benchmark} printed no result row {row!r}:\n{body[-3000:]}"


def test_claims_ratios_against_raw_etcd(quick_run: str) -> None:
    claims = quick_run.split("== claims:", 1)[1].split("\n== ", 1)[0]
    assert "x the raw etcd loop's throughput" in claims
    assert "raw etcd txn (put-if-absent)" in claims
    assert "empty Python gRPC handler" in claims
