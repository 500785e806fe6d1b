"""Iterable data stored as shards, split across ranks and DataLoader workers by position.

Subclass `ShardedStream`, give it the shards' lengths and a `read(shard)` that returns the
shard's elements with random access (a memory-mapped array, a decoded file): the machinery
(project.engine.data.sharding) tells it the world, rank and batch size, and it yields this
rank's part in an order that is a pure function of (seed, epoch):

- the epoch's order (when `shuffle`): the rows laid out in lanes (project.data.lanes), a
  function of (seed, epoch, lanes, shuffle_block) that is the same on every rank and every
  world size dividing the lanes; without `shuffle`, the shards and rows as stored;
- rank r of w reads positions r, r+w, r+2w, ... of that order (`rank_positions`, the layout
  every loader shape of the template shares): optimizer step s of all ranks together reads
  positions [s*G, (s+1)*G) for a global batch G, whatever the world size. Position p is in
  lane p % lanes, so rank r reads only lanes r, r+w, ...: about 1/w of the shards, while a
  global batch draws from every lane. Training pads to a multiple of w with the epoch's first
  elements (as DistributedSampler pads), so every rank runs the same number of steps and no
  rank waits in a collective for one that ran out; validation/test do not pad (each element
  exactly once; evaluation runs no per-batch collective);
- the rank's positions are cut into batches, and batch b goes to DataLoader worker
  b % num_workers: the DataLoader collects workers round-robin, so the batches arrive in the
  same order for any number of workers (the same losses with 0 or 4 workers);
- `skip(p)` starts this epoch at global position p: a mid-epoch resume, also on another world
  size, is exact without any worker state to save (the workers get the dataset, and so the
  position, when the epoch's iterator starts).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from project.data.lanes import SHUFFLE_BLOCK, Layout, check_world, default_lanes

CHUNK = 4096  # positions located at a time while iterating


def rank_positions(
    total: int, world: int, rank: int, start: int = 0, mode: str = "pad", whole: int = 0
) -> range:
    """Rank `rank` of `world`'s positions in an epoch of `total`, from global position `start`
    on: start+rank, start+rank+world, ... Positions >= total wrap to the epoch's first ones.

    mode "pad" (training): every rank the same count, ceil((total-start)/world), as
    DistributedSampler pads; "drop": floor, as DistributedSampler(drop_last=True); "exact"
    (evaluation): every position below `total` exactly once over the ranks, none repeated.
    With start=0 this is DistributedSampler's layout. `whole` > 0: the epoch ends at its last
    multiple of `whole` positions (a loader's drop_last, `whole` the positions one optimizer
    step of all ranks takes: no incomplete global batch, the same steps on any world size)."""
    total = total // whole * whole if whole > 0 else total
    left = max(total - start, 0)
    if mode == "pad":
        end = start + math.ceil(left / world) * world
    elif mode == "drop":
        end = start + left // world * world
    else:
        end = max(total, start)
    return range(start + rank, end, world)


class SkipInEpoch:
    """A mid-epoch resume point: `skip(p, b)` makes the current epoch start at global position
    p (what every rank of the interrupted run had read together, at any world size), which is
    batch b of the epoch; other epochs are whole (the stream here, and the engine's samplers).
    A loader that Lightning cycles inside an epoch (a short one of several, `max_size_cycle`)
    reads its later passes whole: `restart()` before each."""

    epoch = 0
    _skip = (0, 0, 0)  # (epoch, global position, the epoch's batch it is)
    _restarted = -1  # the epoch whose current pass is a later, whole one
    cycles = False  # read again inside an epoch when it runs out (set by the machinery)
    whole = 0  # drop_last: the epoch ends at its last multiple of this (rank_positions)

    def skip(self, position: int, batch: int = 0) -> None:
        self._skip, self._restarted = (self.epoch, position, batch), -1

    def restart(self) -> None:
        """The next pass of this epoch reads it whole, from position 0."""
        self._restarted = self.epoch

    def resumed(self) -> tuple[int, int]:
        """(global position, batch) where this epoch's first pass started: (0, 0) unless
        it was resumed."""
        epoch, position, batch = self._skip
        return (position, batch) if epoch == self.epoch else (0, 0)

    def first(self) -> int:
        """Where the current pass starts: the skipped-to position in the resumed epoch's first
        pass, else 0."""
        return 0 if self._restarted == self.epoch else self.resumed()[0]


class ShardedStream(SkipInEpoch, IterableDataset):
    """Elements of `len(lengths)` shards; shard i holds `lengths[i]` elements. `lanes` and
    `shuffle_block` lay out a shuffled epoch (project.data.lanes; None: the least multiple of
    the world size >= 8, and 4096 rows)."""

    def __init__(
        self, lengths: Sequence[int], shuffle: bool = False, lanes: int | None = None,
        shuffle_block: int | None = None,
    ) -> None:  # fmt: skip
        self.lengths, self.shuffle = [int(n) for n in lengths], shuffle
        self.total = sum(self.lengths)
        self.world, self.rank, self.batch_size, self.seed, self.pad = 1, 0, 1, 0, False
        self.sharded = False  # whether the machinery told it its rank (a loader reads it)
        self.lanes, self.shuffle_block = lanes, shuffle_block  # as asked (None: the defaults)
        self.laid_out: tuple[int, int] | None = None  # (lanes, shuffle_block) in use

    def read(self, shard: int) -> Sequence[Any]:
        """Shard `shard`'s elements, indexable 0..lengths[shard]-1."""
        raise NotImplementedError

    def ahead(self, shards: list[int]) -> None:
        """Called as each iterator starts, with the shards it will read in the order it first
        reads them: a remote source fetches them ahead of use. Default: nothing."""

    def release(self, shard: int) -> None:
        """The iterator has read what it needed of `shard` for now (several are read at once:
        a rank reads its lanes in turn): a remote source may let it go. Default: nothing."""

    # --- set by the machinery ----------------------------------------------------------------
    def shard(self, world: int, rank: int, batch_size: int, seed: int, pad: bool) -> None:
        """Read rank `rank` of `world`'s part, in batches of `batch_size`; `pad` (training):
        every rank gets the same number of elements. Lanes asked for that `world` does not
        divide: one line."""
        self.world, self.rank, self.batch_size, self.seed, self.pad = (
            world, rank, batch_size, seed, pad
        )  # fmt: skip
        self.sharded = True
        if self.shuffle and self.lanes is not None:
            check_world(self.lanes, world, f"data.lanes={self.lanes}")
        self.laid_out = (self.lanes or default_lanes(world), self.shuffle_block or SHUFFLE_BLOCK)

    def lay_out(self, lanes: int, shuffle_block: int) -> None:
        """Use this layout (a resumed run's, from its checkpoint) instead of the asked one."""
        self.laid_out = (lanes, shuffle_block)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    # --- the order -----------------------------------------------------------------------------
    def positions(self, start: int = 0) -> range:
        """This rank's positions in the epoch's order from global position `start` on (those
        >= total wrap around: training's padding)."""
        mode = "pad" if self.pad else "exact"
        return rank_positions(self.total, self.world, self.rank, start, mode, self.whole)

    def __len__(self) -> int:
        return len(self.positions())

    def left(self) -> int:
        """How many elements this epoch still yields (fewer than len after a resume)."""
        return len(self.positions(self.first()))

    def in_use(self) -> tuple[int, int]:
        """(lanes, shuffle_block) a shuffled epoch is laid out with."""
        return self.laid_out or (self.lanes or default_lanes(self.world),
                                 self.shuffle_block or SHUFFLE_BLOCK)  # fmt: skip

    def layout(self) -> Layout:
        """This epoch's order (project.data.lanes)."""
        return Layout(self.lengths, self.seed, self.epoch, *self.in_use(), self.shuffle)

    def shards_of(self, rank: int, start: int = 0) -> list[int]:
        """The shards rank `rank` (of this stream's world) reads this epoch from global position
        `start` on, in the order it first reads them (what a node's cache keeps: the union over
        its ranks)."""
        block = self.positions(start)
        mine = np.arange(block.start - self.rank + rank, block.stop - self.rank + rank, self.world)
        return self.layout().shards_at(mine)

    def _positions(self) -> Iterator[int]:
        """This worker's positions: its batches (b % workers == worker) of the rank's
        positions from where the epoch starts."""
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        block, size = self.positions(self.first()), self.batch_size
        for b in range(worker, math.ceil(len(block) / size), workers):
            yield from block[b * size : (b + 1) * size]

    def __iter__(self) -> Iterator[Any]:
        layout = self.layout()
        mine = np.fromiter(self._positions(), dtype=np.int64)
        shards = layout.locate(mine)[0]
        _, first = np.unique(shards, return_index=True)
        self.ahead([int(s) for s in shards[np.sort(first)]])
        ids, from_end = np.unique(shards[::-1], return_index=True)
        last = dict(zip(ids.tolist(), (len(mine) - 1 - from_end).tolist(), strict=True))
        opened: dict[int, Sequence[Any]] = {}
        # A shard is opened when its first row is due (a remote one is downloaded then, or was
        # fetched ahead) and let go after its last row of the epoch: read once, as before the
        # lanes, while several are open at a time (a block of a lane spans several shards, and
        # a rank reads its lanes in turn). Rows are located a chunk at a time.
        for at in range(0, len(mine), CHUNK):
            chunk, rows = layout.locate(mine[at : at + CHUNK])
            for i, (shard, row) in enumerate(zip(chunk.tolist(), rows.tolist(), strict=True)):
                elements = opened.get(shard)
                if elements is None:
                    elements = opened[shard] = self.read(shard)
                yield elements[row]
                if last[shard] == at + i:
                    del opened[shard]
                    self.release(shard)
