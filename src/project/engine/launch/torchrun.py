"""The torchrun command line, built in one place: sweep jobs with several processes, the compare
command and the start-up benchmark all start the trainers through `command`.

Only the standard library is imported: the compare command builds commands without torch.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

# The two trainers' entry modules (`python -m <module>`), by the names the tools use.
TRAINERS = {
    "lightning": "project.train",
    "raw": "project.raw_train",  # feature:raw
}

log = logging.getLogger(__name__)


def command(target: Sequence[str], nproc: int = 1) -> list[str]:
    """`python <target>` for one process, else the same under single-node torchrun as the
    launch scripts run it (project.launcher: its exit codes, its warm start) (`target` is what
    follows `python`: ["-m", module, *args] or [script, *args])."""
    if nproc == 1:
        return [sys.executable, *target]
    return [sys.executable, "-m", "project.launcher", "--standalone",
            f"--nproc-per-node={nproc}", *target]  # fmt: skip


def run_to_end(
    target: Sequence[str], nproc: int, what: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `command(target, nproc)` to its end with its output captured; exit with the output's
    tail, naming `what`, if it failed (the compare and benchmark commands)."""
    cmd = command(target, nproc)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env or environment())
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{tail}")
    return proc


def environment(**extra: str) -> dict[str, str]:
    """This environment for a child job: one thread per rank unless OMP_NUM_THREADS is set
    (torchrun sets 1 only for several processes per node), plus `extra`."""
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **extra}


def relaunch(module: str, overrides: Sequence[str], output_dir: str, nproc: int) -> None:
    """Run this sweep job as `torchrun --standalone -m <module>` (the launcher's) writing into
    `output_dir`.

    Lightning's own launcher re-runs `sys.argv`, which in a Hydra multirun repeats the whole
    sweep in every child (Lightning #11300, #15737). A torchrun job per sweep job keeps one
    correct DDP run per job directory, and waits for it so no process outlives the sweep.
    """
    # hydra.output_subdir=null: the sweep job already saved its config there
    cmd = command(["-m", module, *overrides, f"hydra.run.dir={output_dir}",
                   "hydra.output_subdir=null"], nproc)  # fmt: skip
    log.info("Sweep job with %d processes: %s", nproc, " ".join(cmd))
    env = environment()
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # see launch/common.sh
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        code = proc.wait()
    except BaseException:
        # Ctrl-C / SIGTERM of the sweep: stop the whole torchrun job, workers included.
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    if code != 0:
        raise RuntimeError(f"sweep job in {output_dir} failed (launcher exit code {code})")
