"""The guard: an email MCP server's tools, re-exposed unchanged, with its send tools fenced by the coordinator.

``tools/list`` and every call of a tool that does not send are forwarded as they are and answered with the
upstream's own result, untouched (the raw JSON, not a re-parsed copy). A call of a configured send tool (a
``SendTool``: its name, and where in its arguments the mailbox and the replied-to message are) goes through the
agent session's guarded send: claim unless held, BeginSend (fenced), the upstream call, then ConfirmSent; an
upstream tool error (or a JSON-RPC refusal of the request itself) proves nothing went out, so the send is
aborted and the upstream's answer returned; anything else (the connection broke mid-call) leaves the outcome
unknown: IN_DOUBT, said plainly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import mcp_types as types
from mcp import Client
from mcp.server import Server, ServerRequestContext
from mcp.shared.exceptions import MCPError
from pydantic import BaseModel, ConfigDict

from .._async import AsyncClaim
from .._errors import CoordinatorError, SendRejected
from .._types import Subject
from ._answers import Answer, Outcome
from ._session import AgentSession, fingerprint
from ._tools import Scope, SessionFor, coordinator_error, tool_error


class _Raw(BaseModel):
    """A result exactly as the upstream sent it: every field kept as it came (no field of ours to fill)."""

    model_config = ConfigDict(extra="allow")

    def document(self) -> dict[str, Any]:
        return dict(self.__pydantic_extra__ or {})


# JSON-RPC errors that refuse the request itself, before any tool code ran: nothing was sent.
log = logging.getLogger("inbox_claims.mcp")

_REFUSED_BEFORE_RUNNING = frozenset({types.INVALID_PARAMS, types.METHOD_NOT_FOUND, types.INVALID_REQUEST})

DEFAULT_SENT_ID_PATHS = ("id", "message_id", "messageId", "data.id")


class PathError(ValueError):
    """An argument path that does not lead to a usable value."""


def _find(document: Any, path: str) -> Any:
    """The value at a dotted path (``reply.in_reply_to``, ``recipients.0``), or ``None`` when absent."""
    value = document
    for part in path.split("."):
        if isinstance(value, Mapping):
            value = value.get(part)
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


@dataclasses.dataclass(frozen=True)
class SendTool:
    """One upstream tool that sends mail, and where its arguments say which message it answers."""

    name: str
    message: str
    """The path of the replied-to message's id in the arguments (``messageId``, ``reply.in_reply_to``)."""
    mailbox: str | None = None
    """The path of the mailbox in the arguments; ``None`` when the server sends from one mailbox only (then the
    guard's ``--mailbox`` names it)."""
    thread: str | None = None
    """The path of the thread id, for a guard that claims whole conversations (``--scope thread``)."""
    sent_id: tuple[str, ...] = DEFAULT_SENT_ID_PATHS
    """Where the sent message's id may be in the tool's structured result."""

    @classmethod
    def parse(cls, spec: str) -> SendTool:
        """``NAME,message=PATH[,mailbox=PATH][,thread=PATH][,sent_id=PATH]`` (the ``--send-tool`` option)."""
        name, *pairs = (part.strip() for part in spec.split(","))
        if not name or "=" in name:
            raise ValueError(f"--send-tool {spec!r}: start with the tool's name, e.g. 'send_email,message=replyTo'")
        fields: dict[str, str] = {}
        for pair in pairs:
            key, _, value = pair.partition("=")
            if key not in ("message", "mailbox", "thread", "sent_id") or not value:
                raise ValueError(
                    f"--send-tool {spec!r}: {pair!r} is not message=PATH, mailbox=PATH, thread=PATH or sent_id=PATH"
                )
            fields[key] = value
        if "message" not in fields:
            raise ValueError(f"--send-tool {spec!r}: say where the replied-to message id is: message=PATH")
        sent_id = (fields.pop("sent_id"),) if "sent_id" in fields else DEFAULT_SENT_ID_PATHS
        return cls(name, sent_id=sent_id, **fields)

    def subject(self, arguments: Mapping[str, Any], *, mailbox: str | None, scope: Scope) -> Subject:
        """The message (or thread) a call answers; raises ``PathError`` naming the argument that is wrong."""
        chosen = self._text(arguments, self.mailbox, "the mailbox") if self.mailbox else mailbox
        if not chosen:
            raise PathError(
                f"the guard does not know which mailbox {self.name} sends from: start it with --mailbox, or give "
                "the tool's mailbox argument in --send-tool (mailbox=PATH)"
            )
        if scope == "thread":
            if not self.thread:
                raise PathError(f"the guard claims threads, but {self.name} has no thread=PATH in --send-tool")
            return Subject.thread(chosen, self._text(arguments, self.thread, "the thread id"))
        return Subject.message(chosen, self._text(arguments, self.message, "the id of the message replied to"))

    @staticmethod
    def _text(arguments: Mapping[str, Any], path: str, what: str) -> str:
        value = _find(arguments, path)
        if not isinstance(value, str) or not value.strip():
            found = "missing" if value is None else f"not a non-empty string ({value!r})"
            raise PathError(f"{path}: {found}; it must be {what}. Nothing was sent.")
        return value

    def sent_message_id(self, result: Mapping[str, Any]) -> str | None:
        structured = result.get("structuredContent")
        for path in self.sent_id:
            value = _find(structured, path)
            if isinstance(value, str) and value:
                return value
        return None


class Upstream:
    """The email MCP server behind the guard, through the SDK's client: raw requests and raw results.

    The connection lives in a task of its own, so that an upstream that dies (a crashed stdio server, a dropped
    HTTP connection) fails the calls in flight, not the guard: the next call connects again.
    ``async with Upstream(lambda: Client(target)) as upstream:``.
    """

    def __init__(self, connect: Callable[[], Client]) -> None:
        self._connect = connect
        self._client: Client | None = None
        self._stop = asyncio.Event()
        self._owner: asyncio.Task[None] | None = None
        self._opening = asyncio.Lock()

    @property
    def instructions(self) -> str | None:
        return self._client.instructions if self._client is not None else None

    async def __aenter__(self) -> Upstream:
        await self._live()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._owner is not None:
            await asyncio.wait([self._owner])

    async def _live(self) -> Client:
        async with self._opening:
            if self._client is None:
                ready = asyncio.Event()
                self._owner = asyncio.create_task(self._own(ready), name="inbox-claims upstream")
                await ready.wait()
            if self._client is None:
                raise MCPError(code=types.INTERNAL_ERROR, message="the email MCP server behind the guard is not there")
            return self._client

    async def _own(self, ready: asyncio.Event) -> None:
        try:
            async with self._connect() as client:
                self._client = client
                ready.set()
                await self._stop.wait()
        except Exception as error:  # the upstream went away; the next call connects again
            log.warning("the connection to the email MCP server ended: %s", error)
        finally:
            self._client = None
            ready.set()

    async def list_tools(self, params: types.PaginatedRequestParams | None) -> dict[str, Any]:
        client = await self._live()
        return (await client.session.send_request(types.ListToolsRequest(params=params), _Raw)).document()

    async def call_tool(self, params: types.CallToolRequestParams) -> dict[str, Any]:
        client = await self._live()
        return (await client.session.send_request(types.CallToolRequest(params=params), _Raw)).document()


def _text_of(result: Mapping[str, Any]) -> str:
    texts = [block.get("text", "") for block in result.get("content") or () if isinstance(block, Mapping)]
    return " ".join(text for text in texts if isinstance(text, str)).strip()


class _UpstreamRefused(SendRejected):
    """The upstream answered the send with a tool error or refused the request: nothing went out."""

    def __init__(self, reason: str, *, result: dict[str, Any] | None = None, error: MCPError | None = None) -> None:
        super().__init__(reason)
        self.result = result
        self.error = error


class Guard:
    """The guard's handlers: pass-through for every tool, the guarded send for the send tools."""

    def __init__(
        self,
        upstream: Upstream,
        send_tools: Sequence[SendTool],
        session_for: SessionFor,
        *,
        mailbox: str | None = None,
        scope: Scope = "message",
    ) -> None:
        self._upstream = upstream
        self._send_tools = {tool.name: tool for tool in send_tools}
        self._session_for = session_for
        self._mailbox = mailbox
        self._scope = scope
        # The upstream's result of each send made through this guard process, by (subject, arguments): a
        # repeat gets it again, byte for byte.
        self._results: dict[tuple[Subject, str], dict[str, Any]] = {}

    async def list_tools(
        self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams
    ) -> dict[str, Any]:
        # Only what the request asks; the downstream client's _meta envelope is not the upstream connection's.
        cursor = params.cursor
        return await self._upstream.list_tools(None if cursor is None else types.PaginatedRequestParams(cursor=cursor))

    async def call_tool(self, ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams) -> Any:
        tool = self._send_tools.get(params.name)
        params = types.CallToolRequestParams(name=params.name, arguments=params.arguments)
        if tool is None:
            return await self._upstream.call_tool(params)
        arguments = params.arguments or {}
        try:
            subject = tool.subject(arguments, mailbox=self._mailbox, scope=self._scope)
        except PathError as wrong:
            return tool_error(f"Invalid arguments for {tool.name}: {wrong}")
        session = await self._session_for(ctx)
        try:
            return await self._send(session, tool, subject, params)
        except CoordinatorError as error:
            return coordinator_error(error)

    async def _send(
        self, session: AgentSession, tool: SendTool, subject: Subject, params: types.CallToolRequestParams
    ) -> Any:
        key = (subject, fingerprint(params.arguments or {}))
        refused: list[_UpstreamRefused] = []

        async def deliver(claim: AsyncClaim) -> str | None:
            try:
                result = await self._upstream.call_tool(params)
            except MCPError as error:
                if error.code in _REFUSED_BEFORE_RUNNING:
                    refusal = _UpstreamRefused(f"{tool.name} refused the request: {error.error.message}", error=error)
                    refused.append(refusal)
                    raise refusal from error
                raise
            if result.get("isError"):
                refusal = _UpstreamRefused(f"{tool.name} answered an error: {_text_of(result)[:500]}", result=result)
                refused.append(refusal)
                raise refusal
            self._results[key] = result
            return tool.sent_message_id(result)

        answer = await session.send(subject, key[1], deliver)
        if answer.outcome is Outcome.SENT:
            # Sent by this process: the upstream's own result. Otherwise (the reply record of an earlier process)
            # a tool error that says it was sent: the upstream tool's output schema is not ours to fill.
            return self._results.get(key) or _said(answer, is_error=True)
        if answer.outcome is Outcome.NOT_SENT and refused:
            if refused[-1].error is not None:
                raise refused[-1].error  # the upstream's own JSON-RPC error, as it sent it
            return refused[-1].result
        return _said(answer, is_error=True)


def _said(answer: Answer, *, is_error: bool) -> types.CallToolResult:
    """Our answer as the tool's result: text only (the upstream tool's output schema is not ours to fill)."""
    return types.CallToolResult(content=[types.TextContent(type="text", text=answer.message)], is_error=is_error)


def build_guard(
    upstream: Upstream,
    send_tools: Sequence[SendTool],
    session_for: SessionFor,
    *,
    mailbox: str | None = None,
    scope: Scope = "message",
    name: str = "inbox-claims-guard",
    instructions: str | None = None,
) -> Server[Any]:
    """The guard as an MCP server over ``upstream`` (connected already)."""
    guard = Guard(upstream, send_tools, session_for, mailbox=mailbox, scope=scope)
    server: Server[Any] = Server(name, title="Inbox claims guard", instructions=instructions)
    server.add_request_handler("tools/list", types.PaginatedRequestParams, guard.list_tools)
    server.add_request_handler("tools/call", types.CallToolRequestParams, guard.call_tool)
    return server
