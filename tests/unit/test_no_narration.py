"""The product describes what is, not when work was done: no "session" and no dates of work in the product
packages' sources, and ``benchmarks/RESULTS.md`` holds current figures only, within its length budget."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository root."""
PRODUCT_PACKAGES = ("engine", "lora", "kernels", "multimodal", "encoders")
"""Packages whose ``.py`` files are scanned."""
RESULTS_MAX_LINES = 400
"""Most lines ``benchmarks/RESULTS.md`` may have: the current figure of each capability; history is in git."""
NARRATION = (
    re.compile(r"\bsessions?\b", re.IGNORECASE),
    re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    re.compile(r"\b(?:twenty|thirty)-(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth)\b",
               re.IGNORECASE),
    re.compile(r"\b(?:eleven|twelf|thirteen|fourteen|fifteen|sixteen|seventeen|eighteen|nineteen|twentie)th\b",
               re.IGNORECASE),
)
"""Words and dates that narrate work: "the twenty-fifth session", "2026-12-01"."""


def _product_sources() -> list[Path]:
    return sorted(p for pkg in PRODUCT_PACKAGES if (ROOT / pkg).is_dir() for p in (ROOT / pkg).rglob("*.py"))


def narration_hits(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line of ``text`` that matches a ``NARRATION`` pattern."""
    return [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1)
            if any(p.search(line) for p in NARRATION)]


def test_patterns_catch_narration():
    assert narration_hits("x = 1  # measured in the twenty-fifth session")
    assert narration_hits('"""Sessions of work."""')
    assert narration_hits("# 2026-12-01: added")
    assert narration_hits("# the nineteenth run")
    assert not narration_hits("def run_soak(cfg):  # a 30 s window, 2,048 rows")


def test_product_sources_do_not_narrate_work():
    sources = _product_sources()
    assert sources, "no product sources found"
    hits = [f"{p.relative_to(ROOT)}:{n}: {line}" for p in sources
            for n, line in narration_hits(p.read_text(encoding="utf-8"))]
    assert not hits, "narration of work in product code (describe what is; cite benchmarks/RESULTS.md " \
                     "sections for measurements):\n" + "\n".join(hits)


def test_results_file_holds_current_figures_only():
    lines = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= RESULTS_MAX_LINES, (
        f"benchmarks/RESULTS.md has {len(lines)} lines (at most {RESULTS_MAX_LINES}): keep the newest figure of "
        "each capability; superseded runs live in git")
