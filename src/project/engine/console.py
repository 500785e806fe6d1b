"""What a person sees: rank-zero-only logging, the config tree, one-line errors."""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from project.engine.env import is_rank_zero
from project.engine.errors import UserError

log = logging.getLogger("project")


class RankZeroFilter(logging.Filter):
    """Drops every record outside global rank 0 (named in configs/hydra/default.yaml).

    With the file handler's `delay: true`, other ranks never even create a log file.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return is_rank_zero()


class DropAdverts(logging.Filter):
    """Lightning 2.6 advertises its cloud products ("Tip: ... litlogger") on every run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Tip: For seamless cloud" not in str(record.msg)


def quiet_lightning() -> None:
    """Call after importing Lightning: `import lightning` attaches its own console handler to the
    "lightning" logger, so every Lightning message would print twice (its handler + root's)
    and bypass the rank-zero filter. Root's handlers (configured by Hydra) are enough.
    """
    # lightning 2.6 + torch >= 2.10 warn about a torch pytree API on every run: noise for users.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    # Printed on any machine with SLURM installed, also where it is not used (tests, laptops
    # with a cluster client): the launch scripts choose srun where it is meant.
    warnings.filterwarnings("ignore", message=r".*The `srun` command is available")
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(DropAdverts())
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True


METRICS_FILE = "metrics.json"  # a run's final metrics, written by global rank 0


def report_metrics(run_dir: Path, metrics: dict[str, float]) -> None:
    """Rank 0 at the end of a run (both trainers): metrics.json and one line per fact."""
    (run_dir / METRICS_FILE).write_text(json.dumps(metrics, indent=2, sort_keys=True))
    log.info("Metrics: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items())))
    log.info(f"Run folder: {run_dir}")


def read_metrics(run_dir: Path) -> dict[str, float]:
    """The final metrics a finished run wrote ({} if it wrote none)."""
    path = run_dir / METRICS_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def one_line(message: str) -> str:
    """Hydra's messages span lines and end with its config search path: keep the useful part."""
    message = str(message).split("Config search path:")[0]
    return " ".join(message.split())


def fail(message: str, code: int = 2) -> NoReturn:
    """Print one line naming the problem (and the fix) and exit non-zero."""
    print(f"error: {one_line(message)}", file=sys.stderr, flush=True)
    sys.exit(code)


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
    except Exception as err:
        if not isinstance(err, user_errors()):
            raise
        # Hydra wraps errors raised in a constructor: show our own message when there is one.
        cause: BaseException | None = err
        while cause is not None and not isinstance(cause, UserError):
            cause = cause.__cause__
        fail(str(cause or err))


def quiet_hydra() -> None:
    """configs/hydra/launcher/submitit_slurm.yaml replaces the plugin's entry of that name on
    purpose; Hydra still checks it against the plugin's schema and would say so every run."""
    warnings.filterwarnings("ignore", message="(?s).*validated against ConfigStore schema")


def run_cli(hydra_main: Callable[[], Any]) -> None:
    """Run a `@hydra.main` function with config errors reported as one line.

    HYDRA_FULL_ERROR=1 makes Hydra re-raise composition errors (unknown option, misspelt key)
    instead of printing its own multi-line report with the config search path.
    """
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    quiet_hydra()
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


def print_config_tree(
    cfg: DictConfig, order: Sequence[str] = (), save_to: Path | None = None
) -> None:
    """Print the composed config as a rich tree (top-level groups first) and save it as text."""
    import rich  # only when a run starts: entry points import this module before --help
    import rich.syntax
    import rich.tree

    tree = rich.tree.Tree("CONFIG", style="dim", guide_style="dim")
    fields = [f for f in order if f in cfg] + [f for f in cfg if f not in order]
    for field in fields:
        branch = tree.add(field, style="bold", guide_style="dim")
        value = cfg[field]
        text = (
            OmegaConf.to_yaml(value, resolve=True) if isinstance(value, DictConfig) else str(value)
        )
        branch.add(rich.syntax.Syntax(text, "yaml"))
    rich.print(tree)
    if save_to is not None:
        with open(save_to, "w") as f:
            rich.print(tree, file=f)
