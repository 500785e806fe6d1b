"""The samplers `sharding.shard_loader` puts into loaders: each rank's share, in an order that
depends on (seed, epoch) only, able to start after the batches a mid-epoch checkpoint had done.

- `ResumableSampler`: a plain dataset's indices (DistributedSampler's order, padded).
- `EvalShardSampler`: validation/test indices, each exactly once over all ranks.
- `ShardedDraws`: rank r's share of any user sampler's draws (a WeightedRandomSampler keeps its
  class balance); `ShardedBatches`: the same for a user batch sampler, batch by batch.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler

from project.data.stream import SkipInEpoch
from project.engine.errors import UserError


class ResumableSampler(SkipInEpoch, DistributedSampler):
    """DistributedSampler (also for one process) that can resume in the middle of an epoch.

    The order depends only on (seed, epoch), never on the global RNG, and `skip(k)` makes this
    epoch start after its first k indices: a run resumed from a mid-epoch checkpoint sees
    exactly the batches the interrupted run had not trained on.
    """

    def __init__(self, dataset: Dataset, world: int, rank: int, shuffle: bool, seed: int) -> None:
        super().__init__(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)

    def __iter__(self) -> Iterator[int]:
        return iter(list(super().__iter__())[self.first() :])


class EvalShardSampler(Sampler[int]):
    """Rank r of w reads samples r, r+w, r+2w, ...: every sample exactly once over all ranks.

    DistributedSampler pads the shards to equal length by repeating samples, which would count
    those samples twice in validation/test metrics. Unequal shards are fine here: evaluation
    runs no collective per batch (metrics sync once, at compute).
    """

    def __init__(self, dataset: Dataset, world: int, rank: int) -> None:
        self.n, self.world, self.rank = len(dataset), world, rank  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.n, self.world))

    def __len__(self) -> int:
        return len(range(self.rank, self.n, self.world))


@contextmanager
def seeded(sampler: Any, seed: int) -> Iterator[None]:
    """Every random source a sampler may draw from, seeded with `seed`, restored afterwards:
    the `generator` attribute of torch's samplers (the sampler's, or a batch sampler's inner
    sampler's) and the global torch, numpy and random generators (the others draw from these)."""
    seedable = (torch.Generator, type(None))
    owners = [s for s in (sampler, getattr(sampler, "sampler", None))
              if isinstance(getattr(s, "generator", False), seedable)]  # fmt: skip
    saved = [(owner, owner.generator) for owner in owners]
    numpy_state, random_state = np.random.get_state(), random.getstate()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)
        random.seed(seed)
        for owner in owners:
            owner.generator = torch.Generator().manual_seed(seed)
        try:
            yield
        finally:
            for owner, generator in saved:
                owner.generator = generator
            np.random.set_state(numpy_state)
            random.setstate(random_state)


class _Shares(SkipInEpoch):
    """What ShardedDraws and ShardedBatches share: all ranks make the epoch's draws of the
    user's sampler with the same seed, and rank r takes draws r, r+w, r+2w, ... (training pads
    the draws to a multiple of w by repeating the first ones, as DistributedSampler does, so
    every rank runs the same number of steps; evaluation does not pad)."""

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
        if self.draws(0) != self.draws(0):
            raise UserError(
                f"{what} ({type(sampler).__name__}) draws differently on two passes with the same "
                "seed, so the ranks' shares would overlap: draw from its `generator` attribute "
                "or from torch's global generator"
            )

    def draws(self, epoch: int) -> list[Any]:
        with seeded(self.source, self.seed + epoch):
            drawn = list(self.source)
        if len(drawn) != self.total:
            raise UserError(
                f"{self.what} ({type(self.source).__name__}) says it has {self.total} draws but "
                f"made {len(drawn)}: make its __len__ match what it yields"
            )
        return drawn

    def share(self) -> list[Any]:
        drawn = self.draws(self.epoch)
        if self.pad and drawn:
            size = math.ceil(len(drawn) / self.world) * self.world
            drawn = (drawn * math.ceil(size / len(drawn)))[:size]
        return drawn[self.rank :: self.world]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def take(self) -> Iterator[Any]:
        return iter(self.share()[self.first() :])

    def __len__(self) -> int:
        if self.pad:
            return math.ceil(self.total / self.world)
        return len(range(self.rank, self.total, self.world))


class ShardedDraws(_Shares, Sampler[int]):
    """Rank r's share of the draws of any sampler with a length (WeightedRandomSampler,
    SubsetRandomSampler, your own): the loader batches them as before."""

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
