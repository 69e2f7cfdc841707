"""``inbox-claims-mcp``: the claim tools (``serve``) or the guard (``guard -- <upstream>``), over stdio or HTTP.

Configured like ``inboxctl`` (the same flags, ``INBOX_*`` variables and TOML keys), from its own config file
(``--config``, ``$INBOX_CLAIMS_MCP_CONFIG`` or ``~/.config/inbox-claims-mcp.toml``); the principal is an agent
unless ``kind`` says otherwise, and must be named (``INBOX_PRINCIPAL``) unless a token says who it is.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any

from mcp import StdioServerParameters
from mcp.server import Server
from mcp.server.stdio import stdio_server

from inbox_wire import VERSION

from .._async import AsyncCoordinator
from .._settings import client_arguments
from ..cli import ConfigFile, UsageError, connection_options, resolve_settings
from ._guard import SendTool, build_guard, check_tools
from ._http import HttpOptions, listening_socket, serve_guarded
from ._presets import PRESETS, UNPRESETTABLE
from ._session import DEFAULT_TTL, AgentSession
from ._sessions import (
    DEFAULT_MAX_HANDLES,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_SESSION_TIMEOUT,
    HttpSessions,
    OneSession,
    SessionFor,
)
from ._tools import NylasReplies, Scope, build_server
from ._upstream import DEFAULT_CALL_TIMEOUT, DEFAULT_MAX_ANSWER_BYTES, Upstream, UpstreamFailed, UpstreamMismatch

MCP_CONFIG = ConfigFile("INBOX_CLAIMS_MCP_CONFIG", "inbox-claims-mcp.toml")
AGENT_DEFAULTS = {"kind": "agent"}
AGENT_HELPS = {
    "principal": "who this agent is, in development mode: required, unless --token says it (no login-name default)"
}
NYLAS_API_BASE = "NYLAS_API_BASE"
NYLAS_API_BASE_BEFORE = "NYLAS_API_URI"
"""The name this setting had before (the Nylas quickstarts' name): still read, with a line saying to rename it."""

log = logging.getLogger("inbox_claims.mcp")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inbox-claims-mcp",
        description="MCP tools that let an email agent reply at most once per message (Inbox Coordinator claims).",
        epilog="examples:\n"
        "  inbox-claims-mcp serve --principal support-agent-1 --nylas-api-key nyk_...\n"
        "  inbox-claims-mcp serve --transport http --listen 127.0.0.1:8765\n"
        "  inbox-claims-mcp guard --send-tool 'send_message,message=reply_to_message_id,mailbox=grant_id' \\\n"
        "      -- npx some-email-mcp-server\n"
        "  inbox-claims-mcp guard --preset agentmail -- npx -y agentmail-mcp\n"
        "  inbox-claims-mcp guard --transport http --preset resend -- https://mcp.example.com/mcp\n"
        "\nsee docs/mcp.md",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = commands.add_parser("serve", help="the claim tools: claim_message, send_reply, ...")
    guard = commands.add_parser(
        "guard",
        help="an email MCP server's tools, with its send tools fenced",
        description="Re-expose every tool of the upstream email MCP server unchanged, except that calls of its "
        "send tools claim the message, pass the fenced commit point, call the upstream and record the reply.",
    )
    for sub in (serve, guard):
        connection_options(sub, file=MCP_CONFIG, defaults=AGENT_DEFAULTS, helps=AGENT_HELPS)
        sub.add_argument("--transport", choices=("stdio", "http"), default="stdio", help="default stdio")
        sub.add_argument("--listen", default="127.0.0.1:8765", help="HTTP: HOST:PORT to serve /mcp on")
        sub.add_argument("--ttl", type=int, default=DEFAULT_TTL, help=f"claim TTL in seconds (default {DEFAULT_TTL})")
        sub.add_argument("--scope", choices=("message", "thread"), default="message", help="claim messages or threads")
        sub.add_argument(
            "--session-timeout",
            type=float,
            default=DEFAULT_SESSION_TIMEOUT,
            help="HTTP: seconds without a call after which a session's (or a claim handle's) claims are released "
            f"(default {DEFAULT_SESSION_TIMEOUT:g})",
        )
        http = sub.add_argument_group("HTTP: the limits of the coordinator's HTTP face, with its names and defaults")
        http.add_argument(
            "--http-header-timeout",
            type=float,
            default=10.0,
            metavar="SECONDS",
            help="a request's head must arrive within this (default 10)",
        )
        http.add_argument(
            "--request-timeout",
            type=float,
            default=10.0,
            metavar="SECONDS",
            help="a request's body must arrive within this after its head (default 10)",
        )
        http.add_argument(
            "--http-idle-timeout",
            type=float,
            default=30.0,
            metavar="SECONDS",
            help="an idle kept-alive connection is closed after this (default 30)",
        )
        http.add_argument(
            "--http-max-connections",
            type=int,
            default=1000,
            metavar="N",
            help="connections open at once, at most the open-file limit less 256 (default 1000); more get 503",
        )
        http.add_argument(
            "--http-allowed-hosts",
            action="append",
            default=[],
            metavar="NAME",
            help="a Host name to answer to besides those it listens on, e.g. behind a proxy (repeatable)",
        )
        sub.add_argument(
            "--max-sessions",
            type=int,
            default=DEFAULT_MAX_SESSIONS,
            help=f"HTTP: MCP sessions open at once, the most (default {DEFAULT_MAX_SESSIONS})",
        )
        sub.add_argument(
            "--max-handles",
            type=int,
            default=DEFAULT_MAX_HANDLES,
            help="HTTP: claims held by clients without sessions (by claim handle) at once, the most "
            f"(default {DEFAULT_MAX_HANDLES})",
        )
    serve.add_argument("--nylas-api-key", default=None, help="send_reply's Nylas API key [$NYLAS_API_KEY]")
    serve.add_argument(
        "--nylas-api-base",
        default=None,
        help="Nylas API base URL, e.g. https://api.eu.nylas.com (default https://api.us.nylas.com) "
        f"[${NYLAS_API_BASE}]",
    )
    guard.add_argument(
        "--preset",
        choices=sorted({*PRESETS, *UNPRESETTABLE}),
        action="append",
        default=[],
        help="a known server's send tools (repeatable; docs/mcp.md lists them and where each was read), each "
        "checked against the published server's tool list: "
        + "; ".join(f"{name}: {', '.join(preset.versions) or 'no recorded list'}" for name, preset in PRESETS.items()),
    )
    guard.add_argument(
        "--send-tool",
        action="append",
        default=[],
        metavar="SPEC",
        help="a tool that sends a reply: NAME,message=PATH[,mailbox=PATH][,thread=PATH][,headers=PATH]"
        "[,sent_id=PATH][,sent_id_text=REGEX][,error_text=TEXT] (repeatable; headers=PATH: where the guard adds "
        "Auto-Submitted: auto-replied)",
    )
    guard.add_argument(
        "--unfenced-tool",
        action="append",
        default=[],
        metavar="NAME",
        help="a tool that sends mail without naming the message it answers (repeatable)",
    )
    guard.add_argument(
        "--unfenced-sends",
        choices=("refuse", "allow"),
        default="refuse",
        help="what becomes of mail that names no message it answers: an --unfenced-tool's calls, and a send "
        "tool's calls without the replied-to id (new mail). refuse (default): a tool error, nothing sent; "
        "allow: passed through, unclaimed",
    )
    guard.add_argument("--mailbox", default=None, help="the mailbox, when the send tools take none")
    guard.add_argument(
        "--upstream-timeout",
        type=float,
        default=DEFAULT_CALL_TIMEOUT,
        metavar="SECONDS",
        help="the longest an upstream call may take in all; a send with no answer by then is in doubt "
        f"(default {DEFAULT_CALL_TIMEOUT:g})",
    )
    guard.add_argument(
        "--upstream-max-bytes",
        type=_byte_count,
        default=DEFAULT_MAX_ANSWER_BYTES,
        metavar="SIZE",
        help="the largest upstream answer read, e.g. 16MiB (default 16MiB); a larger one is not read",
    )
    guard.add_argument("upstream", nargs=argparse.REMAINDER, help="-- then the upstream command, or its URL")
    return parser


def _nylas_api_base() -> str | None:
    """``$NYLAS_API_BASE``; ``$NYLAS_API_URI`` (its name before) too, with a line saying to rename it."""
    if os.environ.get(NYLAS_API_BASE):
        return os.environ[NYLAS_API_BASE]
    before = os.environ.get(NYLAS_API_BASE_BEFORE)
    if before:
        log.warning("%s is deprecated: set %s instead (read this time)", NYLAS_API_BASE_BEFORE, NYLAS_API_BASE)
    return before or None


def _byte_count(text: str) -> int:
    """``16777216``, ``16MiB``, ``512KiB``, ``1GiB``."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "b": 1}
    number = text.strip().lower()
    for unit in units:
        if number.endswith(unit):
            number, factor = number[: -len(unit)].strip(), units[unit]
            break
    else:
        factor = 1
    if not number.isdigit() or int(number) * factor < 1024:
        raise argparse.ArgumentTypeError(f"{text!r}: give a size of at least 1KiB, e.g. 16MiB or 16777216")
    return int(number) * factor


def _coordinator(options: argparse.Namespace) -> AsyncCoordinator:
    settings = resolve_settings(options, file=MCP_CONFIG, defaults=AGENT_DEFAULTS, login_name=False)
    if settings["principal"] is None and settings["token"] is None:
        raise UsageError("say who this agent is: --principal NAME (INBOX_PRINCIPAL) or --token TOKEN (INBOX_TOKEN)")
    try:
        return AsyncCoordinator(**client_arguments(settings))
    except ValueError as error:
        raise UsageError(str(error)) from None


def _send_tools(options: argparse.Namespace) -> tuple[list[SendTool], list[str]]:
    """The fenced send tools and the unfenced ones, from the presets and the options."""
    for name in options.preset:
        if name in UNPRESETTABLE:
            raise UsageError(f"no preset {name}: {UNPRESETTABLE[name]}")
    tools = [tool for name in options.preset for tool in PRESETS[name].tools]
    unfenced = [tool for name in options.preset for tool in PRESETS[name].unfenced] + options.unfenced_tool
    try:
        tools += [SendTool.parse(spec) for spec in options.send_tool]
    except ValueError as error:
        raise UsageError(str(error)) from None
    if not tools and not unfenced:
        raise UsageError("name the upstream's send tools: --preset NAME, --send-tool SPEC or --unfenced-tool NAME")
    mailboxless = [tool.name for tool in tools if tool.mailbox is None]
    if mailboxless and options.mailbox is None:
        raise UsageError(
            f"{', '.join(mailboxless)} take(s) no mailbox argument: say which mailbox this server sends from, "
            "with --mailbox (the address or id its claims are under)"
        )
    return tools, unfenced


def _upstream_target(words: Sequence[str]) -> StdioServerParameters | str:
    words = list(words[1:] if words and words[0] == "--" else words)
    if not words:
        raise UsageError("give the upstream after --: its command (npx some-email-mcp) or its URL")
    if len(words) == 1 and words[0].startswith(("http://", "https://")):
        return words[0]
    # The upstream gets this process's environment (its API keys live there), not the SDK's short default.
    return StdioServerParameters(command=words[0], args=words[1:], env=dict(os.environ))


def _listener(listen: str) -> socket.socket:
    """The HTTP transport's listening socket: a wrong address or a port in use is a usage error, said plainly."""
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--listen {listen!r}: give HOST:PORT, e.g. 127.0.0.1:8765 (port 0: any free port)")
    try:
        return listening_socket(host.strip("[]"), int(port))
    except OSError as error:
        raise UsageError(f"cannot listen on {listen}: {error.strerror or error}") from None


async def _serve(server: Server[Any], options: argparse.Namespace, sessions: HttpSessions) -> None:
    if options.transport == "stdio":
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())
        return
    listener = _listener(options.listen)
    host, port = listener.getsockname()[:2]
    app = server.streamable_http_app(
        host=options.listen.rpartition(":")[0].strip("[]"),
        # The SDK's own sessions (2025 protocol) end and are capped as ours are.
        session_idle_timeout=options.session_timeout,
        max_sessions=options.max_sessions,
    )
    http = HttpOptions(
        header_timeout_s=options.http_header_timeout,
        body_timeout_s=options.request_timeout,
        idle_timeout_s=options.http_idle_timeout,
        max_connections=options.http_max_connections,
        allowed_hosts=tuple(options.http_allowed_hosts),
    )
    sweeper = asyncio.create_task(sessions.sweep())
    where = f"[{host}]" if ":" in host else host
    print(f"inbox-claims-mcp: serving MCP on http://{where}:{port}/mcp", file=sys.stderr, flush=True)
    try:
        await serve_guarded(sessions.ending_sessions(app), listener, http)
    except OSError as error:  # no descriptors left for HTTP under the open-file limit
        raise UsageError(str(error)) from None
    finally:
        sweeper.cancel()
        listener.close()


async def run(options: argparse.Namespace) -> None:
    coordinator = _coordinator(options)
    scope: Scope = options.scope
    sessions = HttpSessions(
        coordinator,
        ttl=options.ttl,
        timeout=options.session_timeout,
        max_sessions=options.max_sessions,
        max_handles=options.max_handles,
    )
    stdio_session = AgentSession(coordinator, ttl=options.ttl)
    session_for: SessionFor = OneSession(stdio_session) if options.transport == "stdio" else sessions

    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(coordinator.close)
        stack.push_async_callback(sessions.close)
        stack.push_async_callback(stdio_session.close)  # releases what the session still holds, first
        if options.command == "serve":
            key = options.nylas_api_key or os.environ.get("NYLAS_API_KEY")
            replies = None
            if key:
                replies = NylasReplies(key, api_base=options.nylas_api_base or _nylas_api_base())
                stack.push_async_callback(replies.close)
            server = build_server(session_for, replies=replies, scope=scope, version=VERSION)
        else:
            (tools, unfenced), target = _send_tools(options), _upstream_target(options.upstream)
            upstream = await _started(tools, options, target)
            stack.push_async_exit(upstream)
            server = build_guard(
                upstream,
                tools,
                session_for,
                mailbox=options.mailbox,
                scope=scope,
                unfenced=unfenced,
                allow_unfenced=options.unfenced_sends == "allow",
                instructions=upstream.instructions,
            )
        await _serve(server, options, sessions)


async def _started(tools: list[SendTool], options: argparse.Namespace, target: StdioServerParameters | str) -> Upstream:
    """The upstream, connected and checked: the guard does not start in front of one it cannot reach, or one that
    does not list the send tools it was told to fence (it would fence nothing)."""
    upstream = Upstream.to(
        target,
        call_timeout=options.upstream_timeout,
        max_answer_bytes=options.upstream_max_bytes,
        check=check_tools(tools, options.unfenced_tool, scope=options.scope),
    )
    try:
        await upstream.__aenter__()
    except UpstreamMismatch as mismatch:
        await upstream.__aexit__(None, None, None)
        raise UsageError(
            f"{_describe(upstream)}: {mismatch.reason}. {_known(options)}The guard does not start: it would fence "
            "nothing."
        ) from None
    except UpstreamFailed as failure:
        await upstream.__aexit__(None, None, None)
        raise UsageError(f"{_describe(upstream)}: {failure.reason}") from None
    return upstream


def _describe(upstream: Upstream) -> str:
    info = upstream.server_info
    if info is None:
        return "the email MCP server"
    return (
        f"the email MCP server ({info.name} {info.version})" if info.version else f"the email MCP server ({info.name})"
    )


def _known(options: argparse.Namespace) -> str:
    """What each preset named was checked against, for a refusal."""
    said = []
    for name in options.preset:
        versions = PRESETS[name].versions
        against = ", ".join(versions) if versions else "no recorded tool list (docs/mcp.md, Presets)"
        said.append(f"--preset {name} was checked against {against}")
    return "; ".join(said) + ". " if said else ""


def main(argv: Sequence[str] | None = None) -> int:
    """The ``inbox-claims-mcp`` command; answers the exit code (0 done, 2 usage, 130 interrupted)."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="inbox-claims-mcp: %(message)s")
    parser = build_parser()
    options = parser.parse_args(argv)
    try:
        asyncio.run(_until_signalled(options))
    except UsageError as error:
        parser.exit(2, f"inbox-claims-mcp: error: {error}\n")
    except KeyboardInterrupt:
        return 130
    return 0


async def _until_signalled(options: argparse.Namespace) -> None:
    """Runs until the client goes away or SIGTERM/SIGINT arrives; either way the session's claims are released."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await run(options)
