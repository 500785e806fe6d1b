"""A small convolutional network for square single-channel images: plain `torch.nn`."""

from __future__ import annotations

import torch
from torch import nn


class CNN(nn.Module):
    """A small convolutional classifier for square single-channel images (8x8 digits)."""

    def __init__(
        self,
        image_size: int = 8,
        channels: int = 16,
        hidden: int = 64,
        out_features: int = 10,
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
            nn.Linear(hidden, out_features),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The dataset yields flat feature vectors so that every network can share it.
        x = x.view(-1, 1, self.image_size, self.image_size)
        return self.head(self.features(x))
