"""A fully connected network: plain `torch.nn`, built by both trainers from `model.net`."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """A fully connected network: flatten -> [Linear, ReLU, Dropout] x depth -> Linear."""

    def __init__(
        self,
        in_features: int = 64,
        hidden: int = 128,
        depth: int = 2,
        out_features: int = 10,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = hidden
        layers.append(nn.Linear(width, out_features))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)
