"""Classification: cross-entropy on class logits, accuracy."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy

from project.tasks.task import Task


class Classification(Task):
    """`net` maps inputs to (batch, num_classes) logits; batches are (inputs, class ids)."""

    def __init__(self, net: nn.Module, num_classes: int = 10) -> None:
        super().__init__(net)
        self.num_classes = num_classes

    def metrics(self, stage: str) -> dict[str, Metric]:
        # Train metrics update every step: skip their input validation (it costs per step).
        return {"acc": MulticlassAccuracy(
            self.num_classes, average="micro", validate_args=stage != "train"
        )}  # fmt: skip

    def step(
        self, batch: tuple[torch.Tensor, torch.Tensor], metrics: Mapping[str, Metric]
    ) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        metrics["acc"].update(logits.detach().argmax(dim=1), y)
        return loss
