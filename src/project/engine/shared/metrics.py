"""The metric objects of one stage, as both trainers keep them (no Lightning here)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchmetrics import Metric


class WeightedMean(Metric):
    """The mean of per-batch means, each weighted by what it averages over (`Task.weight`:
    samples, scored tokens): the mean over every sample, whatever the batch size and the
    world size. A plain mean of batch means gives a short last batch (and each rank's, on
    several processes) the weight of a full one.

    The sums are float64: their order changes with the batching, float32 sums would drift
    with the number of batches. torchmetrics' MeanMetric is not used: with
    `nan_strategy="disable"` (what a per-step update wants: no NaN check, no GPU sync) its
    `update` drops the weight (torchmetrics 1.9). A NaN loss is kept: the epoch's loss is NaN,
    as it would be on any batching (dropping a NaN batch would drop different samples)."""

    full_state_update = False  # update needs no state of the other ranks: cheaper forward

    def __init__(self) -> None:
        super().__init__()
        zero = torch.tensor(0.0, dtype=torch.float64)
        self.add_state("total", zero.clone(), dist_reduce_fx="sum")
        self.add_state("weight", zero.clone(), dist_reduce_fx="sum")

    def update(self, value: torch.Tensor, weight: int | torch.Tensor) -> None:
        """Add one batch: its mean `value` and how many samples (tokens) it averaged over."""
        self.total += value.detach().double() * weight
        self.weight += weight

    def compute(self) -> torch.Tensor:
        return self.total / self.weight


def stage_metrics(task: Any, stage: str) -> nn.ModuleDict:
    """The task's metrics for `stage` plus the weighted mean loss every stage reports (both
    trainers update it with `task.weight(batch)`)."""
    return nn.ModuleDict({"loss": WeightedMean(), **task.metrics(stage)})
