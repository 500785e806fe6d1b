"""The language-model corpus read back streaming from shards (`data=chars_stream`).

`python -m project.data.prepare --out DIR` cuts the corpus into windows exactly as
`data=chars` does (project.data.text) and writes each split as token shards; this source
reads them as a ShardedStream: each rank opens only its part of the shards, and no split is
held in memory. With `data.shuffle=false` the windows come in the order `data=chars` reads
them unshuffled, so the two give the same losses.

A remote folder (`s3://...`) is copied shard by shard into <cache_dir>/rank<R>/ (the run
folder's shard_cache: `${paths.output_dir}/shard_cache`) when a shard is first read, reused by
every later epoch and DataLoader worker of the rank, and removed at the end of the run.
"""

from __future__ import annotations

import atexit
import tempfile
from collections.abc import Sequence
from typing import Any

from project.data.shards import ShardCache, load_shard, read_index
from project.data.source import SPLITS, DataSource
from project.data.stream import ShardedStream
from project.data.text import Windows
from project.engine.errors import UserError


class TokenWindows(ShardedStream):
    """A split's shards of tokens; element i of a shard is window i (input, next tokens).
    `cache`: where a remote folder's shards are copied (required for a URL)."""

    def __init__(self, folder: str, index: dict[str, Any], cache: ShardCache | None = None) -> None:
        super().__init__([e["elements"] for e in index["shards"]])
        self.folder, self.entries, self.block_size = folder, index["shards"], index["block_size"]
        self.cache = cache

    def read(self, shard: int) -> Sequence[Any]:
        tokens = load_shard(self.folder, self.entries[shard], self.cache, self.rank)
        return Windows(tokens, self.block_size)


class CharStream(DataSource):
    """Token shards of `folder`/{train,val,test}, written by project.data.prepare with windows
    of `block_size` (the model's context length reads it from the config, so it is checked).
    `cache_dir`: where a remote folder's shards are copied, per rank (None: a new temp folder)."""

    def __init__(self, folder: str, block_size: int = 64, cache_dir: str | None = None) -> None:
        self.folder = str(folder).rstrip("/")
        # Read and checked here: a missing or corrupt folder fails before any process starts.
        self.indexes = {split: read_index(f"{self.folder}/{split}") for split in SPLITS}
        for split, index in self.indexes.items():
            if index.get("block_size") != block_size:
                raise UserError(
                    f"{self.folder}/{split} holds windows of block_size={index.get('block_size')}"
                    f" but data.dataset.block_size={block_size}: set it to match, or prepare "
                    f"again with --block-size {block_size}"
                )
        self.cache: ShardCache | None = None
        self.streams: list[TokenWindows] = []  # what teardown cleans up after
        if "://" in self.folder:
            self.cache = ShardCache(cache_dir or tempfile.mkdtemp(prefix="shard_cache-"))
            # Also when the rank exits without reaching its trainer's teardown (an exception).
            atexit.register(self.teardown)

    def dataset(self, split: str) -> TokenWindows:
        stream = TokenWindows(f"{self.folder}/{split}", self.indexes[split], self.cache)
        self.streams.append(stream)  # its rank is known once the machinery shards it
        return stream

    def teardown(self) -> None:
        """Remove this rank's shard copies (its workers have ended by now) and those of ranks
        beyond this world (left by a larger attempt killed before its teardown); never those
        of another live rank. A stream no loader read (never sharded) says rank 0 for any
        rank, so only sharded ones count."""
        read = [stream for stream in self.streams if stream.sharded]
        if self.cache is not None and read:
            world = max(stream.world for stream in read)
            self.cache.remove({stream.rank for stream in read} | self.cache.ranks_from(world))
