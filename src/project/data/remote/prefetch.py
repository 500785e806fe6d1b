"""Fetching the next shards in the background while the current one is read.

An iterator over remote shards knows, when it starts, the shards it will read in order
(`ShardedStream.ahead`). A `Prefetch` is `depth` threads per iterator (in the rank with
`num_workers=0`, in each DataLoader worker otherwise) that keep the `depth` shards after the
one being read downloaded into the node's cache, so the reader finds them there instead of
waiting a round trip per request. The threads only fetch (ShardCache.fetch_ahead: never
waits on another process's lock, respects the size limit); the reader still holds each shard
through the cache, which waits for a download under way or does it itself. A failed prefetch
is left to the reader, which tries the download again and reports it. `stop()` ends the
threads (the iterator's end: exhausted, closed, or a new epoch's iterator on the same stream).
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Prefetch:
    """Calls `fetch(i)` for i = 1..count-1 in `depth` threads, never more than `depth` items
    past the reader's position (`advance`): up to `depth` downloads at once, so a store's
    latency per request is paid in parallel rather than once per shard in a row. `fetch`
    returns False when there is no room yet: the thread waits for the reader to move on,
    then tries that item again."""

    def __init__(self, fetch: Callable[[int], bool], count: int, depth: int) -> None:
        self.fetch, self.count, self.depth = fetch, count, depth
        self._position, self._next, self._stopped = 0, 1, False  # the reader fetches item 0
        self._moved = threading.Condition()
        self._threads = [
            threading.Thread(target=self._run, name="shard-prefetch", daemon=True)
            for _ in range(min(depth, count - 1))
        ]
        for thread in self._threads:
            thread.start()

    def advance(self, position: int) -> None:
        """The reader is at item `position` now."""
        with self._moved:
            self._position = position
            self._moved.notify_all()

    def stop(self) -> None:
        """End the threads (after the downloads under way, if any)."""
        with self._moved:
            self._stopped = True
            self._moved.notify_all()
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join()

    def _run(self) -> None:
        while True:
            with self._moved:
                while not self._stopped and self._next > self._position + self.depth:
                    self._moved.wait()
                self._next = max(self._next, self._position + 1)  # passed ones: the reader's
                if self._stopped or self._next >= self.count:
                    return
                item, position = self._next, self._position
                self._next += 1
            try:
                fetched = self.fetch(item)
            except Exception:  # the reader tries again and reports it (ShardCache.hold)
                return
            if not fetched:  # no room under the size limit: wait until the reader moves on
                with self._moved:
                    self._next = min(self._next, item)  # then try it again
                    while not self._stopped and self._position == position:
                        self._moved.wait()
