"""Tracked text names no work period, no issue and no file outside the repository.

Every tracked text file (binary files and the changelog excepted) is scanned for the marks of a
work diary: a numbered session, a parenthesised period tag such as ``(s`` + ``12)``, a file or
folder name ending in ``-s`` + ``12``, an issue cited by number or by its quoted title, the name
of a design file that lives outside the repository (the design the code cites is
``docs/design.md``), and an absolute path of the machine the work was done on (a checkout, a home
or a scratch folder; the container's own paths, such as ``/data`` or the image user's
``/home/prism``, are the product's). Each hit is reported as ``file:line: text``; a test of the
checker proves it catches a planted example of each mark. The documentation's relative links
must resolve to files that exist, and a link's ``#anchor`` into a markdown file to one of its
headings.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The patterns are assembled from pieces so that this file does not match them itself.
_TITLE = r"[\"'\u201c\u2018][A-Z][^\"'\u201d\u2019\n]*\s[^\"'\u201d\u2019\n]+[\"'\u201d\u2019]"
"""A quoted title: capitalised, at least two words."""
_ISSUE_WORD = r"(?i:\b(?:iss" + r"ues?|tick" + r"ets?|pull requests?)\b)"
"""The word that names an issue, in any case."""
_MACHINE_ROOTS = [
    "wo" + "rk",
    "ro" + "ot",
    "tm" + "p",
    "mn" + "t",
    "Users",
    r"home/(?!prism\b)[\w.-]+",
]
"""A build machine's checkout, home or scratch folders; ``/home/prism`` is the image's user."""

MARKS = {
    "work session": re.compile(r"\bsess" + r"ion[ -]?[0-9]+", re.IGNORECASE),
    "period tag": re.compile(r"\(" + r"s[0-9]+\)", re.IGNORECASE),
    "period-suffixed name": re.compile(r"[A-Za-z0-9_.]-" + r"s[0-9]+\b"),
    "issue number": re.compile(r"\biss" + r"ue ?#?[0-9]+", re.IGNORECASE),
    "outside design file": re.compile(re.escape("DESIGN" + ".md")),
    "issue cited by title": re.compile(
        rf"{_ISSUE_WORD}[\s:,(]{{0,4}}{_TITLE}|{_TITLE}\s{{1,3}}{_ISSUE_WORD}"
    ),
    "build-machine path": re.compile(
        r"(?<![\w.~$/-])/(?:" + "|".join(_MACHINE_ROOTS) + r")/|\b[A-Za-z]:\\Us" + r"ers\\"
    ),
}
EXEMPT = {"CHANGELOG.md"}
"""Files whose subject is the project's history."""

RAW_RESULTS = "docs/results/"
HAND_WRITTEN = {"notes.md", "README.md"}
"""Under ``RAW_RESULTS`` every file but these is a benchmark's output, kept as it was written:
it records the paths of the machine that ran it, so only the build-machine mark skips it."""

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
"""Markdown files whose links are checked, with every ``docs/*.md`` and the results' notes."""

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


def _is_raw_result(name: str) -> bool:
    return name.startswith(RAW_RESULTS) and Path(name).name not in HAND_WRITTEN


def _marks(line: str, *, raw_result: bool = False) -> list[str]:
    """The kinds of mark ``line`` carries (a raw result's machine paths are its record)."""
    return [
        kind
        for kind, pattern in MARKS.items()
        if pattern.search(line) and not (raw_result and kind == "build-machine path")
    ]


def _hits(names: list[str]) -> list[str]:
    hits = []
    for name in names:
        if name in EXEMPT:
            continue
        text = _text(name)
        if text is None:
            continue
        raw = _is_raw_result(name)
        for number, line in enumerate(text.splitlines(), start=1):
            for kind in _marks(line, raw_result=raw):
                hits.append(f"{name}:{number}: {kind}: {line.strip()[:160]}")
    return hits


# Planted lines, one per mark, assembled from pieces like the patterns.
_ISSUE = "iss" + "ue"
_PLANTED = [
    ("see sess" + "ion 12's notes", "work session"),
    ("measured (s" + "12)", "period tag"),
    ("bench-results/step-s" + "12.json", "period-suffixed name"),
    ("as " + _ISSUE + " #37 asks", "issue number"),
    ("the design in DES" + "IGN.md", "outside design file"),
    (f'Refusals ({_ISSUE} "The site owns its privacy"): a code', "issue cited by title"),
    (f'the "Secure aggregation with distributed noise" {_ISSUE} adds', "issue cited by title"),
    ("tick" + "et \u201cOne round contract for all\u201d", "issue cited by title"),
    (f"{_ISSUE}: 'Private training at a real budget'", "issue cited by title"),
    ('SST2 = Path("/wo' + 'rk/shared/data/sst2/train.jsonl")', "build-machine path"),
    ("--out /tm" + "p/step-t1.json", "build-machine path"),
    ("cp /ho" + "me/alice/ca.crt .", "build-machine path"),
    ("HOME=/ro" + "ot/.cache", "build-machine path"),
    ("C:\\Us" + "ers\\alice\\data", "build-machine path"),
]
_CLEAN = [
    "#!/usr/bin/env bash",
    "HOME=/home/prism FLWR_HOME=/home/prism/.flwr",
    "- ./data:/data:ro",
    "state-dir = /var/lib/prism/state",
    "--out bench-results/tmp/step.json",
    "see https://example.org/work/tmp/page",
    "PRISM_DATA_DIR=$HOME/work/data ~/work/x",
    f"an {_ISSUE} with the round is logged",
    f'raise ValueError("{_ISSUE} with the key")',
    'the section "Secure aggregation" of docs/benchmarks.md',
    f'the {_ISSUE} "bad round or stale" code',
]


@pytest.mark.parametrize(("line", "kind"), _PLANTED)
def test_each_mark_catches_its_planted_example(line: str, kind: str) -> None:
    assert _marks(line) == [kind]


@pytest.mark.parametrize("line", _CLEAN)
def test_the_marks_pass_ordinary_text(line: str) -> None:
    assert _marks(line) == []


def test_a_raw_result_keeps_its_machine_paths_and_nothing_else() -> None:
    path_line, issue_line = _PLANTED[9][0], _PLANTED[3][0]
    assert _is_raw_result("docs/results/step/sst2.json")
    assert not _is_raw_result("docs/results/step/notes.md")
    assert _marks(path_line, raw_result=True) == []
    assert _marks(issue_line, raw_result=True) == ["issue number"]


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
    docs += sorted(p for p in (ROOT / RAW_RESULTS).rglob("*.md") if p.name in HAND_WRITTEN)
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
