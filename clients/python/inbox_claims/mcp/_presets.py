"""Send tools of known email MCP servers, for ``inbox-claims-mcp guard --preset NAME``.

Each preset says where its schema was read. A server's schema can change with its versions: check it against
the tools your server lists (docs/mcp.md, "Presets"), and give ``--send-tool`` for anything a preset lacks.
"""

from __future__ import annotations

import dataclasses

from ._guard import SendTool


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    tools: tuple[SendTool, ...]
    source: str
    """Where the tools' input schemas were read."""


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset(
            "agentmail",
            (SendTool("reply_to_message", message="messageId", mailbox="inboxId", sent_id=("messageId",)),),
            "AgentMail's MCP server (agentmail-to/agentmail-mcp): its tools take the inbox as inboxId "
            "(mcp-manifest.json); its reply tool answers a messageId, as AgentMail's reply API does",
        ),
    )
}
