"""Optimizer and LR scheduler from config: plain PyTorch, shared by both trainers.

The configs are plain dicts with a `_target_` (a torch class) and its keyword arguments, so they
can sit in a checkpoint's hyperparameters and still load with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from hydra.utils import instantiate

# Keys of the scheduler config that tell the trainer *when* to step; not scheduler kwargs.
SCHEDULER_TRAINER_KEYS = ("interval", "frequency")


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: Mapping[str, Any]
) -> torch.optim.Optimizer:
    """`cfg` = {_target_: torch.optim.AdamW, lr: ..., ...}."""
    return instantiate(dict(cfg), params=params)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: Mapping[str, Any] | None
) -> tuple[torch.optim.lr_scheduler.LRScheduler, str, int] | None:
    """Returns (scheduler, interval, frequency), or None when `cfg` is empty.

    `interval` is "epoch" or "step": both trainers call `scheduler.step()` every `frequency`
    epochs or optimizer steps.
    """
    if not cfg:
        return None
    kwargs = {k: v for k, v in cfg.items() if k not in SCHEDULER_TRAINER_KEYS}
    interval = cfg.get("interval", "epoch")
    if interval not in ("epoch", "step"):
        raise ValueError(f"scheduler interval must be 'epoch' or 'step', got {interval!r}")
    return instantiate(kwargs, optimizer=optimizer), interval, int(cfg.get("frequency", 1))
