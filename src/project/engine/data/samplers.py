"""The samplers `sharding.shard_loader` puts into loaders: each rank's share, in an order that
depends on (seed, epoch) only, able to start at any global position of the epoch.

One layout for every loader shape (and `project.data.stream.ShardedStream`): the epoch is a
sequence of positions, the same on every rank and at every world size, and rank r of w reads
positions r, r+w, r+2w, ... (`rank_positions`, DistributedSampler's layout). So optimizer
step s of every rank together reads positions [s*G, (s+1)*G), G = per-rank batch x
accumulation x world: a run that keeps G (project.engine.data.elastic) trains the same
global batches on any world size, and a resume at global position P on another world size
continues with exactly the positions the interrupted run had not read.

- `ResumableSampler`: a plain dataset's indices (DistributedSampler's order, padded).
- `EvalShardSampler`: validation/test indices, each exactly once over all ranks.
- `ShardedDraws`: rank r's share of any user sampler's draws (a WeightedRandomSampler keeps its
  class balance); `ShardedBatches`: the same for a user batch sampler, batch by batch.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler

from project.data.stream import SkipInEpoch, rank_positions
from project.engine.errors import UserError

__all__ = ["EvalShardSampler", "ResumableSampler", "ShardedBatches", "ShardedDraws",
           "rank_positions"]  # fmt: skip


class ResumableSampler(SkipInEpoch, DistributedSampler):
    """DistributedSampler (also for one process) that can resume at any global position.

    The order depends only on (seed, epoch), never on the global RNG; `skip(p)` makes this
    epoch start at global position p (the positions every rank of the interrupted run had
    read, whatever its world size). `drop_last` as DistributedSampler's (a user's own
    DistributedSampler(drop_last=True) is rebuilt as this)."""

    def __init__(self, dataset: Dataset, world: int, rank: int, shuffle: bool, seed: int,
                 drop_last: bool = False) -> None:  # fmt: skip
        super().__init__(dataset, world, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)

    def order(self) -> list[int] | range:
        """The epoch's order of the dataset's indices (DistributedSampler's)."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return range(n)
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=generator).tolist()

    def positions(self, start: int | None = None) -> range:
        """This rank's positions from global position `start` (None: where this pass starts)."""
        n = len(self.dataset)  # type: ignore[arg-type]
        mode = "drop" if self.drop_last else "pad"
        start = self.first() if start is None else start
        return rank_positions(n, self.num_replicas, self.rank, start, mode, self.whole)

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        return iter([order[p % len(order)] for p in self.positions()])

    def __len__(self) -> int:
        """A whole epoch's indices on this rank (DistributedSampler's, unless `whole` cuts it)."""
        n, mode = len(self.dataset), "drop" if self.drop_last else "pad"  # type: ignore[arg-type]
        return len(rank_positions(n, self.num_replicas, self.rank, 0, mode, self.whole))

    def left(self) -> int:
        """How many indices this epoch still yields (fewer than len after a resume)."""
        return len(self.positions())


class EvalShardSampler(Sampler[int]):
    """Rank r of w reads samples r, r+w, r+2w, ...: every sample exactly once over all ranks.

    DistributedSampler pads the shards to equal length by repeating samples, which would count
    those samples twice in validation/test metrics. Unequal shards are fine here: evaluation
    runs no collective per batch (metrics sync once, at compute).
    """

    def __init__(self, dataset: Dataset, world: int, rank: int) -> None:
        self.n, self.world, self.rank = len(dataset), world, rank  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        return iter(rank_positions(self.n, self.world, self.rank, mode="exact"))

    def __len__(self) -> int:
        return len(rank_positions(self.n, self.world, self.rank, mode="exact"))

    def batches_per_rank(self, batch_size: int, drop_last: bool) -> list[int]:
        """How many batches of `batch_size` each rank evaluates (they differ by one at most)."""
        sizes = [len(rank_positions(self.n, self.world, r, mode="exact"))
                 for r in range(self.world)]  # fmt: skip
        return [n // batch_size if drop_last else -(-n // batch_size) for n in sizes]


class PrivateRng:
    """Every random source a user's sampler may draw from, seeded with `seed` and kept apart
    from the process's: the `generator` attribute of torch's samplers (the sampler's, or a
    batch sampler's inner sampler's) and the global CPU torch, numpy and random generators.
    `run(f)` calls f inside (the process's states are restored afterwards, CUDA's never
    touched), so a sampler can be drawn lazily, a chunk at a time, between training steps."""

    def __init__(self, sampler: Any, seed: int) -> None:
        seedable = (torch.Generator, type(None))
        self.owners = [s for s in (sampler, getattr(sampler, "sampler", None))
                       if isinstance(getattr(s, "generator", False), seedable)]  # fmt: skip
        self.generators = [torch.Generator().manual_seed(seed) for _ in self.owners]
        self.torch = torch.Generator().manual_seed(seed).get_state()
        self.numpy = np.random.RandomState(seed % 2**32).get_state()
        self.random = random.Random(seed).getstate()

    def run(self, f: Any, *args: Any) -> Any:
        outer = (torch.get_rng_state(), np.random.get_state(), random.getstate())
        outer_generators = [owner.generator for owner in self.owners]
        torch.set_rng_state(self.torch)
        np.random.set_state(self.numpy)
        random.setstate(self.random)
        for owner, generator in zip(self.owners, self.generators, strict=True):
            owner.generator = generator
        try:
            return f(*args)
        finally:
            self.torch, self.numpy, self.random = (
                torch.get_rng_state(), np.random.get_state(), random.getstate()
            )  # fmt: skip
            for owner, generator in zip(self.owners, outer_generators, strict=True):
                owner.generator = generator
            torch.set_rng_state(outer[0])
            np.random.set_state(outer[1])
            random.setstate(outer[2])


CHUNK = 2**16  # draws taken from a user's sampler at a time (memory: O(CHUNK), not O(epoch);
# each chunk swaps the process's RNG states out and back, about half a millisecond)
CHECKED = 1000  # draws compared between two passes at start-up: does the sampler repeat?


class _Shares(SkipInEpoch):
    """What ShardedDraws and ShardedBatches share: all ranks make the epoch's draws of the
    user's sampler with the same seed, and rank r takes the draws at its positions
    (`rank_positions`: training pads to a multiple of w with the epoch's first draws, as
    DistributedSampler does, so every rank runs the same number of steps; evaluation does
    not pad). The draws are made lazily, never held whole: a sampler of 10^8 draws costs
    one chunk of memory."""

    def __init__(self, sampler: Iterable, what: str, world: int, rank: int, seed: int,
                 pad: bool) -> None:  # fmt: skip
        try:
            self.total = len(sampler)  # type: ignore[arg-type]
        except TypeError:
            raise UserError(
                f"{what} ({type(sampler).__name__}) has no length, so the ranks cannot agree "
                "how many steps an epoch has: give it a __len__"
            ) from None
        self.source, self.what, self.world, self.rank = sampler, what, world, rank
        self.seed, self.pad = seed, pad
        made, first = 0, []
        for chunk in self.chunks(0):  # one pass: its length, and its first draws
            first += chunk[: CHECKED - len(first)]
            made += len(chunk)
        if first != list(itertools.islice(self.draws(0), CHECKED)):
            raise UserError(
                f"{what} ({type(sampler).__name__}) draws differently on two passes with the same "
                "seed, so the ranks' shares would overlap: draw from its `generator` attribute "
                "or from torch's global generator"
            )
        if made != self.total:
            raise UserError(
                f"{what} ({type(sampler).__name__}) says it has {self.total} draws but made "
                f"{made}: make its __len__ match what it yields"
            )

    def chunks(self, epoch: int) -> Iterator[list[Any]]:
        """The user's sampler's draws for `epoch`, CHUNK at a time (PrivateRng)."""
        rng = PrivateRng(self.source, self.seed + epoch)
        draws = rng.run(iter, self.source)
        while chunk := rng.run(lambda: list(itertools.islice(draws, CHUNK))):
            yield chunk

    def draws(self, epoch: int) -> Iterator[Any]:
        return itertools.chain.from_iterable(self.chunks(epoch))

    def positions(self, start: int | None = None) -> range:
        """This rank's positions from global position `start` (None: where this pass starts)."""
        mode = "pad" if self.pad else "exact"
        start = self.first() if start is None else start
        return rank_positions(self.total, self.world, self.rank, start, mode, self.whole)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def left(self) -> int:
        return len(self.positions())

    def take(self) -> Iterator[Any]:
        """This rank's draws, in order: one pass over the epoch's draws, a slice of each chunk
        (a second, short pass for the padding, which repeats the epoch's first draws)."""
        positions = self.positions()
        position, last, offset = positions.start, min(positions.stop, self.total), 0
        for chunk in self.chunks(self.epoch):
            if position >= last:
                break
            end = offset + len(chunk)
            picked = chunk[position - offset : min(end, last) - offset : self.world]
            yield from picked
            position, offset = position + len(picked) * self.world, end
        padding = range(position, positions.stop, self.world)  # all >= total
        if padding:  # fewer than `world` positions: the epoch's first draws again
            need = min(self.total, padding[-1] - self.total + 1)
            firsts = list(itertools.islice(self.draws(self.epoch), need))
            yield from (firsts[p % self.total] for p in padding)

    def __len__(self) -> int:
        return len(rank_positions(self.total, self.world, self.rank, 0,
                                  "pad" if self.pad else "exact", self.whole))  # fmt: skip


class ShardedDraws(_Shares, Sampler[int]):
    """Rank r's share of the draws of any sampler with a length (WeightedRandomSampler,
    SubsetRandomSampler, RandomSampler with replacement or num_samples, your own): the
    loader batches them as before."""

    def __init__(self, sampler: Sampler, world: int, rank: int, seed: int, pad: bool) -> None:
        super().__init__(sampler, "the sampler", world, rank, seed, pad)

    def __iter__(self) -> Iterator[int]:
        return self.take()


class ShardedBatches(_Shares, Sampler[list[int]]):
    """Rank r's share of a batch sampler's batches (whole batches: the user's grouping, e.g. by
    length, is kept). Lightning calls `set_epoch` on `batch_sampler.sampler`: that is this."""

    def __init__(self, batches: Iterable, world: int, rank: int, seed: int, pad: bool) -> None:
        super().__init__(batches, "the batch sampler", world, rank, seed, pad)

    @property
    def sampler(self) -> ShardedBatches:
        return self

    def __iter__(self) -> Iterator[list[int]]:
        return self.take()
