"""The digits dataset as plain PyTorch: materialise once to .npy, then read memory-mapped.

scikit-learn ships the 1797 8x8 handwritten digits, so this works with no network. Both
trainers use `materialise` (once per node) and `DigitsDataset`, `split_indices` and
`make_loader` (every rank).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from project.errors import UserError

FEATURES_FILE = "digits_x.npy"
TARGETS_FILE = "digits_y.npy"


def check_writable(data_dir: str | Path) -> None:
    """Fail with a one-line fix when `data_dir` cannot be created or written."""
    data_dir = Path(data_dir)
    existing = data_dir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise UserError(
            f"data_dir {data_dir} cannot be written ({existing} is not a writable directory); "
            "point it elsewhere with paths.data_dir=/some/writable/dir"
        )


def _atomic_save(path: Path, array: np.ndarray) -> None:
    """Write `array` to `path` so that a reader never sees a half-written file.

    The temp file lives in the same directory, so `os.replace` is an atomic rename.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def materialise(data_dir: str | Path) -> Path:
    """Write the digits arrays into `data_dir` unless they are already there. Returns the dir.

    Features are scaled to [0, 1] float32, targets are int64.
    """
    data_dir = Path(data_dir)
    if (data_dir / FEATURES_FILE).is_file() and (data_dir / TARGETS_FILE).is_file():
        return data_dir
    from sklearn.datasets import load_digits  # slow import: only when the data is missing

    data_dir.mkdir(parents=True, exist_ok=True)
    digits = load_digits()
    _atomic_save(data_dir / FEATURES_FILE, (digits.data / 16.0).astype(np.float32))
    _atomic_save(data_dir / TARGETS_FILE, digits.target.astype(np.int64))
    return data_dir


def split_indices(
    n: int, val_fraction: float, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A deterministic train/val/test split of `range(n)` that depends on `seed` only."""
    if not (0 <= val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
        raise ValueError(
            f"val_fraction={val_fraction} and test_fraction={test_fraction} must be in [0, 1) "
            "and sum to less than 1"
        )
    perm = np.random.default_rng(seed).permutation(n)
    n_val, n_test = round(n * val_fraction), round(n * test_fraction)
    return perm[n_val + n_test :], perm[:n_val], perm[n_val : n_val + n_test]


class DigitsDataset(Dataset):
    """Rows `indices` of the materialised digits arrays, memory-mapped (no copy per rank)."""

    def __init__(self, data_dir: str | Path, indices: np.ndarray | None = None) -> None:
        data_dir = Path(data_dir)
        self.x = np.load(data_dir / FEATURES_FILE, mmap_mode="r")
        self.y = np.load(data_dir / TARGETS_FILE, mmap_mode="r")
        self.indices = np.arange(len(self.y)) if indices is None else np.asarray(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = self.indices[i]
        return torch.from_numpy(np.array(self.x[j])), torch.tensor(self.y[j])


class ResumableSampler(DistributedSampler):
    """DistributedSampler (also for one process) that can resume in the middle of an epoch.

    The order depends only on (seed, epoch), never on the global RNG, and `skip_batches(k)`
    makes the next epoch iterator start after the first k batches: a run resumed from a
    mid-epoch checkpoint sees exactly the batches the interrupted run had not trained on.
    """

    def __init__(self, dataset: Dataset, world: int, rank: int, shuffle: bool, seed: int) -> None:
        super().__init__(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
        self._skip = 0

    def skip_batches(self, batches: int, batch_size: int) -> None:
        self._skip = batches * batch_size

    def __iter__(self):  # type: ignore[override]
        indices = list(super().__iter__())
        start, self._skip = self._skip, 0  # one epoch only
        return iter(indices[start:])


def make_loader(
    dataset: Dataset,
    batch_size: int,
    shuffle: bool,
    world: int = 1,
    rank: int = 0,
    seed: int = 0,
    num_workers: int = 0,
    pin_memory: bool = False,
    persistent_workers: bool = False,
) -> DataLoader:
    """The DataLoader both trainers use: a ResumableSampler, and a private generator for the
    per-iterator seed (else every new iterator draws from the global RNG, which would make
    dropout masks depend on when iterators were created, e.g. after a resume)."""
    sampler = ResumableSampler(dataset, world, rank, shuffle, seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory and torch.cuda.is_available(),
        persistent_workers=persistent_workers and num_workers > 0,
        generator=torch.Generator().manual_seed(seed),
    )
