"""The Node client (clients/node) in the benchmarks: one row that runs its bench script in a node process.

``node clients/node/dist/bench/claims.js`` makes 64 concurrent claims through one ``inbox-claims`` Coordinator
object (whose concurrent calls go together in Batch RPCs, like the Python client's) against the same coordinator
process as the Python client's rows, so that the two clients' figures come from one run.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

from ._common import CoordinatorProcess, CpuMeter, Environment, Result, SetupError, Workload
from ._load import ETCD_DURABILITY, group_commit_note

NODE_PACKAGE = Path(__file__).resolve().parent.parent / "clients" / "node"
SCRIPT = NODE_PACKAGE / "dist" / "bench" / "claims.js"


def node_problem() -> str | None:
    """Why the Node row cannot run here (None: it can)."""
    if shutil.which("node") is None:
        return "node not installed"
    if not SCRIPT.exists() and not (NODE_PACKAGE / "node_modules" / ".bin" / "tsc").exists():
        return "clients/node not installed (./dev node-test, or npm ci in clients/node)"
    return None


def _build() -> None:
    if SCRIPT.exists():
        return
    subprocess.run(["npx", "tsc", "-p", "tsconfig.json"], cwd=NODE_PACKAGE, check=True)


def node_claims_workload(
    env: Environment, coordinator: CoordinatorProcess, name: str, clients: int, mailbox: str
) -> Workload:
    """Fresh-subject ClaimReply from ``clients`` concurrent tasks of one Node Coordinator object."""
    problem = node_problem()
    if problem is not None:
        raise SetupError(f"the Node client row needs Node and clients/node: {problem}")
    _build()
    rounds = iter(range(1_000_000))

    async def run(seconds: float) -> Result:
        command = ["node", str(SCRIPT), "--target", coordinator.address, "--clients", str(clients)]
        command += ["--seconds", str(seconds), "--mailbox", f"{mailbox}-{next(rounds)}"]
        # The node process starts and warms up before its measured loop; the meter spans both, so the
        # coordinator's and etcd's CPU per claim includes the warm-up's claims too (slightly over, never under).
        before = coordinator.stats()
        meter = CpuMeter(coordinator.cpu_seconds, env.etcd)
        node = await asyncio.create_subprocess_exec(
            *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await node.communicate()
        if node.returncode != 0:
            raise SetupError(f"the Node bench script failed ({node.returncode}):\n{err.decode()[-2000:]}")
        report = json.loads(out.decode().strip().splitlines()[-1])
        server, etcd, _load = meter.stamp_values()
        return Result(
            name,
            int(report["ops"]),
            float(report["seconds"]),
            [float(v) for v in report["latencies_ms"]],
            server,
            etcd,
            float(report["cpu_seconds"]),
            group_commit_note(before, coordinator.stats()),
        )

    return Workload(name, run, ETCD_DURABILITY)
