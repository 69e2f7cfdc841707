"""examples/demo.py, run as a user would: two agent replicas, redeliveries, a created+updated pair and a message a
human claimed first must give exactly one reply per message, and none for the human's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from coordinator.store.etcd.process import EtcdServer

REPO = Path(__file__).resolve().parents[2]


def test_the_demo_sends_exactly_one_reply_per_message(shared_etcd: EtcdServer) -> None:
    demo = subprocess.run(
        [sys.executable, "-m", "examples.demo", "--etcd-endpoint", shared_etcd.endpoint, "--llm-delay", "0.5"],
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=90,
    )
    output = demo.stdout + demo.stderr
    assert demo.returncode == 0, output
    counts = dict(re.findall(r"^  (msg-[\w-]+?)-\w{6}: (\d+) send\(s\)", demo.stdout, re.MULTILINE))
    assert counts == {"msg-redelivered": "1", "msg-created-updated": "1", "msg-human": "0", "msg-forged": "0"}, output
    sends = re.findall(r"^  sent-\d+: reply to (\S+)", demo.stdout, re.MULTILINE)
    assert len(sends) == len(set(sends)) == 2, output  # one reply per message, across both replicas
    assert "deliveries answered [200, 200, 200, 200, 200, 200, 200]; the forged one 401" in demo.stdout
    assert "OK: exactly one reply per message" in demo.stdout
