"""Our MCP server's tools: claim_message, send_reply, mark_replied, release_message, who_is_answering.

Each tool has an input schema and an output schema (both from the pydantic models below), MCP annotations,
and answers with structured content and the sentence the model acts on (``_answers``). Arguments are checked
before anything is claimed or sent; a wrong one is a tool error that names the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

import mcp_types as types
from mcp.server import Server, ServerRequestContext
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError

from .._errors import CoordinatorError, CoordinatorUnavailable, InvalidRequest, PermissionDenied, Unauthenticated
from .._guard import summary_of
from .._message_ids import canonical_message_id
from .._tracing import ToolTrace, traced_tool
from .._types import MessageSummary, Subject
from ..nylas import AsyncNylas, NylasReply
from ..providers import MessageFacts
from ._answers import Answer, Outcome
from ._session import AgentSession, Thread, fingerprint
from ._sessions import SessionCapReached, SessionFor

Scope = Literal["message", "thread"]

INSTRUCTIONS = (
    "This mailbox is shared: other agents and people may answer the same emails. Before you draft a reply, "
    "call claim_message; reply only when it answers may_reply true, and send the reply with send_reply, "
    "which sends it at most once. When a tool says 'do not reply', do not reply to that message in any way. "
    "If you answered a message some other way, call mark_replied; if you decide not to answer, call "
    "release_message. When claim_message answers a claim_handle, pass it in your later calls about that message: "
    "over a connection without sessions it is what makes the claim yours."
)


class _Arguments(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Message(_Arguments):
    mailbox: str = Field(
        min_length=1, max_length=320, description="The mailbox the email arrived in: its Nylas grant id."
    )
    message_id: str = Field(
        min_length=1, max_length=512, description="The id of the email you are answering (Nylas: data.object.id)."
    )
    thread_id: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        description="The email's thread id; required when this server claims whole conversations.",
    )
    received_at: AwareDatetime | None = Field(
        default=None,
        description=(
            "When the email arrived, as the mail service gives it (ISO 8601 with its offset, e.g. "
            "2026-12-02T14:03:00Z). With thread_id, a reply someone writes from the mailbox in that thread "
            "(a person in Gmail) ends your claim, and you are told not to send."
        ),
    )

    claim_handle: str | None = Field(
        default=None,
        max_length=128,
        description="The claim_handle claim_message answered for this message, if it answered one: pass it back, "
        "so that the call acts on your claim (needed over a connection without sessions).",
    )

    def facts(self, summary: Summary | None = None) -> MessageFacts:
        """What the tool was told about the email, as the neutral value the guard reads from any provider
        (docs/providers.md): the subject, the thread and the summary all come from it."""
        return MessageFacts(
            provider="mcp",
            event="message.created",
            mailbox=self.mailbox,
            dedup_key="",
            message_id=self.message_id,
            thread_id=self.thread_id,
            received_at=self.received_at,
            sender=summary.sender if summary is not None else "",
            subject_line=summary.subject_line if summary is not None else "",
        )


def _thread(facts: MessageFacts) -> Thread | None:
    """The message's thread and when it arrived, when both are known."""
    if facts.thread_id is None or facts.received_at is None:
        return None
    return facts.thread_id, facts.received_at


class Summary(_Arguments):
    subject_line: str = Field(default="", max_length=512, description="The email's subject line.")
    sender: str = Field(default="", max_length=512, description="Who sent it, e.g. 'Bea Costa <bea@example.org>'.")


class ClaimArguments(Message):
    summary: Summary | None = Field(
        default=None, description="Which email this is, shown to the people watching the mailbox."
    )
    note: str = Field(default="", max_length=1024, description="What you are doing, shown to the people watching.")


class Participant(_Arguments):
    email: str = Field(min_length=3, max_length=320, pattern=r"^[^@\s]+@[^@\s]+$")
    name: str = Field(default="", max_length=256)


class SendReplyArguments(Message):
    to: list[Participant] = Field(min_length=1, max_length=100, description="Who the reply goes to.")
    subject: str = Field(min_length=1, max_length=998, description="The reply's subject line, e.g. 'Re: ...'.")
    body: str = Field(min_length=1, max_length=1_000_000, description="The reply's body (HTML or plain text).")
    cc: list[Participant] = Field(default_factory=list, max_length=100)
    bcc: list[Participant] = Field(default_factory=list, max_length=100)
    summary: Summary | None = Field(default=None, description="Which email this is, as in claim_message.")


class MarkRepliedArguments(Message):
    sent_message_id: str = Field(default="", max_length=512, description="The id of the reply sent, if known.")
    note: str = Field(default="", max_length=1024, description="How it was answered, e.g. 'replied by phone'.")


class MailboxArguments(_Arguments):
    mailbox: str = Field(min_length=1, max_length=320, description="The mailbox: its Nylas grant id.")


class ToolAnswer(BaseModel):
    """The structured answer of every tool but who_is_answering (``Answer.structured``)."""

    outcome: Literal[
        "granted",
        "held",
        "already_replied",
        "sent",
        "not_sent",
        "in_doubt",
        "lost",
        "marked_replied",
        "released",
        "not_held",
    ] = Field(description="What happened (see the tool's description).")
    may_reply: bool = Field(description="True only when you hold the message and may send a reply to it.")
    message: str = Field(description="What to do, in words.")
    mailbox: str
    subject_kind: Literal["message", "thread"]
    subject_id: str
    holder: str | None = Field(default=None, description="Who is answering or answered it, when not you.")
    holder_kind: Literal["agent", "person"] | None = None
    until: str | None = Field(default=None, description="When the claim ends unless renewed (ISO 8601, UTC).")
    at: str | None = Field(default=None, description="When the reply was sent or the send began (ISO 8601, UTC).")
    sent_message_id: str | None = None
    detail: str | None = None
    claim_handle: str | None = Field(
        default=None, description="granted: pass it back in later calls about this message (see claim_message)."
    )


class LiveClaim(BaseModel):
    subject_kind: Literal["message", "thread"]
    subject_id: str
    state: Literal["claimed", "sending", "in_doubt"]
    holder: str
    holder_kind: Literal["agent", "person"]
    yours: bool = Field(description="Held by this agent (this session or another one of it).")
    until: str | None = None
    since: str | None = None
    subject_line: str | None = None
    sender: str | None = None
    note: str | None = None


class WhoIsAnswering(BaseModel):
    mailbox: str
    claims: list[LiveClaim]
    message: str


class NylasReplies:
    """send_reply's mail service: the Nylas v3 send API, with the claim's Idempotency-Key."""

    def __init__(self, api_key: str, *, api_base: str | None = None, timeout: float = 60.0) -> None:
        options: dict[str, Any] = {"api_base": api_base} if api_base else {}
        self._nylas = AsyncNylas(api_key, timeout=timeout, **options)

    def reply(self, arguments: SendReplyArguments) -> NylasReply:
        def participants(people: list[Participant]) -> list[dict[str, str]]:
            return [{"email": p.email, **({"name": p.name} if p.name else {})} for p in people]

        return NylasReply(
            reply_to_message_id=canonical_message_id(arguments.message_id),  # the id as claimed, as Nylas writes it
            to=participants(arguments.to),
            subject=arguments.subject,
            body=arguments.body,
            cc=participants(arguments.cc),
            bcc=participants(arguments.bcc),
        )

    async def send(self, grant_id: str, reply: NylasReply, idempotency_key: str) -> str | None:
        return await self._nylas.send(grant_id, reply, idempotency_key=idempotency_key)

    async def close(self) -> None:
        await self._nylas.close()


@dataclasses.dataclass(frozen=True)
class _Tool:
    name: str
    title: str
    description: str
    arguments: type[_Arguments]
    output: type[BaseModel]
    annotations: types.ToolAnnotations

    def listed(self) -> types.Tool:
        return types.Tool(
            name=self.name,
            title=self.title,
            description=self.description,
            input_schema=self.arguments.model_json_schema(),
            output_schema=self.output.model_json_schema(),
            annotations=self.annotations,
        )


def _annotations(title: str, *, read_only: bool = False, idempotent: bool, open_world: bool) -> types.ToolAnnotations:
    return types.ToolAnnotations(
        title=title,
        read_only_hint=read_only,
        destructive_hint=None if read_only else False,
        idempotent_hint=None if read_only else idempotent,
        open_world_hint=open_world,
    )


TOOLS: dict[str, _Tool] = {
    tool.name: tool
    for tool in (
        _Tool(
            "claim_message",
            "Claim an email before answering it",
            "Say that you are answering this email, before you draft a reply. Answers 'granted until ...' (you "
            "may reply: it stays yours while this session lasts), 'being answered by X until ...' or 'already "
            "answered by X at ...': then do not reply. Calling it again for a message you hold changes nothing.",
            ClaimArguments,
            ToolAnswer,
            _annotations("Claim an email", idempotent=True, open_world=False),
        ),
        _Tool(
            "send_reply",
            "Send the reply to an email, at most once",
            "Send your reply to this email. It claims the email if you do not hold it yet, and sends only while "
            "nobody else is answering it: at most one reply goes out per email, whoever asks. Calling it again "
            "with the same reply answers what the first call answered and sends nothing. If it says 'not sent' "
            "or 'do not reply', nothing went out from you; if it says the outcome is unknown, do not send again.",
            SendReplyArguments,
            ToolAnswer,
            _annotations("Send a reply", idempotent=True, open_world=True),
        ),
        _Tool(
            "mark_replied",
            "Record that an email was answered some other way",
            "Record that this email was answered outside send_reply (by another tool, by phone): no agent will "
            "reply to it afterwards. Works on an email you hold, or one nobody holds.",
            MarkRepliedArguments,
            ToolAnswer,
            _annotations("Mark an email answered", idempotent=True, open_world=False),
        ),
        _Tool(
            "release_message",
            "Give an email back without answering it",
            "Give up your claim on this email without replying (you will not answer it): others may answer it.",
            Message,
            ToolAnswer,
            _annotations("Release an email", idempotent=True, open_world=False),
        ),
        _Tool(
            "who_is_answering",
            "Who is answering which email in a mailbox",
            "List the emails of a mailbox that someone is answering now (agent or person, until when), being "
            "sent, or waiting for a person to check whether a reply went out, with their subject lines.",
            MailboxArguments,
            WhoIsAnswering,
            _annotations("Who is answering", read_only=True, idempotent=True, open_world=False),
        ),
    )
}


def argument_error(error: ValidationError) -> str:
    """``to.0.email: String should match pattern ...; body: Field required``: each field, then what is wrong."""
    problems = []
    for problem in error.errors(include_url=False):
        field = ".".join(str(part) for part in problem["loc"]) or "arguments"
        problems.append(f"{field}: {problem['msg']}")
    return "Invalid arguments, nothing was done: " + "; ".join(problems)


def tool_error(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=True)


def coordinator_error(error: CoordinatorError) -> types.CallToolResult:
    """What the model is told when the coordinator refused or could not be reached: nothing was sent."""
    if isinstance(error, InvalidRequest):
        return tool_error(f"Invalid arguments, nothing was done: {error.details}")
    if isinstance(error, PermissionDenied | Unauthenticated):
        return tool_error(f"Not permitted, nothing was done: {error.details}")
    if isinstance(error, CoordinatorUnavailable):
        return tool_error(f"The coordinator cannot be reached, nothing was sent: try again shortly ({error.details}).")
    return tool_error(f"The coordinator refused, nothing was sent: {error.details}")


def answered(answer: Answer, *, error_unless: frozenset[Outcome] | None) -> types.CallToolResult:
    """``error_unless``: the outcomes that fulfil the tool's purpose (others are tool errors); ``None``: every
    outcome is an answer."""
    is_error = error_unless is not None and answer.outcome not in error_unless
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=answer.message)],
        structured_content=answer.structured(),
        is_error=is_error,
    )


class ClaimTools:
    """The tools' handlers over the agent sessions."""

    def __init__(self, session_for: SessionFor, *, replies: NylasReplies | None, scope: Scope = "message") -> None:
        self._session_for = session_for
        self._replies = replies
        self._scope = scope

    @property
    def offered(self) -> list[_Tool]:
        """send_reply needs a mail service; without one it is not offered."""
        return [tool for tool in TOOLS.values() if tool.name != "send_reply" or self._replies is not None]

    def _subject(self, facts: MessageFacts) -> Subject | str:
        if self._scope == "thread":
            if facts.thread_id is None:
                return "Invalid arguments, nothing was done: thread_id: required (this server claims conversations)"
            return Subject.thread(facts.mailbox, facts.thread_id)
        return Subject.message(facts.mailbox, facts.message_id)

    async def list_tools(
        self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[tool.listed() for tool in self.offered])

    async def call_tool(
        self, ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        tool = next((tool for tool in self.offered if tool.name == params.name), None)
        if tool is None:
            return tool_error(f"Unknown tool {params.name!r}: the tools are {', '.join(t.name for t in self.offered)}")
        try:
            arguments = tool.arguments.model_validate(params.arguments or {})
        except ValidationError as error:
            return tool_error(argument_error(error))
        handle = arguments.claim_handle if isinstance(arguments, Message) else None
        mailbox = arguments.mailbox if isinstance(arguments, Message | MailboxArguments) else None
        with traced_tool(tool.name, mailbox) as traced:
            result = await self._traced_call(ctx, arguments, handle, traced)
            traced.answered(result)
            return result

    async def _traced_call(
        self, ctx: ServerRequestContext[Any, Any], arguments: _Arguments, handle: str | None, traced: ToolTrace
    ) -> types.CallToolResult:
        try:
            async with self._session_for(ctx, handle, isinstance(arguments, ClaimArguments)) as session:
                subject = self._subject(arguments.facts()) if isinstance(arguments, Message) else None
                if isinstance(subject, Subject):
                    traced.acts_on(subject.mailbox, subject.id, session.claim_trace(subject))
                return await self._call(session, arguments)
        except SessionCapReached as cap:
            return tool_error(str(cap))
        except CoordinatorError as error:
            return coordinator_error(error)

    async def _call(self, session: AgentSession, arguments: _Arguments) -> types.CallToolResult:
        if isinstance(arguments, MailboxArguments):
            return await self._who(session, arguments.mailbox)
        assert isinstance(arguments, Message)
        facts = arguments.facts(
            arguments.summary if isinstance(arguments, ClaimArguments | SendReplyArguments) else None
        )
        subject = self._subject(facts)
        if isinstance(subject, str):
            return tool_error(subject)
        if isinstance(arguments, SendReplyArguments):
            sent = await self._send_reply(session, subject, arguments, facts)
            return answered(sent, error_unless=frozenset({Outcome.SENT}))
        if isinstance(arguments, ClaimArguments):
            claimed = await session.claim(subject, summary=_summary(facts), note=arguments.note, thread=_thread(facts))
            return answered(claimed, error_unless=None)
        if isinstance(arguments, MarkRepliedArguments):
            marked = await session.mark_replied(subject, sent_message_id=arguments.sent_message_id, note=arguments.note)
            return answered(marked, error_unless=frozenset({Outcome.MARKED_REPLIED}))
        return answered(await session.release(subject), error_unless=None)

    async def _send_reply(
        self, session: AgentSession, subject: Subject, arguments: SendReplyArguments, facts: MessageFacts
    ) -> Answer:
        replies = self._replies
        assert replies is not None
        reply = replies.reply(arguments)

        async def deliver(claim: Any) -> str | None:
            return await replies.send(arguments.mailbox, reply, claim.idempotency_key)

        the_reply = arguments.model_dump(exclude={"summary", "thread_id", "received_at", "claim_handle"})
        return await session.send(
            subject, fingerprint(the_reply), deliver, summary=_summary(facts), thread=_thread(facts)
        )

    async def _who(self, session: AgentSession, mailbox: str) -> types.CallToolResult:
        claims = await session.who_is_answering(mailbox)
        people = sum(1 for claim in claims if claim["holder_kind"] == "person")
        text = (
            f"{len(claims)} email(s) of {mailbox} are being answered, sent or checked ({people} by a person)"
            + "".join(
                f"\n- {c['subject_id']}: {c['state']} by {c['holder']} ({c['holder_kind']})"
                + (f", {c['subject_line']!r}" if "subject_line" in c else "")
                for c in claims
            )
            if claims
            else f"Nobody is answering any email of {mailbox} right now."
        )
        document = {"mailbox": mailbox, "claims": claims, "message": text}
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=text)], structured_content=document, is_error=False
        )


def _summary(facts: MessageFacts) -> MessageSummary | None:
    """The summary people see, as the guard makes it from any provider's facts; none unless the tool was told
    which email it is (a subject line or a sender)."""
    if not (facts.subject_line or facts.sender):
        return None
    summary = summary_of(facts)
    return summary if summary is None else MessageSummary(summary.subject_line, summary.sender)


def build_server(
    session_for: SessionFor,
    *,
    replies: NylasReplies | None = None,
    scope: Scope = "message",
    name: str = "inbox-claims",
    version: str = "",
) -> Server[Any]:
    """The MCP server of the claim tools (low-level ``Server``: the schemas are ours, not inferred)."""
    tools = ClaimTools(session_for, replies=replies, scope=scope)
    return Server(
        name,
        version=version,
        title="Inbox claims",
        instructions=INSTRUCTIONS,
        on_list_tools=tools.list_tools,
        on_call_tool=tools.call_tool,
    )


def structured_schemas() -> Mapping[str, dict[str, Any]]:
    """Each tool's output schema, by name (for the docs and the tests)."""
    return {name: tool.output.model_json_schema() for name, tool in TOOLS.items()}
