"""The guard: an email MCP server's tools, prompts and resources, re-exposed unchanged, with its sends fenced.

``tools/list``, every call of a tool that does not send, and the upstream's prompts, resources and completions
(when it has them) are forwarded as they are and answered with the upstream's own result, untouched (the raw
JSON, not a re-parsed copy). A call of a configured send tool (a ``SendTool``: its name, and where in its
arguments the mailbox and the replied-to message are) goes through the agent session's guarded send: claim
unless held, BeginSend (fenced), the upstream call, then ConfirmSent; an upstream tool error (or a JSON-RPC
refusal of the request itself) proves nothing went out, so the send is aborted and the upstream's answer
returned; anything else (the connection broke mid-call) leaves the outcome unknown: IN_DOUBT, said plainly.

A send passes its commit point only towards an upstream that answers: ``Upstream.reachable()`` first (a new
connection if the last one broke), and a send that then never reached the upstream is aborted (the message
free, the model told to try again); only a send handed over and then lost (no answer, a broken connection, an
answer too large to read) is IN_DOUBT.

A tool that sends mail naming no message it answers (a plain "send email", a forward, a draft sent by its id)
cannot be fenced per message: the guard refuses its calls, and a send tool's call that names no replied-to
message, unless it was started to let such mail through unfenced (``allow_unfenced``).

The guard works only with an upstream that lists every tool it was told fences replies (``check_tools``): it
does not start otherwise, and it passes nothing to an upstream whose later tool list lost one.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import mcp_types as types
from mcp.server import Server, ServerRequestContext
from mcp.server.caching import CacheHint
from mcp.shared.exceptions import MCPError
from mcp_types.methods import CacheableMethod

from .._async import AsyncClaim
from .._current import agent_headers
from .._errors import CoordinatorError, SendRejected
from .._types import Subject
from ._answers import Answer, Outcome
from ._session import AgentSession, NotHandedOver, fingerprint
from ._sessions import SessionCapReached, SessionFor
from ._tools import Scope, coordinator_error, tool_error
from ._upstream import Check, Upstream, UpstreamFailed

log = logging.getLogger("inbox_claims.mcp")

# JSON-RPC errors that refuse the request itself, before any tool code ran: nothing was sent.
_REFUSED_BEFORE_RUNNING = frozenset({types.INVALID_PARAMS, types.METHOD_NOT_FOUND, types.INVALID_REQUEST})

DEFAULT_SENT_ID_PATHS = ("id", "message_id", "messageId", "data.id")

# What the guard forwards besides tools, by the upstream capability that offers it: the request to send, and
# the parameters it takes.
_PASSED_THROUGH: dict[str, tuple[str, Callable[..., types.Request[Any, Any]], type[types.RequestParams]]] = {
    "prompts/list": ("prompts", types.ListPromptsRequest, types.PaginatedRequestParams),
    "prompts/get": ("prompts", types.GetPromptRequest, types.GetPromptRequestParams),
    "resources/list": ("resources", types.ListResourcesRequest, types.PaginatedRequestParams),
    "resources/templates/list": ("resources", types.ListResourceTemplatesRequest, types.PaginatedRequestParams),
    "resources/read": ("resources", types.ReadResourceRequest, types.ReadResourceRequestParams),
    "completion/complete": ("completions", types.CompleteRequest, types.CompleteRequestParams),
}


_CACHEABLE: tuple[CacheableMethod, ...] = (
    "tools/list",
    "prompts/list",
    "resources/list",
    "resources/templates/list",
    "resources/read",
)


class PathError(ValueError):
    """An argument path that does not lead to a usable value."""


def _find(document: Any, path: str) -> Any:
    """The value at a dotted path (``reply.in_reply_to``, ``recipients.0``), or ``None`` when absent. A key the
    document lacks is matched without case when exactly one key is so (``headers.In-Reply-To`` finds a header
    written ``in-reply-to``: header names have no case, and a reply must not pass as new mail for it)."""
    value = document
    for part in path.split("."):
        if isinstance(value, Mapping):
            if part not in value:
                folded = [key for key in value if isinstance(key, str) and key.casefold() == part.casefold()]
                part = folded[0] if len(folded) == 1 else part
            value = value.get(part)
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


def _text_of(result: Mapping[str, Any]) -> str:
    texts = [block.get("text", "") for block in result.get("content") or () if isinstance(block, Mapping)]
    return " ".join(text for text in texts if isinstance(text, str)).strip()


_SPEC_KEYS = ("message", "mailbox", "thread", "headers", "sent_id", "sent_id_text", "error_text")


@dataclasses.dataclass(frozen=True)
class SendTool:
    """One upstream tool that sends mail, and where its arguments say which message it answers."""

    name: str
    message: str
    """The path of the replied-to message's id in the arguments (``messageId``, ``reply.in_reply_to``)."""
    mailbox: str | None = None
    """The path of the mailbox in the arguments; ``None`` when the server sends from one mailbox only (then the
    guard's ``--mailbox`` names it, as it does when a call leaves the argument out)."""
    thread: str | None = None
    """The path of the thread id, for a guard that claims whole conversations (``--scope thread``)."""
    headers: str | None = None
    """The path of the reply's headers (an object of name: value) when the tool takes them: the guard adds an
    agent's ``Auto-Submitted: auto-replied`` there (RFC 3834), so that auto-responders do not answer the reply."""
    sent_id: tuple[str, ...] = DEFAULT_SENT_ID_PATHS
    """Where the sent message's id may be in the tool's structured result."""
    sent_id_text: str | None = None
    """A regular expression whose first group is the sent message's id in the result's text, for servers that
    answer in text only (``Message ID: (\\S+)``)."""
    error_text: str | None = None
    """How the result's text starts when the send failed, for servers that report a failure as a plain result
    instead of a tool error (``Error: ``)."""
    origin: str = dataclasses.field(default="--send-tool", compare=False)
    """What named it (``--send-tool``, ``--preset resend``), for the guard's refusals."""

    @classmethod
    def parse(cls, spec: str) -> SendTool:
        """``NAME,message=PATH[,mailbox=PATH][,thread=PATH][,sent_id=PATH][,sent_id_text=RE][,error_text=TEXT]``
        (the ``--send-tool`` option)."""
        name, *pairs = (part.strip() for part in spec.split(","))
        if not name or "=" in name:
            raise ValueError(f"--send-tool {spec!r}: start with the tool's name, e.g. 'send_email,message=replyTo'")
        fields: dict[str, str] = {}
        for pair in pairs:
            key, _, value = pair.partition("=")
            if key not in _SPEC_KEYS or not value:
                raise ValueError(
                    f"--send-tool {spec!r}: {pair!r} is not one of " + ", ".join(f"{known}=..." for known in _SPEC_KEYS)
                )
            fields[key] = value
        if "message" not in fields:
            raise ValueError(f"--send-tool {spec!r}: say where the replied-to message id is: message=PATH")
        if "sent_id_text" in fields:
            try:
                if re.compile(fields["sent_id_text"]).groups < 1:
                    raise ValueError("it has no group")
            except (re.error, ValueError) as wrong:
                raise ValueError(
                    f"--send-tool {spec!r}: sent_id_text must be a regular expression whose first group is the "
                    f"sent message's id ({wrong})"
                ) from None
        sent_id = (fields.pop("sent_id"),) if "sent_id" in fields else DEFAULT_SENT_ID_PATHS
        return cls(name, sent_id=sent_id, **fields)

    def marked(self, params: types.CallToolRequestParams) -> types.CallToolRequestParams:
        """The call as forwarded: with ``Auto-Submitted: auto-replied`` among its headers when the tool takes them
        (kept as the agent wrote it if it set that header itself)."""
        if self.headers is None:
            return params
        arguments = copy.deepcopy(dict(params.arguments or {}))
        *parents, last = self.headers.split(".")
        place: Any = arguments
        for part in parents:
            place = place.setdefault(part, {}) if isinstance(place, dict) else None
        if not isinstance(place, dict):
            return params
        given = place.get(last)
        headers = dict(given) if isinstance(given, Mapping) else {}
        names = {str(name).lower() for name in headers}
        for name, value in agent_headers():
            if name.lower() not in names:
                headers[name] = value
        place[last] = headers
        return params.model_copy(update={"arguments": arguments})

    def replied_to_path(self, scope: Scope) -> str | None:
        return self.thread if scope == "thread" else self.message

    def names_a_message(self, arguments: Mapping[str, Any], *, scope: Scope) -> bool:
        """Whether this call says which message (or thread) it answers; one that does not sends new mail."""
        path = self.replied_to_path(scope)
        return path is not None and _find(arguments, path) is not None

    def subject(self, arguments: Mapping[str, Any], *, mailbox: str | None, scope: Scope) -> Subject:
        """The message (or thread) a call answers; raises ``PathError`` naming the argument that is wrong."""
        given = _find(arguments, self.mailbox) if self.mailbox else None
        chosen = self._text(arguments, self.mailbox, "the mailbox") if self.mailbox and given is not None else mailbox
        if not chosen:
            where = f"its {self.mailbox} argument is missing" if self.mailbox else "it takes no mailbox argument"
            raise PathError(
                f"the guard does not know which mailbox {self.name} sends from ({where}): start the guard with "
                "--mailbox, or give the tool's mailbox argument in --send-tool (mailbox=PATH). Nothing was sent."
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

    def failed(self, result: Mapping[str, Any]) -> bool:
        """The upstream said the send failed: a tool error, or the text this server starts its failures with."""
        if result.get("isError"):
            return True
        return self.error_text is not None and _text_of(result).startswith(self.error_text)

    def sent_message_id(self, result: Mapping[str, Any]) -> str | None:
        structured = result.get("structuredContent")
        for path in self.sent_id:
            value = _find(structured, path)
            if isinstance(value, str) and value:
                return value
        if self.sent_id_text is not None:
            found = re.search(self.sent_id_text, _text_of(result))
            if found is not None and found.group(1):
                return found.group(1)
        return None


def schema_has(schema: Any, path: str) -> bool:
    """Whether an input schema declares ``path``, as deep as it declares anything (an object without declared
    properties, or one that takes any further key, takes any path)."""
    for part in path.split("."):
        if not isinstance(schema, Mapping):
            return False
        properties = schema.get("properties")
        if not isinstance(properties, Mapping):
            return schema.get("type") == "object" or "additionalProperties" in schema
        if part not in properties:
            open_ended = schema.get("additionalProperties")
            if open_ended not in (None, False):
                schema = open_ended if isinstance(open_ended, Mapping) else {}
                continue
            return False
        schema = properties[part]
    return True


def _closest(name: str, names: Iterable[str]) -> str:
    found = difflib.get_close_matches(name, list(names), n=1, cutoff=0.3)
    return f"the closest is {found[0]}" if found else "none is close"


def _listing(names: Sequence[str]) -> str:
    return ", ".join(names) if names else "no tools at all"


def check_tools(send_tools: Sequence[SendTool], unfenced: Sequence[str] = (), *, scope: Scope = "message") -> Check:
    """The check of an upstream's tool list (``Upstream(check=...)``): every send tool listed, with the arguments
    its spec names; every tool named with ``--unfenced-tool`` listed. A preset's unfenced tools need not all be
    there (a preset covers the versions it names). Answers why the guard cannot work with the list, or None."""

    def check(tools: list[dict[str, Any]]) -> str | None:
        listed = {str(tool.get("name")): tool for tool in tools}
        names = sorted(listed)
        problems = []
        for tool in send_tools:
            found = listed.get(tool.name)
            if found is None:
                problems.append(
                    f"it lists no tool {tool.name}, which {tool.origin} names as the tool that sends replies "
                    f"({_closest(tool.name, names)}; it lists {_listing(names)})"
                )
                continue
            schema = found.get("inputSchema") or {}
            replied_to = ("thread" if scope == "thread" else "message", tool.replied_to_path(scope))
            for what, path in (("mailbox", tool.mailbox), replied_to, ("headers", tool.headers)):
                if path is not None and not schema_has(schema, path):
                    declared = sorted((schema.get("properties") or {}) if isinstance(schema, Mapping) else ())
                    problems.append(
                        f"{tool.name} takes no argument {path} ({tool.origin}: {what}={path}); its arguments are "
                        f"{_listing(declared)}"
                    )
        for name in unfenced:
            if name not in listed:
                problems.append(f"it lists no tool {name} (--unfenced-tool {name}; {_closest(name, names)})")
        return "; ".join(problems) or None

    return check


def _own_params(params: types.RequestParams) -> Any:
    """The request's parameters without the downstream client's ``_meta`` envelope, which belongs to that
    connection (its progress token, its protocol version), not to the guard's connection upstream."""
    return type(params).model_validate(params.model_dump(by_alias=True, exclude_none=True, exclude={"meta"}))


def _unanswered(failure: UpstreamFailed) -> MCPError:
    """A request the upstream did not answer, as the JSON-RPC error its client gets."""
    if failure.handed_over:
        after = " It got the request and may have acted on it."
    else:
        after = " Nothing was passed to it: try again in a moment."
    return MCPError(
        code=types.INTERNAL_ERROR, message=f"The email MCP server behind the guard: {failure.reason}.{after}"
    )


class _UpstreamRefused(SendRejected):
    """The upstream answered the send with a tool error or refused the request: nothing went out."""

    def __init__(self, reason: str, *, result: dict[str, Any] | None = None, error: MCPError | None = None) -> None:
        super().__init__(reason)
        self.result = result
        self.error = error


class Guard:
    """The guard's handlers: pass-through for everything, the guarded send for the send tools."""

    def __init__(
        self,
        upstream: Upstream,
        send_tools: Sequence[SendTool],
        session_for: SessionFor,
        *,
        mailbox: str | None = None,
        scope: Scope = "message",
        unfenced: Sequence[str] = (),
        allow_unfenced: bool = False,
    ) -> None:
        self._upstream = upstream
        self._send_tools = {tool.name: tool for tool in send_tools}
        self._session_for = session_for
        self._mailbox = mailbox
        self._scope = scope
        self._unfenced = frozenset(unfenced) - self._send_tools.keys()
        self._allow_unfenced = allow_unfenced
        # The upstream's result of each send made through this guard process, by (subject, arguments): a
        # repeat gets it again, byte for byte.
        self._results: dict[tuple[Subject, str], dict[str, Any]] = {}

    def forwarder(self, method: str) -> Callable[[ServerRequestContext[Any, Any], types.RequestParams], Any]:
        """The handler that forwards ``method`` (one of ``_PASSED_THROUGH``) upstream, answered as it came."""
        _, request_type, _ = _PASSED_THROUGH[method]

        async def forward(ctx: ServerRequestContext[Any, Any], params: types.RequestParams) -> dict[str, Any]:
            try:
                return await self._upstream.request(request_type(params=_own_params(params)))
            except UpstreamFailed as failure:
                raise _unanswered(failure) from None

        return forward

    async def list_tools(
        self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams
    ) -> dict[str, Any]:
        own = _own_params(params)
        try:
            listed = await self._upstream.list_tools(own)
        except UpstreamFailed as failure:
            raise _unanswered(failure) from None
        whole = not (own.cursor if own is not None else None) and not listed.get("nextCursor")
        names = {tool.get("name") for tool in listed.get("tools") or () if isinstance(tool, Mapping)}
        lost = sorted(name for name in self._send_tools if name not in names)
        if whole and lost:
            # The upstream changed under the guard (a new version, a restart): its replies would go unfenced.
            why = (
                f"it no longer lists {', '.join(lost)}, the tool(s) the guard fences replies through; nothing is "
                "passed to it until it does (restart the guard with the send tools this server has)"
            )
            self._upstream.lost_a_tool(why)
            raise _unanswered(UpstreamFailed(why, handed_over=False))
        return listed

    async def call_tool(self, ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams) -> Any:
        params = _own_params(params)
        tool = self._send_tools.get(params.name)
        if tool is None:
            if params.name in self._unfenced and not self._allow_unfenced:
                return tool_error(self._unfenced_refusal(params.name))
            return await self._passed(params)
        arguments = params.arguments or {}
        if self._allow_unfenced and not tool.names_a_message(arguments, scope=self._scope):
            return await self._passed(params)  # new mail, answering nothing: nothing to claim
        try:
            subject = tool.subject(arguments, mailbox=self._mailbox, scope=self._scope)
        except PathError as wrong:
            return tool_error(f"Invalid arguments for {tool.name}: {wrong}")
        try:
            async with self._session_for(ctx, None, False) as session:
                return await self._send(session, tool, subject, params)
        except SessionCapReached as cap:
            return tool_error(str(cap))
        except CoordinatorError as error:
            return coordinator_error(error)

    async def _passed(self, params: types.CallToolRequestParams) -> dict[str, Any]:
        try:
            return await self._upstream.call_tool(params)
        except UpstreamFailed as failure:
            raise _unanswered(failure) from None

    def _unfenced_refusal(self, name: str) -> str:
        replies = sorted(self._send_tools)
        instead = (
            f"To answer an email, use {' or '.join(replies)}, which says which email it answers."
            if replies
            else "No tool here sends a reply that says which email it answers."
        )
        return (
            f"Not sent: {name} sends mail without saying which email it answers, so nothing can make sure each "
            f"email of this shared mailbox is answered once; here it may not send. {instead}"
        )

    async def _send(
        self, session: AgentSession, tool: SendTool, subject: Subject, params: types.CallToolRequestParams
    ) -> Any:
        key = (subject, fingerprint(params.arguments or {}))
        refused: list[_UpstreamRefused] = []

        async def ready() -> None:
            try:
                await self._upstream.reachable()
            except UpstreamFailed as failure:
                raise NotHandedOver(failure.reason) from None

        async def deliver(claim: AsyncClaim) -> str | None:
            try:
                result = await self._upstream.call_tool(tool.marked(params))
            except UpstreamFailed as failure:
                if not failure.handed_over:
                    raise NotHandedOver(failure.reason) from failure
                raise  # it got there, and what it did is unknown: IN_DOUBT
            except MCPError as error:
                if error.code in _REFUSED_BEFORE_RUNNING:
                    refusal = _UpstreamRefused(f"{tool.name} refused the request: {error.error.message}", error=error)
                    refused.append(refusal)
                    raise refusal from error
                raise
            if tool.failed(result):
                refusal = _UpstreamRefused(f"{tool.name} answered an error: {_text_of(result)[:500]}", result=result)
                refused.append(refusal)
                raise refusal
            if result.get("resultType") == "input_required":
                # The tool asks the client something before it runs: nothing went out yet. The client's retry,
                # with the answers, is a send of its own.
                refusal = _UpstreamRefused(f"{tool.name} asked for input before sending", result=result)
                refused.append(refusal)
                raise refusal
            self._results[key] = result
            return tool.sent_message_id(result)

        answer = await session.send(subject, key[1], deliver, ready=ready)
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
    unfenced: Sequence[str] = (),
    allow_unfenced: bool = False,
    name: str = "inbox-claims-guard",
    instructions: str | None = None,
) -> Server[Any]:
    """The guard as an MCP server over ``upstream`` (connected already): its tools, and the prompts, resources
    and completions it offers."""
    guard = Guard(
        upstream,
        send_tools,
        session_for,
        mailbox=mailbox,
        scope=scope,
        unfenced=unfenced,
        allow_unfenced=allow_unfenced,
    )
    # A result the upstream gave no freshness (a server of the handshake era) is stale at once and not shared:
    # the upstream's own ttlMs and cacheScope, when it gives them, win.
    unknown_freshness = CacheHint(ttl_ms=0, scope="private")
    server: Server[Any] = Server(
        name,
        title="Inbox claims guard",
        instructions=instructions,
        cache_hints={method: unknown_freshness for method in _CACHEABLE},
    )
    server.add_request_handler("tools/list", types.PaginatedRequestParams, guard.list_tools)
    server.add_request_handler("tools/call", types.CallToolRequestParams, guard.call_tool)
    offered = upstream.capabilities
    for method, (capability, _, params_type) in _PASSED_THROUGH.items():
        if getattr(offered, capability) is not None:
            server.add_request_handler(method, params_type, guard.forwarder(method))
    return server
