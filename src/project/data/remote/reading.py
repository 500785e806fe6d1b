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
        self.held: dict[int, Hold] = {}  # the shards open now (a rank reads several in turn)
        self.first = 0  # the first shard (in first-read order) that may still be read
        self.reached = -1  # the furthest shard opened so far (prefetch runs ahead of it)
        self.prefetch = Prefetch(self._fetch, len(shards), prefetch)

    def _fetch(self, i: int) -> bool:
        return self.cache.fetch_ahead(self.urls[i], {"bytes": self.sizes[i]})

    def read(self, shard: int, url: str, entry: dict[str, Any]) -> Path:
        """The local copy of `shard` (at `url`, `entry` its index entry), held until
        `release(shard)`."""
        if shard not in self.held:
            self.held[shard] = self.cache.hold(url, entry)
        position = self.shards.index(shard) if shard in self.shards else -1
        if position > self.reached:
            self.reached = position
            self.prefetch.advance(position)
        self._ahead()
        return self.held[shard].path

    def release(self, shard: int) -> None:
        """Done with `shard` for now: it may be evicted once no reader has it ahead."""
        held = self.held.pop(shard, None)
        if held is not None:
            held.release()
        self._ahead()

    def _ahead(self) -> None:
        """Tell the cache what this reader may still read: from the earliest shard open (or,
        none open, the furthest opened) on, in first-read order."""
        open_at = [self.shards.index(s) for s in self.held if s in self.shards]
        first = min(open_at, default=self.reached + 1)
        if first != self.first:
            self.first = first
            self.cache.ahead(self.reader, self.urls[first:])

    def stop(self) -> None:
        """The iterator ended: its thread ends, its shard is released, it has nothing ahead."""
        self.prefetch.stop()
        for held in self.held.values():
            held.release()
        self.held = {}
        self.reader.unlink(missing_ok=True)
