"""The send tools of known email MCP servers, for ``inbox-claims-mcp guard --preset NAME``.

Each preset was written from the server's own tool schemas, and says where they were read (repository, file and
commit, or documentation page). A preset names the tools that send a reply (fenced: claimed, then sent at most
once per message) and the tools that send mail without saying which message they answer (a new email, a
forward, a draft sent by its id): those cannot be fenced per message, and the guard refuses them unless it is
started with ``--unfenced-sends allow``. A server whose every send is of that kind has no preset: the reason is in
``UNPRESETTABLE``. Schemas change with a server's versions: each preset names the published versions whose
recorded tool list it was checked against (``versions``; tests/mcp/data/tools, by scripts/record_mcp_tools.py),
and the guard checks the tool list of the server it is started in front of anyway (``check_tools``): it does not
start when a send tool a preset names is not there.
"""

from __future__ import annotations

import dataclasses

from ._guard import SendTool


def _named(preset: str, *tools: SendTool) -> tuple[SendTool, ...]:
    return tuple(dataclasses.replace(tool, origin=f"--preset {preset}") for tool in tools)


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    server: str
    """The server, and how it is run."""
    tools: tuple[SendTool, ...]
    """The tools that send a reply naming the message it answers."""
    unfenced: tuple[str, ...]
    """The tools that send mail naming no message it answers."""
    source: str
    """Where the tools' input schemas were read."""
    versions: tuple[str, ...] = ()
    """The published packages (``name version``) whose recorded tool list this preset was checked against; empty
    when no package lists its tools without the network or real credentials (``source`` says where it was read)."""


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset(
            "agentmail",
            "AgentMail's MCP server (hosted at https://mcp.agentmail.to/mcp; `npx agentmail-mcp` over stdio)",
            _named(
                "agentmail",
                SendTool("reply_to_message", message="messageId", mailbox="inboxId", sent_id=("messageId",)),
            ),
            ("send_message", "forward_message", "send_draft"),
            "agentmail-to/agentmail-mcp mcp-manifest.json at 8bed271 (the hosted server's tools/list: "
            "reply_to_message requires inboxId and messageId, answers messageId and threadId), the tools being "
            "agentmail-to/agentmail-toolkit node/src/schemas.ts ReplyToMessageParams at f794bc9; the published "
            "bridge (agentmail-mcp 1.0.0 on PyPI) holds no tools and lists none without the hosted server",
        ),
        Preset(
            "nylas",
            "Nylas's hosted MCP server (https://mcp.us.nylas.com, https://mcp.eu.nylas.com; `nylas mcp serve`)",
            _named(
                "nylas", SendTool("send_message", message="message_request.reply_to_message_id", mailbox="grant_id")
            ),
            ("send_draft", "confirm_send_draft"),
            "nylas/cli at b564e79: internal/adapters/mcp/proxy_e2e_fixtures_test.go (its copy of the hosted "
            "server's tools/list: send_message takes grant_id, message_request and confirmation_hash; "
            "confirm_send_draft takes draft_id) and docs/commands/mcp.md; message_request is the Nylas v3 send "
            "body, whose reply_to_message_id names the message answered (developer.nylas.com/docs/reference/api/"
            "messages; nylas/cli internal/adapters/nylas/messages_send.go). The CLI's proxy adds grant_id when a "
            "call leaves it out: start the guard with --mailbox GRANT_ID for that. No package of it on npm or PyPI",
        ),
        Preset(
            "gmail",
            "the Gmail MCP server of GongRzhe/Gmail-MCP-Server (`npx @gongrzhe/server-gmail-autoauth-mcp`)",
            _named(
                "gmail",
                SendTool(
                    "send_email",
                    message="inReplyTo",
                    thread="threadId",
                    sent_id_text=r"with ID: (\S+)",
                    error_text="Error: ",
                ),
            ),
            (),
            "GongRzhe/Gmail-MCP-Server src/index.ts at a890d19: SendEmailSchema (to, subject, body, threadId, "
            "inReplyTo: 'Message ID being replied to'); one Gmail account per server; a failed send is answered "
            "as the text 'Error: ...' without isError, and a sent one as 'Email sent successfully with ID: ...'",
            ("@gongrzhe/server-gmail-autoauth-mcp 1.1.11",),
        ),
        Preset(
            "google-workspace",
            "the Gmail tools of Google Workspace MCP (taylorwilsdon/google_workspace_mcp)",
            _named(
                "google-workspace",
                SendTool(
                    "send_gmail_message",
                    message="in_reply_to",
                    mailbox="user_google_email",
                    thread="thread_id",
                    sent_id_text=r"Message ID: (\S+)",
                ),
            ),
            (),
            "taylorwilsdon/google_workspace_mcp gmail/gmail_tools.py at 31f42c6: send_gmail_message "
            "(user_google_email, to, subject, body, thread_id, in_reply_to: 'Message-ID of the message being "
            "replied to', references; since then forward_message_id, a forward through the same tool, which "
            "names no message answered), answered 'Email sent! Message ID: ...'",
            ("workspace-mcp 2.2.1",),
        ),
        Preset(
            "resend",
            "Resend's MCP server (`npx -y resend-mcp`): a reply is send-email with the In-Reply-To header; one "
            "sending address per guard: needs --mailbox",
            _named(
                "resend",
                SendTool(
                    "send-email", message="headers.In-Reply-To", headers="headers", sent_id_text=r'"id":\s*"([^"]+)"'
                ),
            ),
            ("send-batch-emails", "send-broadcast"),
            "resend-mcp 2.22.0's tools/list (npm; recorded in tests/mcp/data/tools/resend.json): no tool replies to "
            "an email by its id; send-email takes to, subject, text, from, headers (any MIME header: In-Reply-To "
            "names the Message-ID answered) and answers 'Email sent successfully! {\"id\": ...}'; "
            "send-batch-emails and send-broadcast name no message answered (src/tools/emails.js of the package)",
            ("resend-mcp 2.22.0",),
        ),
        Preset(
            "email-mcp",
            "codefuturist/email-mcp (IMAP and SMTP, `npx @codefuturist/email-mcp`)",
            _named(
                "email-mcp",
                SendTool("reply_email", message="emailId", mailbox="account", sent_id_text=r"Message-ID: (\S+)"),
            ),
            ("send_email", "forward_email", "send_draft", "schedule_email"),
            "codefuturist/email-mcp src/tools/send.tool.ts at 4034b78: reply_email (account, emailId: 'Email ID "
            "to reply to', mailbox: the IMAP folder, body), answered 'Reply sent successfully! Message-ID: ...'; "
            "send_email takes to, subject and body only",
            ("@codefuturist/email-mcp 0.2.0",),
        ),
    )
}

UNPRESETTABLE: dict[str, str] = {
    "postmark": (
        "Postmark's MCP server (ActiveCampaign/postmark-mcp, index.js at 80db79b) sends only new messages: "
        "sendEmail and sendEmailWithTemplate take a recipient, a subject and a body, and nothing that says which "
        "email they answer, so there is no message to claim and the guard cannot make its sends at most one per "
        "email. Reply through `inbox-claims-mcp serve` (send_reply), or guard its tools with --unfenced-tool "
        "sendEmail --unfenced-tool sendEmailWithTemplate to stop an agent from sending through them"
    ),
}
"""Common servers that have no preset, and why."""
