"""The command-line shell every entry point shares: Hydra's main with bad input reported as one
line (exit 2), the exit report for project.launcher, and the value a sweeper optimises.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from project.engine import private_api
from project.engine.config import typos
from project.engine.config.compose import register_resolvers
from project.engine.distributed.exits import EXIT_TEMPFAIL, TemporaryFailure, fail, report_exit
from project.engine.errors import UserError, from_worker
from project.engine.run.console import quiet_hydra


def user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean bad input, not a bug: reported as one line."""
    types: list[type[BaseException]] = [UserError, HydraException, OmegaConfBaseException]
    if "lightning" in sys.modules:  # never import Lightning just to name its exception
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        types.append(MisconfigurationException)
    return tuple(types)


def report_user_errors(fn: Callable[[], Any]) -> Any:
    """Run `fn`; bad input -> one line on stderr and exit code 2. Real bugs still raise.

    Used twice: around the task inside `@hydra.main` (so Hydra adds no "Error executing job"
    line; SystemExit passes through Hydra) and around the Hydra call itself by `run_cli`.
    """
    try:
        return fn()
    except TemporaryFailure as err:  # said in one line, restarted like a crash
        fail(str(err), EXIT_TEMPFAIL)
    except Exception as err:
        if not isinstance(err, user_errors()):
            raise
        # Hydra wraps errors raised in a constructor: show our own message when there is one.
        cause: BaseException | None = err
        while cause is not None and not isinstance(cause, UserError):
            cause = cause.__cause__
        fail(from_worker(str(cause or typos.misspelt_override(err) or err)))


def run_cli(hydra_main: Callable[[], Any]) -> None:
    """Run a `@hydra.main` function with config errors reported as one line.

    HYDRA_FULL_ERROR=1 makes Hydra re-raise composition errors (unknown option, misspelt key)
    instead of printing its own multi-line report with the config search path.
    """
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    quiet_hydra()
    private_api.one_repository_help()  # `--help` in well under a second
    try:
        report_user_errors(hydra_main)
    except OSError as err:
        if err.filename is None:
            raise
        # A folder the run must write (run folder, logs, data) cannot be: the environment's
        # fault, not a bug, and nothing a restart would fix.
        fail(
            f"{err.filename} cannot be written ({err.strerror}): point paths.log_dir / "
            "paths.data_dir at a writable folder"
        )


def run_task(task: Callable[[], dict[str, float]]) -> dict[str, float]:
    """The task inside `@hydra.main`: bad input -> one line, exit 2. In a SLURM sweep job
    (submitit) errors travel back to the sweep as exceptions instead: no SystemExit there."""
    # feature:slurm
    from project.engine.cluster import slurm_job

    if slurm_job.active():
        return task()
    # /feature:slurm
    return report_user_errors(task)


def optimized_value(cfg: DictConfig, metrics: dict[str, float]) -> float | None:
    """What a sweeper (e.g. Optuna) optimises: the run's `optimized_metric`."""
    return metrics.get(cfg.get("optimized_metric"))


def main(hydra_main: Callable[[], Any]) -> None:
    """An entry point's main(): resolvers, the exit report for project.launcher (when it
    started us), Hydra with one-line errors."""
    register_resolvers()
    with report_exit():
        run_cli(hydra_main)
