"""The language-model corpus read back streaming from shards (`data=chars_stream`).

`python -m project.data.prepare --out DIR` cuts the corpus into windows exactly as
`data=chars` does (project.data.text) and writes each split as token shards; this source
reads them as a ShardedStream: each rank opens only its part of the shards, and no split is
held in memory. With `data.shuffle=false` the windows come in the order `data=chars` reads
them unshuffled, so the two give the same losses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from project.data.shards import load_shard, read_index
from project.data.source import SPLITS, DataSource
from project.data.stream import ShardedStream
from project.data.text import Windows
from project.engine.errors import UserError


class TokenWindows(ShardedStream):
    """A split's shards of tokens; element i of a shard is window i (input, next tokens)."""

    def __init__(self, folder: str, index: dict[str, Any]) -> None:
        super().__init__([e["elements"] for e in index["shards"]])
        self.folder, self.entries, self.block_size = folder, index["shards"], index["block_size"]

    def read(self, shard: int) -> Sequence[Any]:
        return Windows(load_shard(self.folder, self.entries[shard]), self.block_size)


class CharStream(DataSource):
    """Token shards of `folder`/{train,val,test}, written by project.data.prepare with windows
    of `block_size` (the model's context length reads it from the config, so it is checked)."""

    def __init__(self, folder: str, block_size: int = 64) -> None:
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

    def dataset(self, split: str) -> TokenWindows:
        return TokenWindows(f"{self.folder}/{split}", self.indexes[split])
