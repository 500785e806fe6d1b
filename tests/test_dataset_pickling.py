"""What DataLoader workers receive (issue 35): they start from a fork server and get their
dataset pickled at every epoch's start, so the template's datasets pickle as file paths, not
contents, and reopen their memory maps in the worker (the node's cache of remote shards that
workers share: tests/test_shard_cache.py)."""

from __future__ import annotations

import io
import multiprocessing
import multiprocessing.reduction
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from project.data.digits import FEATURES_FILE, TARGETS_FILE, Digits
from project.data.text import CharCorpus, read_corpus

pytestmark = pytest.mark.quick

SMALLER = 10  # a pickle this many times smaller than the arrays cannot hold them by value


def digits(data_dir: Path, tmp_path: Path) -> tuple[Dataset, int]:
    """The digits train split, and the bytes of the arrays it reads."""
    arrays = [np.load(data_dir / f, mmap_mode="r") for f in (FEATURES_FILE, TARGETS_FILE)]
    return Digits(str(data_dir)).dataset("train"), sum(a.nbytes for a in arrays)


def chars(path: str | None) -> tuple[Dataset, int]:
    """The train windows of a corpus, and the bytes of its tokens at one byte a token."""
    corpus = CharCorpus(path, block_size=32)
    return corpus.dataset("train"), corpus.splits()["train"].nbytes


def corpus_file(tmp_path: Path, newline: bytes) -> str:
    """Python's pydoc topics as a file with `newline` line ends."""
    path = tmp_path / "corpus.txt"
    path.write_bytes(read_corpus(None).replace(b"\n", newline))
    return str(path)


DATASETS: dict[str, Callable[[Path, Path], tuple[Dataset, int]]] = {
    "digits": digits,
    "chars-pydoc": lambda data_dir, tmp_path: chars(None),
    "chars-file": lambda data_dir, tmp_path: chars(corpus_file(tmp_path, b"\n")),
    "chars-crlf-file": lambda data_dir, tmp_path: chars(corpus_file(tmp_path, b"\r\n")),
}


def same_batches(a: list, b: list) -> bool:
    """Two loaders' batches are equal, tensor by tensor."""
    return len(a) == len(b) and all(
        torch.equal(x, y) for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True)
    )


def same_items(a: Dataset, b: Dataset) -> bool:
    """Two datasets of the same length hold the same items (every 97th and the last)."""
    picks = [*range(0, len(a), 97), len(a) - 1]
    return len(a) == len(b) and all(
        all(torch.equal(x, y) for x, y in zip(a[i], b[i], strict=True)) for i in picks
    )


@pytest.mark.parametrize("name", DATASETS)
def test_a_dataset_pickles_as_paths_not_contents(name: str, data_dir: Path, tmp_path) -> None:
    """pickle.dumps of the dataset is far smaller than its arrays, and the copy reads the
    same items (it maps or reads its files again)."""
    dataset, nbytes = DATASETS[name](data_dir, tmp_path)
    pickled = pickle.dumps(dataset)
    size = len(pickled)
    assert size < nbytes // SMALLER, (size, nbytes)
    assert same_items(pickle.loads(pickled), dataset)


def sent_to_workers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes each new worker process is sent from now on: under a fork server (or spawn)
    multiprocessing pickles the process object, its dataset with it, into the child, and a
    tensor's storage goes to shared memory (/dev/shm) instead, counted here at its size."""
    sizes, shared, dump = [], [], multiprocessing.reduction.dump
    reducers = multiprocessing.reduction.ForkingPickler._extra_reducers  # torch's, for tensors

    def measured(obj: object, file: io.BytesIO, protocol: int | None = None) -> None:
        start, shared[:] = file.tell(), []
        dump(obj, file, protocol)
        if isinstance(obj, multiprocessing.process.BaseProcess):
            sizes.append(file.tell() - start + sum(shared))

    def storage_counted(reduce: Callable) -> Callable:
        def reduced(obj: object) -> object:
            if isinstance(obj, torch.UntypedStorage):
                shared.append(obj.nbytes())
            return reduce(obj)

        return reduced

    monkeypatch.setattr(multiprocessing.reduction, "dump", measured)
    for kind, reduce in list(reducers.items()):
        monkeypatch.setitem(reducers, kind, storage_counted(reduce))
    return sizes


@pytest.mark.parametrize("name", ["digits", "chars-file"])
def test_fork_server_workers_get_a_small_dataset_and_yield_the_same_batches(
    name: str, data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dataset, nbytes = DATASETS[name](data_dir, tmp_path)
    alone = list(DataLoader(dataset, batch_size=64))
    sizes = sent_to_workers(monkeypatch)
    loader = DataLoader(dataset, batch_size=64, num_workers=2,
                        multiprocessing_context="forkserver")  # fmt: skip
    batches = list(loader)
    assert len(sizes) == 2 and max(sizes) < nbytes // SMALLER, (sizes, nbytes)
    assert same_batches(batches, alone)
