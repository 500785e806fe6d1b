"""last.ckpt is always the newest, a run folder is only continued by the same training, a
finished run keeps its results, and bad checkpoint input is one line (exit 2) that leaves
every file as it was. Real runs of both trainers, real checkpoints read back."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    QUIET,
    ROOT,
    SHORT_NO_TEST,
    finish,
    one_error_line,
    read_scalars,
    start,
)

FINISHED = ["trainer.max_epochs=2"]  # the shared finished run's own overrides
TRAINERS = {
    "lightning": ("project.train", "last.ckpt"),
    "raw": ("project.raw_train", "last.pt"),  # feature:raw
}
# The raw trainer's twins of these checks run in the slow tier (make test-slow).
BOTH = [
    "lightning",
    pytest.param("raw", marks=pytest.mark.slow),  # feature:raw
]


def run(module: str, args: list[str], run_id: str | None = None, **env: str) -> tuple[int, str]:
    extra = {"RUN_ID": run_id} if run_id else {}
    return finish(start([sys.executable, "-m", module, *args], **extra, **env), 180)


@pytest.fixture(scope="session")
def finished_runs(tmp_path_factory, data_dir) -> dict[str, Path]:
    """trainer -> the folder of one finished 2-epoch run with test results, trained once per
    session; tests copy it (`finished_copy`) instead of training their own."""
    done: dict[str, Path] = {}

    def get(trainer: str) -> Path:
        if trainer not in done:
            log_dir = tmp_path_factory.mktemp(f"finished-{trainer}")
            args = [f"paths.data_dir={data_dir}", f"paths.log_dir={log_dir}", *QUIET, *FINISHED]
            code, out = run(TRAINERS[trainer][0], args, "done")
            assert code == 0, out[-3000:]
            done[trainer] = log_dir / "train/runs/done"
        return done[trainer]

    return get


def finished_copy(finished_runs, trainer: str, log_dir: Path, run_id: str) -> Path:
    """A copy of the session's finished run as `run_id` in this test's log folder (the run's
    identity is seed, model and data: the log folder is not part of it)."""
    run_dir = log_dir / "train" / "runs" / run_id
    shutil.copytree(finished_runs(trainer), run_dir)
    return run_dir


def test_last_ckpt_is_the_newest_although_val_loss_got_worse(base_args, log_dir) -> None:
    """Step-cadence saves before the first epoch end used to make Lightning write every later
    "last" into last-v1.ckpt; and Lightning 2.6 refreshes save_last only when val/loss improves.
    A learning rate this high makes val/loss worse in later epochs."""
    args = [*base_args, "trainer.max_epochs=5", "test=false", "callbacks.early_stopping=null",
            "callbacks.fault_tolerance.every_n_train_steps=7", "model.optimizer.lr=0.05",
            "model/scheduler=none"]  # fmt: skip
    code, out = run("project.train", args, "a")
    assert code == 0, out[-3000:]
    run_dir = log_dir / "train/runs/a"
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("last*")) == ["last.ckpt"]
    val = [v for _, v in read_scalars(run_dir / "tensorboard")["val/loss"]]
    assert len(val) == 5 and val[-1] > min(val), val  # the last epoch was not the best
    last = torch.load(run_dir / "checkpoints/last.ckpt", weights_only=True)
    assert last["global_step"] == 5 * 20  # the final step: 5 epochs of 20 batches
    assert last["project"]["finished"] is True


@pytest.mark.parametrize("trainer", BOTH)
def test_last_checkpoint_written_every_epoch(base_args, log_dir, trainer) -> None:
    """Also on epochs without validation (check_val_every_n_epoch=2)."""
    module, name = TRAINERS[trainer]
    args = [*base_args, *SHORT_NO_TEST, "trainer.check_val_every_n_epoch=2",
            "fault_injection.at_step=45", "callbacks.early_stopping=null"]  # fmt: skip
    code, out = run(module, args, "e")
    assert code == -9, out[-3000:]  # SIGKILLed in epoch 2 (0-based): no chance to save then
    state = torch.load(log_dir / "train/runs/e/checkpoints" / name, weights_only=True)
    assert state["global_step"] == 40  # the end of epoch 1, which had no validation


@pytest.mark.parametrize("trainer", BOTH)
def test_rerun_of_a_finished_run_keeps_its_results(base_args, log_dir, finished_runs, trainer):
    module, name = TRAINERS[trainer]
    args = [*base_args, *FINISHED]
    run_dir = finished_copy(finished_runs, trainer, log_dir, "done")
    before = {p: p.read_bytes() for p in (run_dir / "metrics.json", run_dir / "checkpoints" / name)}
    assert "test/acc" in json.loads(before[run_dir / "metrics.json"])
    code, out = run(module, args, "done")
    assert code == 0 and "already finished" in out, out[-3000:]
    assert "Training" not in out and "Testing" not in out  # nothing trained or tested again
    for path, content in before.items():
        assert path.read_bytes() == content, f"{path} changed"


@pytest.mark.slow
def test_finished_run_without_results_is_tested_not_trained(base_args, log_dir, finished_runs):
    """Training finished but the process died before testing: the rerun only tests."""
    args = [*base_args, *FINISHED]
    finished_copy(finished_runs, "lightning", log_dir, "t")
    metrics = json.loads((log_dir / "train/runs/t/metrics.json").read_text())
    (log_dir / "train/runs/t/metrics.json").unlink()
    code, out = run("project.train", args, "t")
    assert code == 0 and "Training" not in out and "Testing" in out, out[-3000:]
    again = json.loads((log_dir / "train/runs/t/metrics.json").read_text())
    assert again == pytest.approx(metrics, abs=1e-6)


@pytest.mark.parametrize("trainer", BOTH)
def test_run_folder_refuses_another_config_and_keeps_its_record(
    base_args, log_dir, finished_runs, trainer
) -> None:
    """The same RUN_ID with another seed used to train 0 steps and report the first run's
    results; with another model it crashed loading the checkpoint after overwriting .hydra/."""
    module, name = TRAINERS[trainer]
    run_dir = finished_copy(finished_runs, trainer, log_dir, "same")
    record = (run_dir / ".hydra/config.yaml").read_bytes()
    ckpt = (run_dir / "checkpoints" / name).read_bytes()
    changes = [("seed=7", "seed: 42 there, 7 now"), ("model=cnn", "model.net._target_"),
               ("trainer.max_epochs=5", "the command changed trainer.max_epochs, and with it "
                "the run's model.scheduler.T_max (it follows trainer.max_epochs): 2 there, 5 now"
                ": add model.scheduler.T_max=2 to continue")]  # fmt: skip
    for override, key in changes:
        code, out = run(module, [*base_args, *SHORT_NO_TEST, override], "same")
        assert code == 2, out[-3000:]
        line = one_error_line(out)
        assert key in line and "another RUN_ID" in line, line
    assert (run_dir / ".hydra/config.yaml").read_bytes() == record  # the first record kept
    assert (run_dir / "checkpoints" / name).read_bytes() == ckpt
    assert len(list((run_dir / ".hydra").glob("attempt-*/config.yaml"))) == len(changes)


@pytest.mark.parametrize("trainer", BOTH)
def test_bad_checkpoint_input_is_one_line(base_args, log_dir, tmp_path, trainer) -> None:
    module, name = TRAINERS[trainer]
    # A corrupt last.ckpt in the run folder (auto-resume): named, and left untouched.
    ckpt_dir = log_dir / "train/runs/bad/checkpoints"
    ckpt_dir.mkdir(parents=True)
    (ckpt_dir / name).write_bytes(b"PK\x03\x04 half a checkpoint")
    code, out = run(module, [*base_args, *SHORT_NO_TEST], "bad")
    assert code == 2 and f"{ckpt_dir / name} cannot be read" in one_error_line(out)
    assert (ckpt_dir / name).read_bytes() == b"PK\x03\x04 half a checkpoint"
    # A missing ckpt_path.
    code, out = run(module, [*base_args, *SHORT_NO_TEST, f"ckpt_path={tmp_path}/nope.ckpt"])
    assert code == 2 and "does not exist" in one_error_line(out)
    # The other trainer's checkpoint.
    other = tmp_path / "other"
    other.write_bytes(b"")
    torch.save({"state_dict": {}} if trainer == "raw" else {"model": {}}, other)
    code, out = run(module, [*base_args, *SHORT_NO_TEST, f"ckpt_path={other}"])
    assert code == 2 and "not a checkpoint of this trainer" in one_error_line(out)


def test_auto_resume_off_starts_fresh(base_args, log_dir, finished_runs) -> None:
    finished_copy(finished_runs, "lightning", log_dir, "again")
    args = [*base_args, "trainer.max_epochs=1", "test=false", "auto_resume=false"]
    code, out = run("project.train", args, "again")
    assert code == 0 and "Training" in out, out[-3000:]
    assert "resuming from" not in out and "already finished" not in out


# feature:raw
def test_raw_trainer_resumes_from_an_explicit_checkpoint(base_args, finished_runs, tmp_path):
    """More epochs from a finished run's last.pt: only the new epoch is trained."""
    last = finished_runs("raw") / "checkpoints" / "last.pt"  # read, never written
    state = torch.load(last, weights_only=True)
    assert state["epoch"] == 2 and state["global_step"] > 0
    args = [*base_args, "trainer.max_epochs=3", "step_stats=true", f"ckpt_path={last}",
            f"hydra.run.dir={tmp_path / 'resumed'}"]  # fmt: skip
    code, out = run("project.raw_train", args)
    assert code == 0, out[-3000:]
    resumed = json.loads((tmp_path / "resumed" / "step_stats.json").read_text())
    assert len(resumed["losses"]) == state["global_step"] // 2  # only the third epoch ran


# /feature:raw
@pytest.mark.slow
def test_explicit_checkpoint_of_another_network_is_one_line(base_args, finished_runs) -> None:
    last = finished_runs("lightning") / "checkpoints/last.ckpt"  # read, never written
    code, out = run("project.train", [*base_args, *SHORT_NO_TEST, "model=cnn", f"ckpt_path={last}"])
    assert code == 2
    assert "holds another network (model.net._target_" in one_error_line(out)
    # Another seed, more epochs: allowed from an explicit checkpoint (it starts a new run).
    code, out = run("project.train", [*base_args, "trainer.max_epochs=4", "seed=3",
                                      "test=false", f"ckpt_path={last}"])  # fmt: skip
    assert code == 0 and "resuming from" in out, out[-3000:]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_log_dir_is_one_line(base_args, log_dir) -> None:
    log_dir.mkdir()
    log_dir.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        code, out = run("project.train", [*base_args, *SHORT_NO_TEST])
    finally:
        log_dir.chmod(stat.S_IRWXU)
    assert code == 2 and "cannot be written" in one_error_line(out)


def test_read_only_log_dir_is_one_line_as_root(base_args, log_dir, tmp_path) -> None:
    """root ignores permission bits: a log_dir below a regular file cannot be created."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    args = [*base_args, *SHORT_NO_TEST, f"paths.log_dir={blocker}/logs"]
    code, out = run("project.train", args)
    assert code == 2 and str(blocker) in one_error_line(out)


@pytest.mark.quick
def test_an_unwritable_local_last_folder_is_refused_at_start(compose_train, tmp_path) -> None:
    """Both trainers' checkpoint owner, built in preflight: a `callbacks.fault_tolerance.dirpath`
    that is a file, lies below one or on /proc was found only at the first save, after an
    epoch of training, in a line naming paths.log_dir / paths.data_dir."""
    from project.engine.checkpoints.run import RunCheckpoints
    from project.engine.errors import UserError

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cases = [(blocker, f"{blocker} is a file"), (blocker / "ckpt", f"{blocker} is a file")]
    if Path("/proc").is_dir():  # a virtual filesystem: no folder can be made there, even by root
        cases.append((Path("/proc/x"), "nothing can be created in /proc"))
    for dirpath, reason in cases:
        cfg = compose_train([f"callbacks.fault_tolerance.dirpath={dirpath}"])
        with pytest.raises(UserError) as err:
            RunCheckpoints(cfg, Path(cfg.paths.output_dir), None, {}, {})
        line = str(err.value)
        assert line.startswith(f"callbacks.fault_tolerance.dirpath={dirpath} cannot be written")
        assert reason in line and "give a folder this user may write to" in line, line
    fine = tmp_path / "new" / "ckpt"  # writable: accepted, and nothing is made before a save
    cfg = compose_train([f"callbacks.fault_tolerance.dirpath={fine}"])
    assert RunCheckpoints(cfg, Path(cfg.paths.output_dir), None, {}, {}).last == fine / "last.ckpt"
    assert not (tmp_path / "new").exists()


@pytest.mark.quick
def test_an_unwritable_local_last_folder_stops_before_training(base_args, tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    args = [*base_args, *SHORT_NO_TEST, f"callbacks.fault_tolerance.dirpath={blocker}"]
    code, out = run("project.train", args)
    line = one_error_line(out)
    assert code == 2 and line.startswith(f"error: {args[-1]} cannot be written"), line
    assert "paths.log_dir" not in line and "Training" not in out, out[-3000:]


@pytest.mark.slow
def test_slurm_runs_in_one_allocation_get_their_own_folders(base_args, log_dir) -> None:
    """Two runs in one salloc / batch script (same SLURM_JOB_ID) used to share slurm-<job>;
    the same command again (a requeue) still finds its folder."""
    slurm = {"SLURM_JOB_ID": "4242"}
    for seed in ("1", "2", "1"):
        code, out = run("project.train", [*base_args, "trainer.max_epochs=1", f"seed={seed}"],
                        **slurm)  # fmt: skip
        assert code == 0, out[-3000:]
    folders = sorted(p.name for p in (log_dir / "train/runs").iterdir())
    assert len(folders) == 2 and all(f.startswith("slurm-4242-") for f in folders), folders
    assert "already finished" in out  # the third run is the first one again


def test_save_last_beside_fault_tolerance_is_refused(base_args) -> None:
    code, out = run("project.train", [*base_args, "callbacks.model_checkpoint.save_last=true"])
    assert code == 2 and "writes a second last.ckpt" in one_error_line(out)


@pytest.mark.slow
@pytest.mark.distributed
def test_bad_checkpoint_is_not_restarted_by_torchrun(base_args, log_dir) -> None:
    """With MAX_RESTARTS=3 torchrun used to repeat the same failure 3 more times, each with a
    traceback and torchrun's own error report."""
    ckpt_dir = log_dir / "train/runs/bad/checkpoints"
    ckpt_dir.mkdir(parents=True)
    (ckpt_dir / "last.ckpt").write_bytes(b"not a checkpoint")
    script = str(ROOT / "launch" / "single_node.sh")
    proc = start(
        [script, *base_args, *SHORT_NO_TEST],
        NPROC_PER_NODE="2",
        MAX_RESTARTS="3",
        RUN_ID="bad",
    )
    code, out = finish(proc, 120)
    assert code == 2, out[-3000:]
    # One attempt: each rank prints its line, unless torchrun stopped it first (the first
    # failure makes the agent stop the others); never a second round.
    assert 1 <= out.count("cannot be read") <= 2, out[-3000:]
    for noise in ("Traceback", "ChildFailedError", "exitcode", "will restart", "killed by"):
        assert noise not in out, out[-3000:]
    assert (ckpt_dir / "last.ckpt").read_bytes() == b"not a checkpoint"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("trainer", ["lightning", "raw"])  # feature:raw
def test_ranks_that_would_continue_from_different_checkpoints_stop_in_one_line(
    base_args, finished_runs, tmp_path, trainer
) -> None:
    """Each rank picks its checkpoint before any process group: on node-local disks (or a
    folder changed meanwhile) rank 0 continued from its `last` while the others started from
    scratch, and the run ended in a failed collective. Here each rank is given its own copy
    (ckpt_path interpolated per rank): one line naming both, exit 2, before any loading."""
    module, last = TRAINERS[trainer]
    for rank in (0, 1):
        shutil.copy(finished_runs(trainer) / "checkpoints" / last, tmp_path / f"{rank}-{last}")
    per_rank = f"ckpt_path={tmp_path}/${{oc.env:RANK}}-{last}"
    proc = start([sys.executable, "-m", "project.launcher", "--standalone",
                  "--nproc-per-node=2", "-m", module, *base_args, *FINISHED, per_rank,
                  "trainer.accelerator=cpu"])  # fmt: skip
    code, out = finish(proc, 120)
    assert code == 2, out[-3000:]
    line = one_error_line(out)
    assert "the ranks would continue from different checkpoints" in line, line
    assert "rank 0 on " in line and f"/0-{last}, rank 1 on " in line and f"/1-{last}:" in line
    assert "Restoring states" not in out  # (Lightning's line when it loads one)


def test_callbacks_changed_names_each_setting_and_only_those() -> None:
    from project.engine.checkpoints.resume import callbacks_changed

    run = {"early_stopping": {"monitor": "val/loss", "patience": 3}, "model_checkpoint": None}
    assert callbacks_changed(run, dict(run)) is None
    now = {"early_stopping": {"monitor": "val/loss", "patience": 5}, "model_checkpoint": {}}
    line = callbacks_changed(run, now)
    assert line is not None and "\n" not in line
    assert "callbacks.early_stopping.patience: 3 then, 5 now" in line
    assert "callbacks.model_checkpoint: off then, on now" in line and "monitor" not in line
    # Where checkpoints go follows the machine: a resume from another root is the same run.
    from omegaconf import OmegaConf

    from project.engine.checkpoints.resume import callbacks_record

    here, there = ({"callbacks": {"model_checkpoint": {"dirpath": f"{root}/run/checkpoints",
                                                       "monitor": "val/loss"}}}
                   for root in ("/home/a", "/workspace"))  # fmt: skip
    saved = callbacks_record(OmegaConf.create(here))
    assert callbacks_changed(saved, callbacks_record(OmegaConf.create(there))) is None
