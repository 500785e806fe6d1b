"""What users bring to a model: a network with a second head that `forward` never uses
(what DDP without find_unused_parameters cannot train: tests/test_comm_hooks.py names its
parameters), steps and saves slower than `strategy.step_timeout_s` (tests/test_hangs.py), a
module whose configure_model forgets the template's (tests/test_fsdp.py)."""

from __future__ import annotations

import os
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from project.engine.lightning.module import TaskModule
from project.models.mlp import MLP


class TwoHeads(MLP):
    """The MLP plus `aux_head`, a head no loss ever sees."""

    def __init__(self, **mlp: Any) -> None:
        super().__init__(**mlp)
        self.aux_head = nn.Linear(mlp.get("in_features", 64), 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Sleepy(pl.Callback):
    """Every rank's steps take `seconds` longer (a slow model, a long accumulation window)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_before_backward(self, *args: Any) -> None:
        time.sleep(self.seconds)


class SlowToSave(MLP):
    """The MLP, whose weights take rank 0 `save_s` to save (a large model, slow storage): the
    other ranks wait for it in the save's barrier."""

    def __init__(self, save_s: float = 0.0, **mlp: Any) -> None:
        super().__init__(**mlp)
        self.save_s = save_s

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        if os.environ.get("RANK", "0") == "0":
            time.sleep(self.save_s)
        return super().state_dict(*args, **kwargs)


class OwnConfigureModel(TaskModule):
    """A module of one's own whose configure_model does not call the template's."""

    def configure_model(self) -> None:
        pass
