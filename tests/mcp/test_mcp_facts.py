"""The MCP tools read what they are told about an email as the guard reads any provider's message: the neutral
value (docs/providers.md), whose summary is cut to the coordinator's limits as the guard cuts it, so that a long
subject line in another script is shown cut, not refused."""

from __future__ import annotations

import uuid

from coordinator.ops.server import CoordinatorServer
from examples.agent.fake_nylas import FakeNylas
from inbox_claims import AsyncCoordinator, Subject
from tests.mcp.support import agent_session


async def test_a_subject_line_over_the_coordinators_byte_limit_is_cut_as_the_guard_cuts_it(
    server: CoordinatorServer, fake: FakeNylas
) -> None:
    mailbox = f"grant-{uuid.uuid4().hex[:8]}"
    subject_line = (
        "Réclamation: " + "é" * 400
    )  # 413 characters (the tool's limit is 512), 813 bytes (the coordinator's 512)
    async with (
        agent_session(server.address, "agent-a", api_base=fake.api_base) as (client, _),
        AsyncCoordinator(server.address, principal="ana@example.com", kind="human") as person,
    ):
        granted = await client.call_tool(
            "claim_message",
            {"mailbox": mailbox, "message_id": "msg-1", "summary": {"subject_line": subject_line, "sender": "Bea"}},
        )
        assert not granted.is_error, granted.content
        status = await person.status(Subject.message(mailbox, "msg-1"))
    assert status.summary is not None
    shown = status.summary.subject_line
    assert subject_line.startswith(shown)
    assert len(shown.encode()) <= 512 < len(subject_line.encode())
