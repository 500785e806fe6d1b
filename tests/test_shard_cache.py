"""The node's cache of remote shards (project.data.remote: cache, prefetch, reading): the
processes of a node share one copy of each shard (file locks, no copy per rank), a copy
appears only whole, a cut or failed download is tried again and then is one line naming the
shard and its URL, a size limit evicts what no reader still has ahead (never a shard in use),
and the next shards are fetched in the background. Remote folders here are `file://` URLs
(the S3 server's end-to-end runs are in tests/test_streaming.py)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from project.data.prepare import prepare
from project.data.shards import ShardCache, read_index
from project.data.text import read_corpus
from project.data.text_stream import CharStream
from project.engine.data.loaders import plain_loader
from project.engine.data.sharding import set_epoch, shard_loader
from project.engine.errors import UserError

pytestmark = pytest.mark.quick


class CountedFetches(ShardCache):
    """A shard cache that records every fetch (from any process) in <record>/fetches.txt."""

    def __init__(self, root: str | Path, record: str, limit_mb: float | None = None) -> None:
        super().__init__(root, limit_mb)
        self.record = record

    def fetch(self, url: str, local: str) -> None:
        with open(Path(self.record) / "fetches.txt", "a") as f:
            f.write(f"{os.getpid()} {url} {sum(p.stat().st_size for p in self.copies())}\n")
        super().fetch(url, local)


class Cut(CountedFetches):
    """Every download arrives cut (half the shard) the first `cuts` times, then whole."""

    cuts = 2

    def fetch(self, url: str, local: str) -> None:
        super().fetch(url, local)
        if len(fetches(Path(self.record))) <= self.cuts:
            data = Path(local).read_bytes()
            Path(local).write_bytes(data[: len(data) // 2])


class Slow(CountedFetches):
    """Writes half the shard, waits, then the rest (what another process may see meanwhile)."""

    def fetch(self, url: str, local: str) -> None:
        data = Path(url.removeprefix("file://")).read_bytes()
        with open(local, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            Path(self.record, "started").touch()  # the test's reader starts now
            time.sleep(1.0)
            f.write(data[len(data) // 2 :])
        super().fetch(url, local)


class DiesMidDownload(ShardCache):
    """A fetch whose process is killed when half the shard is written."""

    def fetch(self, url: str, local: str) -> None:
        Path(local).write_bytes(Path(url.removeprefix("file://")).read_bytes()[:100])
        os.kill(os.getpid(), signal.SIGKILL)


def fetches(record: Path) -> list[list[str]]:
    """The recorded fetches: [pid, url, bytes in the cache then]."""
    file = record / "fetches.txt"
    return [line.split() for line in file.read_text().splitlines()] if file.exists() else []


@pytest.fixture(scope="module")
def small_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short corpus as shards of 32 windows of 8 characters (20 train shards)."""
    root = tmp_path_factory.mktemp("small")
    corpus = root / "corpus.txt"
    corpus.write_bytes(read_corpus(None)[:6000])
    prepare(str(corpus), root / "shards", 8, 32, val_fraction=0.1, test_fraction=0.1)
    return root / "shards"


def train_loader(
    source: CharStream, workers: int, rank: int = 1, world: int = 2, layout: tuple = (None, None)
) -> DataLoader:
    """Rank `rank` of `world`'s train loader of `source`, as the machinery builds it;
    `layout`: (lanes, shuffle_block), None: the defaults."""
    stream = source.dataset("train")
    stream.lanes, stream.shuffle_block = layout
    plain = plain_loader(stream, "train", 16, num_workers=workers)
    loader = shard_loader(plain, "train", world, rank, seed=3)
    loader.multiprocessing_context = "forkserver" if workers else None
    return loader


def same_batches(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True)
    )


def remote(shards: Path, cache: ShardCache, **options: object) -> CharStream:
    source = CharStream(f"file://{shards}", block_size=8, cache_dir=str(cache.root), **options)
    source.cache = cache
    return source


def train_rank(
    shards: str, cache_dir: str, record: str, rank: int, workers: int, started: object
) -> None:
    """One rank of 2 on this node: reads 2 epochs of its part, checks it against the local
    folder's batches, then leaves the cache (at its exit: this child skips atexit)."""
    source = remote(Path(shards), CountedFetches(cache_dir, record))
    started.wait()  # type: ignore[attr-defined]  (ranks train together: DDP's first collective)
    streamed = train_loader(source, workers, rank)
    local = train_loader(CharStream(shards, 8), 0, rank)
    for epoch in (0, 1):
        set_epoch(streamed, epoch)
        set_epoch(local, epoch)
        assert same_batches(list(streamed), list(local))
    source.teardown()
    source.cache.leave()  # type: ignore[union-attr]


def test_the_ranks_of_a_node_share_one_copy_of_each_shard(
    small_shards: Path, tmp_path: Path
) -> None:
    """2 ranks (processes) x 2 epochs read their parts through one cache folder (DataLoader
    workers share it the same way: tests/test_streaming.py's runs): each shard is downloaded
    once on the node, not once per rank, the batches are the local folder's, and the last
    rank out removes the cache."""
    cache_dir = tmp_path / "run" / "shard_cache"
    ctx = multiprocessing.get_context("forkserver")
    started = ctx.Barrier(2)
    ranks = [ctx.Process(target=train_rank, args=(str(small_shards), str(cache_dir),
                                                  str(tmp_path), rank, 0, started))
             for rank in (0, 1)]  # fmt: skip
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(120)
    assert [p.exitcode for p in ranks] == [0, 0]
    got = fetches(tmp_path)
    shards = sorted(e["file"] for e in read_index(f"{small_shards}/train")["shards"])
    assert sorted(url.split("/")[-1] for _, url, _ in got) == shards  # each exactly once
    assert not cache_dir.exists()


def test_a_shard_another_process_fetches_is_waited_for_and_never_seen_cut(
    small_shards: Path, tmp_path: Path
) -> None:
    """While one process writes a shard slowly, the shard's name never holds a partial copy,
    and a reader in another process waits for it and gets it whole (fetched once)."""
    url, entry = f"file://{small_shards}/train", read_index(f"{small_shards}/train")["shards"][0]
    slow = Slow(tmp_path / "cache", str(tmp_path))
    target = slow.path(f"{url}/{entry['file']}")
    child = multiprocessing.get_context("forkserver").Process(
        target=slow.local_copy, args=(f"{url}/{entry['file']}", entry)
    )
    child.start()
    seen: set[int] = set()
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    reader, began = CountedFetches(tmp_path / "cache", str(tmp_path)), time.monotonic()
    waiting = threading.Thread(target=lambda: seen.add(len(np.load(reader.local_copy(
        f"{url}/{entry['file']}", entry)))))  # fmt: skip
    waiting.start()
    while waiting.is_alive():
        if target.exists():
            seen.add(-target.stat().st_size)
        time.sleep(0.005)
    waited = time.monotonic() - began
    child.join(60)
    whole = len(np.load(small_shards / "train" / entry["file"]))
    assert child.exitcode == 0 and seen - {-entry["bytes"]} == {whole}
    assert waited > 0.5, waited  # it waited for the download under way (a second's sleep)
    assert len(fetches(tmp_path)) == 1  # the reader waited instead of fetching it again
    assert not list((tmp_path / "cache").rglob("*.tmp"))


def test_a_peer_holding_the_shard_never_blocks_its_download(
    small_shards: Path, tmp_path: Path
) -> None:
    """A peer holds the shard's reading lock (as a DataLoader worker does for as long as its
    iterator lives, waiting on this reader's batches) while the copy is not here yet: the
    reader downloads it all the same. Upgrading the reading lock to download deadlocked."""
    import fcntl

    url, entry = f"file://{small_shards}/train", read_index(f"{small_shards}/train")["shards"][0]
    cache = CountedFetches(tmp_path / "cache", str(tmp_path))
    target = cache.path(f"{url}/{entry['file']}")
    target.parent.mkdir(parents=True)
    with open(target.parent / f".{target.name}.lock", "a") as peer:
        fcntl.flock(peer, fcntl.LOCK_SH)  # another open file: it conflicts as a process would
        got: list[Path] = []
        reader = threading.Thread(
            target=lambda: got.append(cache.local_copy(f"{url}/{entry['file']}", entry)),
            daemon=True,  # a deadlocked one must not keep the test's process alive
        )
        reader.start()
        reader.join(30)
        assert got == [target], "the reader waited on a peer that holds the shard"
    assert len(fetches(tmp_path)) == 1


def test_a_download_killed_midway_leaves_no_file_that_is_read_later(
    small_shards: Path, tmp_path: Path
) -> None:
    url, entry = f"file://{small_shards}/train", read_index(f"{small_shards}/train")["shards"][0]
    dying = DiesMidDownload(tmp_path / "cache")
    child = multiprocessing.get_context("fork").Process(
        target=dying.local_copy, args=(f"{url}/{entry['file']}", entry)
    )
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    assert not list((tmp_path / "cache").rglob(entry["file"]))  # only a temp name
    cache = CountedFetches(tmp_path / "cache", str(tmp_path))
    copy = cache.local_copy(f"{url}/{entry['file']}", entry)  # fetched again, whole
    assert np.array_equal(np.load(copy), np.load(small_shards / "train" / entry["file"]))
    assert len(fetches(tmp_path)) == 1


def test_a_cut_download_is_tried_again(small_shards: Path, tmp_path: Path) -> None:
    url, entry = f"file://{small_shards}/train", read_index(f"{small_shards}/train")["shards"][0]
    cache = Cut(tmp_path / "cache", str(tmp_path))
    cache.backoff_s = 0.01
    copy = cache.local_copy(f"{url}/{entry['file']}", entry)
    assert np.array_equal(np.load(copy), np.load(small_shards / "train" / entry["file"]))
    assert len(fetches(tmp_path)) == 3  # cut, cut, whole


@pytest.mark.parametrize("how", ["cut", "missing"])
def test_a_download_that_keeps_failing_is_one_line_naming_the_shard_and_url(
    small_shards: Path, tmp_path: Path, how: str
) -> None:
    """4 tries, then one line; nothing but lock files is left in the cache."""
    entry = dict(read_index(f"{small_shards}/train")["shards"][0])
    url = f"file://{small_shards}/train/{entry['file']}"
    if how == "missing":  # gone after the index was checked
        url = f"file://{tmp_path}/gone/{entry['file']}"
    cache = Cut(tmp_path / "cache", str(tmp_path))
    cache.cuts, cache.backoff_s = 100, 0.01
    with pytest.raises(UserError, match=rf"shard {entry['file']} could not be downloaded from "
                       rf"{url} after 4 tries") as err:  # fmt: skip
        cache.local_copy(url, entry)
    assert "\n" not in str(err.value) and len(fetches(tmp_path)) == 4
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and p.suffix != ".lock"]


def test_the_splits_shards_of_the_same_name_are_cached_apart(
    small_shards: Path, tmp_path: Path
) -> None:
    """Every split's first shard is shard-00000.npy: each keeps its own copy."""
    cache = ShardCache(tmp_path / "cache")
    for split in ("train", "val"):
        entry = read_index(f"{small_shards}/{split}")["shards"][0]
        copy = cache.local_copy(f"file://{small_shards}/{split}/{entry['file']}", entry)
        assert np.array_equal(np.load(copy), np.load(small_shards / split / entry["file"]))


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_size_limit_evicts_what_no_reader_has_ahead_never_a_shard_in_use(
    small_shards: Path, tmp_path: Path, prefetch: int
) -> None:
    """A limit of 5 shards' size (one held by another reader, the one read, 2 prefetched,
    one more): an epoch of 20 shards reads the local folder's batches, the cache never holds
    more than the limit, and a shard another process holds stays. One lane, blocks of one
    shard: a rank reads one shard at a time (with the default lanes it reads a block of rows
    of each of its lanes at once, which a limit must hold: docs/data.md)."""
    entries = read_index(f"{small_shards}/train")["shards"]
    size = max(e["bytes"] for e in entries)
    limit_mb = 5 * size / 2**20
    cache = CountedFetches(tmp_path / "cache", str(tmp_path), limit_mb)
    first = f"file://{small_shards}/train/{entries[0]['file']}"
    held = cache.hold(first, entries[0])  # in use (a reader of another stream)
    source = remote(small_shards, cache, prefetch=prefetch, cache_limit_mb=limit_mb)
    one_at_a_time = (1, entries[0]["elements"])
    streamed = train_loader(source, 0, rank=0, world=1, layout=one_at_a_time)
    local = train_loader(CharStream(str(small_shards), 8), 0, rank=0, world=1,
                         layout=one_at_a_time)  # fmt: skip
    assert same_batches(list(streamed), list(local))
    in_cache = [int(used) for _, _, used in fetches(tmp_path)]
    log = "\n".join(" ".join(f[1:]) for f in fetches(tmp_path))  # url, bytes cached then
    assert len(in_cache) > 5 and max(in_cache) + size <= 5 * size, log
    assert held.path.exists()  # never evicted while held
    assert sum(p.stat().st_size for p in cache.copies()) <= 5 * size
    held.release()


def test_the_next_shards_are_fetched_in_the_background_and_the_thread_ends(
    small_shards: Path, tmp_path: Path
) -> None:
    """prefetch=2: while the first shard is read, the 2 after it arrive (fetched by a thread),
    not the third; closing the iterator ends the thread."""
    cache = CountedFetches(tmp_path / "cache", str(tmp_path))
    source = remote(small_shards, cache, prefetch=2)
    stream = source.dataset("train")
    it = iter(stream)
    next(it)
    deadline = time.monotonic() + 30
    while len(fetches(tmp_path)) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)
    files = [e["file"] for e in stream.entries]
    assert sorted(url.split("/")[-1] for _, url, _ in fetches(tmp_path)) == files[:3]
    assert any(t.name == "shard-prefetch" for t in threading.enumerate())
    it.close()
    assert not any(t.name == "shard-prefetch" for t in threading.enumerate())
    source.teardown()
    cache.leave()  # what the rank's exit does
    assert not (tmp_path / "cache").exists()


def test_a_download_failing_in_a_dataloader_worker_is_the_same_one_line(
    small_shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The shards vanish after the index was checked: the worker that reads one gives up
    after 4 tries, and the rank reports the worker's one line (torch re-raises it with the
    worker's traceback as the message), exit 2."""
    import shutil

    from project.engine.run.cli import report_user_errors

    shards = tmp_path / "shards"
    shutil.copytree(small_shards, shards)
    cache = ShardCache(tmp_path / "cache")
    cache.backoff_s = 0.01
    source = remote(shards, cache)
    for shard in (shards / "train").glob("*.npy"):
        shard.unlink()
    loader = train_loader(source, 1)
    loader.multiprocessing_context = "fork"
    with pytest.raises(SystemExit) as stop:
        report_user_errors(lambda: list(loader))
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: shard shard-") and f"from file://{shards}/train/shard-" in err
    assert "after 4 tries (FileNotFoundError" in err and "Traceback" not in err


def test_the_last_process_out_removes_only_what_the_cache_made(
    small_shards: Path, tmp_path: Path
) -> None:
    """`cache_dir` may be a node's scratch folder holding other files: the last process out
    removes its copies, locks and reader files, never the rest (it removed the whole folder)."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "my_notes.txt").write_text("mine")
    (scratch / "results").mkdir()
    cache = ShardCache(scratch)
    entry = read_index(f"{small_shards}/train")["shards"][0]
    cache.local_copy(f"file://{small_shards}/train/{entry['file']}", entry)
    assert cache.copies()
    cache.leave()
    assert sorted(p.name for p in scratch.iterdir()) == ["my_notes.txt", "results"]
