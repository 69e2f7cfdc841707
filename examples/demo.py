"""The demo: two agent replicas, one coordinator, a fake Nylas, and the webhook deliveries that make agents reply
twice. Exactly one reply per message comes out, and none for the message a human claimed.

::

    python -m examples.demo                 # from the repository root; exits 0 when every check holds

It starts a real coordinator on an embedded etcd (``inbox_claims.testing``; ``--etcd-endpoint`` uses a running
etcd instead), the fake Nylas send endpoint, and two replicas of ``examples/agent`` (two processes on free
ports, principals ``agent-1`` and ``agent-2``). Then it fires, signed with the webhook secret, at both replicas
at once:

1. one ``message.created`` notification three times (a redelivery, and the same delivery at two replicas);
2. a ``message.created`` and a ``message.updated`` notification of one message (two notification ids);
3. a notification of a message that a human (``ana@example.com``) claimed first;
4. a forged notification (bad signature), which must be refused with 401.

It waits for the replies, stops the replicas (each lets its running work finish), and prints every send.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import httpx

from inbox_claims import AsyncCoordinator, Subject, SubjectState
from inbox_claims.testing import CoordinatorOptions, RunningCoordinator, running_coordinator, sign_nylas

from .agent.fake_nylas import FakeNylas

REPO = Path(__file__).resolve().parent.parent
WEBHOOK_SECRET = "demo-webhook-secret"
NYLAS_API_KEY = "demo-api-key"
GRANT = "grant-demo"
HUMAN = "ana@example.com"
AGENTS = ("agent-1", "agent-2")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def notification(notification_id: str, message_id: str, type_: str = "message.created") -> bytes:
    """A Nylas v3 message notification, as raw bytes (signatures are over the exact bytes)."""
    document = {
        "specversion": "1.0",
        "type": type_,
        "source": "/google/emails/realtime",
        "id": notification_id,
        "time": int(time.time()),
        "webhook_delivery_attempt": 1,
        "data": {
            "application_id": "demo-app",
            "object": {
                "id": message_id,
                "grant_id": GRANT,
                "thread_id": f"thread-{message_id}",
                "object": "message",
                "subject": f"Question {message_id}",
                "from": [{"name": "Customer", "email": "customer@example.com"}],
                "folders": ["INBOX"],
            },
        },
    }
    return json.dumps(document).encode()


class Replica:
    """One agent process (``python -m examples.agent.app``), its output kept in a file."""

    def __init__(self, principal: str, coordinator: str, nylas: str, llm_delay: float, log_dir: Path) -> None:
        self.principal = principal
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/webhooks/nylas"
        self.log_path = log_dir / f"{principal}.log"
        self._log: IO[bytes] = self.log_path.open("wb")
        command = [sys.executable, "-m", "examples.agent.app", "--port", str(self.port), "--principal", principal]
        command += ["--coordinator", coordinator, "--webhook-secret", WEBHOOK_SECRET]
        command += ["--nylas-api-base", nylas, "--nylas-api-key", NYLAS_API_KEY, "--llm-delay", str(llm_delay)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    async def ready(self, http: httpx.AsyncClient, within: float = 30.0) -> None:
        """Waits until the replica answers the Nylas challenge (as Nylas checks a new endpoint)."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.principal} exited with {self.process.returncode}:\n{self.output()}")
            with contextlib.suppress(httpx.TransportError):
                answer = await http.get(self.url, params={"challenge": f"hello {self.principal}"})
                if answer.status_code == 200 and answer.text == f"hello {self.principal}":
                    return
            await asyncio.sleep(0.05)
        raise TimeoutError(f"{self.principal} did not answer the challenge within {within} s")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM: uvicorn stops taking requests and the webhook app lets running work finish."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()
        finally:
            self._log.close()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


async def deliver(http: httpx.AsyncClient, replica: Replica, body: bytes, *, signature: str | None = None) -> int:
    """POSTs a notification the way Nylas does; answers the HTTP status."""
    headers = {"content-type": "application/json", "x-nylas-signature": signature or sign_nylas(body, WEBHOOK_SECRET)}
    return (await http.post(replica.url, content=body, headers=headers)).status_code


async def wait_for_states(
    coord: AsyncCoordinator, expected: dict[str, SubjectState], within: float = 30.0
) -> dict[str, SubjectState]:
    deadline = time.monotonic() + within
    while True:
        states = {m: (await coord.status(Subject.message(GRANT, m))).state for m in expected}
        if states == expected or time.monotonic() > deadline:
            return states
        await asyncio.sleep(0.1)


async def scenario(running: RunningCoordinator, nylas: FakeNylas, replicas: list[Replica], run: str) -> list[str]:
    """Fires every delivery; answers the failed checks (empty when all hold)."""
    failures: list[str] = []
    m_redelivered, m_pair, m_human = f"msg-redelivered-{run}", f"msg-created-updated-{run}", f"msg-human-{run}"
    a, b = replicas
    async with httpx.AsyncClient(timeout=10) as http, running.async_client(HUMAN, kind="human") as human:
        await asyncio.gather(*(replica.ready(http) for replica in replicas))
        print(f"replicas ready: {', '.join(f'{r.principal} on :{r.port}' for r in replicas)}")

        claimed = await human.claim(Subject.message(GRANT, m_human), ttl=300, note="Ana is answering by phone")
        print(f"{HUMAN} claims {m_human}: {claimed.outcome.name}")

        same = notification(f"notif-1-{run}", m_redelivered)
        created = notification(f"notif-2-{run}", m_pair, "message.created")
        updated = notification(f"notif-3-{run}", m_pair, "message.updated")
        for_human = notification(f"notif-4-{run}", m_human)
        forged = notification(f"notif-5-{run}", f"msg-forged-{run}")
        deliveries = [(a, same), (b, same), (a, same), (a, created), (b, updated), (a, for_human), (b, for_human)]
        statuses = await asyncio.gather(*(deliver(http, replica, body) for replica, body in deliveries))
        forged_status = await deliver(http, b, forged, signature=sign_nylas(forged, "not-the-secret"))
        print(f"deliveries answered {list(statuses)}; the forged one {forged_status}")
        if any(status != 200 for status in statuses):
            failures.append(f"a signed delivery was not answered 200: {statuses}")
        if forged_status != 401:
            failures.append(f"the forged delivery was answered {forged_status}, not 401")

        expected = {m_redelivered: SubjectState.REPLIED, m_pair: SubjectState.REPLIED, m_human: SubjectState.CLAIMED}
        states = await wait_for_states(human, expected)
        if states != expected:
            failures.append(f"subject states {states}, expected {expected}")
    for replica in replicas:
        code = replica.stop()  # uvicorn re-raises the SIGTERM it handled once it has shut down: -15 is clean
        if code not in (0, -signal.SIGTERM) or "stopped after finishing its work" not in replica.output():
            failures.append(f"{replica.principal} did not stop cleanly (exit status {code})")

    print("\nsends recorded by the fake Nylas:")
    for sent in nylas.sends:
        by = next((agent for agent in AGENTS if agent in sent.payload.get("body", "")), "?")
        print(f"  {sent.id}: reply to {sent.reply_to_message_id:<32} by {by}  Idempotency-Key {sent.idempotency_key}")
    for message_id, want in ((m_redelivered, 1), (m_pair, 1), (m_human, 0), (f"msg-forged-{run}", 0)):
        got = len(nylas.sends_for(message_id))
        print(f"  {message_id}: {got} send(s), expected {want}")
        if got != want:
            failures.append(f"{message_id}: {got} sends, expected {want}")
    if nylas.problems:
        failures.append(f"the fake Nylas refused requests: {nylas.problems}")
    return failures


@contextlib.contextmanager
def replicas_running(target: str, nylas: FakeNylas, llm_delay: float, log_dir: Path) -> Iterator[list[Replica]]:
    replicas = [Replica(name, target, nylas.api_base, llm_delay, log_dir) for name in AGENTS]
    try:
        yield replicas
    finally:
        for replica in replicas:
            replica.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--etcd-endpoint", help="use this running etcd (HOST:PORT) instead of starting one")
    parser.add_argument("--llm-delay", type=float, default=1.0, help="seconds the fake LLM takes (default 1)")
    parser.add_argument("--show-logs", action="store_true", help="print the replicas' logs at the end")
    options = parser.parse_args(argv)
    coordinator_options: CoordinatorOptions = {}
    if options.etcd_endpoint:
        coordinator_options["etcd_endpoint"] = options.etcd_endpoint
    run = uuid.uuid4().hex[:6]
    with (
        tempfile.TemporaryDirectory(prefix="inbox-demo-") as log_dir,
        running_coordinator(**coordinator_options) as running,
        FakeNylas(NYLAS_API_KEY) as nylas,
        replicas_running(running.target, nylas, options.llm_delay, Path(log_dir)) as replicas,
    ):
        print(f"coordinator at {running.target}, fake Nylas at {nylas.api_base}")
        failures = asyncio.run(scenario(running, nylas, replicas, run))
        if failures or options.show_logs:
            for replica in replicas:
                print(f"\n----- {replica.principal} log -----\n{replica.output()}")
    if failures:
        print("\nFAILED:\n  " + "\n  ".join(failures))
        return 1
    print("\nOK: exactly one reply per message, none for the message the human claimed.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
