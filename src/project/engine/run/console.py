"""What a person sees: rank-zero-only logging, quiet Lightning and Hydra, the config tree."""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from project.engine.launch.env import is_rank_zero


class RankZeroFilter(logging.Filter):
    """Drops every record outside global rank 0 (named in configs/hydra/default.yaml).

    With the file handler's `delay: true`, other ranks never even create a log file.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return is_rank_zero()


class DropNoise(logging.Filter):
    """Lines Lightning prints on every run that tell the user nothing: its cloud adverts,
    that the summary callback is configured (by us), no GPU/TPU/HPU on a CPU machine."""

    NOISE = (
        "Tip: For seamless cloud",
        "Trainer already configured with model summary callbacks",
        "GPU available: False",
        "TPU available: False",
        "HPU available: False",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(noise in str(record.msg) for noise in self.NOISE)


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
    # A resumed run's checkpoint folder holds its checkpoints: that is the point, not a risk.
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
    # After a failure, multiprocessing's resource tracker (its own process: it takes the -W
    # options) counts the semaphores of DataLoader workers that were killed, and frees them.
    quiet_tracker = "ignore::UserWarning:multiprocessing.resource_tracker"
    if quiet_tracker not in sys.warnoptions:
        sys.warnoptions.append(quiet_tracker)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(DropNoise())
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
    plain = _full_width(tree)  # no line cut at 80 columns where no terminal says its width
    if sys.stdout.isatty():
        rich.print(tree)
    else:
        sys.stdout.write(plain)
    if save_to is not None:
        save_to.write_text(plain)


def _full_width(renderable: Any) -> str:
    """`renderable` as plain text, each line whole (rich pads lines to its width: stripped)."""
    import io

    import rich.console

    buffer = io.StringIO()
    rich.console.Console(file=buffer, width=4096, color_system=None).print(renderable)
    return "".join(line.rstrip() + "\n" for line in buffer.getvalue().splitlines())


class _HoldBack(logging.Filter):
    """On the root logger's handlers: keeps warnings back (each record once) until released."""

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[int, logging.LogRecord] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        self.held.setdefault(id(record), record)
        return False


@contextlib.contextmanager
def warnings_held_back() -> Iterator[Callable[[], None]]:
    """Warnings logged inside come out when the yielded function is called (or the block
    raises): a resize's warnings read after the config tree that is printed later."""
    hold, handlers = _HoldBack(), list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(hold)

    def release() -> None:
        for handler in handlers:
            handler.removeFilter(hold)
        for record in hold.held.values():
            logging.getLogger().handle(record)
        hold.held.clear()

    try:
        yield release
    except BaseException:
        release()
        raise


def stopped_early(monitor: str, best: float | None, patience: int, epoch: int) -> str:
    """The line that says why a run ended before its max_epochs (both trainers print it)."""
    shown = "none" if best is None else f"{float(best):.5g}"
    return (
        f"Early stopping after epoch {epoch}: {monitor} did not improve for {patience} "
        f"validation checks in a row (best {shown}); callbacks.early_stopping=null trains on"
    )
