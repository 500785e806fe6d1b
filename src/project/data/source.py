"""The data contract both trainers use, and helpers for sources that cache files on disk.

A source builds map-style `torch.utils.data.Dataset`s (or `project.data.stream.ShardedStream`s
for data in shards) for the splits "train", "val" and "test". `prepare()` runs once per node
before any rank reads (local rank 0: download, decode, write a cache); `dataset(split)` runs on
every rank and should be cheap (read the cache, memory-mapped where it can: `MappedArray`).
Splits must depend on the config only (seeded), never on the rank or the process count.
`teardown()` runs at the end of the run, in every rank, to remove what the run cached.

A dataset is pickled to each DataLoader worker at every epoch's start (workers start from a
fork server: project.engine.data.worker_start). Keep file paths in it, not file contents: an
`np.memmap` pickles by value (its whole content, in and out of every worker), a torch tensor
is moved into /dev/shm (docs/data.md has the pattern and the /dev/shm need).
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from project.engine.errors import UserError

SPLITS = ("train", "val", "test")


class DataSource:
    """Subclass and implement `dataset`; override `prepare` when something must be written."""

    def prepare(self) -> None:
        """Once per node, before `dataset` is called anywhere: fetch or cache the raw data."""

    def dataset(self, split: str) -> Dataset:
        """The dataset of `split` (one of SPLITS): map-style, or a ShardedStream."""
        raise NotImplementedError

    def teardown(self) -> None:
        """At the end of the run, in every rank: remove what the run cached (idempotent)."""

    def larger(self, split: str, elements: int) -> str | None:
        """The setting that gives `split` at least `elements` elements, as the fix a one-line
        error names (every process must have one to evaluate); None: the count only."""
        return None


class MappedArray:
    """A read-only memory map of a `.npy` file (or, given `dtype`, of a raw binary file from
    byte `offset`, `shape` elements) that pickles as where it is, not as its content.

    A DataLoader worker gets its dataset pickled every epoch; an `np.memmap` in it would travel
    whole (pickled by value). This one travels as its path and maps the file again on first
    use in the worker: the pages come from the OS's cache, shared by every process.
    """

    _array: np.ndarray | None = None  # the open map; never pickled

    def __init__(
        self, path: str | Path, dtype: str | None = None, offset: int = 0,
        shape: tuple[int, ...] | None = None,
    ) -> None:  # fmt: skip
        self.path, self.dtype, self.offset, self.shape = str(path), dtype, offset, shape

    @property
    def array(self) -> np.ndarray:
        """The memory map, opened on first use (again after unpickling)."""
        if self._array is None:
            if self.dtype is None:
                self._array = np.load(self.path, mmap_mode="r")
            else:
                self._array = np.memmap(self.path, self.dtype, "r", self.offset, self.shape)
        return self._array

    def __getstate__(self) -> dict[str, object]:
        return {k: v for k, v in vars(self).items() if k != "_array"}

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, index: object) -> np.ndarray:
        return self.array[index]


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


def least_fraction(n: int, count: int) -> float | None:
    """The least fraction f of `n`, in two significant digits, with round(n * f) >= count:
    how `split_indices` and project.data.text size a split; None when no split of `n` can
    hold `count` beside a training split (f would reach 1/2)."""
    if 2 * count >= n:
        return None
    f = (count - 0.5) / n
    digits = 1 - math.floor(math.log10(f))  # f's first two significant digits
    f = round(math.ceil(f * 10**digits) / 10**digits, digits)
    while round(n * f) < count:  # float rounding at the boundary
        f = round(f + 10**-digits, digits)
    return f


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


def save_array(path: Path, array: np.ndarray) -> None:
    """np.save to `path` so that a reader never sees a half-written file.

    The temp file lives in the same directory, so `os.replace` is an atomic rename.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
