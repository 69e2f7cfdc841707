"""python -m bench mcp: the latency a guarded send adds to an email MCP server's send tool.

The same send tool (an in-process MCP server whose tool only records the send) is called through the SDK's
in-memory client directly, and through the guard (claim, BeginSend, the upstream call, ConfirmSent against a
real coordinator on this run's etcd), alternating in rounds; every guarded call answers a new message. Prints
the median and p99 of each and the guarded/direct ratios.
"""

from __future__ import annotations

import argparse
import time

from mcp import Client
from mcp.server import MCPServer

from inbox_claims.mcp import AgentSession, SendTool, Upstream, build_guard
from inbox_claims.mcp._sessions import OneSession
from inbox_claims.testing import async_running_coordinator

from ._common import Environment, percentile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sends", type=int, default=300, help="sends per round and path (default 300)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")


def _email_server() -> MCPServer:
    server = MCPServer("bench-email")
    sent: list[str] = []

    @server.tool()
    def send_message(grant_id: str, reply_to_message_id: str, body: str) -> dict[str, str]:
        """Records the send; the guard's cost is what is measured."""
        sent.append(reply_to_message_id)
        return {"id": f"sent-{len(sent)}"}

    return server


async def run(options: argparse.Namespace, env: Environment) -> int:
    print(f"== mcp: a guarded send vs the same send tool called directly ({options.sends} x {options.rounds} rounds)")
    upstream_server = _email_server()
    direct_ms: list[float] = []
    guarded_ms: list[float] = []
    async with (
        async_running_coordinator(etcd_endpoint=env.etcd.endpoint) as running,
        running.async_client("bench-agent") as coordinator,
        Client(upstream_server) as direct,
        Upstream(lambda: Client(upstream_server)) as upstream,
    ):
        session = AgentSession(coordinator)
        spec = SendTool("send_message", message="reply_to_message_id", mailbox="grant_id")
        async with Client(build_guard(upstream, [spec], OneSession(session))) as guarded:
            for round_number in range(options.rounds + 1):  # round 0 warms up
                for path, client, samples in (("direct", direct, direct_ms), ("guarded", guarded, guarded_ms)):
                    for n in range(options.sends):
                        arguments = {
                            "grant_id": "bench",
                            "reply_to_message_id": f"{path}-{round_number}-{n}",
                            "body": "x",
                        }
                        began = time.perf_counter()
                        result = await client.call_tool("send_message", arguments)
                        elapsed = (time.perf_counter() - began) * 1000
                        if result.is_error:
                            print(f"bench mcp: a {path} send failed: {result.content}")
                            return 1
                        if round_number:
                            samples.append(elapsed)
        await session.close()
    direct_ms.sort()
    guarded_ms.sort()
    print(f"{'path':<10} {'median ms':>10} {'p99 ms':>8}")
    for name, samples in (("direct", direct_ms), ("guarded", guarded_ms)):
        print(f"{name:<10} {percentile(samples, 50):>10.2f} {percentile(samples, 99):>8.2f}")
    median_ratio = percentile(guarded_ms, 50) / percentile(direct_ms, 50)
    p99_ratio = percentile(guarded_ms, 99) / percentile(direct_ms, 99)
    added = percentile(guarded_ms, 50) - percentile(direct_ms, 50)
    print(
        f"guarded/direct: median {median_ratio:.2f}x, p99 {p99_ratio:.2f}x; a guarded send adds {added:.2f} ms (median)"
    )
    return 0
