"""The LightningModule: loss, metrics, optimizer. The network itself is plain PyTorch (nets.py).

Hyperparameters are plain dicts of numbers and strings (the `model` config), so a checkpoint
rebuilds its own network and loads with torch's default `weights_only=True`.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from project.config import to_plain
from project.optim import build_optimizer, build_scheduler


class Classifier(pl.LightningModule):
    """Cross-entropy classifier around any `nn.Module` built from `net` (a `_target_` dict)."""

    def __init__(
        self,
        net: dict[str, Any],
        optimizer: dict[str, Any],
        scheduler: dict[str, Any] | None = None,
        num_classes: int = 10,
        compile: bool = False,
    ) -> None:
        super().__init__()
        # Plain containers only: DictConfig in a checkpoint would need weights_only=False.
        net, optimizer, scheduler = to_plain(net), to_plain(optimizer), to_plain(scheduler)
        self.save_hyperparameters(logger=False)
        self.net = instantiate(net)
        # One metric object per stage: torchmetrics syncs their state across ranks at
        # compute() (epoch end), so nothing is reduced on every step.
        # The train metrics update every step: skip input validation and the NaN check (both
        # cost time per step, and the NaN check forces a CPU-GPU sync on GPU).
        self.train_acc = MulticlassAccuracy(num_classes, average="micro", validate_args=False)
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.train_loss = MeanMetric(nan_strategy="disable")
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def configure_model(self) -> None:
        # In-place compile keeps the state-dict keys, so checkpoints load with or without it.
        if self.hparams.compile and not getattr(self, "_compiled", False):
            self.net.compile()
            self._compiled = True

    def _shared_step(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        getattr(self, f"{stage}_loss").update(loss.detach())
        getattr(self, f"{stage}_acc").update(logits.detach().argmax(dim=1), y)
        return loss

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        loss = self._shared_step(batch, "train")
        # The per-step loss is this rank's own (no collective per step; epoch values are
        # synced). Only on the steps the logger writes: in Lightning 2.6 each self.log call
        # costs ~1 ms on CPU (it re-walks its result object), more than a small model's step.
        every = self.trainer.log_every_n_steps
        if self.trainer.fast_dev_run or (every and (self.global_step + 1) % every == 0):
            self.log("train/loss_step", loss, on_step=True, on_epoch=False, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._shared_step(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._shared_step(batch, "test")

    def _log_epoch(self, stage: str) -> None:
        # Logging the metric objects lets Lightning call compute() (synced) and reset().
        self.log(f"{stage}/loss", getattr(self, f"{stage}_loss"), on_step=False, on_epoch=True)
        self.log(
            f"{stage}/acc",
            getattr(self, f"{stage}_acc"),
            on_step=False,
            on_epoch=True,
            prog_bar=stage != "train",
        )

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
