"""The metric objects of one stage, as both trainers keep them (no Lightning here)."""

from __future__ import annotations

from typing import Any

from torch import nn
from torchmetrics import MeanMetric


def stage_metrics(task: Any, stage: str) -> nn.ModuleDict:
    """The task's metrics for `stage` plus the mean loss every stage reports (both trainers)."""
    # The train loss updates every step: no NaN check (it forces a CPU-GPU sync on GPU).
    loss = MeanMetric(nan_strategy="disable") if stage == "train" else MeanMetric()
    return nn.ModuleDict({"loss": loss, **task.metrics(stage)})
