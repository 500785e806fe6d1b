"""The networks: plain `torch.nn` modules, shared by the Lightning and the raw DDP trainer.

No Lightning imports here; both trainers build these from the same `model.net` config.
"""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """A fully connected classifier: flatten -> [Linear, ReLU, Dropout] x depth -> Linear."""

    def __init__(
        self,
        in_features: int = 64,
        hidden: int = 128,
        depth: int = 2,
        num_classes: int = 10,
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
        layers.append(nn.Linear(width, num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class CNN(nn.Module):
    """A small convolutional classifier for square single-channel images (8x8 digits)."""

    def __init__(
        self,
        image_size: int = 8,
        channels: int = 16,
        hidden: int = 64,
        num_classes: int = 10,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.image_size = image_size
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        pooled = image_size // 2
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * channels * pooled * pooled, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The dataset yields flat feature vectors so that every network can share it.
        x = x.view(-1, 1, self.image_size, self.image_size)
        return self.head(self.features(x))
