"""The language-model corpus read back streaming from shards (`data=chars_stream`).

`python -m project.data.prepare --out DIR` cuts the corpus into windows exactly as
`data=chars` does (project.data.text) and writes each split as token shards; this source
reads them as a ShardedStream: each rank opens only its part of the shards, and no split is
held in memory. With `data.shuffle=false` the windows come in the order `data=chars` reads
them unshuffled, so the two give the same losses.

A remote folder (`s3://...`) is copied shard by shard into the node's cache, `cache_dir` (the
run folder's shard_cache: `${paths.output_dir}/shard_cache`, shared by the node's ranks and
their DataLoader workers: project.data.remote.cache), `prefetch` shards ahead of the one read,
reused by every later epoch and worker, and removed when the node's last rank exits.
"""

from __future__ import annotations

import atexit
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

from project.data.remote.reading import RemoteReading
from project.data.shards import ShardCache, load_shard, map_shard, read_index
from project.data.source import SPLITS, DataSource, least_fraction
from project.data.stream import ShardedStream
from project.data.text import Windows
from project.engine.errors import UserError


class TokenWindows(ShardedStream):
    """A split's shards of tokens; element i of a shard is window i (input, next tokens).
    `cache`: where a remote folder's shards are copied (required for a URL); `prefetch`: how
    many shards after the one being read are downloaded in the background."""

    def __init__(
        self,
        folder: str,
        index: dict[str, Any],
        cache: ShardCache | None = None,
        prefetch: int = 2,
    ) -> None:
        super().__init__([e["elements"] for e in index["shards"]])
        self.folder, self.entries, self.block_size = folder, index["shards"], index["block_size"]
        self.cache, self.prefetch = cache, prefetch
        self._reading: RemoteReading | None = None  # this iterator's remote reading

    def __getstate__(self) -> dict[str, Any]:
        return {**vars(self), "_reading": None}  # a worker starts its own (threads, locks)

    def url(self, shard: int) -> str:
        return f"{self.folder}/{self.entries[shard]['file']}"

    def ahead(self, shards: list[int]) -> None:
        if self.cache is None:
            return
        self.stop_reading()  # a previous iterator of this stream that was not read to its end
        urls, sizes = [self.url(s) for s in shards], [self.entries[s]["bytes"] for s in shards]
        self._reading = RemoteReading(self.cache, shards, urls, sizes, self.prefetch)

    def release(self, shard: int) -> None:
        if self._reading is not None:
            self._reading.release(shard)

    def read(self, shard: int) -> Sequence[Any]:
        url, entry = self.url(shard), self.entries[shard]
        if self._reading is None:  # a local folder (or a read outside an iterator)
            tokens = load_shard(self.folder, entry, self.cache)
        else:
            tokens = map_shard(self._reading.read(shard, url, entry), url)
        return Windows(tokens, self.block_size)

    def __iter__(self) -> Iterator[Any]:
        try:
            yield from super().__iter__()
        finally:  # exhausted, closed, or dropped by its loader: its thread and holds end too
            self.stop_reading()

    def stop_reading(self) -> None:
        if self._reading is not None:
            self._reading.stop()
            self._reading = None


def local_cache(root: str) -> str:
    """`data.dataset.cache_dir`, checked: the shards are copied onto each node's own disk, so
    a URL there (which used to become a local folder named `gs:`) is one line."""
    if "://" in root:
        raise UserError(
            f"data.dataset.cache_dir={root} is a URL, but the shards of a remote "
            "data.dataset.folder are cached on each node's own disk: give a local folder"
        )
    return root


class CharStream(DataSource):
    """Token shards of `folder`/{train,val,test}, written by project.data.prepare with windows
    of `block_size` (the model's context length reads it from the config, so it is checked).
    `cache_dir`: where a remote folder's shards are copied, one folder per node (None: a new
    temp folder); `cache_limit_mb`: its size limit (None: none); `prefetch`: shards
    downloaded ahead of the one read."""

    def __init__(
        self,
        folder: str,
        block_size: int = 64,
        cache_dir: str | None = None,
        cache_limit_mb: float | None = None,
        prefetch: int = 2,
    ) -> None:
        self.folder, self.prefetch = str(folder).rstrip("/"), int(prefetch)
        # Read and checked here: a missing or corrupt folder fails before any process starts.
        self.indexes = {split: read_index(f"{self.folder}/{split}") for split in SPLITS}
        for split, index in self.indexes.items():
            if index.get("block_size") != block_size:
                raise UserError(
                    f"{self.folder}/{split} holds windows of block_size={index.get('block_size')}"
                    f" but data.dataset.block_size={block_size}: set it to match, or prepare "
                    f"again with --block-size {block_size}"
                )
        if self.prefetch < 0:
            raise UserError(f"data.dataset.prefetch={prefetch}: give 0 (no prefetch) or more")
        if cache_limit_mb is not None and float(cache_limit_mb) <= 0:
            raise UserError(
                f"data.dataset.cache_limit_mb={cache_limit_mb}: give a size in MiB, or null "
                "for no limit"
            )
        self.cache: ShardCache | None = None
        self.streams: list[TokenWindows] = []  # what teardown stops
        if "://" in self.folder:
            root = cache_dir or tempfile.mkdtemp(prefix="shard_cache-")
            self.cache = ShardCache(local_cache(str(root)), cache_limit_mb)
            try:
                self.cache.join()  # the node's cache stays until its last user leaves
            except OSError as err:  # a file in its way, a read-only filesystem: at start
                why = f"{err.strerror}: {err.filename}" if err.filename else str(err)
                raise UserError(
                    f"data.dataset.cache_dir={root} cannot be made a folder ({why}): give a "
                    "local folder this user may write to"
                ) from None
            # At the rank's exit, not at a trainer's teardown: Lightning tears down after fit
            # and again after test, and a rank leaving between the two could find itself last
            # while another rank's test workers are only starting.
            atexit.register(self.leave)

    def dataset(self, split: str) -> TokenWindows:
        stream = TokenWindows(f"{self.folder}/{split}", self.indexes[split], self.cache,
                              self.prefetch)  # fmt: skip
        self.streams.append(stream)
        return stream

    def larger(self, split: str, elements: int) -> str | None:
        """The fraction project.data.prepare cuts off for `split`; the corpus's length is read
        back from the shards as its least (each split held windows*block_size+1 tokens or a
        few more), so the fraction named works."""
        if split == "train":
            return None
        block = self.indexes[split]["block_size"]
        tokens = sum(sum(e["elements"] for e in index["shards"]) * block + 1
                     for index in self.indexes.values())  # fmt: skip
        fraction = least_fraction(tokens, elements * block + 1)
        return fraction and (
            f"shards prepared again with a larger {split} split (python -m "
            f"project.data.prepare --{split}-fraction {fraction} for the same corpus)"
        )

    def leave(self) -> None:
        """This rank is done with the node's cache (at its exit); the last one out removes it."""
        if self.cache is not None:
            self.cache.leave()

    def teardown(self) -> None:
        """Stop this rank's readers (threads, held shards). The node's cache is left when the
        rank exits: the last process of the node to leave removes it."""
        for stream in self.streams:
            stream.stop_reading()
