"""The provider scenarios' coordinator (sends not confirmed within 0.3 s are IN_DOUBT) and its clients."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from coordinator.ops.server import CoordinatorServer
from inbox_claims import AsyncCoordinator
from tests.conftest import StartCoordinator


@pytest.fixture
async def server(start_coordinator: StartCoordinator) -> CoordinatorServer:
    return await start_coordinator(send_timeout_ms=300)


@pytest.fixture
async def clients(server: CoordinatorServer) -> AsyncIterator[dict[str, AsyncCoordinator]]:
    """Two workers of agent-a, and agent-b, another agent watching the same mailbox."""
    made = {
        name: AsyncCoordinator(server.address, principal=principal)
        for name, principal in (("a1", "agent-a"), ("a2", "agent-a"), ("b", "agent-b"))
    }
    yield made
    for client in made.values():
        await client.close()
