"""One step of the raw trainer: the batch moved to the device, the task's step run as the
forward of the module DDP wraps (so its gradients are all-reduced, as under Lightning)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from project.engine.shared.shapes import checked_step


class Step(nn.Module):
    """DDP all-reduces the gradients of work done inside its module's forward: like Lightning's
    wrapper around training_step, this makes `task.step` that forward."""

    def __init__(self, task: nn.Module, net: Mapping[str, Any]) -> None:
        super().__init__()
        self.task, self.net = task, net

    def forward(self, batch: Any, metrics: nn.ModuleDict) -> torch.Tensor:
        return checked_step(self.task, batch, metrics, self.net)


def to_device(batch: Any, device: torch.device) -> Any:
    """Tensors of a (nested) tuple/list/dict batch moved to `device` (Lightning does the same)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch
