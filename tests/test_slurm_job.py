"""How a sweep job that submitit started on SLURM sets up torchrun on its node (no SLURM
needed: the job's environment is given; tests/test_slurm.py runs it on a real cluster)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from project.engine.cluster import slurm_job
from project.engine.errors import UserError
from tests.helpers import ROOT, child_env

pytestmark = pytest.mark.quick  # the fast tier: `make test`

JOB = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "4321", "SLURM_NNODES": "2",
       "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_NODELIST": "node7",
       "SLURM_CPUS_PER_TASK": "8"}  # fmt: skip


@pytest.fixture(autouse=True)
def no_controller(monkeypatch, tmp_path) -> None:
    """JOB's node is made up: asking a real (or an unreachable) controller about it takes
    seconds per call. An scontrol that fails at once: the head node is the node list's first."""
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def trainer(**kw):
    return OmegaConf.create({"devices": "auto", "num_nodes": "auto", **kw})


def test_only_a_submitit_slurm_job_is_one() -> None:
    assert slurm_job.active(JOB)
    assert not slurm_job.active({k: v for k, v in JOB.items() if k != "SUBMITIT_EXECUTOR"})
    assert not slurm_job.active({"SUBMITIT_EXECUTOR": "local"})


def test_torchrun_per_node_as_the_sbatch_recipe() -> None:
    env = slurm_job.node_env(trainer(devices=4), JOB)
    assert (env["NNODES"], env["NPROC_PER_NODE"], env["RDZV_ID"]) == ("2", "4", "slurm-4321")
    # A port of this job's own (as launch/slurm.sbatch), threads: the task's CPUs / processes.
    assert env["RDZV_ENDPOINT"].endswith(f":{20000 + 4321 % 40000}")
    assert env["OMP_NUM_THREADS"] == "2"
    assert not slurm_job.active(env)  # the workers report errors as any torchrun worker
    gpus = slurm_job.node_env(trainer(), {**JOB, "SLURM_GPUS_ON_NODE": "8"})
    assert gpus["NPROC_PER_NODE"] == "8"  # devices=auto: every GPU of the node
    assert slurm_job.node_env(trainer(num_nodes=2), JOB)["NNODES"] == "2"


@pytest.mark.parametrize(
    ("cfg", "env", "message"),
    [
        (
            trainer(num_nodes=4),
            JOB,
            "trainer.num_nodes=4 but this SLURM job has 2 node(s): set hydra.launcher.nodes=4",
        ),
        (
            trainer(),
            {**JOB, "SLURM_NTASKS_PER_NODE": "2(x2)"},
            "hydra.launcher.tasks_per_node=2(x2): keep 1",
        ),
        (
            trainer(devices="many"),
            JOB,
            "trainer.devices='many' must be a number of processes or auto",
        ),
    ],
)
def test_a_mismatch_is_one_line(cfg, env, message) -> None:
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        slurm_job.node_env(cfg, env)


def test_without_the_slurm_extra_the_launcher_says_how_to_install_it() -> None:
    code = ("import sys; sys.modules['hydra_plugins.hydra_submitit_launcher'] = None; "
            "sys.argv = ['train.py', '-m', 'hydra/launcher=submitit_slurm']; "
            "from project.train import main; main()")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env=child_env(), timeout=60)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: hydra/launcher=submitit_slurm needs the slurm extra: pip install -e '.[slurm]'"
    )


def test_without_accounting_a_job_that_left_the_queue_has_ended() -> None:
    from project.engine.cluster.slurm_queue import QueueWatcher

    watcher = QueueWatcher()
    for job_id in ("5", "6_0", "6_1", "6_2"):
        watcher.register_job(job_id)
    info = watcher.read_info(b"6_0|RUNNING\n6_[1-2]|PENDING\n")  # squeue --array --format=%i|%T
    states = {job_id: info[job_id]["State"] for job_id in ("5", "6_0", "6_1", "6_2")}
    assert states == {"5": "LEFT_QUEUE", "6_0": "RUNNING", "6_1": "PENDING", "6_2": "PENDING"}
    watcher._info_dict.update(info)
    assert watcher.is_done("5", mode="cache") and not watcher.is_done("6_1", mode="cache")
