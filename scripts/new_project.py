#!/usr/bin/env python3
"""Stamp out a renamed copy of this template (standard library only).

    python scripts/new_project.py ../my-net --package mynet --name my-net \\
        --author "Ada Lovelace" --email ada@example.com --description "Digits, but bigger"
    python scripts/new_project.py . --in-place --package mynet   # a "use this template" clone
    python scripts/new_project.py ../lean --package lean --without slurm,k8s,sweeps,doctor

Copies the git-tracked files (never .venv, logs, data caches), renames src/project to
src/<package>, and rewrites `project` only where it names the package: imports, dotted paths
(Hydra `_target_`, `-m project.train`, logger names), `src/project` paths, the pyproject
name/scripts/tool settings, and the launch recipes' job names. The word in prose and keys that
merely share it (the `[project]` table of pyproject.toml) stay. Afterwards ruff (`tidy`) makes
the new project lint-clean under its own name, it checks that no `project` import is left (exit
1 if one is) and lists the remaining plain-text mentions.

`--without` leaves optional features out (FEATURES below): their own files, and in the shared
files the lines marked for them, which is each feature's one seam to the rest: a block between
a `feature:NAME` line and a `/feature:NAME` line, or a single line ending in `# feature:NAME`.
Markdown table rows that name a file left out go too (README's map of the docs, its layout).
"""

from __future__ import annotations

import argparse
import importlib.util
import keyword
import re
import shutil
import subprocess
import sys
from pathlib import Path

OLD = "project"
# Files that belong to the template only: the generator, its tests, the copier front-end.
TEMPLATE_ONLY = {
    "scripts/new_project.py",
    "tests/test_new_project.py",
    "copier.yml",
    ".copier-answers.yml.jinja",
}
# Optional features: the files (or folders, ending in /) that are each one's own.
FEATURES = {
    "slurm": ["launch/slurm.sbatch", "configs/hydra/launcher/", "docs/slurm.md",
              "src/hydra_plugins/submitit_slurm_launcher.py",
              f"src/{OLD}/engine/cluster/slurm_job.py", f"src/{OLD}/engine/cluster/slurm_queue.py",
              "tests/test_slurm.py", "tests/test_slurm_job.py", "tests/slurm_cluster.sh"],
    "k8s": ["launch/k8s/", "tests/test_k8s.py"],
    "sweeps": ["configs/hparams_search/", "src/hydra_plugins/optuna_sqlite_sweeper.py",
               f"src/{OLD}/engine/cluster/sweeper.py", "tests/test_sweep.py", "docs/sweeps.md"],
    "tracking": ["configs/logger/mlflow.yaml", "configs/logger/wandb.yaml",
                 "configs/logger/many.yaml", f"src/{OLD}/engine/lightning/tracking.py",
                 "tests/test_tracking.py", "docs/tracking.md"],
    "doctor": [f"src/{OLD}/doctor/", "tests/test_doctor.py", "docs/doctor.md"],
    "raw": [f"src/{OLD}/raw_train.py", f"src/{OLD}/engine/raw/", f"src/{OLD}/compare.py",
            f"src/{OLD}/bench/", "tests/test_raw_parity.py", "tests/test_bench.py",
            "docs/raw-trainer.md",
            "docs/compare.png"],
}  # fmt: skip
# What the docs (README.md, docs/*.md) say of each optional feature: a paragraph, list item,
# table row or code block still naming one after the marked spans went (strip_features) goes
# with it, then a heading whose section is left empty; tests check no variant's docs name a
# feature it left out.
MENTIONS = {
    "slurm": [r"slurm\.sbatch", r"submitit", r"\.\[slurm\]", r"slurm\.md", r"\bsbatch\b",
              r"SLURM\s+recipe", r"SLURM\s+test\s+cluster"],
    "k8s": [r"launch/k8s", r"\bk8s\b", r"kubectl", r"pytorchjob", r"trainjob",
            r"Kubernetes\s+(?:object-storage\s+)?(?:recipe|manifest)"],
    "sweeps": [r"hparams_search", r"optuna", r"\.\[sweep\]", r"sweeps\.md"],
    "tracking": [r"mlflow", r"wandb", r"\bW&B\b", r"\.\[track\]", r"tracking\.md"],
    "doctor": [rf"{OLD}\.doctor", r"doctor\.md", r"\bthe doctor\b"],
    "raw": [r"raw[_\s-]+train", r"raw-trainer\.md", rf"{OLD}\.compare", r"compare command",
            r"TRAINER=raw", r"raw\s+PyTorch",
            r"compare\.png", r"\.\[plot\]", rf"{OLD}\.bench"],
}  # fmt: skip
# Copied but never rewritten: copier's record of the template it came from.
VERBATIM = {".copier-answers.yml"}
# Import names of the dependencies: a package named like one would shadow it.
TAKEN = {
    "torch", "lightning", "pytorch_lightning", "hydra", "omegaconf", "torchmetrics", "rich",
    "tensorboard", "sklearn", "numpy", "pytest", "ruff", "copier", "tests", "src",
}  # fmt: skip

IMPORT = re.compile(rf"^\s*(from|import)\s+{OLD}\b", re.M)
DOTTED_USE = re.compile(rf"(_target_:\s*|-m\s+|[\"']){OLD}\.[A-Za-z_]")


class Refused(Exception):
    """Bad input: nothing was written."""


def validate_package(package: str) -> None:
    if not re.fullmatch(r"[a-z_][a-z0-9_]*", package):
        raise Refused(
            f"--package {package!r} is not a valid package name: use lowercase letters, "
            "digits and underscores, not starting with a digit (e.g. my_net)"
        )
    if keyword.iskeyword(package) or package in sys.stdlib_module_names or package in TAKEN:
        raise Refused(
            f"--package {package!r} is a Python keyword, a standard-library module or a "
            "dependency's import name: pick another name"
        )


def validate_name(name: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?", name):
        raise Refused(f"--name {name!r} is not a valid distribution name (letters, digits, . _ -)")


def tracked_files(template: Path) -> list[str]:
    """The template's git-tracked files (what a fresh clone has)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(template), "ls-files", "-z"],
            capture_output=True, check=True, text=True,
        )  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        raise Refused(
            f"{template} is not a git checkout: clone the template with git and run this "
            "script from that clone"
        ) from None
    return [f for f in out.stdout.split("\0") if f]


def rewrite(text: str, rel: str, package: str, name: str, description: str) -> str:
    """`project` -> the new names wherever it is an identifier in file `rel`."""
    text = re.sub(rf"\bsrc/{OLD}\b", f"src/{package}", text)
    # Dotted module paths (imports, _target_, -m project.x, "project.train" logger names),
    # but not TOML tables such as [project.scripts].
    text = re.sub(rf"(?<![\w.\-\[/]){OLD}(?=\.[A-Za-z_])", package, text)
    text = re.sub(rf"(?<=\bfrom ){OLD}(?= import\b)", package, text)
    text = re.sub(rf"(?<=\bimport ){OLD}\b(?!-)", package, text)
    if rel.endswith(".py"):
        text = re.sub(rf'(?<=["\']){OLD}(?=["\'])', package, text)  # getLogger("project")
    if rel == "pyproject.toml":
        text = re.sub(rf'^name = "{OLD}"', f'name = "{name}"', text, flags=re.M)
        text = re.sub(r'^description = ".*"', f'description = "{description}"', text, flags=re.M)
        text = re.sub(rf'"{OLD}"', f'"{package}"', text)  # known-first-party, coverage source
        text = re.sub(rf"^{OLD}-(\w+) =", rf"{name}-\1 =", text, flags=re.M)  # console scripts
    if rel.startswith("launch/"):
        # job, image and volume names in the recipes
        text = re.sub(rf"(?<![\w.])(k8s-)?{OLD}(?=[-:])", lambda m: f"{m[1] or ''}{name}", text)
        text = re.sub(rf"/workspace/{OLD}\b", f"/workspace/{name}", text)
    if rel.endswith(".md"):
        # The names the launch recipes and pyproject's scripts take (project-consolidate,
        # the Kubernetes secret and volume, k8s-project-train), as they are renamed there.
        text = re.sub(rf"(?<![\w.])(k8s-)?{OLD}(?=-[a-z])", lambda m: f"{m[1] or ''}{name}", text)
        # What documents the generator itself: the new project no longer contains it.
        text = re.sub(r"<!-- template-only -->.*?<!-- /template-only -->\n*", "", text, flags=re.S)
        text = re.sub(r"^\| `scripts/new_project\.py`.*\n", "", text, flags=re.M)
    if rel == "README.md":
        first, _, rest = text.partition("\n")
        if first.startswith(f"# {OLD}"):
            origin = "Made from the Lightning + Hydra project starter."
            text = f"# {name}\n\n{description}\n\n{origin}\n{rest}"
    return text


def parse_without(value: str | None) -> set[str]:
    """`--without a,b`: the optional features to leave out (all must be known)."""
    names = {n.strip() for n in (value or "").split(",") if n.strip()}
    if unknown := sorted(names - set(FEATURES)):
        raise Refused(
            f"--without {','.join(unknown)}: not an optional feature; choose from "
            f"{','.join(FEATURES)}"
        )
    return names


def left_out(rel: str, without: set[str]) -> bool:
    """Whether template file `rel` belongs to a feature left out."""
    own = [f for name in without for f in FEATURES[name]]
    return any(rel == f or (f.endswith("/") and rel.startswith(f)) for f in own)


def kept_files(files: list[str], without: set[str]) -> list[str]:
    """The files of the new project: no left-out feature's files, and no package folder left
    holding only its __init__.py."""
    kept = [f for f in files if not left_out(f, without)]
    folders = {str(Path(f).parent) for f in kept if not f.endswith("__init__.py")}
    return [f for f in kept if not f.endswith("__init__.py") or str(Path(f).parent) in folders
            or any(d.startswith(str(Path(f).parent) + "/") for d in folders)]  # fmt: skip


BLOCK = re.compile(r"^\s*(?:#|<!--)\s*(/?)feature:(\w+)\s*(?:-->)?\s*$")
INLINE = re.compile(r"\s+#\s*feature:(\w+)\s*$")
SPAN = re.compile(r" ?<!-- feature:(\w+) -->(.*?)<!-- /feature:\1 -->", re.S)


def strip_features(text: str, rel: str, without: set[str]) -> str:
    """The lines of `text` marked for a left-out feature removed, every marker removed, and
    (markdown) the table rows naming a left-out file."""
    gone = [f for name in without for f in FEATURES[name]]
    gone += [f"({Path(f).name})" for f in gone if f.startswith("docs/")]  # links inside docs/
    gone += [f"({Path(f).name}#" for f in gone if f.startswith("docs/")]
    gone += [f"`{f.removeprefix(f'src/{OLD}/')}`" for f in gone if f.startswith(f"src/{OLD}/")]
    # Inline spans (markdown): `<!-- feature:raw -->(raw trainer: last.pt)<!-- /feature:raw -->`
    text = SPAN.sub(lambda m: "" if m[1] in without else m[2], text)
    out: list[str] = []
    open_blocks: list[str] = []
    for line in text.splitlines(keepends=True):
        block = BLOCK.match(line)
        if block:
            closing, name = block.groups()
            if closing:
                open_blocks.remove(name)
            else:
                open_blocks.append(name)
            continue
        if any(name in without for name in open_blocks):
            continue
        inline = INLINE.search(line)
        if inline:
            if inline.group(1) in without:
                continue
            line = line[: inline.start()] + "\n"
        if rel.endswith(".md") and line.lstrip().startswith("|") and any(g in line for g in gone):
            continue
        out.append(line)
    return "".join(out)


def strip_mentions(text: str, without: set[str]) -> str:
    """Markdown `text` without the blocks (paragraph, list item, table row, fenced code)
    that mention a left-out feature (MENTIONS), nor the headings whose section is then empty."""
    found = [re.compile(p, re.I) for name in without for p in MENTIONS[name]]
    if not found:
        return text
    kept = [b for b in md_blocks(text) if not any(p.search(b) for p in found)]
    out: list[str] = []
    for i, block in enumerate(kept):
        level = len(block) - len(block.lstrip("#")) if block.startswith("#") else 0
        if level:  # a heading stays while its section holds anything but deeper headings
            rest = kept[i + 1 :]
            end = next((j for j, b in enumerate(rest) if b.startswith("#")
                        and len(b) - len(b.lstrip("#")) <= level), len(rest))  # fmt: skip
            if all(not b.strip() or b.startswith("#") for b in rest[:end]):
                continue
        out.append(block)
    # Blank lines left where blocks went are squeezed, but not inside fenced code (two blank
    # lines before a class are what ruff's formatter, which reads docs' code too, wants).
    parts = re.split(r"(^[ \t]*```.*?^[ \t]*```[ \t]*$)", "".join(out), flags=re.M | re.S)
    text = "".join(p if p.lstrip().startswith("```") else re.sub(r"\n{3,}", "\n\n", p)
                   for p in parts)  # fmt: skip
    # A table whose rows all went: its header and separator go too.
    return re.sub(r"^\|[^\n]*\|\n\|[ :|-]+\|\n(?!\|)", "", text, flags=re.M)


ITEM = re.compile(r"\s*[-*] |\s*\d+\. ")


def md_blocks(text: str) -> list[str]:
    """`text` cut into blocks that join back to it: fenced code, a table row, a list item
    with its indented lines, a heading, a paragraph, blank lines."""
    blocks: list[str] = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line, j = lines[i], i + 1
        if line.lstrip().startswith("```"):
            while j < len(lines) and not lines[j].lstrip().startswith("```"):
                j += 1
            j = min(j + 1, len(lines))
        elif ITEM.match(line):  # an item: its indented lines, until a blank or the next item
            while j < len(lines) and lines[j].startswith("  ") and not ITEM.match(lines[j]):
                j += 1
        elif line.strip() and not line.startswith(("|", "#")):  # a paragraph
            while (
                j < len(lines)
                and lines[j].strip()
                and not ITEM.match(lines[j])
                and not (lines[j].startswith(("|", "#", "```")))
            ):
                j += 1
        blocks.append("".join(lines[i:j]))
        i = j
    return blocks


def add_author(text: str, author: str | None, email: str | None) -> str:
    if not author:
        return text
    entry = f'{{ name = "{author}"' + (f', email = "{email}"' if email else "") + " }"
    return re.sub(r"^(license = .*)$", rf"\1\nauthors = [{entry}]", text, count=1, flags=re.M)


def generate(args: argparse.Namespace) -> Path:
    template = Path(__file__).resolve().parents[1]
    validate_package(args.package)
    name = args.name or args.package.replace("_", "-")
    validate_name(name)
    without = parse_without(args.without)
    tracked = [f for f in tracked_files(template) if f not in TEMPLATE_ONLY]
    files = kept_files(tracked, without)
    if not (template / "src" / OLD).is_dir():
        raise Refused(f"{template}/src/{OLD} does not exist: this checkout was renamed already")
    dest = Path(args.destination).resolve()
    if args.in_place:
        if dest != template:
            raise Refused(
                "--in-place renames the checkout this script is in: pass '.' from its root"
            )
    elif dest.exists():
        raise Refused(f"{dest} already exists: choose a new destination (nothing was written)")

    description = args.description or f"{name}: a Lightning + Hydra project"
    new_src = f"src/{args.package}/"
    for rel in files:
        target_rel = new_src + rel[len(f"src/{OLD}/") :] if rel.startswith(f"src/{OLD}/") else rel
        source, target = template / rel, dest / target_rel
        if not source.is_file():  # deleted in the working tree but still tracked
            continue
        data, mode = source.read_bytes(), source.stat().st_mode
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = None  # binary: copied as is
        if text is not None and rel not in VERBATIM:
            text = strip_features(text, rel, without)
            if rel.endswith(".md"):
                text = strip_mentions(text, without)
            text = rewrite(text, rel, args.package, name, description)
            if rel == "pyproject.toml":
                text = add_author(text, args.author, args.email)
            data = text.encode("utf-8")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        target.chmod(mode)  # keeps executable bits (launch scripts, .ci/run)
        if args.in_place and target != source:
            source.unlink()
    if args.in_place:
        for rel in set(tracked) - set(files):  # the features left out
            (template / rel).unlink(missing_ok=True)
        shutil.rmtree(template / "src" / OLD, ignore_errors=True)
        for rel in TEMPLATE_ONLY:
            path = template / rel
            path.unlink(missing_ok=True)
            if path.parent != template and not any(path.parent.iterdir()):
                path.parent.rmdir()  # scripts/ held only the generator
    return dest


def tidy(dest: Path) -> str | None:
    """Lint-clean under the new name and without the features left out, as the project's
    `make lint` checks it (ruff, with the project's own settings): imports only a left-out
    block used removed, imports sorted again, code wrapped again (a shorter name lets a
    wrapped line fit, a longer one pushes lines past the limit), and a line that still runs
    past it (prose or a string naming the package) marked `# noqa: E501`. A note instead
    where this Python has no ruff."""
    if importlib.util.find_spec("ruff") is not None:
        ruff = [sys.executable, "-m", "ruff"]
    elif shutil.which("ruff"):
        ruff = ["ruff"]
    else:
        return "ruff is not installed here: run `make format` in the new project first"
    for args in (["check", "--fix", "--select", "F401,I"], ["format"],
                 ["check", "--add-noqa", "--select", "E501"]):  # fmt: skip
        subprocess.run([*ruff, *args, "--no-cache", "--quiet", "."], cwd=dest,
                       capture_output=True, check=False)  # fmt: skip
    return None


def leftovers(dest: Path) -> tuple[list[str], list[str]]:
    """(package imports still naming `project`: errors, plain-text mentions: for review)."""
    errors, mentions = [], []
    for path in sorted(dest.rglob("*")):
        if not path.is_file() or ".git" in path.parts or ".venv" in path.parts:
            continue
        try:
            text = path.read_text("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        rel = path.relative_to(dest)
        for lineno, line in enumerate(text.splitlines(), 1):
            if IMPORT.search(line) or DOTTED_USE.search(line):
                errors.append(f"{rel}:{lineno}: {line.strip()}")
            elif re.search(rf"\b{OLD}\b", line, re.I):
                mentions.append(f"{rel}:{lineno}: {line.strip()}")
    return errors, mentions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "destination", help="new project folder (must not exist), or . with --in-place"
    )
    parser.add_argument("--package", required=True, help="import name, e.g. mynet")
    parser.add_argument("--name", help="distribution name (default: package with - for _)")
    parser.add_argument("--author", help="author name for pyproject.toml")
    parser.add_argument("--email", help="author email for pyproject.toml")
    parser.add_argument("--description", help="one-line description")
    parser.add_argument("--in-place", action="store_true", help="rename this checkout itself")
    parser.add_argument(
        "--without",
        metavar="FEATURES",
        help=f"optional features to leave out, comma-separated: {','.join(FEATURES)}",
    )
    args = parser.parse_args(argv)
    try:
        dest = generate(args)
    except Refused as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    note = tidy(dest)
    errors, mentions = leftovers(dest)
    if errors:
        print("error: these lines still use the package 'project':", file=sys.stderr)
        print("\n".join(f"  {e}" for e in errors), file=sys.stderr)
        return 1
    print(f"Created {dest} (package {args.package}).")
    if args.without:
        print(f"Left out: {', '.join(sorted(parse_without(args.without)))}.")
    if note:
        print(note)
    if mentions:
        print(f"Plain-text mentions of '{OLD}' left for you to review ({len(mentions)}):")
        print("\n".join(f"  {m}" for m in mentions))
    if args.in_place:
        print("Next: git add -A && make test && git commit -m 'Rename the template'")
    else:
        print(f"Next: cd {dest} && git init -q && git add -A && make test")
    return 0


if __name__ == "__main__":
    sys.exit(main())
