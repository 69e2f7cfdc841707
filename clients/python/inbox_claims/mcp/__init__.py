"""MCP for agents that send through tool calls: our claim tools, and a guard in front of any email MCP server.

``inbox-claims-mcp serve`` runs the claim tools (``claim_message``, ``send_reply``, ``mark_replied``,
``release_message``, ``who_is_answering``) over stdio or streamable HTTP; ``inbox-claims-mcp guard -- <upstream>``
re-exposes an email MCP server's tools unchanged, with its send tools fenced by the coordinator. Needs the
``mcp`` extra. See docs/mcp.md.
"""

from ._answers import Answer, Outcome
from ._guard import Guard, SendTool, build_guard, check_tools
from ._session import DEFAULT_TTL, AgentSession, NotHandedOver, SentReplies, fingerprint
from ._tools import INSTRUCTIONS, TOOLS, NylasReplies, build_server
from ._upstream import Upstream, UpstreamFailed, UpstreamMismatch

__all__ = [
    "DEFAULT_TTL",
    "INSTRUCTIONS",
    "TOOLS",
    "AgentSession",
    "Answer",
    "Guard",
    "NotHandedOver",
    "NylasReplies",
    "Outcome",
    "SendTool",
    "SentReplies",
    "Upstream",
    "UpstreamFailed",
    "UpstreamMismatch",
    "build_guard",
    "build_server",
    "check_tools",
    "fingerprint",
    "main",
]


def main() -> None:
    """The ``inbox-claims-mcp`` command."""
    from ._cli import main as run

    raise SystemExit(run())
