"""The command line: config-only commands stay light, bad input gets one clear line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import (
    ROOT,
    assert_one_line_error,
    child_env,
    finish,
    one_error_line,
    run_script,
    start,
)

pytestmark = pytest.mark.quick  # the fast tier: `make test`


def imported_modules(args: list[str]) -> set[str]:
    """Top-level modules imported by `python train.py args` (via -X importtime)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", str(ROOT / "train.py"), *args],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln.split("|")[-1].strip() for ln in proc.stderr.splitlines() if "|" in ln]
    return {name.split(".")[0] for name in lines}


@pytest.mark.parametrize("args", [["--help"], ["--cfg", "job"], ["--cfg", "all"]])
def test_config_only_commands_import_no_torch(args: list[str]) -> None:
    # What makes these answer in well under a second: neither torch nor Lightning is loaded.
    modules = imported_modules(args)
    assert "hydra" in modules
    assert not modules & {"torch", "lightning", "pytorch_lightning", "sklearn"}


# Counts the config repositories Hydra builds (each a deep copy of its whole ConfigStore) while
# `train.py args` runs, and prints the count last.
COUNT_REPOSITORIES = """
import atexit, sys
import hydra._internal.config_repository as repository
built = []
init = repository.CachingConfigRepository.__init__
def counted(self, delegate):
    built.append(1)
    init(self, delegate)
repository.CachingConfigRepository.__init__ = counted
atexit.register(lambda: print("repositories:", len(built)))
from project.train import main
main()
"""


def test_help_lists_every_group_from_one_repository() -> None:
    """What keeps `--help` under a second, counted instead of timed: Hydra's own listing
    builds a repository per group and kind (about 120, over half a second); ours builds one
    per listing (app and Hydra groups) besides the one of the composition. Every group and
    option in configs/ is still listed."""
    proc = subprocess.run(
        [sys.executable, "-c", COUNT_REPOSITORIES, "--help"],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "repositories: 3"
    listed = dict(ln.split(": ", 1) for ln in proc.stdout.splitlines() if ": " in ln)
    for folder in (p for p in (ROOT / "configs").rglob("*") if p.is_dir()):
        group = folder.relative_to(ROOT / "configs").as_posix()
        options = sorted(p.stem for p in folder.glob("*.yaml"))
        if options and not group.startswith("hydra"):
            assert listed.get(group) == ", ".join(options), group


def test_cfg_job_shows_composed_config() -> None:
    proc = run_script("train.py", ["--cfg", "job", "model=cnn", "trainer.max_epochs=3"])
    assert proc.returncode == 0
    assert "project.models.cnn.CNN" in proc.stdout and "max_epochs: 3" in proc.stdout


def test_unknown_group_option() -> None:
    proc = run_script("train.py", ["model=nope"])
    assert_one_line_error(proc, "model/nope", "cnn", "mlp")


@pytest.mark.parametrize(
    "override, hint",
    [("trainer.max_epoch=3", "did you mean `trainer.max_epochs`?"),
     ("+trainer.max_epoch=3", "did you mean `trainer.max_epochs`?"),
     ("callbacks.early_stoping=null", "did you mean `callbacks.early_stopping`?"),
     ("+callbacks.early_stoping=null", "did you mean `callbacks.early_stopping`?"),
     ("model.optimizer.lrr=0.1", "did you mean `model.optimizer.lr`?"),
     ("+trainer.foo=1", "drop it")],
)  # fmt: skip
def test_a_misspelt_or_unread_key_is_one_line_with_the_close_match(
    override: str, hint: str, log_dir
) -> None:
    """Hydra's own advice for these is `+key` (a Trainer error seconds later, or a callback
    entry nobody reads: exit 0 with early stopping still on)."""
    proc = run_script("train.py", [override, f"paths.log_dir={log_dir}"])
    assert_one_line_error(proc, override.lstrip("+").split("=")[0], hint)
    assert "+" not in proc.stderr  # no advice to add the key


def test_the_trainer_arguments_checked_are_lightnings() -> None:
    import inspect

    from lightning.pytorch import Trainer

    from project.engine.config.typos import TRAINER_ARGS

    assert set(inspect.signature(Trainer.__init__).parameters) - {"self"} == TRAINER_ARGS


@pytest.mark.parametrize(
    "entry",
    [
        "train.py",
        "-m project.raw_train",  # feature:raw
    ],
)
def test_several_nodes_without_a_launcher_is_one_line(entry: str, log_dir) -> None:
    """Refused before any process starts (it used to print `MEMBER: 1/4` and wait for ten
    minutes); start/finish: a job that waits is killed whole, rank 1 included."""
    target = entry.split() if entry.startswith("-m ") else [str(ROOT / entry)]
    cmd = [sys.executable, *target, "trainer.accelerator=cpu", "trainer.devices=2",
           "trainer.num_nodes=2", f"paths.log_dir={log_dir}"]  # fmt: skip
    code, out = finish(start(cmd), timeout=60)
    line = one_error_line(out)
    assert code == 2 and "trainer.num_nodes=2 needs a launcher" in line, out[-3000:]
    assert "launch/multinode.sh" in line and "MEMBER" not in out


def test_unwritable_data_dir(tmp_path, log_dir) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    proc = run_script("train.py", [f"paths.data_dir={blocker}/data", f"paths.log_dir={log_dir}"])
    assert_one_line_error(proc, "data_dir", str(blocker), "paths.data_dir=")


def test_eval_without_ckpt_path(log_dir) -> None:
    proc = run_script("eval.py", [f"paths.log_dir={log_dir}"])  # no run folder in the repo
    assert_one_line_error(proc, "ckpt_path is required")


def test_eval_missing_checkpoint(tmp_path, log_dir) -> None:
    proc = run_script("eval.py", [f"ckpt_path={tmp_path}/nope.ckpt", f"paths.log_dir={log_dir}"])
    assert_one_line_error(proc, "does not exist")


def test_eval_not_a_checkpoint(tmp_path, log_dir) -> None:
    fake = tmp_path / "fake.ckpt"
    fake.write_text("hello")
    proc = run_script("eval.py", [f"ckpt_path={fake}", f"paths.log_dir={log_dir}"])
    assert_one_line_error(proc, "cannot be read")
