"""The epoch's order of a ShardedStream as lanes: exact on every world size that divides the
lanes, each rank reading only its part of the shards, and a global batch drawn from all of
them (docs/data.md, "The stream's layout").

An epoch of `total` rows in shards is laid out as `lanes` sequences:

- the shards in a seeded order of (seed, epoch), each shard's rows in a seeded order of
  (seed, epoch, shard): one sequence of all rows, cut into `lanes` contiguous parts of equal
  length (the first `total % lanes` one row longer), in the order `places` gives (the lanes
  a rank reads lie side by side). A part boundary may fall inside a shard, which two lanes
  then share: at most lanes - 1 shards are read by two lanes;
- inside a lane, consecutive blocks of `shuffle_block` rows are each shuffled (seeded by
  (seed, epoch, lanes, lane, block)): rows of the several shards a block spans mix, while a
  reader only ever holds the shards of its current block (memory ~ shuffle_block rows per
  lane);
- global position p is row p // lanes of lane p % lanes. Rank r of w reads positions r, r+w,
  ... (project.data.stream.rank_positions): when w divides the lanes that is lanes r, r+w,
  ..., about 1/w of the shards (locality), and a global batch of consecutive positions takes
  rows from every lane (mixing). The order is a function of (seed, epoch, lanes,
  shuffle_block) only, not of the world size: the same global batches on every world size the
  lanes admit, and `skip(p)` resumes exactly at any position.

Equal lane lengths are what keep p -> lane p % lanes exact to the epoch's last row (unequal
ones would need a tail rule that sends a rank into other ranks' lanes); training's padding
(positions >= total wrap to the epoch's first rows) reads at most one row of another lane.
Without shuffling (evaluation, `data.shuffle=false`) the order is the shards as stored, one
lane: every rank reads a part of every shard. One lane with a `shuffle_block` of 1 is the
shard-major order streams had before the lanes (a checkpoint of that time resumes in it).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np

from project.engine.errors import UserError

MIN_LANES = 8  # the default: at least this many lanes, a multiple of the world size
SHUFFLE_BLOCK = 4096  # the default window of rows shuffled together in a lane


WORLDS_ENV = "PROJECT_WORLD_SIZES"  # an elastic job's possible world sizes (project.launcher)


def default_lanes(world: int) -> int:
    """The least multiple of `world` that is >= MIN_LANES; in an elastic job (a range of
    nodes), of every world size it may take, so that a node joining or leaving never meets
    lanes it does not divide (its resume would be refused)."""
    sizes = [int(w) for w in os.environ.get(WORLDS_ENV, "").split(",") if w.strip().isdigit()]
    base = math.lcm(world, *sizes)
    return base * math.ceil(MIN_LANES / base)


def admitted(lanes: int) -> list[int]:
    """The world sizes `lanes` lanes admit: its divisors."""
    return [w for w in range(1, lanes + 1) if lanes % w == 0]


def check_world(lanes: int, world: int, whose: str) -> None:
    """One line when `world` processes cannot read `lanes` lanes each its own (`whose`: where
    the lanes come from, e.g. "data.lanes=6"). One lane is the shard-major order streams had
    before the lanes: every rank reads every shard by design, on any world size."""
    if lanes > 1 and lanes % world:
        sizes = ", ".join(map(str, admitted(lanes)))
        fix = f", or set data.lanes to a multiple of {world}" if whose.startswith("data.") else ""
        raise UserError(
            f"{whose}: the stream is laid out in {lanes} lanes and {world} processes do not "
            f"divide them: run on {sizes} process(es){fix}"
        )


def places(lanes: int) -> np.ndarray:
    """Each lane's place among the lanes' parts of the sequence of all rows: its index with
    the digits reversed, in the mixed radix of the lanes' prime factors (smallest first; for
    8 lanes: 0, 4, 2, 6, 1, 5, 3, 7, the bit reversal). Lanes r, r+w, r+2w, ... then lie
    side by side for every w that is a product of the first factors (1, 2, 4, 8 for 8 lanes;
    1, 3, 9 for 9; 1, 2, 4, 12 for 12): rank r of w reads one stretch of the rows, so the
    shards two lanes share are mostly read by one rank. Other divisors (6 of 12) read their
    lanes' stretches apart, a shard or two more each."""
    factors, n, p = [], lanes, 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    lane, place, scale = np.arange(lanes), np.zeros(lanes, dtype=np.int64), lanes
    for f in factors:
        scale //= f
        place += (lane % f) * scale
        lane = lane // f
    return place


class Layout:
    """One epoch's order: global position -> (shard, row of the shard as stored).

    `shuffle` off: the shards and their rows as stored, in one lane (`lanes` and `block` are
    then not used)."""

    def __init__(
        self, lengths: Sequence[int], seed: int, epoch: int, lanes: int, block: int,
        shuffle: bool = True,
    ) -> None:  # fmt: skip
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.total = int(self.lengths.sum())
        self.seed, self.epoch, self.shuffle = seed, epoch, shuffle
        self.lanes, self.block = (lanes, block) if shuffle else (1, 0)
        order = np.arange(len(self.lengths))
        if shuffle:
            order = np.random.default_rng([seed, epoch]).permutation(order)
        self.order = order
        self.starts = np.concatenate([[0], np.cumsum(self.lengths[order])])
        short, longer = divmod(self.total, self.lanes)  # lanes 0..longer-1 have one row more
        self.lane_lengths = short + (np.arange(self.lanes) < longer)
        place = places(self.lanes)
        before = np.concatenate([[0], np.cumsum(self.lane_lengths[np.argsort(place)])])
        self.lane_starts = before[place]  # where each lane starts in the sequence of all rows

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, row of the shard as stored) of each global position (those >= total wrap
        around: training's padding)."""
        q = np.asarray(positions, dtype=np.int64) % max(self.total, 1)
        lane, index = q % self.lanes, q // self.lanes
        if self.shuffle and self.block > 1:  # a block of one row is the identity
            index = self._block_shuffled(lane, index)
        row = self.lane_starts[lane] + index  # in the sequence of all rows
        k = np.searchsorted(self.starts, row, side="right") - 1
        shard, offset = self.order[k], row - self.starts[k]
        if self.shuffle:
            offset = self._within_shards(shard, offset)
        return shard, offset

    def _block_shuffled(self, lane: np.ndarray, index: np.ndarray) -> np.ndarray:
        """Each lane index moved to its place in its block's seeded permutation."""
        block = index // self.block
        key = lane * (self.total // self.block + 2) + block
        out = index.copy()
        for where, first in _groups(key):
            ln, b = int(lane[first]), int(block[first])
            size = min(self.block, int(self.lane_lengths[ln]) - b * self.block)
            rng = np.random.default_rng([self.seed, self.epoch, self.lanes, ln, b])
            out[where] = b * self.block + rng.permutation(size)[index[where] - b * self.block]
        return out

    def _within_shards(self, shard: np.ndarray, offset: np.ndarray) -> np.ndarray:
        """Each offset moved to its place in its shard's seeded order of rows."""
        out = offset.copy()
        for where, first in _groups(shard):
            s = int(shard[first])
            perm = np.random.default_rng([self.seed, self.epoch, s]).permutation(self.lengths[s])
            out[where] = perm[offset[where]]
        return out

    def shards_at(self, positions: np.ndarray) -> list[int]:
        """The shards holding `positions`, in the order they are first read."""
        if len(positions) == 0:
            return []
        shards = self.locate(positions)[0]
        _, first = np.unique(shards, return_index=True)
        return [int(s) for s in shards[np.sort(first)]]


def _groups(keys: np.ndarray) -> list[tuple[np.ndarray, int]]:
    """(indices holding one key, the first of them) for each distinct key."""
    order = np.argsort(keys, kind="stable")
    cuts = np.flatnonzero(np.diff(keys[order])) + 1
    return [(idx, int(idx[0])) for idx in np.split(order, cuts) if len(idx)]
