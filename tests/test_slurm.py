"""launch/slurm.sbatch on a real SLURM: two nodes, submitted from another folder, CPU only,
requeued after a signal and resumed, two jobs side by side. Uses the SLURM that answers here
(two nodes or more), else brings up a one-host cluster with tests/slurm_cluster.sh (root,
Debian packages); skips with the reason where neither works."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import QUIET, ROOT, child_env

# The first test also installs and starts a real SLURM (up to 15 min on a fresh machine).
pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(1800)]


def sh(*cmd: str, timeout: float = 60) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).stdout


@pytest.fixture(scope="module")
def slurm() -> None:
    if shutil.which("sinfo") and len(sh("sinfo", "-h", "-N", "-o", "%N").split()) >= 2:
        return
    proc = subprocess.run([str(ROOT / "tests" / "slurm_cluster.sh")], capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    if proc.returncode != 0:
        pytest.skip(f"no SLURM here: {proc.stderr.strip()[-300:]}")


def submit(cwd: Path, args: list[str], *sbatch: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        ["sbatch", "--parsable", *sbatch, str(ROOT / "launch" / "slurm.sbatch"), *args],
        cwd=cwd, env=env or child_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


JOB_NAME = re.search(r"--job-name=(\S+)", (ROOT / "launch" / "slurm.sbatch").read_text())[1]


def job(job_id: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S+)", sh("scontrol", "show", "job", job_id)))


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def finished(job_id: str, timeout: float = 240) -> dict[str, str]:
    try:
        wait_for(lambda: job(job_id).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED",
                                                           "TIMEOUT", "NODE_FAIL"),
                 timeout, f"job {job_id}")  # fmt: skip
    except AssertionError:
        subprocess.run(["scancel", job_id])
        raise
    return job(job_id)


def run_args(data_dir: Path, log_dir: Path, epochs: int) -> list[str]:
    return [f"paths.data_dir={data_dir}", f"paths.log_dir={log_dir}", "trainer.accelerator=cpu",
            f"trainer.max_epochs={epochs}", "callbacks.early_stopping=null", "test=false",
            *QUIET]  # fmt: skip


def signal_after_first_checkpoint(
    job_id: str, log_dir: Path, *scancel: str, last: str = "last.ckpt"
) -> None:
    """`last`: the file that appears with the first checkpoint (a sharded one's manifest)."""
    path = log_dir / "train/runs" / f"torchrun-slurm-{job_id}" / "checkpoints" / last
    wait_for(path.exists, 180, f"the first checkpoint of job {job_id}")
    subprocess.run(["scancel", *scancel, job_id], check=True, timeout=30)


def test_two_nodes_from_another_folder_requeued_on_a_batch_signal(slurm, data_dir, tmp_path):
    """`--output=logs/slurm/...` failed a fresh clone's first job with no output anywhere, and
    the recipe ran only from the repo root; a signal to the batch shell alone killed it."""
    log_dir, submit_dir = tmp_path / "logs", tmp_path / "elsewhere"
    submit_dir.mkdir()
    job_id = submit(submit_dir, run_args(data_dir, log_dir, 20), "--nodes=2")
    signal_after_first_checkpoint(job_id, log_dir, "--batch", "--signal=USR1")
    state = finished(job_id)
    output = (submit_dir / f"{JOB_NAME}-{job_id}.out").read_text()
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", output[-3000:]
    assert int(state["Restarts"]) >= 1  # requeued by the recipe after the stop (exit 143)
    assert "SIGUSR1 received" in output and "resuming from" in output
    assert "1 process(es) per node x 2 node(s)" in output
    run = log_dir / "train/runs" / f"torchrun-slurm-{job_id}"
    assert (run / "metrics.json").is_file()


def test_two_nodes_under_fsdp_are_requeued_and_resume_the_sharded_last(
    slurm, data_dir, tmp_path
) -> None:
    """strategy=fsdp through the recipe: two nodes shard the model, a signal after the first
    sharded `last` stops and requeues the job, which resumes from that save and completes."""
    log_dir = tmp_path / "logs"
    args = [*run_args(data_dir, log_dir, 20), "strategy=fsdp"]
    job_id = submit(tmp_path, args, "--nodes=2")
    signal_after_first_checkpoint(job_id, log_dir, "--batch", "--signal=USR1",
                                  last="last-ckpt.json")  # fmt: skip
    state = finished(job_id)
    output = (tmp_path / f"{JOB_NAME}-{job_id}.out").read_text()
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", output[-3000:]
    assert int(state["Restarts"]) >= 1, output[-3000:]
    assert re.search(r"resuming from \S+/last-ckpt-step\d+", output), output[-3000:]
    run = log_dir / "train/runs" / f"torchrun-slurm-{job_id}"
    assert "sharded over 2 ranks" in (run / "train.log").read_text()
    assert (run / "metrics.json").is_file() and not list(run.rglob("last.ckpt"))


def test_two_jobs_side_by_side_and_a_signal_to_every_task(slurm, data_dir, tmp_path) -> None:
    """Every job used rendezvous port 29400: a second job on a node joined the first one's
    store. `scancel --signal=TERM` reaches every process of the step: stop, save, requeue."""
    log_dir = tmp_path / "logs"
    # The second job: 2 processes on a 1-CPU task, threads left to the recipe (it used to
    # overwrite NPROC_PER_NODE, and set OMP_NUM_THREADS=0, which crashes every rank).
    env = {k: v for k, v in child_env(NPROC_PER_NODE="2").items() if k != "OMP_NUM_THREADS"}
    jobs = [
        submit(tmp_path, run_args(data_dir, log_dir, 20)),
        submit(tmp_path, run_args(data_dir, log_dir, 20), "--cpus-per-task=1", env=env),
    ]
    signal_after_first_checkpoint(jobs[0], log_dir, "--signal=TERM")
    for job_id in jobs:
        state = finished(job_id)
        output = (tmp_path / f"{JOB_NAME}-{job_id}.out").read_text()
        assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", output[-3000:]
        assert (log_dir / "train/runs" / f"torchrun-slurm-{job_id}" / "metrics.json").is_file()
    assert int(job(jobs[0])["Restarts"]) >= 1
    second = (tmp_path / f"{JOB_NAME}-{jobs[1]}.out").read_text()
    assert "2 process(es) per node x 1 node(s), launcher: torchrun, 1 thread(s)" in second


# feature:doctor
def test_doctor_under_srun(slurm, tmp_path) -> None:
    """One task per node, ranks from SLURM's variables, rendezvous at node 0's NodeAddr."""
    cmd = ["srun", "--nodes=2", "--ntasks=2", sys.executable, "-m", "project.doctor",
           "--max-mb", "0.1", "--log-dir", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "2 rank(s) on 2 node(s)" in proc.stdout and "all checks passed" in proc.stdout


# /feature:doctor
def submitted_jobs(sweep_dir: Path) -> list[str]:
    """The SLURM job ids submitit used for this sweep (its folders hold their pickles)."""
    return [p.parent.name for p in (sweep_dir / ".submitit").glob("*/*_submitted.pkl")]


def test_a_sweep_from_hydra_runs_torchrun_per_node_and_resumes_after_a_preemption(
    slurm, data_dir, tmp_path
) -> None:
    """hydra/launcher=submitit_slurm: every sweep job is a SLURM job whose nodes each run
    torchrun (launch/multinode.sh); submitit's SIGUSR2 stops the ranks at one step with
    last.ckpt saved, then the job requeues itself and resumes in its own folder."""
    log_dir = tmp_path / "logs"
    sweep = [sys.executable, "train.py", "-m", "hydra/launcher=submitit_slurm",
             *run_args(data_dir, log_dir, 12)]  # fmt: skip
    # Bad input found by the workers stops the sweep with their one line, exit 2 (not a hang).
    bad = subprocess.run([*sweep, f"ckpt_path={tmp_path}/none.ckpt"], cwd=ROOT, text=True,
                         capture_output=True, env=child_env(RUN_ID="bad"), timeout=240)  # fmt: skip
    assert bad.returncode == 2, bad.stderr[-2000:]
    last = bad.stderr.strip().splitlines()[-1]
    assert last.startswith("error: sweep job ") and "stopped on bad input: ckpt_path " in last
    assert "does not exist" in last and "(log: " in last, last

    runs = log_dir / "train/multiruns/sweep"
    # A sweep of one job: a second one would double the start-up time on 2 cores.
    proc = subprocess.Popen([*sweep, "hydra.launcher.nodes=2", "model.optimizer.lr=0.01"],
                            cwd=ROOT, env=child_env(RUN_ID="sweep"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        wait_for((runs / "0/checkpoints/last.ckpt").exists, 240, "sweep job 0's checkpoint")
        (job_id,) = submitted_jobs(runs)
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
        output, _ = proc.communicate(timeout=420)
    finally:
        proc.kill()  # the sweep waits for its jobs; they would outlive it
        subprocess.run(["scancel", *submitted_jobs(runs)], timeout=30)
    assert proc.returncode == 0, output[-3000:]
    assert int(job(job_id)["Restarts"]) >= 1  # requeued by submitit after the stop
    log = (runs / "0/train.log").read_text()
    assert "Stopped by a signal" in log and "resuming from" in log, log[-3000:]
    assert "1 process(es) per node x 2 node(s), launcher: torchrun" in log
    assert "val/loss" in (runs / "0/metrics.json").read_text()


def test_a_sweep_job_that_dies_without_a_result_ends_the_sweep(slurm, data_dir, tmp_path) -> None:
    """submitit learns that a job died from sacct; this cluster keeps no accounting, so the
    sweep waited forever for a killed job. It now reads squeue
    (project.engine.cluster.slurm_queue)."""
    runs = tmp_path / "logs/train/multiruns/killed"
    cmd = [sys.executable, "train.py", "-m", "hydra/launcher=submitit_slurm",
           *run_args(data_dir, tmp_path / "logs", 60)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(RUN_ID="killed"), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait_for((runs / "0/train.log").exists, 120, "the sweep job to start")
        # The job's task and its srun die at once, as on a lost node: no result is written.
        subprocess.run(["pkill", "-KILL", "-f", str(runs / ".submitit")], timeout=30)
        output, _ = proc.communicate(timeout=180)
    finally:
        proc.kill()
        subprocess.run(["scancel", *submitted_jobs(runs)], timeout=30)
    assert proc.returncode == 1, output[-3000:]
    assert "has not produced any output (state: LEFT_QUEUE)" in output
