"""The documents stay documents for their readers: README.md is a user's guide of a few hundred lines,
its test command is the one CI runs, every relative link in README.md and docs/ names a file that exists,
and none of them narrates when work was done."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.unit.test_no_narration import narration_hits

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
README_MAX_LINES = 400
"""Above this README.md is turning into design notes or a results log; those belong in docs/ and
benchmarks/RESULTS.md."""
_LINK = re.compile(r"\]\(([^)\s]+)\)")
"""The target of a Markdown inline link: ``[text](target)``."""
_SOURCE_PATH = re.compile(r"`((?:engine|lora|kernels|multimodal|encoders|benchmarks|tests|examples|docs)/[\w/.-]*)")
"""A repository path the prose names in code spans: ``engine/scheduler.py``, ``kernels/csrc/``,
``engine/layers/rotary.py::MRotaryEmbedding`` (the part before ``::``)."""


def _relative_links(path: Path) -> list[str]:
    """Targets of the file's inline links that point into the repository (no scheme, no pure anchor)."""
    targets = (m.group(1) for m in _LINK.finditer(path.read_text()))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def _documents() -> list[Path]:
    return [README, *sorted((REPO / "docs").glob("*.md"))]


def test_readme_is_a_guide_not_a_notebook():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, (f"README.md has {n} lines (at most {README_MAX_LINES}): move design notes "
                                   "to docs/ and measured figures to benchmarks/RESULTS.md.")


def test_readme_links_into_docs():
    links = _relative_links(README)
    assert "docs/cli.md" in links
    assert any(t.startswith("docs/architecture.md") for t in links)


@pytest.mark.parametrize("doc", _documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc: Path):
    missing = [t for t in _relative_links(doc) if not (doc.parent / t.split("#")[0]).exists()]
    assert missing == [], f"{doc.relative_to(REPO)} links to files that do not exist: {missing}"


@pytest.mark.parametrize("doc", _documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_documents_do_not_narrate_work(doc: Path):
    hits = narration_hits(doc.read_text())
    assert hits == [], f"{doc.relative_to(REPO)} narrates when work was done (describe what is): {hits}"


@pytest.mark.parametrize("doc", _documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_named_source_paths_exist(doc: Path):
    """A module the documents name exists: a file moved or split fails here until its page follows."""
    named = sorted({m.group(1) for m in _SOURCE_PATH.finditer(doc.read_text())})
    missing = [p for p in named if not (REPO / p).exists()]
    assert missing == [], f"{doc.relative_to(REPO)} names paths that do not exist: {missing}"


def test_readme_runs_the_ci_test_command():
    """.ci/run's last command is the README's test command (the same line, character for character)."""
    ci = REPO / ".ci" / "run"
    if not ci.exists():
        pytest.skip("no .ci/run in this checkout")
    commands = [line for line in ci.read_text().splitlines()
                if line.strip() and not re.match(r"\s*(#|set |cd |export )", line)]
    assert commands[-1] in README.read_text(), ".ci/run's test command does not appear in README.md."


def test_the_link_finder_sees_links():
    """The checker itself: a planted Markdown link is found, a URL and an anchor are not."""
    text = "see [a](docs/a.md#x), [b](https://x.org/b.md) and [c](#c)"
    found = [m.group(1) for m in _LINK.finditer(text)]
    assert found == ["docs/a.md#x", "https://x.org/b.md", "#c"]
