"""Experiment tracking with MLflow: one tracked run per training run, under DDP and across a
preemption and its resume; a tracking server that does not answer is one line."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

from project.engine.distributed.exits import EXIT_PREEMPTED
from tests.helpers import ROOT, finish, free_port, start

pytest.importorskip("mlflow", reason="logger=mlflow needs pip install -e '.[track]'")


def mlflow_runs(db: Path) -> tuple[Any, list[Any]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    expt = client.get_experiment_by_name("train")
    return client, client.search_runs([expt.experiment_id]) if expt else []


@pytest.mark.distributed
def test_one_mlflow_run_per_training_run_under_ddp_and_resume(base_args, log_dir) -> None:
    args = [*base_args, "logger=mlflow", "trainer.max_epochs=4", "test=false",
            "callbacks.early_stopping=null"]  # fmt: skip
    launch = [str(ROOT / "launch" / "single_node.sh")]
    env = {"NPROC_PER_NODE": "2", "RUN_ID": "tracked"}
    # Stopped mid-run by a SIGTERM (every rank stops, last.ckpt saved), then the same command.
    stop = ["fault_injection.at_step=25", "fault_injection.mode=sigterm"]
    code, out = finish(start([*launch, *args, *stop], **env), 240)
    assert code == EXIT_PREEMPTED, out[-3000:]
    code, out = finish(start([*launch, *args], **env), 240)
    assert code == 0 and "resuming from" in out, out[-3000:]
    client, runs = mlflow_runs(log_dir / "mlflow" / "mlflow.db")
    assert len(runs) == 1, [r.info.run_id for r in runs]  # 2 attempts x 2 ranks: one run
    run = runs[0]
    assert run.data.tags["run_dir"] == str(log_dir / "train" / "runs" / "tracked")
    assert run.data.params["trainer/max_epochs"] == "4"  # the composed config as parameters
    assert run.data.params["model/net/_target_"] == "project.models.mlp.MLP"
    history = client.get_metric_history(run.info.run_id, "val/loss")
    steps = [m.step for m in history]
    assert len(steps) == len(set(steps)) == 4, steps  # one value per epoch, none repeated


def test_unreachable_tracking_server_is_one_line(base_args, log_dir) -> None:
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    began = time.monotonic()
    cmd = [sys.executable, str(ROOT / "train.py"), *base_args, "logger=mlflow"]
    code, out = finish(start(cmd, MLFLOW_TRACKING_URI=uri, RUN_ID="offline"), 120)
    assert code == 2, out[-3000:]
    assert f"error: the MLflow tracking server {uri} cannot be reached" in out
    assert "Traceback" not in out and time.monotonic() - began < 90
    assert not (log_dir / "train" / "runs" / "offline" / "checkpoints").exists()


def test_wandb_offline_run_in_the_run_folder(base_args, log_dir) -> None:
    """logger=wandb needs no account or network: one offline run, written into the run folder."""
    pytest.importorskip("wandb")
    cmd = [sys.executable, str(ROOT / "train.py"), *base_args, "logger=wandb",
           "trainer.max_epochs=1"]  # fmt: skip
    code, out = finish(start(cmd, RUN_ID="wb", WANDB_SILENT="true"), 180)
    assert code == 0, out[-3000:]
    runs = list((log_dir / "train" / "runs" / "wb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), runs


def test_a_run_folder_made_again_gets_a_new_mlflow_run(tmp_path) -> None:
    """An attempt in the same run folder logs into the run its first attempt made; the same
    path deleted and made again (a new training, nothing to resume) starts a new run."""
    import shutil

    from project.engine.lightning.tracking import MLflowRun

    uri, run_dir = f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "run"

    def attempt() -> str:
        logger = MLflowRun(str(run_dir), uri, experiment_name="train")
        logger.log_metrics({"x": 1.0}, step=0)
        return logger.run_id

    first = attempt()
    assert attempt() == first  # a resumed attempt: the same MLflow run
    shutil.rmtree(run_dir)
    again = attempt()
    assert again != first
    _, runs = mlflow_runs(tmp_path / "mlflow.db")
    assert sorted(r.info.run_id for r in runs) == sorted([first, again])
