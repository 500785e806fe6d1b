"""The launcher of hydra/launcher=submitit_slurm (configs/hydra/launcher/submitit_slurm.yaml):
hydra-submitit-launcher's, plus job states from `squeue` where SLURM keeps no accounting
(project.engine.cluster.slurm_queue), so that a cancelled or killed job ends the sweep instead of
being waited for.

Hydra imports every module below `hydra_plugins` at start-up and runs launchers defined here
only: this stays light, and without the slurm extra it only says how to install it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from project.engine.errors import UserError

try:
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import (
        SlurmLauncher as SubmititSlurmLauncher,
    )
except ImportError:  # the slurm extra is not installed
    SubmititSlurmLauncher = None


if SubmititSlurmLauncher is not None:

    class SlurmLauncher(SubmititSlurmLauncher):
        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Any:
            from project.engine.cluster.slurm_queue import watch_the_queue

            watch_the_queue()
            return super().launch(job_overrides, initial_job_idx)

else:
    from hydra.plugins.launcher import Launcher

    class SlurmLauncher(Launcher):  # type: ignore[no-redef]
        def __init__(self, **params: Any) -> None:
            raise UserError(
                "hydra/launcher=submitit_slurm needs the slurm extra: pip install -e '.[slurm]'"
            )

        def setup(self, **kwargs: Any) -> None: ...

        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Any: ...
