"""The documentation holds together: every relative link of the README, CONTRIBUTING.md and docs/*.md leads to a
file that exists (and, with an anchor, to a heading of it, by GitHub's anchor rule), and docs/performance.md is
what benchmarks/results/*.json say (benchmarks/performance_page.py)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a Markdown page: each heading lower-cased, punctuation but '-' and '_' dropped,
    spaces as '-' (code fences skipped)."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


def _links(page: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+://|mailto:", target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_leads_somewhere(page: Path):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        if not destination.exists():
            shown = destination.relative_to(REPO) if REPO in destination.parents else destination
            broken.append(f"{target}: no file {shown}")
        elif anchor and destination.suffix == ".md" and anchor not in _anchors(destination):
            broken.append(f"{target}: no heading #{anchor} in {destination.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}:\n" + "\n".join(broken)


def test_the_performance_page_is_what_the_results_say():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import performance_page
    finally:
        sys.path.pop(0)
    assert performance_page.main(["--check"]) == 0, "run: python benchmarks/performance_page.py"
    assert "| target | measured | bound | status |" in (REPO / "docs" / "performance.md").read_text()


def test_the_readme_stays_short_and_says_when_to_pick_shardkit():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250, "the README is the front page; detail goes to docs/"
    assert "\n## When to pick shardkit\n" in readme
