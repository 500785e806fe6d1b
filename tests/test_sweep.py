"""Optuna sweeps on a real SQLite study that survive being killed: the same command again
keeps the finished trials, runs the interrupted one again in its own folder (where training
resumes from its checkpoint) and reaches n_trials; bad sweep input is one line."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from project.engine.distributed.exits import EXIT_PREEMPTED
from tests.helpers import ROOT, finish, start

optuna = pytest.importorskip("optuna", reason="sweeps need pip install -e '.[sweep]'")

SWEEP = ["-m", "hparams_search=optuna", "hydra.sweeper.n_trials=3", "trainer.max_epochs=3",
         "test=false", "callbacks.early_stopping=null"]  # fmt: skip


def sweep(base_args: list[str], *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), *SWEEP, *base_args, *extra]


def wait_for(path: Path, proc, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists(), f"{path} never appeared"


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_killed_sweep_resumes_where_it_stopped(base_args, log_dir, signum) -> None:
    folder = log_dir / "train" / "multiruns" / "search"
    # Trial 1 saves from step 5 on: its first checkpoint leaves it ~100 more steps, so the
    # signal lands while it trains even on a fast machine (a fixed sleep after the first save
    # was longer than the whole rest of the trial on one).
    args = [*base_args, "callbacks.fault_tolerance.every_n_train_steps=5"]
    proc = start(sweep(args), RUN_ID="search")
    wait_for(folder / "1" / "checkpoints" / "last.ckpt", proc)  # trial 0 done, trial 1 training
    proc.send_signal(signum)
    first = (folder / "0" / "metrics.json").read_bytes()
    code, out = finish(proc, 90)
    assert code == (EXIT_PREEMPTED if signum == signal.SIGTERM else -signal.SIGKILL), out[-3000:]

    code, out = finish(start(sweep(args), RUN_ID="search"), 400)  # the same command again
    assert code == 0, out[-3000:]
    assert "Trial 1 was running when the sweep stopped: it runs again" in out
    assert f"resuming from {folder / '1' / 'checkpoints' / 'last.ckpt'}" in out
    assert (folder / "0" / "metrics.json").read_bytes() == first  # trial 0 was not run again
    study = optuna.load_study(study_name="train", storage=f"sqlite:///{folder / 'optuna.db'}")
    states = [t.state.name for t in study.trials]
    assert states == ["COMPLETE", "FAIL", "COMPLETE", "COMPLETE"], states
    assert study.trials[2].params == study.trials[1].params  # the interrupted trial, again
    assert study.trials[2].user_attrs["job_folder"] == 1  # ...in its own folder
    best = min((t for t in study.trials if t.value is not None), key=lambda t: t.value)
    assert f"Best trial {best.number} (folder" in out
    results = (folder / "optimization_results.yaml").read_text()
    assert f"best_value: {best.value}" in results and "ended_trials: 3" in results


SEARCH = """# @package _global_
defaults:
  - optuna
hydra:
  sweeper:
    params:
      {param}
"""


@pytest.mark.parametrize(
    ("param", "extra", "line"),
    [
        ("model.optimizer.lrr: choice(0.1, 0.2)", [],
         "error: hydra.sweeper.params.model.optimizer.lrr: the config has no key"),
        ("data.batch_size: 64", [], "error: hydra.sweeper.params.data.batch_size=64: use choice("),
        ("data.batch_size: choice(32, 64)", ["hydra.sweeper.n_trails=3"],
         "error: `hydra.sweeper.n_trails` is not a key of the config: did you mean "
         "`hydra.sweeper.n_trials`?"),
    ],
    ids=["misspelt-key", "not-a-search-space", "unknown-sweeper-option"],
)  # fmt: skip
def test_bad_sweep_input_is_one_line(base_args, tmp_path, param, extra, line) -> None:
    """A search file of the user's own (--config-dir), with a mistake in it."""
    (tmp_path / "hparams_search").mkdir()
    (tmp_path / "hparams_search" / "mine.yaml").write_text(SEARCH.format(param=param))
    cmd = sweep(base_args, "hparams_search=mine", *extra, f"--config-dir={tmp_path}")
    code, out = finish(start(cmd, RUN_ID="bad"), 60)
    assert code == 2 and line in out and "Traceback" not in out, out[-2000:]


def test_a_study_file_that_is_not_sqlite_is_left_alone(base_args, log_dir) -> None:
    db = log_dir / "train" / "multiruns" / "notdb" / "optuna.db"
    db.parent.mkdir(parents=True)
    db.write_text("my notes, not a database\n")
    code, out = finish(start(sweep(base_args), RUN_ID="notdb"), 60)
    assert code == 2 and f"error: {db} is not an SQLite database" in out, out[-2000:]
    assert db.read_text() == "my notes, not a database\n"


def test_interrupted_trials_do_not_count_and_failed_ones_do() -> None:
    """ended(): a trial killed with the sweep is replaced by its retry (even twice); a trial
    that raised counts, so a config that always fails cannot loop forever."""
    from project.engine.cluster.sweeper import FOLDER, ended

    study = optuna.create_study()
    fail, dist = optuna.trial.TrialState.FAIL, optuna.distributions.FloatDistribution(0, 1)

    def trial(folder: int, value: float | None) -> None:
        t = study.ask({"x": dist})
        t.set_user_attr(FOLDER, folder)
        study.tell(t, value) if value is not None else study.tell(t, state=fail)

    trial(0, 0.5)  # finished
    trial(1, None)  # killed with the sweep (FAIL) ...
    assert ended(study) == 2  # ...counted until its retry exists (the sweeper subtracts it)
    trial(1, None)  # its retry, killed again
    assert ended(study) == 2
    trial(1, 0.25)  # the retry that finished: trials 1 and 2 are replaced by it
    assert ended(study) == 2
    trial(3, None)  # raised: ends as FAIL, counts
    assert ended(study) == 3
