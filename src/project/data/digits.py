"""scikit-learn's 8x8 handwritten digits (1797 images, shipped with it: works offline).

`prepare` writes the arrays to .npy once per node; every rank then reads them memory-mapped,
and so does every DataLoader worker: the dataset pickles as the files' paths (`MappedArray`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from project.data.source import (
    SPLITS,
    DataSource,
    MappedArray,
    check_writable,
    least_fraction,
    save_array,
    split_indices,
)

FEATURES_FILE = "digits_x.npy"
TARGETS_FILE = "digits_y.npy"


def materialise(data_dir: str | Path) -> Path:
    """Write the digits arrays into `data_dir` unless they are already there. Returns the dir.

    Features are scaled to [0, 1] float32, targets are int64.
    """
    data_dir = Path(data_dir)
    if (data_dir / FEATURES_FILE).is_file() and (data_dir / TARGETS_FILE).is_file():
        return data_dir
    from sklearn.datasets import load_digits  # slow import: only when the data is missing

    digits = load_digits()
    save_array(data_dir / FEATURES_FILE, (digits.data / 16.0).astype(np.float32))
    save_array(data_dir / TARGETS_FILE, digits.target.astype(np.int64))
    return data_dir


class DigitsDataset(Dataset):
    """Rows `indices` of the materialised digits arrays, memory-mapped (no copy per rank or
    per DataLoader worker: it pickles as the files' paths and the indices)."""

    def __init__(self, data_dir: str | Path, indices: np.ndarray | None = None) -> None:
        data_dir = Path(data_dir)
        self.features = MappedArray(data_dir / FEATURES_FILE)
        self.targets = MappedArray(data_dir / TARGETS_FILE)
        self.indices = np.arange(len(self.targets)) if indices is None else np.asarray(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = self.indices[i]
        return torch.from_numpy(np.array(self.features[j])), torch.tensor(self.targets[j])


class Digits(DataSource):
    """(64 pixel features in [0, 1], class 0-9) pairs with a seeded train/val/test split."""

    def __init__(
        self,
        data_dir: str,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        seed: int = 42,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.fractions, self.seed = (val_fraction, test_fraction), seed
        check_writable(self.data_dir)  # fail before any process or trainer is started
        split_indices(10, val_fraction, test_fraction, seed)  # validates the fractions now

    def prepare(self) -> None:
        materialise(self.data_dir)

    def size(self) -> int:
        """Images in all splits together (prepared)."""
        return len(np.load(self.data_dir / TARGETS_FILE, mmap_mode="r"))

    def larger(self, split: str, elements: int) -> str | None:
        if split == "train":
            return None
        fraction = least_fraction(self.size(), elements)
        return fraction and f"data.dataset.{split}_fraction={fraction} or more"

    def dataset(self, split: str) -> Dataset:
        n = self.size()
        splits = dict(zip(SPLITS, split_indices(n, *self.fractions, self.seed), strict=True))
        return DigitsDataset(self.data_dir, splits[split])
