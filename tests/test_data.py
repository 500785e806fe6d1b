"""The plain-PyTorch dataset: atomic materialisation, deterministic split, memory-mapped reads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from project.data import digits

pytestmark = pytest.mark.quick  # the fast tier: `make test`


def test_materialise_writes_once_and_atomically(tmp_path: Path, monkeypatch) -> None:
    out = digits.materialise(tmp_path / "d")
    x = np.load(out / digits.FEATURES_FILE)
    y = np.load(out / digits.TARGETS_FILE)
    assert x.shape == (1797, 64) and x.dtype == np.float32 and x.min() >= 0 and x.max() <= 1
    assert y.shape == (1797,) and set(np.unique(y)) == set(range(10))
    assert not list(out.glob(".*tmp"))  # no temp files left behind

    # A second call must not rewrite (other ranks may be reading it).
    mtime = (out / digits.FEATURES_FILE).stat().st_mtime_ns
    digits.materialise(out)
    assert (out / digits.FEATURES_FILE).stat().st_mtime_ns == mtime


def test_interrupted_write_leaves_no_partial_file(tmp_path: Path, monkeypatch) -> None:
    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "save", boom)
    with pytest.raises(KeyboardInterrupt):
        digits.materialise(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_split_is_deterministic_and_disjoint() -> None:
    a = digits.split_indices(1797, 0.15, 0.15, seed=3)
    b = digits.split_indices(1797, 0.15, 0.15, seed=3)
    c = digits.split_indices(1797, 0.15, 0.15, seed=4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not np.array_equal(a[0], c[0])
    assert sorted(np.concatenate(a).tolist()) == list(range(1797))
    with pytest.raises(ValueError, match="sum to less than 1"):
        digits.split_indices(10, 0.6, 0.5, seed=0)


def test_dataset_reads_memory_mapped(data_dir: Path) -> None:
    ds = digits.DigitsDataset(data_dir, np.array([5, 7]))
    assert isinstance(ds.features.array, np.memmap) and len(ds) == 2
    x, y = ds[1]
    assert x.shape == (64,) and int(y) == int(np.load(data_dir / digits.TARGETS_FILE)[7])
