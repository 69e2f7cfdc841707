"""Every reference to the design points at something docs/design.md has (no etcd needed).

The design is the repository's own: code, proto, tests and docs cite its sections by anchor, and a citation
of a section or an invariant that does not exist, or of a design file outside the repository, fails here.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"

# `docs/design.md#anchor` anywhere, `design.md#anchor` in Markdown links between docs/ pages.
_REFERENCE = re.compile(r"(?:docs/)?design\.md#([A-Za-z0-9_-]+)")
_INVARIANT = re.compile(r"design\.md#invariants[^\n]{0,40}?invariants? (\d+)")
_OUTSIDE_DESIGN = re.compile(r"(?<![/\w])DESIGN\.md")
_TEXT_SUFFIXES = {".py", ".proto", ".md", ".pyi", ".toml", ".yaml", ".yml", ".ts", ".js", ".mjs", ".sh", ""}


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors() -> set[str]:
    return {_slug(line.lstrip("#")) for line in DESIGN.read_text().splitlines() if line.startswith("#")}


def _invariant_numbers() -> set[int]:
    section = DESIGN.read_text().split("## Invariants", 1)[1].split("\n## ", 1)[0]
    return {int(number) for number in re.findall(r"^(\d+)\. ", section, flags=re.MULTILINE)}


def _tracked_text_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    paths = [ROOT / name for name in listed if "node_modules" not in name]
    return [path for path in paths if path.is_file() and path.suffix in _TEXT_SUFFIXES]


def test_the_design_has_the_sections_the_code_relies_on() -> None:
    assert {
        "states-of-a-subject",
        "invariants",
        "key-layout",
        "leases-and-expiry",
        "fencing",
        "architecture",
        "replies-written-outside",
        "reply-storms",
    } <= (_anchors())
    assert _invariant_numbers() == set(range(1, 11))


def test_every_design_reference_names_an_existing_section_and_invariant() -> None:
    anchors, invariants = _anchors(), _invariant_numbers()
    broken: list[str] = []
    for path in _tracked_text_files():
        if path == Path(__file__):
            continue  # its own examples of broken references
        text = path.read_text(errors="replace")
        where = path.relative_to(ROOT)
        broken += [f"{where}: #{anchor}" for anchor in _REFERENCE.findall(text) if anchor not in anchors]
        broken += [f"{where}: invariant {n}" for n in _INVARIANT.findall(text) if int(n) not in invariants]
    assert broken == [], "references to docs/design.md that point nowhere"


def test_nothing_cites_a_design_file_outside_the_repository() -> None:
    citing = [
        str(path.relative_to(ROOT))
        for path in _tracked_text_files()
        if path != Path(__file__) and _OUTSIDE_DESIGN.search(path.read_text(errors="replace"))
    ]
    assert citing == [], "cite docs/design.md (in the repository), not the design notes outside it"


def test_the_checks_would_catch_a_broken_reference() -> None:
    assert _REFERENCE.findall("see docs/design.md#no-such-section") == ["no-such-section"]
    assert "no-such-section" not in _anchors()
    assert _INVARIANT.findall("docs/design.md#invariants (invariant 9)") == ["9"]
    # The outside file's name in two parts: this check has to name it, and must not read as citing it.
    assert _OUTSIDE_DESIGN.search("after " + "DESIGN" + ".md section 3")
    assert not _OUTSIDE_DESIGN.search("docs/design.md")
