"""Fake upstreams for the guard's presets: each lists the tools of a real email MCP server, and answers a send
the way that server does (structured or text; a failure as a tool error or, for GongRzhe's Gmail server, as
plain text). Every send is recorded, so that a test counts what went out.

The tools listed are the published package's own, as recorded by scripts/record_mcp_tools.py in
tests/mcp/data/tools (every tool, its schema as the server declared it); for a server no package lists without
the network (AgentMail's, Nylas's), the send tools written from the source each preset names (``_presets.py``),
keeping every property of the real tool with its type and whether it is required.

In memory (``Recorder().server(FAKES[name])``) or as a process over stdio (``python -m tests.mcp.preset_servers
NAME --outbox FILE``, each send one JSON line of FILE), so that a guard process can be started in front of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
from mcp.server import Server, ServerRequestContext
from mcp.server.caching import CacheHint
from mcp.server.stdio import stdio_server
from mcp_types.methods import CacheableMethod

DATA = Path(__file__).resolve().parent / "data" / "tools"


def recorded(preset: str) -> dict[str, Any]:
    """What scripts/record_mcp_tools.py recorded of the package the preset is for (``listed``: its tools)."""
    document: dict[str, Any] = json.loads((DATA / f"{preset}.json").read_text(encoding="utf-8"))
    return document


Answer = Callable[[str], dict[str, Any]]
"""The server's result of a send, given the id of what it sent."""


def _text(text: str, *, error: bool = False) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "isError": error}


def _wrapped(text: str) -> dict[str, Any]:
    return {**_text(text), "structuredContent": {"result": text}}


def _structured(document: dict[str, Any]) -> dict[str, Any]:
    return {
        "content": [{"type": "text", "text": json.dumps(document)}],
        "structuredContent": document,
        "isError": False,
    }


def _object(required: tuple[str, ...] = (), **properties: dict[str, Any]) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    return schema


STRING: dict[str, Any] = {"type": "string"}
OBJECT: dict[str, Any] = {"type": "object", "additionalProperties": {"type": "string"}}
STRINGS: dict[str, Any] = {"type": "array", "items": {"type": "string"}}
OBJECTS: dict[str, Any] = {"type": "array", "items": {"type": "object"}}
BOOLEAN: dict[str, Any] = {"type": "boolean"}


@dataclasses.dataclass(frozen=True)
class FakeTool:
    name: str
    input_schema: dict[str, Any]
    sent: Answer
    """The answer to a send that went out."""
    failed: Callable[[str], dict[str, Any]] = lambda reason: _text(reason, error=True)
    """The answer to a send that did not (the server's own way of saying so)."""
    sends: bool = True

    def listed(self) -> dict[str, Any]:
        return {"name": self.name, "description": f"{self.name} (fake)", "inputSchema": self.input_schema}


@dataclasses.dataclass(frozen=True)
class FakeServer:
    """One preset's upstream: its tools, and example calls of them."""

    preset: str
    tools: tuple[FakeTool, ...]
    reply: Callable[[str, str], tuple[str, dict[str, Any]]]
    """A reply to message (id) of mailbox: the tool and its arguments."""
    mailbox: str | None = None
    """The --mailbox the guard needs (a server of one mailbox), else the mailbox argument is the test's."""
    new_mail: tuple[str, dict[str, Any]] | None = None
    """A call of the reply tool that sends new mail, naming no message (when the tool can)."""
    unfenced: tuple[tuple[str, dict[str, Any]], ...] = ()
    """A call of each tool that sends without naming the message it answers."""
    sent_ids: bool = True
    """The server says the sent message's id, so the reply record has it."""

    def listed(self) -> list[dict[str, Any]]:
        """The tools as the server lists them: the published package's, as recorded, or the fakes' own."""
        record = recorded(self.preset)
        if record["listed"]:
            return list(record["tools"])
        return [tool.listed() for tool in self.tools]


CONFIRMATION = {
    "confirm": {
        "method": "elicitation/create",
        "params": {
            "mode": "form",
            "message": "Send this email?",
            "requestedSchema": {"type": "object", "properties": {}},
        },
    }
}
"""What a send tool asks before it sends, when it asks (2026-07-28: an ``input_required`` result)."""


class Recorder:
    """What a fake upstream sent; ``failing`` makes its send tools answer their failure instead, ``confirming``
    makes them ask the client to confirm first (sending only on the retry that carries the answer)."""

    def __init__(self) -> None:
        self.sends: list[dict[str, Any]] = []
        self.failing = False
        self.confirming = False

    def server(self, fake: FakeServer, *, outbox: Path | None = None) -> Server[Any]:
        """``outbox``: each send also one JSON line of this file (for a test that does not own the process)."""
        tools = {tool.name: tool for tool in fake.tools}
        listed = fake.listed()

        async def list_tools(ctx: ServerRequestContext[Any, Any], params: Any) -> dict[str, Any]:
            return {"tools": listed, "resultType": "complete"}  # dropped again on a handshake-era connection

        async def call_tool(ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams) -> Any:
            tool = tools.get(params.name)
            if tool is None or not tool.sends:
                return _text(f"{params.name}: nothing to send")
            if self.failing:
                return tool.failed("the provider refused the recipient")
            if self.confirming and not params.input_responses:
                return {"resultType": "input_required", "inputRequests": CONFIRMATION}
            sent_id = f"sent-{len(self.sends) + 1}"
            self.sends.append({"tool": tool.name, "arguments": params.arguments or {}, "id": sent_id})
            if outbox is not None:
                with outbox.open("a", encoding="utf-8") as file:
                    file.write(json.dumps(self.sends[-1]) + "\n")
            return {**tool.sent(sent_id), "resultType": "complete"}  # dropped again on a handshake-era connection

        # The 2026-07-28 protocol wants a list's freshness: none (as the guard says for servers of the 2025 era).
        record = recorded(fake.preset)
        info = record.get("server_info") or {"name": f"fake-{fake.preset}", "version": "0"}  # who it says it is
        hints: dict[CacheableMethod, CacheHint] = {"tools/list": CacheHint(ttl_ms=0, scope="private")}
        server: Server[Any] = Server(info["name"], version=info["version"], cache_hints=hints)
        server.add_request_handler("tools/list", types.PaginatedRequestParams, list_tools)
        server.add_request_handler("tools/call", types.CallToolRequestParams, call_tool)
        return server


def _sent_by(name: str) -> Answer:
    return lambda sent_id: _text(f"{name}: sent {sent_id}")


# AgentMail, agentmail-to/agentmail-mcp mcp-manifest.json: the tools share inboxId, text, html, labels and
# attachments; reply_to_message answers {messageId, threadId}.
_AGENTMAIL_BODY = {"inboxId": STRING, "text": STRING, "html": STRING, "labels": STRINGS, "attachments": OBJECTS}
_AGENTMAIL_RECIPIENTS = {"to": STRINGS, "cc": STRINGS, "bcc": STRINGS, "replyTo": STRINGS}
_AGENTMAIL_SENT: Answer = lambda sent_id: _structured({"messageId": sent_id, "threadId": f"thread-{sent_id}"})  # noqa: E731
AGENTMAIL = FakeServer(
    "agentmail",
    (
        FakeTool(
            "reply_to_message",
            _object(
                ("inboxId", "messageId"),
                **_AGENTMAIL_BODY,
                **_AGENTMAIL_RECIPIENTS,
                messageId=STRING,
                replyAll=BOOLEAN,
            ),
            _AGENTMAIL_SENT,
        ),
        FakeTool(
            "send_message",
            _object(("inboxId", "to"), **_AGENTMAIL_BODY, **_AGENTMAIL_RECIPIENTS, subject=STRING),
            _AGENTMAIL_SENT,
        ),
        FakeTool(
            "forward_message",
            _object(("inboxId", "to", "messageId"), **_AGENTMAIL_BODY, to=STRINGS, subject=STRING, messageId=STRING),
            _AGENTMAIL_SENT,
        ),
        FakeTool("send_draft", _object(("inboxId", "draftId"), inboxId=STRING, draftId=STRING), _AGENTMAIL_SENT),
        FakeTool("list_threads", _object(("inboxId",), inboxId=STRING, limit={"type": "number"}), _AGENTMAIL_SENT),
    ),
    lambda mailbox, message: (
        "reply_to_message",
        {"inboxId": mailbox, "messageId": message, "text": "It ships today."},
    ),
    unfenced=(
        ("send_message", {"inboxId": "inbox-1", "to": ["bea@example.org"], "text": "Hello"}),
        ("forward_message", {"inboxId": "inbox-1", "to": ["ops@example.org"], "messageId": "msg-1"}),
        ("send_draft", {"inboxId": "inbox-1", "draftId": "draft-1"}),
    ),
)

# Nylas's hosted server, as nylas/cli's fixture of its tools/list has it; message_request is the v3 send body.
_NYLAS_SENT: Answer = lambda sent_id: _text(f'{{"request_id": "r-1", "data": {{"id": "{sent_id}"}}}}')  # noqa: E731
NYLAS = FakeServer(
    "nylas",
    (
        FakeTool(
            "send_message",
            _object(
                ("message_request", "confirmation_hash"),
                grant_id=STRING,
                message_request={"type": "object"},
                confirmation_hash=STRING,
            ),
            _NYLAS_SENT,
        ),
        FakeTool(
            "confirm_send_message",
            _object(("message_request",), message_request={"type": "object"}),
            _NYLAS_SENT,
            sends=False,
        ),
        FakeTool("confirm_send_draft", _object(("draft_id",), grant_id=STRING, draft_id=STRING), _NYLAS_SENT),
        FakeTool("send_draft", _object(("draft_id",), grant_id=STRING, draft_id=STRING), _NYLAS_SENT),
    ),
    lambda mailbox, message: (
        "send_message",
        {
            "grant_id": mailbox,
            "confirmation_hash": "h-1",
            "message_request": {
                "to": [{"email": "bea@example.org"}],
                "subject": "Re: Where is my order?",
                "body": "It ships today.",
                "reply_to_message_id": message,
            },
        },
    ),
    new_mail=(
        "send_message",
        {
            "grant_id": "grant-1",
            "confirmation_hash": "h-2",
            "message_request": {"to": [{"email": "cy@example.org"}], "subject": "Hello", "body": "New mail."},
        },
    ),
    unfenced=(
        ("send_draft", {"grant_id": "grant-1", "draft_id": "d-1"}),
        ("confirm_send_draft", {"grant_id": "grant-1", "draft_id": "d-1"}),
    ),
    sent_ids=False,
)

# GongRzhe/Gmail-MCP-Server: one account; failures answered as plain text "Error: ...".
GMAIL = FakeServer(
    "gmail",
    (
        FakeTool(
            "send_email",
            _object(
                ("to", "subject", "body"),
                to=STRINGS,
                subject=STRING,
                body=STRING,
                htmlBody=STRING,
                mimeType={"type": "string", "enum": ["text/plain", "text/html", "multipart/alternative"]},
                cc=STRINGS,
                bcc=STRINGS,
                threadId=STRING,
                inReplyTo=STRING,
                attachments=STRINGS,
            ),
            lambda sent_id: _text(f"Email sent successfully with ID: {sent_id}"),
            lambda reason: _text(f"Error: {reason}"),
        ),
        FakeTool("search_emails", _object(("query",), query=STRING), _sent_by("search_emails"), sends=False),
    ),
    lambda mailbox, message: (
        "send_email",
        {
            "to": ["bea@example.org"],
            "subject": "Re: Where is my order?",
            "body": "It ships today.",
            "threadId": "thread-1",
            "inReplyTo": message,
        },
    ),
    mailbox="support@example.com",
    new_mail=("send_email", {"to": ["cy@example.org"], "subject": "Hello", "body": "New mail."}),
)

# taylorwilsdon/google_workspace_mcp: send_gmail_message, the account in user_google_email.
GOOGLE_WORKSPACE = FakeServer(
    "google-workspace",
    (
        FakeTool(
            "send_gmail_message",
            _object(
                ("user_google_email", "to", "subject", "body"),
                user_google_email=STRING,
                to=STRING,
                subject=STRING,
                body=STRING,
                body_format={"type": "string", "enum": ["plain", "html"]},
                cc=STRING,
                bcc=STRING,
                thread_id=STRING,
                in_reply_to=STRING,
                references=STRING,
            ),
            # FastMCP wraps the tool's str in structured content too, as its recorded output schema says.
            lambda sent_id: _wrapped(f"Email sent! Message ID: {sent_id}"),
        ),
    ),
    lambda mailbox, message: (
        "send_gmail_message",
        {
            "user_google_email": mailbox,
            "to": "bea@example.org",
            "subject": "Re: Where is my order?",
            "body": "It ships today.",
            "in_reply_to": message,
        },
    ),
    new_mail=(
        "send_gmail_message",
        {"user_google_email": "me@example.com", "to": "cy@example.org", "subject": "Hello", "body": "New mail."},
    ),
)

# resend-mcp 2.22.0: no inbox tools; a reply is send-email with the In-Reply-To header (its dist/tools/emails.js
# answers 'Email sent successfully! {"id": ...}' and throws, a tool error, on a refusal).
_RESEND_SENT: Answer = lambda sent_id: _text(f'Email sent successfully! {{"id":"{sent_id}"}}')  # noqa: E731
RESEND = FakeServer(
    "resend",
    (
        FakeTool(
            "send-email",
            _object(("to", "subject", "text", "from"), to=STRINGS, subject=STRING, text=STRING, headers=OBJECT),
            _RESEND_SENT,
            lambda reason: _text(f"Email failed to send: {reason}", error=True),
        ),
        FakeTool("send-batch-emails", _object(("emails",), emails=OBJECTS), _RESEND_SENT),
        FakeTool("send-broadcast", _object(("broadcastId",), broadcastId=STRING), _RESEND_SENT),
    ),
    lambda mailbox, message: (
        "send-email",
        {
            "from": "Support <support@shop.example>",
            "to": ["bea@example.org"],
            "subject": "Re: Where is my order?",
            "text": "It ships today.",
            "headers": {"In-Reply-To": message},
        },
    ),
    mailbox="support@shop.example",
    new_mail=("send-email", {"from": "support@shop.example", "to": ["cy@example.org"], "subject": "Hi", "text": "Hi"}),
    unfenced=(
        ("send-batch-emails", {"emails": [{"to": ["bea@example.org"], "subject": "Hi", "text": "Hi"}]}),
        ("send-broadcast", {"broadcastId": "b-1"}),
    ),
)

# codefuturist/email-mcp: IMAP and SMTP; the account names the mailbox, emailId the message.
EMAIL_MCP = FakeServer(
    "email-mcp",
    (
        FakeTool(
            "reply_email",
            _object(
                ("account", "emailId", "body"),
                account=STRING,
                emailId=STRING,
                mailbox=STRING,
                body=STRING,
                replyAll=BOOLEAN,
                html=BOOLEAN,
            ),
            lambda sent_id: _text(f"Reply sent successfully!\nMessage-ID: {sent_id}"),
            lambda reason: _text(f"Failed to reply: {reason}", error=True),
        ),
        FakeTool(
            "send_email",
            _object(("account", "to", "subject", "body"), account=STRING, to=STRINGS, subject=STRING, body=STRING),
            _sent_by("send_email"),
        ),
        FakeTool(
            "forward_email",
            _object(("account", "emailId", "to"), account=STRING, emailId=STRING, to=STRINGS, body=STRING),
            _sent_by("forward_email"),
        ),
        FakeTool(
            "send_draft", _object(("account", "id"), account=STRING, id={"type": "integer"}), _sent_by("send_draft")
        ),
        FakeTool(
            "schedule_email",
            _object(
                ("account", "to", "subject", "body", "send_at"),
                account=STRING,
                to=STRINGS,
                subject=STRING,
                body=STRING,
                send_at=STRING,
            ),
            _sent_by("schedule_email"),
        ),
    ),
    lambda mailbox, message: ("reply_email", {"account": mailbox, "emailId": message, "body": "It ships today."}),
    unfenced=(
        ("send_email", {"account": "work", "to": ["bea@example.org"], "subject": "Hi", "body": "Hi"}),
        ("forward_email", {"account": "work", "emailId": "7", "to": ["ops@example.org"]}),
        ("send_draft", {"account": "work", "id": 3}),
        ("schedule_email", {"account": "work", "to": ["a@example.org"], "subject": "s", "body": "b", "send_at": "x"}),
    ),
)

FAKES: dict[str, FakeServer] = {
    fake.preset: fake for fake in (AGENTMAIL, NYLAS, GMAIL, GOOGLE_WORKSPACE, RESEND, EMAIL_MCP)
}


def main() -> None:
    parser = argparse.ArgumentParser(description="A preset's fake email MCP server over stdio, recording its sends.")
    parser.add_argument("preset", choices=sorted(FAKES))
    parser.add_argument("--outbox", required=True, type=Path, help="a file to append every send to")
    options = parser.parse_args()
    server = Recorder().server(FAKES[options.preset], outbox=options.outbox)

    async def serve() -> None:
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())

    anyio.run(serve)


if __name__ == "__main__":
    main()
