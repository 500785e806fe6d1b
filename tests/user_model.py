"""A network with a second head that `forward` never uses: what DDP without
find_unused_parameters cannot train (tests/test_comm_hooks.py names its parameters)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from project.models.mlp import MLP


class TwoHeads(MLP):
    """The MLP plus `aux_head`, a head no loss ever sees."""

    def __init__(self, **mlp: Any) -> None:
        super().__init__(**mlp)
        self.aux_head = nn.Linear(mlp.get("in_features", 64), 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)
