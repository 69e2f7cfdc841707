"""A fake email MCP server for the guard's tests: tools that read mail, and a send tool that counts its sends.

In memory (``fake_email_server(outbox)``) or as a process over stdio or streamable HTTP (``python -m
tests.mcp.fake_email --outbox FILE [--http PORT]``, every send one JSON line of FILE, so that a test can count the
sends of processes it does not own). It also has a prompt, resources and completions, for the guard to pass
through, and ``export_mailbox``, which answers as many MiB as asked. The outbox's ``mode`` says how
``send_message`` answers: ``send`` (sent), ``fail`` (a tool error: nothing went out), ``hang`` (the send is
recorded, then no answer ever comes), ``slow`` (the send is recorded, and answered 3 s later), ``huge`` (the send
is recorded, and answered with 64 MiB). In a process, the
mode is read from ``FILE.mode`` at each call, and a process started while ``FILE.tools`` says ``no-send`` lists
no ``send_message`` (a server that changed under the guard).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from pathlib import Path
from typing import TypedDict

from mcp.server import MCPServer
from mcp.types import Completion, CompletionArgument, ToolAnnotations

SEND_TOOL = "send_message"
SEND_TOOL_SPEC = f"{SEND_TOOL},message=reply_to_message_id,mailbox=grant_id,thread=thread_id"


def a_reply(grant_id: str, message_id: str, body: str = "It ships today.") -> dict[str, object]:
    """The arguments of a ``send_message`` call that replies to ``message_id``."""
    return {
        "grant_id": grant_id,
        "to": ["bea@example.org"],
        "subject": "Re: Where is my order?",
        "body": body,
        "reply_to_message_id": message_id,
    }


class Sent(TypedDict):
    id: str
    thread_id: str


class Outbox:
    """Every send the fake made, in memory and, with ``path``, one JSON line each in that file."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.mode = "send"
        self._sent: list[dict[str, object]] = []
        self._lock = threading.Lock()

    def current_mode(self) -> str:
        if self.path is not None and self.path.with_suffix(".mode").exists():
            return self.path.with_suffix(".mode").read_text().strip()
        return self.mode

    def record(self, send: dict[str, object]) -> str:
        with self._lock:
            sent_id = f"sent-{len(self.sends) + 1}"
            self._sent.append({**send, "id": sent_id})
            if self.path is not None:
                with self.path.open("a", encoding="utf-8") as file:
                    file.write(json.dumps({**send, "id": sent_id}) + "\n")
            return sent_id

    @property
    def sends(self) -> list[dict[str, object]]:
        """Every send, also those of other processes on the same file."""
        if self.path is not None:
            if not self.path.exists():
                return []
            return [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines()]
        return list(self._sent)

    def sends_for(self, message_id: str) -> list[dict[str, object]]:
        return [send for send in self.sends if send.get("reply_to_message_id") == message_id]


INBOX = {
    "msg-1": {"from": "bea@example.org", "subject": "Where is my order?", "body": "Order 42 has not arrived."},
    "msg-2": {"from": "cy@example.org", "subject": "Refund", "body": "Please refund order 7."},
}


HUGE_MIB = 64


def fake_email_server(outbox: Outbox, *, send: bool = True) -> MCPServer:
    """Tools (three that read, one that sends unless ``send`` is False), a prompt, a resource, a resource template
    and completions."""
    server = MCPServer("fake-email", instructions="A fake mailbox for tests.")

    @server.prompt(description="Draft a reply to one message, in the mailbox's tone.")
    def draft_reply(message_id: str, tone: str = "friendly") -> str:
        message = INBOX.get(message_id, {"subject": "?", "body": "?"})
        return f"Write a {tone} reply to: {message['subject']}\n\n{message['body']}"

    @server.resource("mail://signature", mime_type="text/plain", description="The mailbox's signature.")
    def signature() -> str:
        return "-- \nThe support team"

    @server.resource("mail://messages/{message_id}", mime_type="text/plain")
    def message_text(message_id: str) -> str:
        message = INBOX.get(message_id)
        if message is None:
            raise ValueError(f"no message {message_id!r}")
        return message["body"]

    @server.completion()  # type: ignore[untyped-decorator,no-untyped-call]  # the SDK's decorator is untyped
    async def complete(ref: object, argument: CompletionArgument, context: object) -> Completion:
        return Completion(values=[key for key in INBOX if key.startswith(argument.value)])

    @server.tool(annotations=ToolAnnotations(read_only_hint=True, open_world_hint=False))
    def list_messages(grant_id: str, limit: int = 10) -> list[dict[str, str]]:
        """The latest messages of the mailbox."""
        return [{"id": key, **value} for key, value in list(INBOX.items())[:limit]]

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def get_message(grant_id: str, message_id: str) -> str:
        """One message, as text."""
        message = INBOX.get(message_id)
        if message is None:
            raise ValueError(f"no message {message_id!r} in {grant_id}")
        return f"From: {message['from']}\nSubject: {message['subject']}\n\n{message['body']}"

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def export_mailbox(grant_id: str, megabytes: int) -> str:
        """The whole mailbox as text (``megabytes`` of it)."""
        return "x" * (megabytes << 20)

    if not send:
        return server

    @server.tool(annotations=ToolAnnotations(destructive_hint=False, open_world_hint=True))
    async def send_message(
        grant_id: str,
        to: list[str],
        subject: str,
        body: str,
        reply_to_message_id: str | None = None,
        thread_id: str | None = None,
    ) -> Sent:
        """Send an email (a reply when reply_to_message_id is given)."""
        mode = outbox.current_mode()
        if mode == "fail":
            raise ValueError("the provider refused the recipient: mailbox unavailable")
        sent_id = outbox.record(
            {
                "grant_id": grant_id,
                "to": to,
                "subject": subject,
                "body": body,
                "reply_to_message_id": reply_to_message_id,
            }
        )
        if mode == "hang":
            await asyncio.Event().wait()
        if mode == "slow":
            await asyncio.sleep(3)
        if mode == "huge":
            return {"id": sent_id, "thread_id": "x" * (HUGE_MIB << 20)}
        return {"id": sent_id, "thread_id": thread_id or f"thread-{sent_id}"}

    return server


def main() -> None:
    parser = argparse.ArgumentParser(description="A fake email MCP server that records its sends.")
    parser.add_argument("--outbox", required=True, type=Path, help="a file to append every send to")
    parser.add_argument("--http", type=int, default=None, metavar="PORT", help="serve /mcp on 127.0.0.1:PORT")
    options = parser.parse_args()
    tools = options.outbox.with_suffix(".tools")
    send = not (tools.exists() and tools.read_text().strip() == "no-send")
    server = fake_email_server(Outbox(options.outbox), send=send)
    if options.http is None:
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=options.http)


if __name__ == "__main__":
    main()
