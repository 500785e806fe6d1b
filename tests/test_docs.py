"""README.md and docs/: every relative link and every repository path they name exists, the
README stays short, and dated figures live in docs/performance.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.quick  # the fast tier: `make test`

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
# A path in backticks that starts at a top-level folder of the repository.
PATH = re.compile(r"`((?:configs|src|launch|tests|scripts|schema|docs)/[^`\s*<>]*)`")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown page."""
    found = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, anchor = target.partition("#")
        linked = (page.parent / file).resolve() if file else page
        assert linked.exists(), f"{page.name}: link to {target} goes nowhere"
        if anchor:
            assert anchor in anchors(linked), f"{page.name}: no heading #{anchor} in {file}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_named_paths_exist(page: Path) -> None:
    for path in PATH.findall(page.read_text()):
        if "<" in path or path.endswith("/<name>.py"):
            continue  # a placeholder: src/project/models/<name>.py
        assert (ROOT / path.rstrip("/")).exists(), f"{page.name} names {path}, which does not exist"


def test_readme_is_short_and_undated() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", readme), "dated figures go to docs/performance.md"


def test_every_docs_page_is_in_the_readme_map() -> None:
    readme = (ROOT / "README.md").read_text()
    for page in (ROOT / "docs").glob("*.md"):
        assert f"(docs/{page.name})" in readme, f"docs/{page.name} is missing from the README"
