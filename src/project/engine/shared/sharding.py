"""Every loader sharded across ranks, in a resumable order: both trainers, any user loader.

Both trainers pass each DataLoader through `shard_loader` (the Lightning path wraps the
datamodule's `*_dataloader` methods with `shard_datamodule`; Lightning's own sampler
injection is off, `trainer.use_distributed_sampler: false`):

- a plain map-style loader, `DataLoader(dataset, batch_size, shuffle=...)` as Lightning's docs
  write it, is rebuilt with the same settings around a sampler of ours: for training a
  `ResumableSampler` (sharded, seeded, able to skip the batches a mid-epoch checkpoint already
  trained on), for validation/test an `EvalShardSampler` (each sample on exactly one rank, no
  padding, so metrics count every sample once);
- a loader that already has one of these, or a DistributedSampler over this world, is kept;
- anything the template cannot shard (an IterableDataset, a custom sampler or batch sampler)
  stops a multi-process run at start-up with one line; in a single process it is kept, with
  one warning that a mid-epoch resume does not continue its order exactly.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from project.engine.errors import UserError

log = logging.getLogger("project.engine.shared.sharding")


class ResumableSampler(DistributedSampler):
    """DistributedSampler (also for one process) that can resume in the middle of an epoch.

    The order depends only on (seed, epoch), never on the global RNG, and `skip_batches(k)`
    makes the next epoch iterator start after the first k batches: a run resumed from a
    mid-epoch checkpoint sees exactly the batches the interrupted run had not trained on.
    """

    def __init__(self, dataset: Dataset, world: int, rank: int, shuffle: bool, seed: int) -> None:
        super().__init__(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
        self._skip = 0

    def skip_batches(self, batches: int, batch_size: int) -> None:
        self._skip = batches * batch_size

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        start, self._skip = self._skip, 0  # one epoch only
        return iter(indices[start:])


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


def _rebuild(loader: DataLoader, sampler: Sampler, seed: int) -> DataLoader:
    """`loader` with `sampler` instead of its own; every other setting kept.

    A private generator seeds each new iterator (else every iterator draws its base seed from
    the global RNG, so dropout masks would depend on when iterators were made, e.g. after a
    resume).
    """
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory and torch.cuda.is_available(),
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=torch.Generator().manual_seed(seed),
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers and loader.num_workers > 0,
    )


def _unshardable(loader: DataLoader) -> str | None:
    """Why the template cannot shard `loader` itself (None: it can)."""
    if isinstance(loader.dataset, IterableDataset):
        return f"its dataset is an IterableDataset ({type(loader.dataset).__name__})"
    if loader.batch_sampler is None or type(loader.batch_sampler) is not BatchSampler:
        return f"it uses a custom batch sampler ({type(loader.batch_sampler).__name__})"
    if type(loader.sampler) not in (RandomSampler, SequentialSampler):
        return f"it uses a custom sampler ({type(loader.sampler).__name__})"
    return None


_warned: set[str] = set()


def resumes_exactly() -> None:
    """The train loader's order resumes mid-epoch (FaultTolerance makes the ResumableSampler
    skip the batches already trained on), which Lightning cannot see: its "dataloader is not
    resumable" warning would mislead. For other loaders it stays."""
    warnings.filterwarnings("ignore", message=r".*your dataloader is not resumable")


def shard_loader(loader: Any, stage: str, world: int, rank: int, seed: int) -> Any:
    """`loader` sharded over `world` ranks for `stage` ("train", "val", "test")."""
    if not isinstance(loader, DataLoader):
        return loader  # not a DataLoader (e.g. a list of batches): the user's own business
    sampler, train = loader.sampler, stage == "train"
    if isinstance(sampler, ResumableSampler):
        resumes_exactly()
        return loader
    if isinstance(sampler, EvalShardSampler):
        return loader
    if isinstance(sampler, DistributedSampler):
        if sampler.num_replicas != world:
            raise UserError(
                f"the {stage} DataLoader's DistributedSampler has num_replicas="
                f"{sampler.num_replicas} but the run has {world} processes: build it from "
                "trainer.world_size / trainer.global_rank, or return a plain DataLoader"
            )
        if train:
            return loader
        return _rebuild(loader, EvalShardSampler(loader.dataset, world, rank), seed)
    reason = _unshardable(loader)
    if reason is None:
        if train:
            shuffle = isinstance(sampler, RandomSampler)
            new: Sampler = ResumableSampler(loader.dataset, world, rank, shuffle, seed)
            resumes_exactly()
        else:
            new = EvalShardSampler(loader.dataset, world, rank)
        return _rebuild(loader, new, seed)
    if world > 1:
        raise UserError(
            f"the {stage} DataLoader cannot be sharded across the {world} processes: {reason}. "
            "Return DataLoader(dataset, batch_size=..., shuffle=...) and the template shards it, "
            "or give it a DistributedSampler(dataset, trainer.world_size, trainer.global_rank)"
        )
    if train and stage not in _warned:
        _warned.add(stage)
        log.warning(
            f"the train DataLoader is used as it is ({reason}): a resume from a mid-epoch "
            "checkpoint restarts that epoch's order, so it is not exact"
        )
    return loader


def shard_loaders(loaders: Any, stage: str, world: int, rank: int, seed: int) -> Any:
    """`shard_loader` over one loader or a list/tuple/dict of loaders (Lightning allows all)."""
    if isinstance(loaders, dict):
        return {k: shard_loader(v, stage, world, rank, seed) for k, v in loaders.items()}
    if isinstance(loaders, (list, tuple)):
        return type(loaders)(shard_loader(v, stage, world, rank, seed) for v in loaders)
    return shard_loader(loaders, stage, world, rank, seed)
