"""The repository's documents stand on their own: no citation of a document that is not in it, and
every citation of a ``docs/`` section names a heading that exists.

Sections of ``docs/*.md`` are cited by file and heading, e.g. ``docs/architecture.md, "Compressor"``
(several headings: ``docs/architecture.md, "Compressor" and "Lightning indexer"``). Benchmark runs
are cited in ``benchmarks/HISTORY.md``, where every dated run lives (``benchmarks/HISTORY.md,
run 11``); ``benchmarks/README.md`` keeps only the current tables.
"""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("deepinfer_vllm/", "tests/", "benchmarks/", "examples/", "docs/", "README.md")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".txt", ".toml", ".cfg", ".json", ".yaml", ".yml", ".ipynb"}

# Section numbers of documents that are not in the repository (a section sign alone is one too);
# built from pieces so that this file does not match itself.
_SECTION = "\N{SECTION SIGN}"
FORBIDDEN = re.compile(
    "|".join(
        (
            re.escape(_SECTION),
            "deepinfer" + "-design",
            r"deepseek-v41-flash\.md",
        )
    )
)
# ``docs/<file>.md`` (optionally closed by a backtick), a comma, then one or more quoted headings.
CITATION = re.compile(r'docs/([\w.-]+\.md)`?,[\s#*]*"([^"]+)"((?:[\s#*]*(?:,|;|and|/)[\s#*]*"[^"]+")*)')
MORE_HEADINGS = re.compile(r'"([^"]+)"')
# A run number cited in the README, which no longer holds dated runs.
README_RUN = re.compile(r"benchmarks/README\.md`*,?\s*\(?runs?\s+\d+")
HISTORY_RUN = re.compile(r"benchmarks/HISTORY\.md`*,?\s*\(?run\s+(\d+)")


@cache
def _files() -> tuple[Path, ...]:
    """Tracked and untracked (not ignored) text files under the scanned paths."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *SCANNED],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    paths = []
    for line in out.splitlines():
        path = ROOT / line
        if path.suffix in TEXT_SUFFIXES and path.is_file() and path != Path(__file__).resolve():
            paths.append(path)
    return tuple(paths)


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


@cache
def _headings(doc: str) -> frozenset[str]:
    path = ROOT / "docs" / doc
    if not path.is_file():
        return frozenset()
    titles = []
    in_code = False
    for line in _text(path).splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(r"#{1,6} ", line):
            titles.append(line.lstrip("#").strip())
    return frozenset(titles)


def test_no_external_document_citations():
    """No section number of an outside document ("spec" or "design" with a section sign, the
    names of the two outside documents): a reader of the repository has neither."""
    bad = {}
    for path in _files():
        text = _text(path)
        for m in FORBIDDEN.finditer(text):
            where = f"{path.relative_to(ROOT)}:{_line(text, m.start())}"
            bad.setdefault(where, text.splitlines()[_line(text, m.start()) - 1].strip()[:120])
    bad = [f"{where}: {line}" for where, line in bad.items()]
    assert not bad, "citations of documents outside the repository:\n" + "\n".join(bad)


def test_docs_headings_unique():
    """Headings are citation targets, so each names one section."""
    for path in sorted((ROOT / "docs").glob("*.md")):
        titles = [
            line.lstrip("#").strip()
            for line in _strip_code(_text(path)).splitlines()
            if re.match(r"#{1,6} ", line)
        ]
        dupes = sorted({t for t in titles if titles.count(t) > 1})
        assert not dupes, f"{path.relative_to(ROOT)}: headings used twice: {dupes}"


def _strip_code(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)


def test_docs_citations_name_existing_headings():
    """Every ``docs/<file>.md, "Heading"`` names an existing file and one of its headings."""
    bad = []
    for path in _files():
        text = _text(path)
        for m in CITATION.finditer(text):
            doc = m.group(1)
            names = [m.group(2)] + MORE_HEADINGS.findall(m.group(3) or "")
            known = _headings(doc)
            for name in names:
                name = " ".join(name.split())
                where = f"{path.relative_to(ROOT)}:{_line(text, m.start())}"
                if not known:
                    bad.append(f"{where}: docs/{doc} does not exist")
                elif name not in known:
                    bad.append(f"{where}: docs/{doc} has no heading {name!r}")
    assert not bad, "citations of missing docs sections:\n" + "\n".join(bad)


def test_benchmark_run_citations():
    """Dated runs live in ``benchmarks/HISTORY.md``: a run cited there has its heading, and none is
    cited in ``benchmarks/README.md``."""
    history = _text(ROOT / "benchmarks" / "HISTORY.md")
    runs = set(re.findall(r"^### Run (\d+)", history, flags=re.MULTILINE))
    bad = []
    for path in _files():
        text = _text(path)
        for m in README_RUN.finditer(text):
            where = f"{path.relative_to(ROOT)}:{_line(text, m.start())}"
            bad.append(f"{where}: {m.group(0)!r} (runs are in HISTORY.md)")
        for m in HISTORY_RUN.finditer(text):
            if m.group(1) not in runs:
                bad.append(
                    f"{path.relative_to(ROOT)}:{_line(text, m.start())}: HISTORY.md has no run {m.group(1)}"
                )
    assert not bad, "benchmark run citations:\n" + "\n".join(bad)


def test_docs_exist():
    for doc in ("architecture.md", "design-notes.md"):
        assert _headings(doc), f"docs/{doc} is missing or has no headings"
