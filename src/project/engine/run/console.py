"""What a person sees: rank-zero-only logging, quiet Lightning and Hydra, the config tree."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from project.engine.launch.env import is_rank_zero


class RankZeroFilter(logging.Filter):
    """Drops every record outside global rank 0 (named in configs/hydra/default.yaml).

    With the file handler's `delay: true`, other ranks never even create a log file.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return is_rank_zero()


class DropAdverts(logging.Filter):
    """Lightning advertises its cloud products ("Tip: ... litlogger") on every run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Tip: For seamless cloud" not in str(record.msg)


def quiet_lightning() -> None:
    """Call after importing Lightning: `import lightning` attaches its own console handler to the
    "lightning" logger, so every Lightning message would print twice (its handler + root's)
    and bypass the rank-zero filter. Root's handlers (configured by Hydra) are enough.
    """
    # Lightning on a newer torch warns about a torch pytree API on every run: noise for users.
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


def quiet_hydra() -> None:
    """configs/hydra/launcher/submitit_slurm.yaml replaces the plugin's entry of that name on
    purpose; Hydra still checks it against the plugin's schema and would say so every run."""
    warnings.filterwarnings("ignore", message="(?s).*validated against ConfigStore schema")


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


def stopped_early(monitor: str, best: float | None, patience: int, epoch: int) -> str:
    """The line that says why a run ended before its max_epochs (both trainers print it)."""
    shown = "none" if best is None else f"{float(best):.5g}"
    return (
        f"Early stopping after epoch {epoch}: {monitor} did not improve for {patience} "
        f"validation checks in a row (best {shown}); callbacks.early_stopping=null trains on"
    )
