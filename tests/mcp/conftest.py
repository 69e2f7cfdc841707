"""The fixtures every MCP test shares: a real coordinator on the run's etcd, and a fake Nylas send endpoint."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from coordinator.ops.server import CoordinatorServer
from examples.agent.fake_nylas import FakeNylas
from tests.conftest import StartCoordinator
from tests.mcp.support import API_KEY


@pytest.fixture
async def server(start_coordinator: StartCoordinator) -> CoordinatorServer:
    return await start_coordinator()


@pytest.fixture
def fake() -> Iterator[FakeNylas]:
    with FakeNylas(API_KEY) as nylas:
        yield nylas
