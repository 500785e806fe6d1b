"""One iterator's reading of a stream's remote shards through the node's cache.

A `ShardedStream` over a remote folder makes one `RemoteReading` as each iterator starts (in
its `ahead(shards)`) and stops it when the iterator ends (project.data.text_stream.
TokenWindows does both). It tells the node's cache what this reader still has ahead (so a
size limit never evicts it), holds the shard being read (so nothing evicts it while it is
mapped), and runs the prefetch thread that downloads the next ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from project.data.remote.cache import Hold, ShardCache
from project.data.remote.prefetch import Prefetch


class RemoteReading:
    """Reading `shards` (their `urls` and sizes in bytes, in the order first read) through
    `cache`, with `prefetch` shards downloaded ahead of the one read."""

    def __init__(
        self, cache: ShardCache, shards: list[int], urls: list[str], sizes: list[int], prefetch: int
    ) -> None:
        self.cache, self.shards, self.urls, self.sizes = cache, shards, urls, sizes
        self.reader: Path = cache.reader()
        cache.ahead(self.reader, urls)
        self.held: Hold | None = None
        self.prefetch = Prefetch(self._fetch, len(shards), prefetch)

    def _fetch(self, i: int) -> bool:
        return self.cache.fetch_ahead(self.urls[i], {"bytes": self.sizes[i]})

    def read(self, shard: int, url: str, entry: dict[str, Any]) -> Path:
        """The local copy of `shard` (at `url`, `entry` its index entry), held until the next
        one is read."""
        if shard in self.shards:
            position = self.shards.index(shard)
            self.cache.ahead(self.reader, self.urls[position:])
            self.prefetch.advance(position)
        held = self.cache.hold(url, entry)
        if self.held is not None:
            self.held.release()
        self.held = held
        return held.path

    def stop(self) -> None:
        """The iterator ended: its thread ends, its shard is released, it has nothing ahead."""
        self.prefetch.stop()
        if self.held is not None:
            self.held.release()
            self.held = None
        self.reader.unlink(missing_ok=True)
