"""The LightningModule: a thin adapter that runs a Task (project.tasks) in Lightning's loop.

The task (network, loss, metrics) is plain PyTorch and the raw trainer runs the same one.
Hyperparameters are the plain `task`, `net`, `optimizer` and `scheduler` config dicts, so a
checkpoint rebuilds its own module (`TaskModule(**ckpt["hyper_parameters"])`) and loads with
torch's default `weights_only=True`.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from project.engine.checkpoints.run import RunCheckpoints
from project.engine.config.compose import to_plain
from project.engine.private_api import DirectHookName
from project.engine.shared.metrics import stage_metrics
from project.engine.shared.optim import build_optimizer, build_scheduler
from project.engine.shared.shapes import checked_step
from project.engine.shared.throughput import Throughput
from project.tasks.task import STAGES, build_task


class TaskModule(DirectHookName, pl.LightningModule):
    """Lightning's hooks around `task.step`; metrics logged as `<stage>/<name>` per epoch."""

    def __init__(
        self,
        task: dict[str, Any],
        net: dict[str, Any],
        optimizer: dict[str, Any],
        scheduler: dict[str, Any] | None = None,
        compile: bool = False,
    ) -> None:
        super().__init__()
        # Plain containers only: DictConfig in a checkpoint would need weights_only=False.
        task, net = to_plain(task), to_plain(net)
        optimizer, scheduler = to_plain(optimizer), to_plain(scheduler)
        self.save_hyperparameters(logger=False)
        self.task = build_task(task, net)
        # One set of metric objects per stage: torchmetrics syncs their state across ranks at
        # compute() (epoch end), so nothing is reduced on every step.
        for stage in STAGES:  # attributes train_metrics, val_metrics, test_metrics
            setattr(self, f"{stage}_metrics", stage_metrics(self.task, stage))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.task(x)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Before the callbacks' hooks: an older template's checkpoint resumes without a
        # warning about its callback that is gone (RunState does it for other modules).
        RunCheckpoints.upgrade(checkpoint)

    # Cuts in Lightning's per-step hook machinery, same results (DirectHookName, this hook and
    # the datamodule's transfer_batch_to_device; docs/performance.md has what they save).
    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        # Called after every backward; Lightning's default validates its arguments even when
        # there is nothing to clip (trainer.gradient_clip_val null or 0). The raw trainer too
        # clips only when the value is set.
        if gradient_clip_val:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_model(self) -> None:
        # In-place compile keeps the state-dict keys, so checkpoints load with or without it.
        if self.hparams.compile and not getattr(self, "_compiled", False):
            self.task.net.compile()
            self._compiled = True
        # strategy=fsdp: the network's blocks and the network get fully_shard (idempotent).
        shard = getattr(self.trainer.strategy, "shard", None)
        if shard is not None:
            shard(self.task)

    def _step(self, batch: Any, stage: str) -> torch.Tensor:
        metrics = getattr(self, f"{stage}_metrics")
        loss = checked_step(self.task, batch, metrics, self.hparams.net)
        metrics["loss"].update(loss.detach(), self.task.weight(batch))
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._step(batch, "train")
        self.throughput.count(self.task.count(batch))
        # The per-step loss is this rank's own (no collective per step; epoch values are
        # synced). Only on the steps the logger writes: each self.log call re-walks Lightning's
        # result object, which costs more than a small model's step (docs/performance.md).
        every = self.trainer.log_every_n_steps
        if self.trainer.fast_dev_run or (every and (self.global_step + 1) % every == 0):
            self.log("train/loss_step", loss, on_step=True, on_epoch=False, prog_bar=True)
            rate = self.throughput.rate()  # the task's units per second, all ranks
            self.log(f"train/{self.task.unit}_per_s", rate, on_step=True, on_epoch=False)
        return loss

    def on_train_start(self) -> None:
        self.throughput = Throughput(self.trainer.world_size)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._step(batch, "test")

    def _log_epoch(self, stage: str) -> None:
        # Logging the metric objects lets Lightning call compute() (synced) and reset().
        for name, metric in getattr(self, f"{stage}_metrics").items():
            show = stage != "train" and name != "loss"
            self.log(f"{stage}/{name}", metric, on_step=False, on_epoch=True, prog_bar=show)

    def on_train_epoch_end(self) -> None:
        self._log_epoch("train")

    def on_validation_epoch_end(self) -> None:
        self._log_epoch("val")

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")

    def configure_optimizers(self) -> Any:
        optimizer = build_optimizer(self.parameters(), self.hparams.optimizer)
        built = build_scheduler(optimizer, self.hparams.scheduler)
        if built is None:
            return optimizer
        scheduler, interval, frequency = built
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": interval, "frequency": frequency},
        }
