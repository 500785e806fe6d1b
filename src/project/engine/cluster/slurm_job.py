"""A Hydra sweep job that hydra-submitit-launcher runs on SLURM (`hydra/launcher=submitit_slurm`).

submitit starts one task per node of the SLURM job and calls the Hydra task function in each.
Here every task runs launch/multinode.sh, the torchrun-per-node path of launch/slurm.sbatch:
c10d rendezvous at the first node's address on a port of this job's own, `trainer.devices`
processes per node, the Hydra job's folder as the run folder. So a sweep job behaves as one
`sbatch launch/slurm.sbatch` run: same environment, same signals, same exit codes.

Preemption and time limits: submitit asks SLURM for SIGUSR2 `signal_delay_s` before the end
and, on it, pickles the call and requeues the job. That must wait until the workers have
stopped at the same step and saved last.ckpt (exit 143), so submitit's handler is replaced
while the workers run and called only after they exited. The requeued job runs the same call:
same job folder, so training resumes from last.ckpt.

Inside a submitit job nothing may end with SystemExit: submitit writes a job's result (which
the sweep waits for) only when the function returns or raises an Exception.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from omegaconf import DictConfig

from project.engine.config.compose import ROOT_DIR
from project.engine.distributed.exits import EXIT_BAD_INPUT, EXIT_PREEMPTED
from project.engine.errors import UserError
from project.engine.launch.env import slurm_rendezvous

log = logging.getLogger(__name__)


def active(env: Mapping[str, str] = os.environ) -> bool:
    """Whether this process is a job that submitit started on SLURM."""
    return env.get("SUBMITIT_EXECUTOR") == "slurm" and "SLURM_JOB_ID" in env


def processes_per_node(trainer_cfg: DictConfig, env: Mapping[str, str] = os.environ) -> int:
    """`trainer.devices` when it is a number, else the node's GPUs, else 1 (as slurm.sbatch)."""
    # Read as ddp reads it; imported here: entry points import this module before torch.
    from project.engine.distributed.ddp import _explicit_int

    devices = _explicit_int(trainer_cfg.get("devices", "auto"), "trainer.devices")
    if devices not in (None, -1):  # -1: every GPU, as auto
        return devices
    gpus = env.get("SLURM_GPUS_ON_NODE", env.get("SLURM_GPUS_PER_NODE", "0")).split(":")[-1]
    return max(1, int(gpus) if gpus.isdigit() else 0)


def node_env(trainer_cfg: DictConfig, env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """launch/multinode.sh's environment for this node of the SLURM job."""
    if int(env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]) != 1:
        raise UserError(
            f"hydra.launcher.tasks_per_node={env['SLURM_NTASKS_PER_NODE']}: keep 1, torchrun "
            "starts trainer.devices processes on each node"
        )
    from project.engine.distributed.ddp import _explicit_int

    nodes = int(env["SLURM_NNODES"])
    asked = _explicit_int(trainer_cfg.get("num_nodes", "auto"), "trainer.num_nodes")
    if asked not in (None, nodes):
        raise UserError(
            f"trainer.num_nodes={asked} but this SLURM job has {nodes} node(s): set "
            f"hydra.launcher.nodes={asked} (or drop trainer.num_nodes: it follows the job)"
        )
    nproc = processes_per_node(trainer_cfg, env)
    head, port = slurm_rendezvous(env)
    cpus = int(env.get("SLURM_CPUS_PER_TASK", len(os.sched_getaffinity(0))))
    # The workers are plain torchrun workers: not submitit jobs (errors exit with one line).
    return {
        **{k: v for k, v in env.items() if not k.startswith("SUBMITIT_")},
        "PYTHON": sys.executable,
        "NNODES": str(nodes),
        "NPROC_PER_NODE": str(nproc),
        "RDZV_ID": f"slurm-{env['SLURM_JOB_ID']}",
        "RDZV_ENDPOINT": f"{head}:{env.get('MASTER_PORT', port)}",
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", str(max(1, cpus // nproc))),
    }


def preempt_signal() -> signal.Signals:
    """The signal submitit asks SLURM for before the end (SUBMITIT_PREEMPT_SIGNAL, USR2)."""
    return signal.Signals[f"SIG{os.environ.get('SUBMITIT_PREEMPT_SIGNAL', 'USR2')}"]


def run_on_every_node(
    overrides: Sequence[str], output_dir: str, trainer_cfg: DictConfig, trainer: str = "lightning"
) -> None:
    """Run this sweep job as launch/multinode.sh (TRAINER=`trainer`) on this node; requeue it
    after a stop."""
    env = {**node_env(trainer_cfg), "TRAINER": trainer}
    cmd = [str(ROOT_DIR / "launch" / "multinode.sh"), *overrides,
           f"hydra.run.dir={output_dir}", "hydra.output_subdir=null"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env)
    warning = preempt_signal()
    requeue = signal.getsignal(warning)  # submitit's: pickle the call, requeue, exit

    def forward(signum: int, frame: Any) -> None:
        # SLURM signals every process of the step; forwarding covers a signal to this task
        # alone. The launcher and workers act on the first one only.
        proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (warning, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if code == EXIT_PREEMPTED and callable(requeue):
        log.info("Stopped with last.ckpt saved: requeueing this job to resume")
        requeue(warning, None)  # task 0: requeues the job and exits; the other tasks return
        return
    if code != 0:
        raise _job_error(code, output_dir)


def _job_error(code: int, output_dir: str) -> Exception:
    """What the sweep reports for a failed job: the workers' own `error:` line, and the log."""
    import submitit  # present: submitit started this job

    log_file = submitit.JobEnvironment().paths.stderr
    lines = log_file.read_text(errors="replace").splitlines() if log_file.is_file() else []
    said = next((x.removeprefix("error: ") for x in reversed(lines) if x.startswith("error: ")),
                None)  # fmt: skip
    why = "stopped on bad input" if code == EXIT_BAD_INPUT else f"failed (exit code {code})"
    error = UserError if code == EXIT_BAD_INPUT else RuntimeError
    return error(f"sweep job {output_dir} {why}: {said or 'see'} (log: {log_file})")
