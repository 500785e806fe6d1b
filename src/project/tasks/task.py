"""The task contract: written once in plain PyTorch, run by both trainers.

A task owns the network and says what one batch computes:

    metrics = task.metrics(stage)        # fresh torchmetrics objects for "train"/"val"/"test"
    loss = task.step(batch, metrics)     # the batch's mean loss; updates `metrics`
    task.weight(batch)                   # what that mean is over: samples, scored tokens

The Lightning module (project.engine.lightning.module) and the raw trainer
(project.engine.raw.trainer) are loops around these calls: both add a "loss" to every stage
(the batch losses weighted by `weight`: the mean over every sample, the same on any batch
size and world size), log each metric as `<stage>/<name>`, and let torchmetrics sync the
metric states across ranks once per epoch (at compute), never per step. Metrics of your own
must be sums over samples too (accuracy, perplexity are), not means of batch means.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from hydra.utils import instantiate
from torch import nn
from torchmetrics import Metric

STAGES = ("train", "val", "test")


class Task(nn.Module):
    """Subclass, implement `step`, and return your metrics from `metrics`."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def metrics(self, stage: str) -> dict[str, Metric]:
        """name -> metric for one stage; logged as `<stage>/<name>` at the epoch's end."""
        return {}

    def step(self, batch: Any, metrics: Mapping[str, Metric]) -> torch.Tensor:
        """The mean loss of `batch` (what backward runs on); update `metrics` with detached
        values."""
        raise NotImplementedError

    # What throughput counts (train/<unit>_per_s): samples by default.
    unit = "samples"

    def count(self, batch: Any) -> int:
        """How many `unit`s `batch` holds (its first tensor's length, by default)."""
        first = batch[0] if isinstance(batch, (tuple, list)) else batch
        return len(first)

    def weight(self, batch: Any) -> int | torch.Tensor:
        """How many terms `step`'s mean loss of `batch` averages over (`count`, by default:
        its samples). An epoch's loss weights each batch by it; override it when the loss is
        a mean over something else (tokens, unmasked positions)."""
        return self.count(batch)


def build_task(task: Mapping[str, Any], net: Mapping[str, Any]) -> Task:
    """The task of the `model.task` config around the network of `model.net` (both trainers)."""
    return instantiate(dict(task), net=instantiate(dict(net)))
