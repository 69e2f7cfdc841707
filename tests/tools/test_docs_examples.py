"""The Python examples of README.md and docs/client.md type-check with ``mypy --strict``, docs/client.md
section 2 shows the very handler (and the very diff) that tests/client/test_guard_handlers.py runs, and
docs/node.md section 2 the very agent of examples/node and its whole diff, counted as its prose says.

Each ```python block becomes a module of its own; ``llm`` (the examples' stand-in for an LLM call) is
tests/data/handlers/llm.py. A block that is deliberately a fragment is marked by the line
``<!-- fragment: why -->`` right before it, and skipped.
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HANDLERS = ROOT / "tests" / "data" / "handlers"
DOCS = [ROOT / "README.md", ROOT / "docs" / "client.md"]
BLOCK = re.compile(r"(?P<before>[^\n]*)\n```python\n(?P<code>.*?)\n```", re.DOTALL)
FRAGMENT = "<!-- fragment:"


def python_blocks(path: Path) -> tuple[list[str], list[str]]:
    """The blocks to check, and the fragments."""
    checked: list[str] = []
    fragments: list[str] = []
    for match in BLOCK.finditer(path.read_text()):
        (fragments if match["before"].startswith(FRAGMENT) else checked).append(match["code"])
    return checked, fragments


def project_mypy_ini() -> str:
    """The project's own mypy overrides (pyproject.toml) as a mypy.ini, for the server's untyped dependencies
    (inbox_claims.testing imports the server), without its file selection."""
    overrides = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["overrides"]
    sections = ["[mypy]\nstrict = True\n"]
    for override in overrides:
        options = "".join(f"{key} = {value}\n" for key, value in override.items() if key != "module")
        sections.append(f"[mypy-{','.join(override['module'])}]\n{options}")
    return "\n".join(sections)


def test_the_python_examples_in_the_docs_pass_mypy_strict(tmp_path: Path) -> None:
    shutil.copy(HANDLERS / "llm.py", tmp_path / "llm.py")
    (tmp_path / "mypy.ini").write_text(project_mypy_ini())
    names: list[str] = []
    for doc in DOCS:
        checked, _fragments = python_blocks(doc)
        for index, code in enumerate(checked):
            name = f"{doc.stem.lower()}_{index}.py"
            (tmp_path / name).write_text(code + "\n")
            names.append(name)
    # README's example, the handler, the reply_to form, connecting, the blocking client, testing, the adapters.
    assert len(names) >= 8, names
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--cache-dir", os.devnull, *names, "llm.py"],
        cwd=tmp_path,
        env={**os.environ, "MYPYPATH": os.pathsep.join([str(ROOT / "clients" / "python"), str(ROOT)])},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_client_md_section_2_is_the_tested_handler_and_its_diff() -> None:
    text = (ROOT / "docs" / "client.md").read_text()
    section = text[text.index("## 2. ") : text.index("## 3. ")]
    unguarded = (HANDLERS / "fastapi_unguarded.py").read_text()
    guarded = (HANDLERS / "fastapi_guarded.py").read_text()
    assert f"```python\n{unguarded}```" in section
    diff = difflib.unified_diff(
        unguarded.splitlines(), guarded.splitlines(), "fastapi_unguarded.py", "fastapi_guarded.py", lineterm=""
    )
    assert "```diff\n" + "\n".join(diff) + "\n```" in section
    checked, _fragments = python_blocks(ROOT / "docs" / "client.md")
    assert unguarded.rstrip("\n") in checked


def _example_code(name: str) -> list[str]:
    """An examples/node file's lines, its leading comment left out (as clients/node's examples test counts)."""
    lines = (ROOT / "examples" / "node" / name).read_text().split("\n")
    return lines[next(index for index, line in enumerate(lines) if not line.startswith("//")) :]


def test_node_md_section_2_is_the_example_agent_and_its_complete_diff_counted_right() -> None:
    text = (ROOT / "docs" / "node.md").read_text()
    section = text[text.index("## 2. ") : text.index("## 3. ")]
    unguarded, guarded = _example_code("agent-unguarded.mjs"), _example_code("agent-guarded.mjs")
    listing = re.search(r"```js\n(.*?)```", section, re.DOTALL)
    assert listing is not None
    assert listing[1] in "\n".join(unguarded), "the handler shown is not the one in examples/node"
    assert "async function sendReply(grantId, message, draft)" in listing[1], "the send the diff changes is not shown"
    diff = list(difflib.unified_diff(unguarded, guarded, "agent-unguarded.mjs", "agent-guarded.mjs", lineterm="", n=1))
    assert "```diff\n" + "\n".join(diff) + "\n```" in section, "the diff shown is not the diff of the two files"
    # Counted right: what the prose says is what the diff shows (a changed line is one - and one +).
    added = [line for line in diff if line.startswith("+") and not line.startswith("+++")]
    removed = [line for line in diff if line.startswith("-") and not line.startswith("---")]
    assert (len(added) - len(removed), len(removed)) == (4, 3)
    assert "7 lines: 4\nadded and 3 changed" in section or "7 lines: 4 added and 3 changed" in section
    # Nothing of the key is left out: the send takes it and puts it in the header.
    assert any('"idempotency-key": idempotencyKey' in line for line in added)
    assert any("claim.send((idempotencyKey) =>" in line for line in added)
    # The environment variables are the Python client's, not names of its own.
    assert any("Coordinator.fromEnv()" in line for line in added)
    for old_name in ("process.env.INBOX_COORDINATOR ", "process.env.INBOX_COORDINATOR ??", "process.env.PRINCIPAL"):
        assert old_name not in text
