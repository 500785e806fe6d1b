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


def test_the_hand_written_torchrun_of_the_elastic_page_is_the_launch_scripts() -> None:
    """docs/elastic.md's own torchrun command passes what launch/multinode.sh passes (its dry
    run with the page's example values: the rendezvous timings, the monitor interval) and the
    variables launch/common.sh exports by default, so the two cannot drift apart."""
    import os
    import shlex
    import subprocess

    page = (ROOT / "docs" / "elastic.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", page, re.S)
    (block,) = [b for b in blocks if "torchrun --nnodes" in b and "--rdzv-conf" in b]
    words = shlex.split(block.replace("\\\n", " "), comments=True)
    at = words.index("torchrun")
    env, doc = dict(w.split("=", 1) for w in words[:at]), words[at + 1 :]
    flags = dict(w.removeprefix("--").split("=", 1) for w in doc if w.startswith("--"))
    example = {"NNODES": flags["nnodes"], "NPROC_PER_NODE": flags["nproc-per-node"],
               "MAX_RESTARTS": flags["max-restarts"], "RDZV_ENDPOINT": flags["rdzv-endpoint"],
               "RDZV_ID": flags["rdzv-id"], "DRY_RUN": "1"}  # fmt: skip
    script = ROOT / "launch" / "multinode.sh"
    base = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    dry = subprocess.run([str(script), *doc[doc.index("-m") + 2 :]], env=base | example,
                         capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    shown = shlex.split(next(ln[2:] for ln in dry.stdout.splitlines() if ln.startswith("+ ")))
    ran = shown[shown.index("project.launcher") + 1 :]
    assert sorted(doc) == sorted(ran), (doc, ran)
    exported = re.findall(
        r'export (\w+)="\$\{\1:-([^}]*)\}"', (script.parent / "common.sh").read_text()
    )
    assert exported and env == dict(exported)
