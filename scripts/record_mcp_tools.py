"""Record the tool lists of the published email MCP servers that the guard's presets are for, as test data.

    .venv/bin/python scripts/record_mcp_tools.py            # every package below
    .venv/bin/python scripts/record_mcp_tools.py resend     # one preset's package
    .venv/bin/python scripts/record_mcp_tools.py --work /tmp/mcp-record   # keep the installs there

Each package is installed from its registry at the version pinned below (npm into WORK/npm, PyPI into a
virtualenv of its own under WORK), run over stdio with dummy credentials (never a real key: listing tools
needs none, and nothing is called), and asked ``tools/list`` (every page) by the official MCP SDK's client,
over the initialize handshake (these servers are of the 2025 protocol). The answer, exactly as the server
sent it (the package, its registry and version, the server's own name and version, the protocol version, and
every tool with its input schema), is written to tests/mcp/data/tools/<preset>.json. A package that cannot
list its tools without real credentials or the network is recorded with what it said and why nothing more
could be had. The tests (tests/mcp/test_mcp_presets.py) read these files and need no network.

Raise a pinned version here, run this, and let the preset tests say what changed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from mcp import Client, StdioServerParameters
from mcp.types import ListToolsRequest, PaginatedRequestParams
from pydantic import BaseModel, ConfigDict

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "mcp" / "data" / "tools"
LIST_TIMEOUT_S = 90.0


@dataclasses.dataclass(frozen=True)
class Package:
    preset: str
    registry: str  # "npm", "pypi", or "none" (no package on a registry this can install from)
    name: str
    version: str
    command: tuple[str, ...]
    """The installed program and its arguments: a bin of the npm package, or a console script of the PyPI one."""
    environment: dict[str, str]
    """Dummy credentials and settings the server needs to start (``{work}`` is the package's scratch folder)."""
    files: dict[str, str] = dataclasses.field(default_factory=dict)
    """Dummy files the server reads at start (paths relative to the scratch folder)."""
    note: str = ""


PACKAGES = (
    Package("resend", "npm", "resend-mcp", "2.22.0", ("resend-mcp",), {"RESEND_API_KEY": "re_dummy_not_a_key"}),
    Package(
        "email-mcp",
        "npm",
        "@codefuturist/email-mcp",
        "0.2.0",
        ("email-mcp", "stdio"),
        {
            # One account from the environment (dist/config/loader.js); nothing connects until a tool runs.
            "MCP_EMAIL_ADDRESS": "support@shop.example",
            "MCP_EMAIL_PASSWORD": "dummy-not-a-password",
            "MCP_EMAIL_IMAP_HOST": "127.0.0.1",
            "MCP_EMAIL_SMTP_HOST": "127.0.0.1",
            "HOME": "{work}",
        },
    ),
    Package(
        "gmail",
        "npm",
        "@gongrzhe/server-gmail-autoauth-mcp",
        "1.1.11",
        ("gmail-mcp",),
        {"GMAIL_OAUTH_PATH": "{work}/keys.json", "GMAIL_CREDENTIALS_PATH": "{work}/credentials.json", "HOME": "{work}"},
        files={
            # It exits at start without an OAuth client file; a dummy one lets it list (Google is never called).
            "keys.json": '{"installed": {"client_id": "dummy.apps.googleusercontent.com", "client_secret": "dummy", '
            '"redirect_uris": ["http://localhost"]}}',
            "credentials.json": '{"refresh_token": "dummy", "token_type": "Bearer"}',
        },
    ),
    Package(
        "google-workspace",
        "pypi",
        "workspace-mcp",
        "2.2.1",
        ("workspace-mcp", "--tools", "gmail", "--transport", "stdio"),
        {
            "GOOGLE_OAUTH_CLIENT_ID": "dummy.apps.googleusercontent.com",
            "GOOGLE_OAUTH_CLIENT_SECRET": "dummy",
            "HOME": "{work}",
        },
    ),
    Package(
        "agentmail",
        "pypi",
        "agentmail-mcp",
        "1.0.0",
        ("agentmail-mcp",),
        {"AGENTMAIL_API_KEY": "am_dummy_not_a_key", "HOME": "{work}"},
        note="A bridge to the hosted server (https://mcp.agentmail.to/mcp): it holds no tool definitions, and lists "
        "what the hosted server answers. The npm bridge of the same name is not on the npm registry reachable here.",
    ),
    Package(
        "nylas",
        "none",
        "nylas",
        "",
        (),
        {},
        note="Nylas's MCP server is hosted (https://mcp.us.nylas.com, https://mcp.eu.nylas.com) or run by the "
        "Nylas CLI "
        "(`nylas mcp serve`, a Go program released outside npm and PyPI): no package of it on npm or PyPI to install.",
    ),
)


class _Raw(BaseModel):
    model_config = ConfigDict(extra="allow")


def _install(package: Package, work: Path) -> Path:
    """Installs the package; answers the folder its programs are in."""
    if package.registry == "npm":
        prefix = work / "npm"
        prefix.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--loglevel=error",
             f"{package.name}@{package.version}"],
            check=True,
        )  # fmt: skip
        return prefix / "node_modules" / ".bin"
    venv = work / f"venv-{package.preset}"
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", f"{package.name}=={package.version}"], check=True
    )
    return venv / "bin"


async def _listed(command: list[str], environment: dict[str, str], cwd: Path) -> dict[str, Any]:
    params = StdioServerParameters(command=command[0], args=command[1:], env=environment, cwd=cwd)
    async with asyncio.timeout(LIST_TIMEOUT_S), Client(params, mode="legacy") as client:
        tools: list[Any] = []
        cursor: str | None = None
        while True:
            request = ListToolsRequest(params=PaginatedRequestParams(cursor=cursor) if cursor else None)
            page = (await client.session.send_request(request, _Raw)).model_dump()
            tools += page.get("tools", [])
            cursor = page.get("nextCursor")
            if not cursor:
                break
        info = client.server_info
        return {
            "server_info": {"name": info.name, "version": info.version} if info else None,
            "protocol_version": client.protocol_version,
            "tools": tools,
        }


def record(package: Package, work: Path) -> dict[str, Any]:
    document: dict[str, Any] = {
        "about": "The tools/list answer of a published email MCP server, recorded by scripts/record_mcp_tools.py "
        "(installed from its registry at this version, run over stdio with dummy credentials, asked by the "
        "official MCP SDK's client); the guard's preset named here is checked against it by "
        "tests/mcp/test_mcp_presets.py. Re-run the script to record a newer version.",
        "preset": package.preset,
        "registry": package.registry,
        "package": package.name,
        "version": package.version,
        "command": list(package.command),
        "dummy_environment": sorted(package.environment),
        "recorded": datetime.date.today().isoformat(),
    }
    if package.note:
        document["note"] = package.note
    if package.registry == "none":
        return document | {"listed": False, "why": "no package to install"}
    scratch = work / f"run-{package.preset}"
    scratch.mkdir(parents=True, exist_ok=True)
    for name, content in package.files.items():
        (scratch / name).write_text(content)
    programs = _install(package, work)
    environment = {key: value.replace("{work}", str(scratch)) for key, value in package.environment.items()}
    # PATH for node (the npm bins are scripts run by it); nothing else of this shell's environment.
    environment.setdefault("PATH", os.environ.get("PATH", "/usr/bin:/bin"))
    # The server's stderr goes to a file, so that a failure to list can say what the server said.
    stderr = scratch / "stderr.txt"
    stderr.write_text("")
    program = [str(programs / package.command[0]), *package.command[1:]]
    command = ["/bin/sh", "-c", 'exec "$@" 2>>"$0"', str(stderr), *program]
    try:
        listed = asyncio.run(_listed(command, environment, scratch))
    except Exception as error:  # an ExceptionGroup from the SDK's task groups too
        said = stderr.read_text(errors="replace").strip().splitlines()[:3]
        document |= {"listed": False, "why": f"{type(error).__name__}: {_first_leaf(error)}", "stderr": said}
    else:
        document |= {"listed": True, **listed}
    return document


def _first_leaf(error: BaseException) -> str:
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return str(error) or type(error).__name__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("presets", nargs="*", help="only these presets' packages (default: all)")
    parser.add_argument("--work", type=Path, default=None, help="where to install (default: a temporary folder)")
    options = parser.parse_args()
    chosen = [package for package in PACKAGES if not options.presets or package.preset in options.presets]
    with tempfile.TemporaryDirectory(prefix="mcp-record-") as temporary:
        work = options.work or Path(temporary)
        OUT.mkdir(parents=True, exist_ok=True)
        for package in chosen:
            document = record(package, work)
            path = OUT / f"{package.preset}.json"
            path.write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
            said = f"{len(document['tools'])} tools" if document["listed"] else f"not listed: {document['why']}"
            print(f"{package.preset}: {package.name} {package.version} ({package.registry}): {said} -> {path}")


if __name__ == "__main__":
    main()
