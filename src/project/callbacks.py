"""The template's own Lightning callbacks (the rest come from Lightning, see configs/callbacks)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.exceptions import SIGTERMException

from project.signals import StopSignal
from project.step_stats import StepStats

log = logging.getLogger("project.callbacks")


class CoordinatedStop(pl.Callback):
    """Stop every rank at the same step on SIGTERM/SIGUSR1, checking every N steps.

    Replaces Lightning's per-step blocking broadcast (`_broadcast_sigterm_tensor`, run before
    every training step when world size > 1) and its signal handler (which broadcasts from
    inside the handler) with `project.signals.StopSignal`. On a stop, Lightning's own
    shutdown path runs (SIGTERMException: on_exception hooks, teardown).
    """

    def __init__(self, every_n_steps: int = 10) -> None:
        self.stop = StopSignal(every_n_steps)
        self._step = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning registered its handlers just before this hook; ours replace them and
        # Lightning's teardown restores the original ones afterwards.
        self.stop.install()
        epoch_loop = trainer.fit_loop.epoch_loop
        if not hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
            log.warning("this Lightning has no per-step SIGTERM broadcast to replace")
            return
        device = trainer.strategy.root_device

        def check_before_step() -> None:
            self._step += 1
            if self.stop.should_stop(self._step, device):
                raise SIGTERMException()

        epoch_loop._broadcast_sigterm_tensor = check_before_step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.stop.restore()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self.stop.restore()


class StepStatsCallback(pl.Callback):
    """Records per-step times and losses into <run dir>/step_stats.json (for project.compare)."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = Path(run_dir)
        self.stats = StepStats()

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.stats.step_start()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, *args: Any
    ) -> None:
        # outputs["loss"] is what backward saw: the loss divided by accumulate_grad_batches.
        self.stats.record_loss(outputs["loss"])

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.stats.write(self.run_dir)
