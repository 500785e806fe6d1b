"""Fetching the next shards in the background while the current one is read.

An iterator over remote shards knows, when it starts, the shards it will read in order
(`ShardedStream.ahead`). A `Prefetch` is one thread per iterator (in the rank with
`num_workers=0`, in each DataLoader worker otherwise) that keeps the `depth` shards after the
one being read downloaded into the node's cache, so the reader finds them there instead of
waiting a round trip per request. The thread only fetches (ShardCache.fetch_ahead: never
waits on another process's lock, respects the size limit); the reader still holds each shard
through the cache, which waits for a download under way or does it itself. A failed prefetch
is left to the reader, which tries the download again and reports it. `stop()` ends the
thread (the iterator's end: exhausted, closed, or a new epoch's iterator on the same stream).
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Prefetch:
    """Calls `fetch(i)` for i = 0..count-1 in a thread, at most `depth` items past the
    reader's position (`advance`). `fetch` returns False when there is no room yet: the
    thread waits for the reader to move on."""

    def __init__(self, fetch: Callable[[int], bool], count: int, depth: int) -> None:
        self.fetch, self.count, self.depth = fetch, count, depth
        self._position, self._stopped = 0, False
        self._moved = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="shard-prefetch", daemon=True)
        if depth > 0 and count > 1:
            self._thread.start()

    def advance(self, position: int) -> None:
        """The reader is at item `position` now."""
        with self._moved:
            self._position = position
            self._moved.notify()

    def stop(self) -> None:
        """End the thread (after the download under way, if any)."""
        with self._moved:
            self._stopped = True
            self._moved.notify()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        done = 0  # items fetched (or found there) so far, in order
        while done < self.count:
            with self._moved:
                while not self._stopped and done > self._position + self.depth:
                    self._moved.wait()
                if self._stopped:
                    return
                position = self._position
            done = max(done, position + 1)  # the reader fetches its current item itself
            if done >= self.count:
                return
            try:
                fetched = self.fetch(done)
            except Exception:  # the reader tries again and reports it (ShardCache.hold)
                return
            if fetched:
                done += 1
            else:  # no room under the size limit: wait until the reader moves on
                with self._moved:
                    while not self._stopped and self._position == position:
                        self._moved.wait()
