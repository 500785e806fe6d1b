"""The layout promises: your code apart from the machinery, no import loops, light modules,
small folders, private APIs touched in one place, test files that import no other test file."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.quick  # the fast tier: `make test`

PACKAGE = ROOT / "src" / "project"


def module_name(path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def project_imports(lazy: bool = False) -> dict[str, set[str]]:
    """project module -> the project modules it imports (at module level, or anywhere)."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        deps = set()
        for node in ast.walk(tree) if lazy else tree.body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("project"):
                deps.add(node.module)
                deps |= {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("project")}
        graph[module_name(path)] = deps
    return {m: {d for d in deps if d in graph} for m, deps in graph.items()}


def test_no_import_loops() -> None:
    """Also through imports inside functions: a loop there breaks the first call that runs
    before its modules are loaded."""
    graph = project_imports(lazy=True)
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        assert module not in path, "import loop: " + " -> ".join([*path, module])
        if module in done:
            return
        for dep in graph[module]:
            visit(dep, [*path, module])
        done.add(module)

    for module in graph:
        visit(module, [])


# The engine's sub-packages from the bottom up: each imports those below it (or its own
# layer), never one above, not even inside a function. checkpoints builds on distributed (the
# comm hook's state files are checkpoints/comm_hook_files.py), not the other way round.
LAYERS = (
    ("errors", "private_api", "store"),
    ("launch",),
    ("config",),
    ("data", "shared"),
    ("distributed",),
    ("checkpoints",),
    ("cluster",),
    ("run",),
    ("lightning", "raw"),
)


def test_the_engine_imports_downward_only() -> None:
    """Lazy and type-checking imports count: an upward import inside a method is still a loop
    between two packages (distributed/comm_hooks.py once imported checkpoints/state.py so)."""
    level = {f"project.engine.{name}": i for i, names in enumerate(LAYERS) for name in names}

    def layer(module: str) -> int | None:
        return level.get(".".join(module.split(".")[:3]))

    graph = project_imports(lazy=True)
    engine = [m for m in graph if m.startswith("project.engine.")]
    assert all(layer(m) is not None for m in engine), "place the new package in LAYERS"
    upward = sorted(f"{m} -> {d}" for m in engine for d in graph[m]
                    if layer(d) is not None and layer(d) > layer(m))  # fmt: skip
    assert not upward, f"imports against the engine's layers: {upward}"


def test_your_code_does_not_depend_on_the_machinery() -> None:
    """models/, data/, tasks/ are plain PyTorch: besides each other they may only use the
    one-line error type, and data/ the object-store calls (a remote shard folder)."""
    mine = ("project.models", "project.data", "project.tasks")
    for module, deps in project_imports().items():
        if module.startswith(mine):
            machinery = {d for d in deps if not d.startswith(mine)}
            allowed = {"project.engine", "project.engine.errors", "project.engine.store"}
            assert machinery <= allowed, (module, machinery)


# What entry points import before Hydra has composed: torch and Lightning stay out of it.
LIGHT = [
    "project.engine.launch.env", "project.engine.config.compose", "project.engine.run.console",
    "project.engine.run.cli", "project.engine.run.skeleton", "project.engine.distributed.exits",
    "project.engine.launch.torchrun", "project.engine.private_api", "project.launcher",
    "project.train",
    "project.raw_train",  # feature:raw
]  # fmt: skip


def test_launcher_environment_is_read_without_torch() -> None:
    code = (
        f"import sys, {', '.join(LIGHT)}; "
        "print(sorted(m for m in sys.modules if m.startswith(('torch', 'lightning'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# feature:raw
def test_the_raw_trainer_never_imports_lightning(data_dir, tmp_path) -> None:
    """A whole raw run (checks, data, loop, test) without Lightning: importing it would add
    seconds to every start of a trainer that does not use it."""
    from tests.helpers import QUIET, child_env

    code = (
        "import atexit, sys; from project.raw_train import main; "
        "atexit.register(lambda: print('LOADED', sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('lightning', 'pytorch_lightning')))); main()"
    )
    args = [f"paths.data_dir={data_dir}", f"hydra.run.dir={tmp_path}", "trainer.max_epochs=1",
            "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", *QUIET]  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         env=child_env(), timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "LOADED []" in out.stdout, out.stdout[-500:]


# /feature:raw
def test_ddp_options_read_from_source_match_the_imported_signature() -> None:
    from lightning.pytorch.strategies import DDPStrategy

    from project.engine.distributed.ddp import _ddp_strategy_arguments

    assert _ddp_strategy_arguments() == set(inspect.signature(DDPStrategy.__init__).parameters)


def test_no_folder_holds_more_than_eight_modules() -> None:
    for folder in [PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir())]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= 8, f"{folder.relative_to(ROOT)}: {len(modules)} modules"


MODULE_LINES = 520  # a module one reads at a glance; past it, split by concern


def test_no_module_is_longer_than_a_read_at_a_glance() -> None:
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MODULE_LINES}  # fmt: skip
    assert not long, f"modules over {MODULE_LINES} lines (split them by concern): {long}"


def test_private_apis_are_touched_in_one_module() -> None:
    """Names listed in project.engine.private_api.USED appear nowhere else in src/ (but the
    MLflow logger subclass, which reads its parent's state, and the start-up benchmark)."""
    from project.engine.private_api import USED

    elsewhere = {
        "_run_sanity_check": {"bench/startup.py"},
        "_run_id": {"engine/lightning/tracking.py"},
        "_initialized": {"engine/lightning/tracking.py"},
        "_mlflow_client": {"engine/lightning/tracking.py"},
    }
    import re

    for _, dotted in USED:
        name = next(part for part in dotted.split(".") if part.startswith("_"))
        used = re.compile(rf"\.{name}\b|\bimport\b.*\b{name}\b|^\s+{name},?$", re.M)
        for path in PACKAGE.rglob("*.py"):
            rel = str(path.relative_to(PACKAGE))
            if rel == "engine/private_api.py" or rel in elsewhere.get(name, ()):
                continue
            assert not used.search(path.read_text()), f"{rel} uses {name}: go through private_api"


def test_test_files_import_no_other_test_file() -> None:
    """Shared helpers live in tests/helpers.py (fixtures in conftest.py)."""
    for path in (ROOT / "tests").glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests."):
                allowed = ("tests.helpers", "tests.user_data", "tests.user_model")
                assert node.module in allowed, (path.name, node.module)
