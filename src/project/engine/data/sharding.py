"""Every loader sharded across ranks, in a resumable order: both trainers, any user loader.

Both trainers pass each DataLoader through `shard_loader` (the Lightning path wraps the
datamodule's `*_dataloader` methods with `shard_datamodule`; Lightning's own sampler
injection is off, `trainer.use_distributed_sampler: false`). By the loader's shape
(samplers.py and project.data.stream say how each splits):

- `DataLoader(dataset, batch_size, shuffle=...)` as Lightning's docs write it (also with an
  explicit `BatchSampler`, or `batch_size=None` over a dataset of ready-made batches): rebuilt
  with the same settings around a `ResumableSampler` (training) or an `EvalShardSampler`;
- a custom sampler (WeightedRandomSampler, RandomSampler with replacement or num_samples, ...)
  or batch sampler: each rank takes its share of its draws (`ShardedDraws`,
  `ShardedBatches`), seeded from the run seed and the epoch;
- a user's DistributedSampler: rebuilt as a `ResumableSampler` with its shuffle, seed and
  drop_last (a subclass of it is kept, with one warning that a mid-epoch resume restarts
  the epoch);
- a `ShardedStream` (iterable data in shards): told its rank, world and batch size;
- a loader that already has one of these: kept.

Every one of these resumes exactly at a global position of the epoch (`resume_at`), on any
world size (samplers.py: one layout for all). Anything else (an IterableDataset that does not
shard itself) stops a multi-process run at start-up with one line; in a single process it is
kept, with one warning that a mid-epoch resume restarts the epoch. All ranks must see data of
the same length: a mismatch is one line on every rank, and so is a val/test split that leaves
a rank without a batch (`same_eval_batches`). Lists and dicts of loaders and
Lightning's CombinedLoader (in its mode) are sharded, given their epoch and resumed loader by
loader, each at its own count (`own_position`: Lightning re-reads a short train loader inside
the epoch, project.engine.lightning.combined). A rebuilt loader keeps every DataLoader option.
"""

from __future__ import annotations

import inspect
import logging
import math
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
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

from project.data.stream import ShardedStream, SkipInEpoch, rank_positions
from project.engine.data.samplers import (
    EvalShardSampler,
    ResumableSampler,
    ShardedBatches,
    ShardedDraws,
)
from project.engine.errors import UserError

log = logging.getLogger(__name__)
OURS = (ResumableSampler, EvalShardSampler, ShardedDraws)


_warned: set[str] = set()
# How a loader samples: replaced by `_rebuild`; every other DataLoader option is kept.
SAMPLING = ("self", "dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")


def options(loader: DataLoader) -> dict[str, Any]:
    """Every option of DataLoader.__init__ but how it samples, read back from `loader` (it
    keeps each under its parameter's name): in_order, pin_memory_device, prefetch_factor,
    ..., and whatever a later torch adds."""
    params = inspect.signature(DataLoader.__init__).parameters
    return {name: getattr(loader, name, p.default) for name, p in params.items()
            if name not in SAMPLING}  # fmt: skip


def _rebuild(loader: DataLoader, seed: int, **sampling: Any) -> DataLoader:
    """`loader` with `sampling` (a sampler and its batch size, or a batch sampler) instead of
    its own; every other option kept (`options`).

    A private generator seeds each new iterator's workers (else every iterator draws its base
    seed from the global RNG, so dropout masks would depend on when iterators were made);
    `set_epoch` reseeds it from (seed, epoch), so workers draw alike after a resume. A user's
    own generator is not drawn from (it may be shared, and its state is in no checkpoint):
    its seed takes the run seed's place, so it still decides what the workers draw.
    """
    if "batch_sampler" not in sampling and "batch_size" not in sampling:
        sampling.update(batch_size=loader.batch_size, drop_last=loader.drop_last)
    kept = options(loader)
    user = kept.pop("generator")
    base = user.initial_seed() if isinstance(user, torch.Generator) else seed
    kept["pin_memory"] = kept["pin_memory"] and torch.cuda.is_available()  # else one warning
    cls = type(loader)
    if cls.__init__ is not DataLoader.__init__:  # its own arguments cannot be replayed
        _warn_once(cls.__name__, f"the {cls.__name__} (a DataLoader subclass with its own "
                   "__init__) is rebuilt as a plain DataLoader around the sharded sampler, "
                   "with every DataLoader option it had; its own methods are not used")  # fmt: skip
        cls = DataLoader
    new = cls(loader.dataset, **sampling, **kept, generator=torch.Generator().manual_seed(base))
    if user is not None:
        new.worker_seed_base = base  # set_epoch: the user's seed, not the sampler's
    return new


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


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
    if stage == "train" and stream.shuffle:
        say_layout(*stream.in_use())
    same_length_on_all_ranks(stream.total, stage)
    resumes_exactly()
    return _rebuild(loader, seed)  # for its private generator


def _sampler_and_batch(loader: DataLoader) -> tuple[Any, dict[str, Any]]:
    """The loader's sampler and how it batches it. An explicit `BatchSampler(sampler, n,
    drop_last)` is the same as `sampler=sampler, batch_size=n`: its inner sampler is the one
    to shard (the loader's own `sampler` is then a SequentialSampler it never reads)."""
    batches = loader.batch_sampler
    if type(batches) is BatchSampler:
        return batches.sampler, {"batch_size": batches.batch_size, "drop_last": batches.drop_last}
    return loader.sampler, {"batch_size": loader.batch_size, "drop_last": loader.drop_last}


def _plain_random(sampler: Any, dataset: Any) -> bool:
    """A RandomSampler that is a permutation of the dataset (`shuffle=True`): not one drawing
    with replacement or another number of samples (an epoch defined by a number of draws)."""
    return (type(sampler) is RandomSampler and not sampler.replacement
            and sampler.num_samples == len(dataset))  # fmt: skip


def _training_sampler(sampler: Any, loader: DataLoader, world: int, rank: int, seed: int,
                      stage: str) -> Sampler | None:  # fmt: skip
    """Our training sampler in place of `sampler` (None: keep the loader as it is)."""
    if isinstance(sampler, OURS):
        return None
    if type(sampler) is SequentialSampler or _plain_random(sampler, loader.dataset):
        shuffle = type(sampler) is RandomSampler
        return ResumableSampler(loader.dataset, world, rank, shuffle, seed)
    if type(sampler) is DistributedSampler:  # the user's: its settings, our resumable order
        _check_replicas(sampler, world, stage)
        return ResumableSampler(loader.dataset, world, rank, sampler.shuffle, sampler.seed,
                                sampler.drop_last)  # fmt: skip
    if isinstance(sampler, DistributedSampler):  # a subclass: its own order, kept
        _check_replicas(sampler, world, stage)
        return None
    return ShardedDraws(sampler, world, rank, seed, pad=True)


def _check_replicas(sampler: DistributedSampler, world: int, stage: str) -> None:
    if sampler.num_replicas != world:
        raise UserError(
            f"the {stage} DataLoader's DistributedSampler has num_replicas="
            f"{sampler.num_replicas} but the run has {world} processes: build it from "
            "trainer.world_size / trainer.global_rank, or return a plain DataLoader"
        )


def _sampled(loader: DataLoader, stage: str, world: int, rank: int, seed: int) -> DataLoader:
    """A map-style loader: our sampler around its own (or its batch sampler)."""
    train, batches = stage == "train", loader.batch_sampler
    if hasattr(loader.dataset, "__len__"):
        same_length_on_all_ranks(len(loader.dataset), stage)  # type: ignore[arg-type]
    if train:
        resumes_exactly()
    if batches is not None and type(batches) is not BatchSampler:
        if isinstance(batches, ShardedBatches):
            return loader
        sharded = ShardedBatches(batches, world, rank, seed, pad=train)
        return _rebuild(loader, seed, batch_sampler=sharded)
    sampler, batching = _sampler_and_batch(loader)
    new: Sampler | None
    if train:
        new = _training_sampler(sampler, loader, world, rank, seed, stage)
    elif isinstance(sampler, EvalShardSampler):
        new = None
    elif type(sampler) in (RandomSampler, SequentialSampler) or isinstance(
        sampler, DistributedSampler
    ):
        new = EvalShardSampler(loader.dataset, world, rank)
    else:
        new = ShardedDraws(sampler, world, rank, seed, pad=False)
    return loader if new is None else _rebuild(loader, seed, sampler=new, **batching)


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
    if stage == "train":
        _warn_once(stage, f"the train DataLoader is used as it is (an IterableDataset, {what}): "
                   "a resume from a mid-epoch checkpoint restarts that epoch's order, so it is "
                   "not exact")  # fmt: skip
    return loader


def combined(loaders: Any) -> bool:
    """Whether `loaders` is Lightning's CombinedLoader (its loaders in `iterables`, a mode;
    told by shape: this module does not import Lightning)."""
    return hasattr(loaders, "flattened") and hasattr(loaders, "iterables")


def shard_loaders(loaders: Any, stage: str, world: int, rank: int, seed: int) -> Any:
    """`shard_loader` over one loader or a list/tuple/dict of loaders or a CombinedLoader of
    them (Lightning allows all; a CombinedLoader keeps its mode)."""
    if combined(loaders):
        loaders.flattened = [shard_loader(v, stage, world, rank, seed) for v in loaders.flattened]
        return loaders
    if isinstance(loaders, Mapping):
        return {k: shard_loader(v, stage, world, rank, seed) for k, v in loaders.items()}
    if isinstance(loaders, (list, tuple)):
        return type(loaders)(shard_loader(v, stage, world, rank, seed) for v in loaders)
    return shard_loader(loaders, stage, world, rank, seed)


def flat(loaders: Any) -> list[Any]:
    """The loaders of one loader or a list/tuple/dict (or CombinedLoader) of them, in a
    fixed order."""
    if combined(loaders):
        return flat(loaders.iterables)
    if isinstance(loaders, Mapping):
        return [loader for key in sorted(loaders) for loader in flat(loaders[key])]
    if isinstance(loaders, (list, tuple)):
        return [loader for item in loaders for loader in flat(item)]
    return [loaders]


def eval_batches(loader: Any) -> tuple[int, list[int]] | None:
    """(elements, each rank's batches) of an evaluation loader sharded here (None: not ours,
    or training's padded order)."""
    order = _order(loader)
    total = order.n if isinstance(order, EvalShardSampler) else getattr(order, "total", None)
    if total is None or getattr(order, "pad", False):
        return None
    size, drop = units_per_batch(loader), getattr(loader, "drop_last", False)
    ranks = [len(rank_positions(total, order.world, r, mode="exact")) for r in range(order.world)]
    return total, [n // size if drop else -(-n // size) for n in ranks]


def same_eval_batches(loaders: Any, stage: str, fsdp: bool = True, source: Any = None) -> None:
    """Every rank evaluates a batch where any does: a rank with none skips the evaluation its
    peers run, and they wait for it in the metrics' sync until the timeout (Lightning stops
    that rank alone). Under strategy=fsdp (`fsdp`) every forward is a collective (each unit's
    all-gather): a rank with one more eval batch than its peers would wait for good in an
    all-gather they never issue. Refused in one line, with the fix: the setting the data
    `source` names for a larger split (its `larger`), the batch sizes that give every rank as
    many batches, fewer processes."""
    for loader in flat(loaders):
        counted = eval_batches(loader)
        if counted is not None and min(counted[1]) == 0 < max(counted[1]):
            raise UserError(_no_batch(loader, stage, *counted, source))
    for loader in flat(loaders) if fsdp else ():
        sampler = getattr(loader, "sampler", None)
        size = getattr(loader, "batch_size", None)
        if not isinstance(sampler, EvalShardSampler) or not size:
            continue
        drop = loader.drop_last
        counts = sampler.batches_per_rank(size, drop)
        if len(set(counts)) == 1:
            continue
        fits = [b for b in range(max(1, size - 8), size + 9)
                if len(set(sampler.batches_per_rank(b, drop))) == 1]  # fmt: skip
        nearest = sorted(sorted(fits, key=lambda b: abs(b - size))[:4])
        raise UserError(
            f"strategy=fsdp runs a collective in every forward, so every rank must evaluate as "
            f"many batches, but the {stage} data ({sampler.n} samples over {sampler.world} "
            f"processes in batches of {size}) gives {max(counts)} batches on some ranks and "
            f"{min(counts)} on others: use a {stage} batch size of "
            f"{', '.join(map(str, nearest))} (data.batch_size for the shipped data), or "
            "strategy=ddp"
        )


def _no_batch(loader: Any, stage: str, total: int, counts: list[int], source: Any) -> str:
    """The line refusing a split that leaves some of the `counts` ranks without a batch."""
    size, drop, world = units_per_batch(loader), getattr(loader, "drop_last", False), len(counts)
    need, fewer = (world * size, total // size) if drop else (world, total)
    larger = getattr(source, "larger", None)
    fix = (callable(larger) and larger(stage, need)) or f"a {stage} split of {need} elements"
    return (f"the {stage} split has {sum(counts)} batch(es) ({total} element(s) in batches of "
            f"{size}) for {world} processes, so rank {counts.index(0)} would evaluate none while "
            f"the others wait for it: use {fix}, or at most {fewer} process(es) (fewer "
            "trainer.devices)")  # fmt: skip


def _parts(loader: Any) -> list[Any]:
    """What may hold a loader's order: its batch sampler, sampler and dataset."""
    return [getattr(loader, name, None) for name in ("batch_sampler", "sampler", "dataset")]


def _order(loader: Any) -> Any:
    """What holds `loader`'s order: our sampler, batch sampler or stream (None: not ours)."""
    ours = (*OURS, ShardedBatches, ShardedStream)
    return next((part for part in _parts(loader) if isinstance(part, ours)), None)


def lay_out(loader: Any, lanes: int, shuffle_block: int) -> None:
    """Lay `loader`'s stream out in `lanes` lanes and blocks of `shuffle_block` rows."""
    _order(loader).lay_out(lanes, shuffle_block)


def say_layout(lanes: int, block: int) -> None:
    """One line, once per layout, naming how a shuffled train stream reads its epoch (a new
    run's order follows its lanes: the same global batches on their divisors only)."""
    said = f"layout {lanes} {block}"
    if said not in _warned:
        _warned.add(said)
        sizes = ", ".join(str(w) for w in range(1, lanes + 1) if lanes % w == 0)
        log.info(f"The train stream is laid out in {lanes} lanes, shuffle_block {block} rows: "
                 f"the same global batches on {sizes} process(es) (docs/data.md)")  # fmt: skip


def stream_layout(loader: Any) -> tuple[int, int]:
    """(lanes, shuffle_block) of `loader`'s shuffled stream (project.data.lanes); (0, 0) when
    its order is no shuffled stream (then no world size is excluded)."""
    order = _order(loader)
    if not isinstance(order, ShardedStream) or not order.shuffle:
        return 0, 0
    return order.in_use()


def units_per_batch(loader: Any) -> int:
    """Positions of the epoch's order one batch of `loader` takes: its batch size, or 1 for a
    batch sampler's batches and for a dataset of ready-made batches (batch_size=None)."""
    if isinstance(_order(loader), ShardedBatches):
        return 1
    return getattr(loader, "batch_size", None) or 1


def worker_seed(seed: int, epoch: int) -> int:
    """The base of an epoch's DataLoader worker seeds: a function of (seed, epoch) only."""
    high, low = np.random.SeedSequence([seed, epoch]).generate_state(2)
    return int(high) << 31 ^ int(low)


def set_epoch(loaders: Any, epoch: int) -> None:
    """A new order for `epoch` (one loader, or a list/dict of them): `set_epoch` on each
    loader's batch sampler, sampler and dataset, where they have it (Lightning sets it on
    samplers only, not on an iterable dataset), and its workers' seeds from (seed, epoch)."""
    for loader in flat(loaders):
        for part in _parts(loader):
            if callable(getattr(part, "set_epoch", None)):
                part.set_epoch(epoch)
        order, generator = _order(loader), getattr(loader, "generator", None)
        if order is not None and isinstance(generator, torch.Generator):
            base = getattr(loader, "worker_seed_base", getattr(order, "seed", 0))
            generator.manual_seed(worker_seed(base, epoch))


def batches_left(loader: Any) -> int | None:
    """The batches `loader` still yields in this epoch (None: not known, not ours). After a
    resume on another world size with another global batch it can be fewer than its length
    minus the batches done, which counts whole batches of this world."""
    order, size = _order(loader), units_per_batch(loader)
    if order is None or not hasattr(order, "left"):
        return None
    drop = getattr(loader, "drop_last", False)
    return order.left() // size if drop else math.ceil(order.left() / size)


def drop_incomplete_steps(loaders: Any, accumulate: int, world: int) -> None:
    """A train loader with drop_last drops its epoch's incomplete optimizer step, not each
    rank's incomplete micro-batch: its epoch ends at the last whole global batch (batch x
    accumulate x world positions), so it has the same steps on any world size that keeps the
    global batch (a batch sampler's own batches are kept as they are). Without accumulation
    that is what the DataLoader dropped already; with it, the epoch's last partial window is
    dropped too (one warning with the numbers); an epoch without one whole step is refused."""
    for loader in flat(loaders):
        order = _order(loader)
        if not getattr(loader, "drop_last", False) or not isinstance(order, SkipInEpoch) or (
                isinstance(order, ShardedBatches)):  # fmt: skip
            continue
        size = units_per_batch(loader)
        order.whole = whole = size * accumulate * world
        total = _epoch_total(order)
        if total is None:
            continue
        if total < whole:
            raise UserError(
                f"drop_last: the epoch has {total} samples, less than one optimizer step of "
                f"{whole} ({size} x {accumulate} accumulated x {world} process(es)): it would "
                "train nothing; lower trainer.accumulate_grad_batches or the batch size, or "
                "set drop_last=False"
            )
        kept, loader_kept = total // whole * whole, total // (size * world) * size * world
        if kept < loader_kept:
            _warn_once("drop_last", f"drop_last: every epoch ends at its last whole optimizer "
                       f"step of {whole} samples ({size} x {accumulate} accumulated x {world} "
                       f"process(es)), the same steps on any world size: {total - kept} of "
                       f"{total} samples an epoch are not trained on ({total - loader_kept} "
                       "without accumulation)")  # fmt: skip


def _epoch_total(order: Any) -> int | None:
    """The positions of an epoch of `order` (a template sampler or stream), if known."""
    total = getattr(order, "total", None)
    if total is None and hasattr(order, "dataset"):
        total = len(order.dataset)
    return total


def epoch_start(loader: Any, epoch: int) -> int:
    """The global position where `loader`'s `epoch` started (0 unless it was resumed)."""
    order = _order(loader)
    return order.resumed()[0] if isinstance(order, SkipInEpoch) and order.epoch == epoch else 0


def resumable(loader: Any) -> bool:
    """Whether `resume_at` can start `loader`'s epoch at a global position."""
    order = _order(loader)
    return order is not None and not isinstance(order, EvalShardSampler)


def resume_at(loader: Any, epoch: int, position: int, batch: int = 0) -> bool:
    """Make `loader`'s `epoch` start at global `position` of its order (the positions every
    rank read together before a mid-epoch checkpoint), which is the epoch's `batch` (the
    trainer's count); other epochs are whole. False when its order is not ours.

    With DataLoader workers, call it before the epoch's iterator is made: the workers take
    their copy of the order then."""
    if not resumable(loader):
        return False
    set_epoch(loader, epoch)
    _order(loader).skip(position, batch)
    return True


# --- several train loaders: each by its own count -------------------------------------------
def cycle_in_epoch(loaders: Any) -> None:
    """Mark the train `loaders` as cycled inside an epoch (Lightning's `max_size_cycle`, its
    default for several): a short one is read again from its start when it runs out, so its
    place in a checkpoint is its own count in its current pass (`own_position`)."""
    for loader in flat(loaders):
        if isinstance(order := _order(loader), SkipInEpoch):
            order.cycles = True


def restart(loader: Any) -> None:
    """`loader` is read again inside the epoch (cycled): this pass reads its order whole."""
    if isinstance(order := _order(loader), SkipInEpoch):
        order.restart()


def pass_batches(loader: Any, start: int) -> int:
    """The batches one pass of `loader`'s epoch yields on this rank from global `start`."""
    size, drop = units_per_batch(loader), getattr(loader, "drop_last", False)
    left = len(_order(loader).positions(start))
    return left // size if drop else math.ceil(left / size)


def own_position(loader: Any, epoch: int, batches: int, world: int) -> int:
    """Positions of `loader`'s current pass of `epoch` every rank read together after the
    epoch's first `batches` batches (this world's count): past its end for a loader that ran
    out (Lightning's max_size), within its pass for one that is cycled (`cycle_in_epoch`)."""
    order, units = _order(loader), units_per_batch(loader)
    ours = isinstance(order, SkipInEpoch) and order.epoch == epoch
    start, first_batch = order.resumed() if ours else (0, 0)
    read = batches - first_batch  # batches read since the epoch (re)started here
    if getattr(order, "cycles", False) and read >= (first := pass_batches(loader, start)):
        whole = pass_batches(loader, 0)
        return (read - first) % whole * units * world if whole else 0
    return start + read * units * world
