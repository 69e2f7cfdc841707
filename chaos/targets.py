"""What a fault may do to the world, and all it may read of it: the narrow face that chaos/faults.py acts on.

Behind it are the processes (chaos/processes.py), the monitor's measurements (chaos/monitor.py) and the
webhook deliveries (chaos/webhooks.py); a fault sees members, coordinators and agents by index or handle, never how
they are started or wired."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from .monitor import Monitor
from .processes import AgentHandle, OpenClaim, Processes
from .webhooks import Webhooks


class FaultTargets:
    def __init__(self, processes: Processes, monitor: Monitor, webhooks: Webhooks, partition_unavailable: str):
        self._processes = processes
        self._monitor = monitor
        self._webhooks = webhooks
        self.partition_unavailable = partition_unavailable
        """Why no member can be cut off alone (no network namespaces); empty when one can."""
        self.ttl = processes.config.ttl
        """The agents' claim TTL, seconds."""

    # -- etcd members ---------------------------------------------------------------------------------------

    @property
    def member_count(self) -> int:
        return len(self._processes.cluster.members)

    def member_name(self, index: int) -> str:
        return self._processes.cluster.members[index].spec.name

    async def leader_index(self) -> int:
        return await self._processes.leader_index()

    def kill_member(self, index: int) -> None:
        self._processes.kill_member(index)

    async def restart_member(self, index: int) -> None:
        await self._processes.restart_member(index)

    async def connect_member(self, index: int, connected: bool) -> None:
        """Cuts member ``index`` off from peers and clients, or joins it again (network namespaces only)."""
        await self._processes.set_link(index, up=connected)

    async def delay_etcd(self, member: str, delay_ms: float) -> None:
        """One-way latency the proxy adds to member ``member`` (its index, or "*" for all); 0 ends it."""
        await self._processes.proxy_command(f"delay {member} {delay_ms:.0f}")

    # -- coordinators ---------------------------------------------------------------------------------------

    @property
    def coordinator_count(self) -> int:
        return len(self._processes.coordinators)

    async def kill_coordinator(self, index: int) -> None:
        await self._processes.kill_coordinator(index)

    async def start_coordinator(self, index: int, clock_offset: str = "") -> None:
        await self._processes.start_coordinator(index, clock_offset)

    # -- agents ---------------------------------------------------------------------------------------------

    def live_agents(self) -> list[AgentHandle]:
        return self._processes.live_agents()

    async def agent_with_claims(self, rng: random.Random, wait: float = 10.0) -> AgentHandle:
        """A live agent holding the most claims (waits up to ``wait`` for one that holds any)."""
        deadline = time.time() + wait
        while True:
            live = self.live_agents()
            if not live:
                raise RuntimeError("no live agent to inject a fault into")
            held = [(len(a.open_claims()), a) for a in live]
            best = max(n for n, _ in held)
            if best > 0 or time.time() >= deadline:
                return rng.choice([a for n, a in held if n == best])
            await asyncio.sleep(0.5)

    def pause_agent(self, agent: AgentHandle) -> None:
        self._processes.pause_agent(agent)

    def resume_agent(self, agent: AgentHandle) -> None:
        self._processes.resume_agent(agent)

    async def kill_agent(self, agent: AgentHandle) -> None:
        await self._processes.kill_agent(agent)

    async def restart_agent(self, agent: AgentHandle) -> None:
        await self._processes.start_agent(agent)

    async def redeliver(self, notification_id: str, agent: AgentHandle) -> int:
        """The notification again, to ``agent``, as Nylas does when the first did not answer; 1 if it took it."""
        return await self._webhooks.deliver(notification_id, agent, reason="pause")

    async def measure_free(self, claim: OpenClaim, killed_at: float) -> dict[str, Any]:
        """When a dead holder's claim was last seen held and when free (see :meth:`Monitor.measure_free`)."""
        return await self._monitor.measure_free(claim, killed_at, self.ttl)
