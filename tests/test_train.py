"""Training end to end: the default job, eval on its checkpoints, determinism, 2-process DDP."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from project.train import train
from tests.helpers import (
    ROOT,
    assert_one_line_error,
    finish,
    logged_metrics,
    one_error_line,
    read_scalars,
    run_script,
    start,
    step_losses,
    user_data,
)


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_fast_dev_run_per_model(compose_train, model: str) -> None:
    cfg = compose_train([f"model={model}", "debug=fdr"])
    metrics = train(cfg)
    assert {"train/loss_step", "test/acc"} <= metrics.keys()


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> dict:
    """The default job exactly as `make train` runs it, logs redirected to a temp folder."""
    log_dir = tmp_path_factory.mktemp("logs")
    proc = run_script(
        "train.py", [f"paths.data_dir={data_dir}", f"paths.log_dir={log_dir}"], RUN_ID="default"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"proc": proc, "run_dir": log_dir / "train" / "runs" / "default", "data_dir": data_dir}


def test_default_job_reaches_95_percent(default_run: dict) -> None:
    assert logged_metrics(default_run["proc"].stdout)["test/acc"] >= 0.95


def test_default_job_writes_curves_to_tensorboard(default_run: dict) -> None:
    scalars = read_scalars(default_run["run_dir"] / "tensorboard")
    for tag in ("train/loss", "train/acc", "val/loss", "val/acc", "train/loss_step"):
        assert len(scalars.get(tag, [])) >= 2, f"{tag} missing from TensorBoard: {sorted(scalars)}"
    val_loss = [v for _, v in scalars["val/loss"]]
    assert min(val_loss) < val_loss[0]  # a curve that actually goes down
    assert [v for _, v in scalars["test/acc"]]


def test_run_folder_layout(default_run: dict) -> None:
    run_dir = default_run["run_dir"]
    for name in (".hydra/config.yaml", "config_tree.log", "train.log", "checkpoints/last.ckpt"):
        assert (run_dir / name).is_file(), name


def test_checkpoints_load_with_weights_only(default_run: dict) -> None:
    ckpts = sorted((default_run["run_dir"] / "checkpoints").glob("*.ckpt"))
    assert len(ckpts) >= 2  # last.ckpt and the best one
    for ckpt in ckpts:
        loaded = torch.load(ckpt, map_location="cpu", weights_only=True)
        assert loaded["hyper_parameters"]["net"]["_target_"] == "project.models.mlp.MLP"


def test_eval_reproduces_test_metrics(default_run: dict, tmp_path: Path) -> None:
    run_dir = default_run["run_dir"]
    trained = logged_metrics(default_run["proc"].stdout)  # tested on the best checkpoint
    best = next(p for p in (run_dir / "checkpoints").glob("epoch_*.ckpt"))
    proc = run_script(
        "eval.py",
        [
            f"ckpt_path={best}",
            f"paths.data_dir={default_run['data_dir']}",
            f"paths.log_dir={tmp_path}",
            "trainer.enable_progress_bar=false",
        ],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert logged_metrics(proc.stdout) == pytest.approx(trained, abs=1e-4)


def test_eval_on_last_ckpt_matches_train_tested_on_last(base_args, log_dir, data_dir) -> None:
    args = [*base_args, "trainer.max_epochs=3", "test_ckpt=last"]
    proc = run_script("train.py", args, RUN_ID="last")
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = log_dir / "train" / "runs" / "last" / "checkpoints" / "last.ckpt"
    evaluated = run_script(
        "eval.py", [f"ckpt_path={last}", *base_args[:2], "trainer.enable_progress_bar=false"]
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert logged_metrics(evaluated.stdout) == pytest.approx(logged_metrics(proc.stdout), abs=1e-4)


def test_same_seed_same_losses_runs_never_overwrite_each_other(base_args, log_dir) -> None:
    """The same command twice: two run folders (none named by RUN_ID here), bitwise the same
    losses; another seed, other losses."""
    args = [*base_args, "trainer.max_epochs=2", "trainer.log_every_n_steps=1", "test=false"]
    for _ in range(2):
        proc = run_script("train.py", args)
        assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sorted((log_dir / "train" / "runs").iterdir())
    assert len(runs) == 2, runs
    a, b = (step_losses(run) for run in runs)
    assert len(a) >= 30 and a == b  # bitwise
    other = run_script("train.py", [*args, "seed=1"], RUN_ID="c")
    assert step_losses(log_dir / "train" / "runs" / "c") != a, other.stderr[-2000:]


@pytest.mark.distributed
def test_lightning_launcher_ddp_two_cpu_processes(base_args, log_dir) -> None:
    """`python train.py trainer.accelerator=cpu trainer.devices=2`: DDP on gloo via Lightning's
    own launcher, one run folder, every log line once."""
    args = [*base_args, "trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_epochs=2"]
    proc = run_script("train.py", args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list((log_dir / "train" / "runs").iterdir())
    assert len(runs) == 1, runs
    assert "Starting with 2 processes" in proc.stdout + proc.stderr
    for needle in ("Metrics:", "Training", "Seed set to"):
        assert (proc.stdout + proc.stderr).count(needle) == 1, needle
    log_file = (runs[0] / "train.log").read_text()
    assert log_file.count("Metrics:") == 1
    assert sorted(p.name for p in runs[0].glob("*.log")) == ["config_tree.log", "train.log"]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("refusing", "when"),
    [(1, "built"), (1, "setup"), ("every", "setup")],
    ids=["rank-1-before-the-group", "rank-1-in-the-group", "every-rank"],
)
def test_a_rank_refusing_under_lightnings_launcher_ends_the_job_with_exit_2(
    base_args, tmp_path: Path, refusing: int | str, when: str
) -> None:
    """A rank that exits 2 after its one-line error ends the job with 2, the line shown once
    (issue 53): rank 0 was SIGKILLed by Lightning's watcher (exit 137, read as out of memory)
    while it waited for rank 1 to join, or, once the group was up, reported the collective
    that rank 1 left (exit 1, a second line). No process of the job is left (finish)."""
    data = user_data(tmp_path, "RefusingDataModule", refusing=refusing, when=when)
    cmd = [sys.executable, str(ROOT / "train.py"), *base_args, *data, "trainer.accelerator=cpu",
           "trainer.devices=2", f"hydra.run.dir={tmp_path}/run"]  # fmt: skip
    code, out = finish(start(cmd), timeout=120)
    assert code == 2, out[-3000:]
    who = "every rank" if refusing == "every" else "rank 1"
    assert f"the data folder of {who} is missing" in one_error_line(out), out[-3000:]


def test_a_run_early_stopping_ends_says_why_in_both_trainers(base_args, log_dir) -> None:
    """Early stopping ending a 30-epoch run after 2 says so in one line naming the metric, its
    best value and the patience (Lightning said nothing), the same line in both trainers; the
    final metrics line shows a small learning rate as it is (it read lr-AdamW=0.0000)."""
    args = [*base_args, "trainer.max_epochs=30", "trainer.limit_train_batches=5", "test=false",
            "callbacks.early_stopping.patience=1", "callbacks.early_stopping.min_delta=0.5",
            "model.optimizer.lr=0.00002"]  # fmt: skip
    lines = []
    for module in ("project.train", "project.raw_train"):
        proc = run_script(f"-m {module}", args)
        assert proc.returncode == 0, proc.stderr[-2000:]
        said = [ln.split(" - ", 1)[1] for ln in proc.stdout.splitlines() if "Early stopping" in ln]
        assert len(said) == 1, proc.stdout[-3000:]
        lines.append(said[0])
        if module == "project.train":
            assert re.search(r"lr-AdamW=[0-9.]+e-05\b", proc.stdout), proc.stdout[-1000:]
    assert lines[0] == lines[1]
    assert re.fullmatch(
        r"Early stopping after epoch 1: val/loss did not improve for 1 validation checks in a "
        r"row \(best [0-9.]+\); callbacks.early_stopping=null trains on",
        lines[0],
    ), lines[0]


@pytest.mark.parametrize("module", ["project.train", "project.raw_train"])
@pytest.mark.parametrize(
    "override, torch_says, sizes",
    [("model.net.in_features=32", "cannot be multiplied (64x64 and 32x256)", "in_features=32"),
     ("model.task.num_classes=5", "Target", "out_features=5")],
)  # fmt: skip
def test_a_network_that_does_not_fit_the_data_is_one_line(
    base_args, module, override, torch_says, sizes
) -> None:
    """A first layer narrower than the data, or fewer outputs than classes: one line naming
    torch's shapes, the batch's and the network's sizes (it was a 113-line traceback)."""
    args = [*base_args, override, "trainer.max_epochs=1", "trainer.enable_progress_bar=false"]
    proc = run_script(f"-m {module}", args)
    assert_one_line_error(proc, "the network does not fit the data", torch_says,
                          "on a batch of [64, 64] float32, [64] int64", sizes)  # fmt: skip


def test_the_console_says_what_matters_once(data_dir, tmp_path) -> None:
    """Output that is not a terminal, a run stopped and resumed: progress lines (no tqdm
    redraws), the config tree once per run and whole (paths were cut at 80 columns), the
    epochs' checkpoint saves in the log file only, none of Lightning's noise lines."""
    log_dir = tmp_path / ("a_folder_with_a_long_name_" * 4)  # > 80 columns with the run's path
    args = [f"paths.data_dir={data_dir}", f"paths.log_dir={log_dir}", "trainer.max_epochs=4",
            "callbacks.progress_bar.lines_every_s=0", "test=false"]  # fmt: skip
    stop = ["fault_injection.at_step=25", "fault_injection.mode=sigterm"]
    first = run_script("-m project.train", [*args, *stop], RUN_ID="screen")
    assert first.returncode == 143, first.stdout[-3000:] + first.stderr[-3000:]
    again = run_script("-m project.train", args, RUN_ID="screen")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    run = log_dir / "train" / "runs" / "screen"
    for proc in (first, again):
        screen = proc.stdout + proc.stderr
        assert "\r" not in screen and re.search(r"epoch \d, batch \d+/20 \(\d+%\), step", screen)
        for noise in ("GPU available", "TPU available", "already configured with model summary",
                      "FLOPs", "exists and is not empty", "leaked semaphore"):  # fmt: skip
            assert noise not in screen, noise
        assert screen.count(f"Saved {run}/checkpoints/last.ckpt") == 1, screen[-3000:]
    assert "CONFIG" in first.stdout and f"data_dir: {data_dir}\n" in first.stdout
    assert "CONFIG" not in again.stdout and f"Config tree: {run}/config_tree.log" in again.stdout
    assert f"output_dir: {run}\n" in (run / "config_tree.log").read_text()
    saves = re.findall(r"\]\[(\w+)\] - Saved \S+ at step (\d+)", (run / "train.log").read_text())
    stopped = re.search(r"Stopped by a signal at step (\d+)", first.stdout)[1]
    assert saves == [("DEBUG", "20"), ("INFO", stopped), ("DEBUG", "40"), ("DEBUG", "60"),
                     ("INFO", "80")], saves  # each epoch's end, the stop, the end  # fmt: skip


@pytest.mark.parametrize("module", ["project.train", "project.raw_train"])
def test_a_resume_with_other_callbacks_says_so(base_args, module) -> None:
    """Stopped with early stopping off, resumed by a command that left the `=null` out: it
    stops early now, and one line says the callbacks are not the run's (it said nothing)."""
    args = [*base_args, "trainer.max_epochs=3", "test=false"]
    stop = ["callbacks.early_stopping=null", "fault_injection.at_step=5",
            "fault_injection.mode=sigterm"]  # fmt: skip
    first = run_script(f"-m {module}", [*args, *stop], RUN_ID="cb")
    assert first.returncode == 143, first.stdout[-3000:] + first.stderr[-3000:]
    again = run_script(f"-m {module}", [*args, "callbacks.early_stopping.patience=7"], RUN_ID="cb")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    said = [ln for ln in again.stdout.splitlines() if "callbacks differ" in ln]
    assert len(said) == 1 and "callbacks.early_stopping: off then, on now" in said[0], said


def test_only_the_networks_own_shape_errors_are_taken_for_a_mismatch() -> None:
    """The same torch text from the task's own code is a bug: it keeps its traceback."""
    from torch import nn

    from project.engine.errors import UserError
    from project.engine.shared.shapes import checked_step
    from project.tasks.task import Task

    class Buggy(Task):
        def step(self, batch, metrics):
            self.net(batch[0])
            return torch.zeros(3)[3]  # index 3 is out of bounds: the task's bug

    class Plain(Task):
        def step(self, batch, metrics):
            return self.net(batch[0]).sum()

    batch = (torch.zeros(4, 64), torch.zeros(4, dtype=torch.long))
    with pytest.raises(IndexError, match="out of bounds"):
        checked_step(Buggy(nn.Linear(64, 2)), batch, {}, {"in_features": 64})
    with pytest.raises(UserError, match=r"cannot be multiplied \(4x64 and 32x2\)"):
        checked_step(Plain(nn.Linear(32, 2)), batch, {}, {"in_features": 32})
