"""Job states for submitit from `squeue` where SLURM keeps no accounting (no `sacct`).

submitit learns that a job ended from `sacct`, or from the result file the job writes when its
function returns. Without accounting only the result file is left, so a sweep would wait
forever for a job that was cancelled or killed. `squeue` lists the jobs SLURM still has: a job
that has left it is over, and submitit then reports it ("has not produced any output") instead
of waiting. Used by the launcher of hydra/launcher=submitit_slurm in the sweep's process.
"""

from __future__ import annotations

import subprocess

from submitit.slurm import slurm


def accounting_enabled() -> bool:
    """Whether `sacct` can answer here (AccountingStorageType is not none)."""
    try:
        config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True,
                                timeout=60).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return True  # cannot tell: leave submitit as it is
    return "accounting_storage/none" not in config


class QueueWatcher(slurm.SlurmInfoWatcher):
    """submitit's watcher reading `squeue`: a registered job that is not listed has ended."""

    def _make_command(self) -> list[str] | None:
        if not self._registered - self._finished:
            return None
        return ["squeue", "--noheader", "--array", "--format=%i|%T"]  # one line per array task

    def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
        text = string.decode() if isinstance(string, bytes) else string
        info = super().read_info("\n".join(["JobID|State", *text.splitlines()]))
        for job_id in self._registered - self._finished - set(info):
            info[job_id] = {"JobID": job_id, "State": "LEFT_QUEUE"}  # is_done: not a live state
        return info


def watch_the_queue() -> None:
    """Make submitit's SLURM jobs use `squeue` where there is no `sacct` (idempotent)."""
    if not isinstance(slurm.SlurmJob.watcher, QueueWatcher) and not accounting_enabled():
        slurm.SlurmJob.watcher = QueueWatcher(delay_s=30)  # squeue is cheap: poll every 30 s
