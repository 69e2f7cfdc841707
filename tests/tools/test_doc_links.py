"""Every link in the README and the docs goes somewhere: a file of the repository that exists and, with a
`#fragment`, a heading of that file (GitHub's anchors). Links to the web are not fetched (CI has no web), but
must be absolute http(s) URLs."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]

# What a reader of the repository reads: the README, docs/ and the examples' READMEs.
PAGES = sorted(
    {ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("**/README.md")}
    - set((ROOT / "examples").glob("**/node_modules/**/README.md"))
)

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+).+?\1", re.DOTALL)
# [text](target "title") and ![alt](target); a target is up to the first space or closing parenthesis.
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
_HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def _prose(text: str) -> str:
    """The page without its code blocks and code spans, where brackets are code, not links."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup and punctuation dropped, lower case, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The fragments a link may name in ``page``: its headings' anchors (a repeated one gets -1, -2, ...), and
    explicit <a id> / <a name> anchors."""
    text = page.read_text()
    found: set[str] = set(_HTML_ANCHOR.findall(text))
    counts: dict[str, int] = {}
    for line in _FENCE.sub("", text).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading is None:
            continue
        slug = _slug(heading.group(1))
        seen = counts.get(slug, 0)
        counts[slug] = seen + 1
        found.add(slug if seen == 0 else f"{slug}-{seen}")
    return found


def links(page: Path) -> list[str]:
    prose = _prose(page.read_text())
    return _LINK.findall(prose) + _REFERENCE_DEFINITION.findall(prose)


def broken_links(page: Path, root: Path = ROOT) -> list[tuple[str, str]]:
    """(target, what is wrong with it) for each link of ``page`` that goes nowhere inside ``root``."""
    broken: list[tuple[str, str]] = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            if not re.match(r"(https?://[^/\s]+|mailto:\S+@\S+)", target):
                broken.append((target, "not an absolute http(s) or mailto link"))
            continue
        path_part, _, fragment = target.partition("#")
        destination = (page.parent / unquote(path_part)).resolve() if path_part else page
        if destination != root and root not in destination.parents:
            broken.append((target, "outside the repository"))
        elif not destination.exists():
            broken.append((target, f"no such file: {destination.relative_to(root)}"))
        elif fragment and destination.suffix == ".md" and unquote(fragment) not in anchors(destination):
            broken.append((target, f"{destination.relative_to(root)} has no heading with the anchor #{fragment}"))
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_link_of_the_page_goes_somewhere(page: Path) -> None:
    assert broken_links(page) == []


def test_the_check_finds_the_links_and_catches_broken_ones(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## 2. A guarded handler\n\n## Repeated\n\n## Repeated\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\nGood: [other](other.md), [a section](other.md#2-a-guarded-handler),"
        " [the second](other.md#repeated-1), [here](#page), [web](https://example.org/x).\n"
        "Broken: [gone](missing.md), [no section](other.md#2-a-guarded-webhook-handler), [here](#nowhere),"
        " [odd](ftp:/x).\n\n```md\n[in code](not-checked.md)\n```\n"
    )
    assert sorted(target for target, _ in broken_links(page, tmp_path)) == [
        "#nowhere",
        "ftp:/x",
        "missing.md",
        "other.md#2-a-guarded-webhook-handler",
    ]
    assert broken_links(page, tmp_path / "elsewhere") != [], "a page outside the root was not refused"
