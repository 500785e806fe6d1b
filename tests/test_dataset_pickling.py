"""What DataLoader workers receive (issue 35): they start from a fork server and get their
dataset pickled at every epoch's start, so the template's datasets pickle as file paths, not
contents, and reopen their memory maps in the worker; remote shards are copied once per rank
into a cache under the run folder, reused by every epoch and worker, written atomically and
removed at the end of the run."""

from __future__ import annotations

import io
import multiprocessing
import multiprocessing.reduction
import os
import pickle
import signal
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from project.data.digits import FEATURES_FILE, TARGETS_FILE, Digits
from project.data.prepare import prepare
from project.data.shards import ShardCache, read_index
from project.data.text import CharCorpus, read_corpus
from project.data.text_stream import CharStream
from project.engine.data.loaders import plain_loader
from project.engine.data.sharding import set_epoch, shard_loader
from project.engine.errors import UserError

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


# --- remote shards ---------------------------------------------------------------------------
class CountedFetches(ShardCache):
    """A shard cache that records every fetch (from any process) in <record>/fetches.txt."""

    def __init__(self, root: str | Path, record: str) -> None:
        super().__init__(root)
        self.record = record

    def fetch(self, url: str, local: str) -> None:
        with open(Path(self.record) / "fetches.txt", "a") as f:
            f.write(f"{os.getpid()} {url}\n")
        super().fetch(url, local)


class DiesMidDownload(ShardCache):
    """A fetch whose process is killed when half the shard is written."""

    def fetch(self, url: str, local: str) -> None:
        Path(local).write_bytes(Path(url.removeprefix("file://")).read_bytes()[:100])
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.fixture(scope="module")
def small_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short corpus as shards of 32 windows of 8 characters (a handful of shards)."""
    root = tmp_path_factory.mktemp("small")
    corpus = root / "corpus.txt"
    corpus.write_bytes(read_corpus(None)[:6000])
    prepare(str(corpus), root / "shards", 8, 32, val_fraction=0.1, test_fraction=0.1)
    return root / "shards"


def train_loader(source: CharStream, workers: int) -> DataLoader:
    """Rank 1 of 2's train loader of `source`, as the machinery builds it."""
    plain = plain_loader(source.dataset("train"), "train", 16, num_workers=workers)
    loader = shard_loader(plain, "train", 2, 1, seed=3)
    loader.multiprocessing_context = "forkserver" if workers else None
    return loader


def test_remote_shards_are_fetched_once_per_rank_over_epochs_and_workers(
    small_shards: Path, tmp_path: Path
) -> None:
    """2 epochs x 2 workers (new workers every epoch) read the rank's shards from a `file://`
    URL: each shard the rank reads (its lanes') is fetched once, into
    <run>/shard_cache/rank1/, the batches are those of the local folder, and the source's
    teardown removes the cache."""
    run_cache = tmp_path / "run" / "shard_cache"
    remote = CharStream(f"file://{small_shards}", block_size=8, cache_dir=str(run_cache))
    remote.cache = CountedFetches(run_cache, str(tmp_path))
    streamed, local = train_loader(remote, 2), train_loader(CharStream(str(small_shards), 8), 0)
    entries, read = read_index(f"{small_shards}/train")["shards"], set()
    for epoch in (0, 1):
        set_epoch(streamed, epoch)
        set_epoch(local, epoch)
        assert same_batches(list(streamed), list(local))
        read |= set(local.dataset.shards_of(1))  # the rank's lanes' shards: its part
    fetches = (tmp_path / "fetches.txt").read_text().splitlines()
    shards = sorted(entries[i]["file"] for i in read)
    assert sorted(line.split("/")[-1] for line in fetches) == shards and len(shards) > 2
    assert len({line.split()[0] for line in fetches}) > 1  # fetched by workers, not the rank
    kept = sorted(p.name for p in (run_cache / "rank1").rglob("shard-*.npy"))
    assert kept == shards and not list(run_cache.rglob("*.tmp"))
    remote.teardown()
    assert not run_cache.exists()


def test_a_ranks_teardown_leaves_the_other_ranks_copies(small_shards: Path, tmp_path: Path) -> None:
    """Rank 1 builds every split (Lightning's setup does) but reads only train: its teardown
    removes its own copies and those of a rank beyond the world (a larger attempt's, killed),
    never rank 0's, which rank 0 may still be reading."""
    run_cache = tmp_path / "shard_cache"
    entry = read_index(f"{small_shards}/train")["shards"][0]
    ShardCache(run_cache).local_copy(f"file://{small_shards}/train/{entry['file']}", entry, 0)
    (run_cache / "rank5").mkdir()  # left by a 6-rank attempt
    rank1 = CharStream(f"file://{small_shards}", block_size=8, cache_dir=str(run_cache))
    for split in ("val", "test"):
        rank1.dataset(split)  # built, never sharded: says rank 0
    list(train_loader(rank1, 0))
    assert (run_cache / "rank1").is_dir()
    rank1.teardown()
    assert sorted(p.name for p in run_cache.iterdir()) == ["rank0"]
    assert list((run_cache / "rank0").rglob(entry["file"]))


def test_a_download_killed_midway_leaves_no_file_that_is_read_later(
    small_shards: Path, tmp_path: Path
) -> None:
    url, entry = f"file://{small_shards}/train", read_index(f"{small_shards}/train")["shards"][0]
    dying = DiesMidDownload(tmp_path / "cache")
    child = multiprocessing.get_context("fork").Process(
        target=dying.local_copy, args=(f"{url}/{entry['file']}", entry, 0)
    )
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    assert not list((tmp_path / "cache").rglob(entry["file"]))  # only a temp name
    cache = CountedFetches(tmp_path / "cache", str(tmp_path))
    copy = cache.local_copy(f"{url}/{entry['file']}", entry, 0)  # fetched again, whole
    assert np.array_equal(np.load(copy), np.load(small_shards / "train" / entry["file"]))
    assert len((tmp_path / "fetches.txt").read_text().splitlines()) == 1


def test_a_shard_that_arrives_at_another_size_is_one_line(
    small_shards: Path, tmp_path: Path
) -> None:
    entry = dict(read_index(f"{small_shards}/train")["shards"][0])
    entry["bytes"] += 1  # the folder changed between the index check and the download
    url = f"file://{small_shards}/train/{entry['file']}"
    with pytest.raises(UserError, match=r"arrived with \d+ bytes, the index says") as err:
        ShardCache(tmp_path / "cache").local_copy(url, entry, 0)
    assert "\n" not in str(err.value)
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and p.suffix != ".lock"]


def test_the_splits_shards_of_the_same_name_are_cached_apart(
    small_shards: Path, tmp_path: Path
) -> None:
    """Every split's first shard is shard-00000.npy: each keeps its own copy."""
    cache = ShardCache(tmp_path / "cache")
    for split in ("train", "val"):
        entry = read_index(f"{small_shards}/{split}")["shards"][0]
        copy = cache.local_copy(f"file://{small_shards}/{split}/{entry['file']}", entry, 0)
        assert np.array_equal(np.load(copy), np.load(small_shards / split / entry["file"]))
