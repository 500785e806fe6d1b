"""Every loader sharded across ranks, in a resumable order: both trainers, any user loader.

Both trainers pass each DataLoader through `shard_loader` (the Lightning path wraps the
datamodule's `*_dataloader` methods with `shard_datamodule`; Lightning's own sampler
injection is off, `trainer.use_distributed_sampler: false`). By the loader's shape
(samplers.py and project.data.stream say how each splits):

- `DataLoader(dataset, batch_size, shuffle=...)` as Lightning's docs write it: rebuilt with the
  same settings around a `ResumableSampler` (training) or an `EvalShardSampler` (val/test);
- a custom sampler (WeightedRandomSampler, ...) or batch sampler: each rank takes its share of
  its draws (`ShardedDraws`, `ShardedBatches`), seeded from the run seed and the epoch;
- a `ShardedStream` (iterable data in shards): told its rank, world and batch size;
- a loader that already has one of these, or a DistributedSampler over this world: kept.

Every one of these resumes exactly in the middle of an epoch (`resume_at`). Anything else (an
IterableDataset that does not shard itself) stops a multi-process run at start-up with one
line; in a single process it is kept, with one warning that a mid-epoch resume restarts the
epoch. All ranks must see data of the same length: a mismatch is one line on every rank.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from project.data.stream import ShardedStream
from project.engine.errors import UserError
from project.engine.shared.samplers import (
    EvalShardSampler,
    ResumableSampler,
    ShardedBatches,
    ShardedDraws,
)

log = logging.getLogger("project.engine.shared.sharding")
OURS = (ResumableSampler, EvalShardSampler, ShardedDraws)


def _rebuild(loader: DataLoader, seed: int, **sampling: Any) -> DataLoader:
    """`loader` with `sampling` (a sampler, or a batch sampler) instead of its own; every other
    setting kept.

    A private generator seeds each new iterator (else every iterator draws its base seed from
    the global RNG, so dropout masks would depend on when iterators were made, e.g. after a
    resume).
    """
    if "batch_sampler" not in sampling:
        sampling.update(batch_size=loader.batch_size, drop_last=loader.drop_last)
    return DataLoader(
        loader.dataset,
        **sampling,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory and torch.cuda.is_available(),
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=torch.Generator().manual_seed(seed),
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers and loader.num_workers > 0,
    )


_warned: set[str] = set()


def resumes_exactly() -> None:
    """The train loader's order resumes mid-epoch (`resume_at`, before the first iterator), which
    Lightning cannot see: its "dataloader is not resumable" warning would mislead, and so would
    its warning that an IterableDataset's length may be wrong with workers (a ShardedStream
    splits by worker itself)."""
    warnings.filterwarnings("ignore", message=r".*your dataloader is not resumable")
    warnings.filterwarnings("ignore", message=r".*`IterableDataset` has `__len__` defined")


def same_length_on_all_ranks(length: int, stage: str) -> None:
    """Fail on every rank at once (one line, no hang) when the ranks' data differ in length:
    their step counts would differ and the longer ranks would wait forever in a collective."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    both = torch.tensor([length, -length], device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    longest, shortest = int(both[0]), -int(both[1])
    if longest != shortest:
        raise UserError(
            f"the {stage} data has {length} elements on rank {dist.get_rank()} but between "
            f"{shortest} and {longest} across the ranks: every rank must read the same data "
            "(one shared folder, or the same prepared copy on every node)"
        )


def _stream(loader: DataLoader, stage: str, world: int, rank: int, seed: int) -> DataLoader:
    stream = loader.dataset
    if loader.persistent_workers and loader.num_workers > 0:
        raise UserError(
            f"the {stage} DataLoader keeps its workers (persistent_workers) but its "
            f"{type(stream).__name__} learns each epoch's order when the workers start: set "
            "data.persistent_workers=false"
        )
    stream.shard(world, rank, loader.batch_size or 1, seed, pad=stage == "train")
    same_length_on_all_ranks(stream.total, stage)
    resumes_exactly()
    return _rebuild(loader, seed)  # for its private generator


def _sampled(loader: DataLoader, stage: str, world: int, rank: int, seed: int) -> DataLoader:
    """A map-style loader: our sampler around its own (or its batch sampler)."""
    train, sampler, batches = stage == "train", loader.sampler, loader.batch_sampler
    if hasattr(loader.dataset, "__len__"):
        same_length_on_all_ranks(len(loader.dataset), stage)  # type: ignore[arg-type]
    if train:
        resumes_exactly()
    if batches is not None and type(batches) is not BatchSampler:
        if isinstance(batches, ShardedBatches):
            return loader
        sharded = ShardedBatches(batches, world, rank, seed, pad=train)
        return _rebuild(loader, seed, batch_sampler=sharded)
    if isinstance(sampler, OURS):
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
        return _rebuild(loader, seed, sampler=EvalShardSampler(loader.dataset, world, rank))
    new: Sampler
    if type(sampler) not in (RandomSampler, SequentialSampler):
        new = ShardedDraws(sampler, world, rank, seed, pad=train)
    elif train:
        shuffle = isinstance(sampler, RandomSampler)
        new = ResumableSampler(loader.dataset, world, rank, shuffle, seed)
    else:
        new = EvalShardSampler(loader.dataset, world, rank)
    return _rebuild(loader, seed, sampler=new)


def shard_loader(loader: Any, stage: str, world: int, rank: int, seed: int) -> Any:
    """`loader` sharded over `world` ranks for `stage` ("train", "val", "test")."""
    if not isinstance(loader, DataLoader):
        return loader  # not a DataLoader (e.g. a list of batches): the user's own business
    if isinstance(loader.dataset, ShardedStream):
        return _stream(loader, stage, world, rank, seed)
    if not isinstance(loader.dataset, IterableDataset):
        return _sampled(loader, stage, world, rank, seed)
    what = type(loader.dataset).__name__
    if world > 1:
        raise UserError(
            f"the {stage} DataLoader cannot be sharded across the {world} processes: its "
            f"dataset is an IterableDataset ({what}) that does not split itself. Subclass "
            "project.data.stream.ShardedStream (docs/data.md), or return a map-style dataset"
        )
    if stage == "train" and stage not in _warned:
        _warned.add(stage)
        log.warning(
            f"the train DataLoader is used as it is (an IterableDataset, {what}): a resume from "
            "a mid-epoch checkpoint restarts that epoch's order, so it is not exact"
        )
    return loader


def shard_loaders(loaders: Any, stage: str, world: int, rank: int, seed: int) -> Any:
    """`shard_loader` over one loader or a list/tuple/dict of loaders (Lightning allows all)."""
    if isinstance(loaders, dict):
        return {k: shard_loader(v, stage, world, rank, seed) for k, v in loaders.items()}
    if isinstance(loaders, (list, tuple)):
        return type(loaders)(shard_loader(v, stage, world, rank, seed) for v in loaders)
    return shard_loader(loaders, stage, world, rank, seed)


def _parts(loader: Any) -> list[Any]:
    """What may hold a loader's order: its batch sampler, sampler and dataset."""
    return [getattr(loader, name, None) for name in ("batch_sampler", "sampler", "dataset")]


def _order(loader: Any) -> Any:
    """What holds `loader`'s order: our sampler, batch sampler or stream (None: not ours)."""
    ours = (*OURS, ShardedBatches, ShardedStream)
    return next((part for part in _parts(loader) if isinstance(part, ours)), None)


def set_epoch(loader: Any, epoch: int) -> None:
    """A new order for `epoch`: `set_epoch` on the loader's batch sampler, sampler and dataset,
    where they have it (Lightning sets it on samplers only, not on an iterable dataset)."""
    for part in _parts(loader):
        if callable(getattr(part, "set_epoch", None)):
            part.set_epoch(epoch)


def resume_at(loader: Any, epoch: int, batches: int) -> bool:
    """Make `loader`'s `epoch` start after its first `batches` batches (a mid-epoch resume;
    other epochs are whole). False when its order is not ours (it restarts the epoch).

    With DataLoader workers, call it before the epoch's iterator is made: the workers take
    their copy of the order then."""
    order = _order(loader)
    if order is None or isinstance(order, EvalShardSampler):
        return False
    set_epoch(loader, epoch)
    per_batch = 1 if isinstance(order, ShardedBatches) else loader.batch_size
    order.skip(batches * per_batch)
    return True
