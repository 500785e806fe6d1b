"""What Lightning's callbacks show on the console: progress and the model summary.

Progress: tqdm's bar where stderr is a terminal, else a line every `lines_every_s` seconds
(configs/callbacks/progress_bar.yaml). tqdm redraws its bar with carriage returns: in a file
(a batch job's log, `| tee`, CI) every redraw stays, so a 38-second run wrote 65 KB of bars; a
periodic line says the same (where training is, how fast, the bar's metrics) in a few lines.

The summary: Lightning's rich table without the columns that say nothing: a FLOPs column (and
"Total FLOPs" line) of zeros, what every model without an `example_input_array` gets
(configs/callbacks/model_summary.yaml).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar, RichModelSummary, TQDMProgressBar

log = logging.getLogger(__name__)


def progress_bar(refresh_rate: int = 10, lines_every_s: float = 30.0) -> ProgressBar:
    """tqdm's bar (redrawn every `refresh_rate` batches) on a terminal, else `ProgressLines`."""
    if sys.stderr.isatty():
        return TQDMProgressBar(refresh_rate=refresh_rate)
    return ProgressLines(lines_every_s)


class ProgressLines(ProgressBar):
    """A line at most every `every_s` seconds while training, and one when training ends."""

    def __init__(self, every_s: float = 30.0) -> None:
        super().__init__()
        self.every_s, self._enabled = every_s, True
        self._said = self._began = 0.0

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._said = self._began = time.monotonic()
        self._steps_at_start = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if self._enabled and time.monotonic() - self._said >= self.every_s:
            self._say(trainer, pl_module, args[-1] + 1)

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if self._enabled:
            self._say(trainer, pl_module, None)

    def _say(self, trainer: pl.Trainer, pl_module: Any, batch: int | None) -> None:
        now = time.monotonic()
        self._said = now
        rate = (trainer.global_step - self._steps_at_start) / max(now - self._began, 1e-9)
        total = self.total_train_batches
        where = "training ended" if batch is None else f"epoch {trainer.current_epoch}, batch " + (
            f"{batch}/{total} ({100 * batch / total:.0f}%)" if isinstance(total, int) and total
            else str(batch)
        )  # fmt: skip
        shown = ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in self.get_metrics(trainer, pl_module).items()
        )  # fmt: skip
        log.info(
            f"{where}, step {trainer.global_step}, "
            f"{rate:.3g} steps/s" + (f", {shown}" if shown else "")
        )


class ModelSummary(RichModelSummary):
    """RichModelSummary; FLOPs shown only when Lightning could count them."""

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        from lightning.pytorch.utilities.model_summary.model_summary import (
            get_formatted_model_size,
            get_human_readable_count,
        )
        from rich import get_console
        from rich.table import Table

        columns = [(name, values) for name, values in summary_data
                   if name != "FLOPs" or total_flops]  # fmt: skip
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for name, _ in columns:
            right = name in ("Params", "Params per Device", "FLOPs", "In sizes", "Out sizes")
            style = "dim" if name == " " else None
            table.add_column(name, justify="right" if right else "left", style=style,
                             no_wrap=name == "Name")  # fmt: skip
        for row in zip(*(values for _, values in columns), strict=True):
            table.add_row(*row)
        frozen = total_parameters - trainable_parameters
        lines = [
            f"[bold]Trainable params[/]: {get_human_readable_count(int(trainable_parameters))}",
            f"[bold]Non-trainable params[/]: {get_human_readable_count(int(frozen))}",
            f"[bold]Total params[/]: {get_human_readable_count(int(total_parameters))}",
            "[bold]Total estimated model params size (MB)[/]: "
            + get_formatted_model_size(model_size),
            f"[bold]Modules in train mode[/]: {total_training_modes['train']}",
            f"[bold]Modules in eval mode[/]: {total_training_modes['eval']}",
        ]
        if total_flops:
            lines.append(f"[bold]Total FLOPs[/]: {get_human_readable_count(total_flops)}")
        console = get_console()
        console.print(table)
        console.print("\n".join(lines))
