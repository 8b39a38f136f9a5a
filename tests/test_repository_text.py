"""Tracked text names no work period, no issue and no file outside the repository.

Every tracked text file (binary files and the changelog excepted) is scanned for the marks of a
work diary: a numbered session, a parenthesised period tag such as ``(s`` + ``12)``, a file or
folder name ending in ``-s`` + ``12``, an issue number, and the name of a design file that lives
outside the repository (the design the code cites is ``docs/design.md``). Each hit is reported
as ``file:line: text``. The documentation's relative links must resolve to files that exist,
and a link's ``#anchor`` into a markdown file to one of its headings.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The patterns are assembled from pieces so that this file does not match them itself.
MARKS = {
    "work session": re.compile(r"\bsess" + r"ion[ -]?[0-9]+", re.IGNORECASE),
    "period tag": re.compile(r"\(" + r"s[0-9]+\)", re.IGNORECASE),
    "period-suffixed name": re.compile(r"[A-Za-z0-9_.]-" + r"s[0-9]+\b"),
    "issue number": re.compile(r"\biss" + r"ue[ #]?[0-9]+", re.IGNORECASE),
    "outside design file": re.compile(re.escape("DESIGN" + ".md")),
}
EXEMPT = {"CHANGELOG.md"}
"""Files whose subject is the project's history."""

DOCUMENTATION = (
    "README.md",
    "CONTRIBUTING.md",
    "CHANGELOG.md",
    "LICENSE",
    "docs/",
    "deploy/README.md",
)
"""Prefixes of the documentation a reader opens first."""

LINKED_DOCS = ("README.md", "CONTRIBUTING.md", "CHANGELOG.md", "deploy/README.md")
"""Markdown files whose links are checked, with every ``docs/*.md``."""

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def _without_code_blocks(text: str) -> str:
    """The text with each fenced code block blanked, line numbers kept."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def _tracked() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "-z"],
            check=True,
            capture_output=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout ({exc}): nothing to scan")
    return [name for name in out.decode().split("\0") if name]


def _text(name: str) -> str | None:
    """The file's text, or None for a binary or missing file."""
    path = ROOT / name
    if not path.is_file():
        return None
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    return data.decode("utf-8", errors="replace")


def _is_documentation(name: str) -> bool:
    return any(name == p or (p.endswith("/") and name.startswith(p)) for p in DOCUMENTATION)


def _hits(names: list[str]) -> list[str]:
    hits = []
    for name in names:
        if name in EXEMPT:
            continue
        text = _text(name)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            for kind, pattern in MARKS.items():
                if pattern.search(line):
                    hits.append(f"{name}:{number}: {kind}: {line.strip()[:160]}")
    return hits


@pytest.mark.parametrize("part", ["documentation", "code and configuration"])
def test_tracked_text_carries_no_work_period_marks(part: str) -> None:
    names = [n for n in _tracked() if _is_documentation(n) == (part == "documentation")]
    hits = _hits(names)
    assert not hits, f"{len(hits)} work-period marks in the {part}:\n" + "\n".join(hits)


def _slug(heading: str) -> str:
    """The anchor GitHub gives a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = _without_code_blocks(path.read_text(encoding="utf-8"))
    anchors: set[str] = set()
    for line in text.splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = _slug(match.group(1))
            n, unique = 0, slug
            while unique in anchors:
                n += 1
                unique = f"{slug}-{n}"
            anchors.add(unique)
    return anchors


def _linked_docs() -> list[Path]:
    docs = sorted((ROOT / "docs").glob("*.md"))
    return [ROOT / name for name in LINKED_DOCS if (ROOT / name).is_file()] + docs


def test_documentation_links_resolve() -> None:
    broken = []
    for doc in _linked_docs():
        text = _without_code_blocks(doc.read_text(encoding="utf-8"))
        for number, line in enumerate(text.splitlines(), start=1):
            for target in LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                file_part, _, anchor = target.partition("#")
                path = (doc.parent / file_part).resolve() if file_part else doc
                where = f"{doc.relative_to(ROOT)}:{number}: {target}"
                if not path.exists():
                    broken.append(f"{where}: no such file")
                elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                    broken.append(f"{where}: no heading with that anchor")
    assert not broken, f"{len(broken)} broken links:\n" + "\n".join(broken)
