"""A TCP proxy between the coordinators and the etcd members that can add latency (the slow-etcd fault).

One listening port per member (``--targets`` in member order); the coordinators are given these ports as their
etcd endpoints. Commands arrive on stdin, one a line, each answered ``ok ...`` on stdout:

* ``delay <member index or *> <milliseconds>``: every chunk forwarded to or from that member waits that long
  (one-way latency, order kept; 0 restores).

The proxy exits when stdin closes (the harness is gone) or at its lifetime.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time

from .common import announce, exit_at

CHUNK = 64 * 1024


class Link:
    """The proxy of one member."""

    def __init__(self, index: int, target: str) -> None:
        self.index = index
        host, _, port = target.rpartition(":")
        self.host, self.port = host, int(port)
        self.delay_s = 0.0
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), 3.0)
        except (OSError, TimeoutError):
            writer.close()
            return
        done = asyncio.Event()
        tasks = [
            asyncio.create_task(self._pump(reader, up_writer, done)),
            asyncio.create_task(self._pump(up_reader, writer, done)),
        ]
        await done.wait()
        for task in tasks:
            task.cancel()
        for w in (writer, up_writer):
            w.close()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, done: asyncio.Event) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, chunk = await queue.get()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not chunk:
                    return
                sink.write(chunk)
                await sink.drain()

        writer_task = asyncio.create_task(deliver())
        last_due = 0.0
        try:
            while True:
                chunk = await source.read(CHUNK)
                last_due = max(time.monotonic() + self.delay_s, last_due)
                queue.put_nowait((last_due, chunk))
                if not chunk:
                    break
            await writer_task
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await writer_task
            done.set()


async def run(targets: list[str], deadline: float) -> None:
    links = [Link(i, target) for i, target in enumerate(targets)]
    servers = [await asyncio.start_server(link.handle, "127.0.0.1", 0, backlog=256) for link in links]
    ports = [str(server.sockets[0].getsockname()[1]) for server in servers]
    announce("ready " + ",".join(ports))
    watchdog = asyncio.create_task(exit_at(deadline))
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    while line := await stdin.readline():
        words = line.decode().split()
        if len(words) == 3 and words[0] == "delay":
            chosen = links if words[1] == "*" else [links[int(words[1])]]
            for link in chosen:
                link.delay_s = max(float(words[2]), 0.0) / 1000
            announce(f"ok delay {words[1]} {words[2]}")
        else:
            announce(f"error unknown command {line.decode().strip()!r}")
    watchdog.cancel()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos proxy")
    parser.add_argument("--targets", required=True, help="HOST:PORT of each etcd member, comma-separated")
    parser.add_argument("--lifetime", type=float, default=3600.0)
    options = parser.parse_args(argv)
    asyncio.run(run(options.targets.split(","), time.time() + options.lifetime))
    return 0
