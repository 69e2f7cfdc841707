"""The world's child processes (coordinators, agents, proxy, sink, the human tool): started with their readiness
line awaited, stopped with a grace period, killed by pid. The harness (chaos/harness.py) decides what runs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path
from typing import IO


class Child:
    """One child process: started with its readiness line (if any) awaited, stopped and killed by pid."""

    def __init__(
        self, name: str, argv: list[str], log_path: Path, *, stdin: bool = False, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.want_stdin = stdin
        self.proc: asyncio.subprocess.Process | None = None
        self._log: IO[bytes] | None = None

    async def start(self, ready_timeout: float | None = 30.0) -> str:
        self._log = self.log_path.open("ab")
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.PIPE if self.want_stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE if ready_timeout is not None else self._log,
            stderr=self._log,
            start_new_session=True,
            env={**os.environ, **self.env} if self.env else None,
        )
        if ready_timeout is None:
            return ""
        assert self.proc.stdout is not None
        try:
            line = await asyncio.wait_for(self.proc.stdout.readline(), ready_timeout)
        except TimeoutError:
            line = b""
        if not line.startswith(b"ready"):
            await self.kill()
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{self.name} did not start ({line!r}); its log:\n{tail}")
        return line.decode().strip()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.returncode is None else None

    def signal(self, signum: signal.Signals) -> None:
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    async def kill(self) -> None:
        if self.proc is not None:
            self.signal(signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                await self.proc.wait()
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    async def stop(self, grace: float = 5.0) -> None:
        if self.proc is None:
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), grace)
        except TimeoutError:
            await self.kill()
        self._close_log()

    async def read_line(self, within: float = 10.0) -> str:
        assert self.proc is not None
        assert self.proc.stdout is not None
        return (await asyncio.wait_for(self.proc.stdout.readline(), within)).decode().strip()

    async def write_line(self, line: str) -> None:
        assert self.proc is not None
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()
