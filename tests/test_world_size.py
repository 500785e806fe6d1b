"""The same training whatever the world size (project.engine.data.elastic): the epoch's
positions and the global batch belong to the run. In one process: the sharding arithmetic for
world sizes up to 1000 and every change W -> W' in the middle of an epoch, every loader shape
the template splits, the global batch kept or refused in one line, and each loader idiom kept
to what it means. With real processes: a run preempted on 2 processes continues on 1 or 3
(and on 1, continues on 2) in both trainers and trains what the uninterrupted run trains."""

from __future__ import annotations

import collections
import itertools
import math
import re
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.utilities import CombinedLoader
from omegaconf import OmegaConf
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    RandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from project.data.stream import ShardedStream, rank_positions
from project.engine.data import elastic, sharding
from project.engine.data.samplers import ResumableSampler, ShardedDraws
from project.engine.data.sharding import resume_at, set_epoch, shard_loader
from project.engine.distributed.exits import EXIT_PREEMPTED
from project.engine.errors import UserError
from project.engine.lightning.combined import combine_train
from tests.helpers import (
    QUIET,
    final_weights,
    finish,
    launcher,
    recorded_data,
    recorded_reads,
    start,
)

SIZES = (1, 2, 3, 7, 64, 1000)


# --- the arithmetic, for any world size ----------------------------------------------------
def read_by(total: int, world: int, start: int, per_rank: int | None) -> list[list[int]]:
    """Each rank's positions from `start` on (the first `per_rank` of them, or all)."""
    return [list(rank_positions(total, world, r, start))[:per_rank] for r in range(world)]


def step_sets(ranks: list[list[int]], per_step: int) -> list[set[int]]:
    """The positions each optimizer step of all ranks together took (per_step per rank)."""
    steps = math.ceil(len(ranks[0]) / per_step)
    return [{p for rank in ranks for p in rank[s * per_step : (s + 1) * per_step]}
            for s in range(steps)]  # fmt: skip


@pytest.mark.quick
def test_positions_cover_every_element_once_whatever_the_world_changes() -> None:
    """For every change W -> W' after 2 optimizer steps of an epoch (global batch G kept):
    every element once an epoch (the padding repeats fewer than W' of the first ones), the
    same number of steps on every rank, and the same global batches as the run that never
    changed."""
    for w0, w1 in itertools.product(SIZES, SIZES):
        batch = 2 * math.lcm(w0, w1)  # a global batch both split into whole per-rank batches
        total = 5 * batch + 2 * w1 + 1  # 5 full steps and a ragged end
        whole = step_sets(read_by(total, w0, 0, None), batch // w0)
        before = read_by(total, w0, 0, 2 * batch // w0)  # 2 steps, then the world changes
        after = read_by(total, w1, 2 * batch, None)
        assert len({len(r) for r in after}) == 1, (w0, w1)  # the same steps on every rank
        read = collections.Counter(p % total for rank in before + after for p in rank)
        assert set(read) == set(range(total)), (w0, w1)
        assert sum(read.values()) - total < w1, (w0, w1)  # padding only
        resized = step_sets(before, batch // w0)[:2] + step_sets(after, batch // w1)
        assert resized[:-1] == whole[: len(resized) - 1], (w0, w1)  # the same global batches
        last = [{p for p in step[-1] if p < total} for step in (resized, whole)]
        assert last[0] == last[1], (w0, w1)  # the last step: the same but for its padding


@pytest.mark.quick
def test_without_padding_every_position_is_read_once() -> None:
    for world, total in itertools.product(SIZES, (0, 1, 999, 1000, 1001)):
        ranks = [rank_positions(total, world, r, mode="exact") for r in range(world)]
        assert sorted(p for r in ranks for p in r) == list(range(total))
        dropped = [rank_positions(total, world, r, mode="drop") for r in range(world)]
        assert {len(r) for r in dropped} == {total // world}


@pytest.mark.quick
@pytest.mark.parametrize(
    "run, world, batch, fixed, split",
    [(128, 1, 64, False, (64, 2)), (64, 2, 64, False, (32, 1)), (96, 3, 48, False, (32, 1)),
     (1000, 64, 10, False, None), (256, 64, 8, False, (4, 1)), (128, 4, 64, True, None),
     (128, 1, 64, True, (64, 2)), (42, 7, 6, False, (6, 1)), (2000, 1000, 1, True, (1, 2))],
)  # fmt: skip
def test_the_global_batch_is_split_or_refused_in_one_line(run, world, batch, fixed, split):
    if split is None:
        with pytest.raises(UserError, match=rf"global batch of {run} cannot be split") as err:
            elastic.split_global_batch(run, world, batch, fixed)
        assert "keep_global_batch=false" in str(err.value) and "\n" not in str(err.value)
        # Only fixes that exist: each world size it names splits the batch.
        named = re.search(r"run on ([\d, .]+) process\(es\)", str(err.value))[1]
        sizes = [int(w) for w in named.replace("...", "").split(",") if w.strip()]
        assert sizes and world not in sizes, err.value
        for w in sizes:
            elastic.split_global_batch(run, w, batch, fixed)
        return
    assert elastic.split_global_batch(run, world, batch, fixed) == split
    per_rank, accumulate = split
    assert per_rank * accumulate * world == run and per_rank <= batch


def config(batch: int | None = 64, accumulate: int = 1, **run: object) -> OmegaConf:
    data = {} if batch is None else {"batch_size": batch}
    trainer = {"accumulate_grad_batches": accumulate, "limit_train_batches": None}
    return OmegaConf.create({"data": data, "trainer": trainer, **run})


def position(world: int, units: int = 64, accumulate: int = 1, limit=None) -> elastic.Position:
    """Where a run of `units` per rank x `accumulate` x `world` stood, the command's own batch
    keys as config() gives them."""
    asked = (64, 1, limit)
    return elastic.Position(1, 4, world, accumulate, (units,), (0,), units == 64, limit, asked)


def fit(cfg: OmegaConf, saved: elastic.Position, world: int) -> tuple[int, int]:
    """fit_global_batch on `cfg` as the command gave it: (batch size, accumulation)."""
    elastic.fit_global_batch(cfg, saved, world, elastic.asked(cfg))
    return cfg.data.get("batch_size"), cfg.trainer.accumulate_grad_batches


@pytest.mark.quick
def test_a_resumed_run_keeps_its_global_batch_on_another_world_size() -> None:
    assert fit(config(), position(2), world=1) == (64, 2)  # 64 x 1 x 2 when it was written
    assert fit(config(), position(1), world=2) == (32, 1)
    assert fit(config(keep_global_batch=False), position(2), world=1) == (64, 1)  # opt-out
    # An earlier attempt on 1 process kept 128 as 64 x 2: the same command again keeps it.
    again = elastic.Position(1, 4, 1, 2, (64,), (0,), True, None, (64, 1, None))
    assert fit(config(), again, world=1) == (64, 2)
    cfg = config()
    cfg.trainer.limit_train_batches = 12  # a count of batches: the same samples an epoch
    assert fit(cfg, position(2, limit=12), world=1) == (64, 2)
    assert cfg.trainer.limit_train_batches == 24
    with pytest.raises(UserError, match="cannot be split over 3"):
        fit(config(), position(2), world=3)


@pytest.mark.quick
def test_a_command_that_changes_the_batch_keys_is_followed() -> None:
    """Not the world size changed but the command's accumulation: the command wins."""
    cfg = config(accumulate=4)
    assert fit(cfg, position(2), world=2) == (64, 4) and cfg.keep_global_batch is False


@pytest.mark.quick
def test_a_datamodule_of_its_own_gets_the_accumulation_that_keeps_the_global_batch() -> None:
    """Its batch size is its own (20 a rank, or a global 40 it divides by the world): the
    accumulation is fitted when its loader is built, or one line when none fits."""
    assert fit(config(batch=None), position(2, units=20), world=1) == (None, 1)  # not here
    fixed = shard_loader(DataLoader(DATA, batch_size=20), "train", 1, 0, 0)
    assert elastic.fit_accumulation(fixed, position(2, units=20), 1, 1, keep=True) == 2
    divided = shard_loader(DataLoader(DATA, batch_size=40), "train", 1, 0, 0)  # 40 / 1
    assert elastic.fit_accumulation(divided, position(2, units=20), 1, 1, keep=True) == 1
    assert elastic.fit_accumulation(fixed, position(2, units=20), 1, 1, keep=False) == 1
    odd = shard_loader(DataLoader(DATA, batch_size=30), "train", 1, 0, 0)
    with pytest.raises(UserError, match=r"no whole accumulation makes it this run's global"):
        elastic.fit_accumulation(odd, position(2, units=20), 1, 1, keep=True)


# --- every loader shape, really resumed on another world size ------------------------------
N = 101
DATA = TensorDataset(torch.arange(N))


class Ids(ShardedStream):
    """N ids in 3 shards of uneven length, in 42 lanes: the world sizes below divide them
    (project.data.lanes)."""

    def __init__(self) -> None:
        super().__init__([37, 41, 23], shuffle=True, lanes=42)

    def read(self, shard: int) -> range:
        start = sum(self.lengths[:shard])
        return range(start, start + self.lengths[shard])


class Pairs(torch.utils.data.Sampler):
    """A user's batch sampler: pairs of neighbours in a random order."""

    def __len__(self) -> int:
        return 50

    def __iter__(self):
        return iter([[2 * p, 2 * p + 1] for p in torch.randperm(50).tolist()])


def plain(batch: int) -> DataLoader:
    return DataLoader(DATA, batch_size=batch, shuffle=True)


def weighted(batch: int) -> DataLoader:
    sampler = WeightedRandomSampler([1.0 + (i % 3) for i in range(N)], N)
    return DataLoader(DATA, batch_size=batch, sampler=sampler)


def stream(batch: int) -> DataLoader:
    return DataLoader(Ids(), batch_size=batch)


def batched(batch: int) -> DataLoader:
    return DataLoader(DATA, batch_sampler=Pairs())


SHAPES = {"plain": plain, "weighted": weighted, "stream": stream, "batch-sampler": batched}


def batches(loader: DataLoader, n: int | None = None) -> list[list[int]]:
    """The loader's first `n` batches (all), as lists of element ids."""
    taken = itertools.islice(loader, n)
    return [(b[0] if isinstance(b, list) else b).tolist() for b in taken]


def run_epoch(make, world: int, batch: int, accumulate: int, cut: tuple | None = None):
    """One epoch (epoch 1) on `world` ranks: each rank's batches, and the position the ranks
    record after `cut` = (steps, resumed on: world', batch', accumulate')."""
    loaders = [shard_loader(make(batch), "train", world, r, seed=5) for r in range(world)]
    for loader in loaders:
        set_epoch(loader, 1)
    if cut is None:
        return [batches(loader) for loader in loaders]
    steps, w1, b1, a1 = cut
    done = steps * accumulate
    before = [batches(loader, done) for loader in loaders]
    cfg = config(batch, accumulate)
    saved = elastic.record(loaders[0], 1, done, world, accumulate, cfg, elastic.asked(cfg))
    resumed = [shard_loader(make(b1), "train", w1, r, seed=5) for r in range(w1)]
    at = {elastic.resume(loader, elastic.Position.of(saved), 1, w1) for loader in resumed}
    assert at == {steps * a1}  # this world's batches of the epoch already done
    return before, [batches(loader) for loader in resumed]


def steps_of(ranks: list[list[list[int]]], per_step: int) -> list[list[int]]:
    """Every optimizer step's elements (sorted), all ranks together."""
    n = math.ceil(len(ranks[0]) / per_step)
    return [sorted(i for r in ranks for b in r[s * per_step : (s + 1) * per_step] for i in b)
            for s in range(n)]  # fmt: skip


@pytest.mark.quick
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("w0, w1", [(2, 1), (1, 2), (2, 3), (3, 7), (7, 2)])
def test_every_loader_shape_resumes_on_another_world_size(shape: str, w0: int, w1: int) -> None:
    """Preempted after 2 optimizer steps on w0 ranks, continued on w1 with the global batch
    kept: the same global batches as the uninterrupted run, each element (draw, batch) once,
    the same number of batches on every rank."""
    make, units = SHAPES[shape], (1 if shape == "batch-sampler" else None)
    global_batch = math.lcm(w0, w1) * (1 if units else 2)
    b0, a0 = (1, global_batch // w0) if units else (global_batch // w0, 1)
    b1, a1 = (1, global_batch // w1) if units else (global_batch // w1, 1)
    whole = steps_of(run_epoch(make, w0, b0, a0), a0)
    before, after = run_epoch(make, w0, b0, a0, cut=(2, w1, b1, a1))
    assert len({len(r) for r in after}) == 1  # no rank waits in a collective for another
    resized = steps_of(before, a0) + steps_of(after, a1)
    assert resized[: len(whole) - 1] == whole[:-1]  # full steps: the same global batches
    read = collections.Counter(i for step in resized for i in step)
    expected = collections.Counter(i for step in whole for i in step)
    assert set(read) == set(expected)  # nothing left out
    size = 2 if units else 1  # elements in one position: a pair of the batch sampler's
    # Only the padding at the end of the epoch differs (fewer than w positions each).
    assert sum((read - expected).values()) < w1 * size
    assert sum((expected - read).values()) < w0 * size


@pytest.mark.quick
def test_a_sampler_of_many_draws_is_never_held_whole() -> None:
    """10^6 + 1 draws (an epoch defined by a number of draws): start-up and a whole epoch of
    rank 1 of 4, padding included, hold a chunk of the draws, not the epoch (a list of 10^6
    ints is ~36 MB)."""
    data = range(1000)
    sampler = RandomSampler(data, replacement=True, num_samples=10**6 + 1)
    tracemalloc.start()
    shard = shard_loader(DataLoader(data, batch_size=1000, sampler=sampler), "train", 4, 1, 0)
    sizes = [len(b) for b in shard]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8 * 2**20, peak
    assert len(shard) == len(sizes) == 251 and sum(sizes) == 250001  # the last one padded


# --- each loader idiom kept to what it means -----------------------------------------------
@pytest.mark.quick
def test_an_explicit_batch_sampler_keeps_its_batches_and_weights() -> None:
    """DataLoader(batch_sampler=BatchSampler(WeightedRandomSampler(...), 50, False)): the
    weighted draws shared out, batched by 50, not rebuilt as plain unbatched indices."""
    weights = [9.0 if i % 10 == 0 else 1.0 for i in range(N)]
    user = DataLoader(DATA, batch_sampler=BatchSampler(WeightedRandomSampler(weights, 400), 50,
                                                       False))  # fmt: skip
    shards = [shard_loader(user, "train", 2, r, seed=1) for r in (0, 1)]
    assert all(isinstance(s.sampler, ShardedDraws) and s.batch_size == 50 for s in shards)
    drawn = [batches(s) for s in shards]
    assert [len(b) for b in drawn[0]] == [50, 50, 50, 50]
    ids = [i for rank in drawn for b in rank for i in b]
    assert len(ids) == 400 and abs(sum(i % 10 == 0 for i in ids) / 400 - 0.5) < 0.1


@pytest.mark.quick
def test_a_random_sampler_with_replacement_keeps_its_number_of_draws() -> None:
    """RandomSampler(replacement=True, num_samples=200) defines an epoch as 200 draws."""
    user = DataLoader(DATA, batch_size=10, sampler=RandomSampler(DATA, True, num_samples=200))
    shards = [shard_loader(user, "train", 2, r, seed=1) for r in (0, 1)]
    read = [i for s in shards for b in batches(s) for i in b]
    assert len(read) == 200 and len(set(read)) < 101  # draws, with repeats
    without = DataLoader(DATA, batch_size=10, sampler=RandomSampler(DATA, num_samples=60))
    assert sum(len(b) for r in (0, 1)
               for b in batches(shard_loader(without, "train", 2, r, 1))) == 60  # fmt: skip


class ReadyBatches(Dataset):
    """A dataset of ready-made batches (DataLoader(batch_size=None))."""

    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.arange(4 * i, 4 * i + 4)


@pytest.mark.quick
def test_a_dataset_of_ready_made_batches_resumes() -> None:
    user = DataLoader(ReadyBatches(), batch_size=None, shuffle=True)
    shards = [shard_loader(user, "train", 2, r, seed=2) for r in (0, 1)]
    whole = [[b.tolist() for b in s] for s in shards]
    assert sharding.units_per_batch(shards[0]) == 1
    saved = elastic.record(shards[0], 0, 5, 2, 1, config(None), {})
    resumed = shard_loader(user, "train", 1, 0, seed=2)
    assert elastic.resume(resumed, elastic.Position.of(saved), 0, 1) == 10
    rest = [b.tolist() for b in resumed]
    first_five = [b for step in zip(whole[0][:5], whole[1][:5], strict=True) for b in step]
    assert sorted(map(tuple, first_five + rest)) == sorted(
        (4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3) for i in range(30)
    )


@pytest.mark.quick
def test_a_users_distributed_sampler_is_resumed_exactly() -> None:
    """A DistributedSampler the user built keeps its shuffle, seed and drop_last, and a
    mid-epoch resume continues with the batches not yet trained (not the epoch's first)."""

    def user(rank: int) -> DataLoader:
        sampler = DistributedSampler(DATA, 2, rank, shuffle=True, seed=11, drop_last=True)
        return DataLoader(DATA, batch_size=10, sampler=sampler)

    ref = [list(DistributedSampler(DATA, 2, r, shuffle=True, seed=11, drop_last=True))
           for r in (0, 1)]  # fmt: skip
    shards = [shard_loader(user(r), "train", 2, r, seed=0) for r in (0, 1)]
    assert all(isinstance(s.sampler, ResumableSampler) for s in shards)
    assert [[i for b in batches(s) for i in b] for s in shards] == ref
    assert resume_at(shards[1], 0, 2 * 10 * 2)
    assert [i for b in batches(shards[1]) for i in b] == ref[1][20:]


class RandomPixels(Dataset):
    """Worker-side randomness (an augmentation): each item is a draw of torch's RNG."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.rand(1)


@pytest.mark.quick
def test_worker_seeds_follow_seed_and_epoch() -> None:
    """Epoch 2 of a run draws in its workers what epoch 2 of a resumed run draws: the
    workers' seeds depend on (seed, epoch), not on how many iterators the loader made."""

    def epoch_draws(epochs: list[int]) -> list[float]:
        user = DataLoader(RandomPixels(), batch_size=4, shuffle=True, num_workers=1,
                          multiprocessing_context="fork")  # fmt: skip
        loader = shard_loader(user, "train", 1, 0, seed=3)
        for epoch in epochs:
            set_epoch(loader, epoch)
            drawn = [float(x) for b in loader for x in b]
        return drawn

    assert epoch_draws([0, 1, 2]) == epoch_draws([2])
    assert epoch_draws([1]) != epoch_draws([2])


@pytest.mark.quick
def test_a_dict_of_train_loaders_gets_its_epoch_and_resume_point() -> None:
    loaders = {name: shard_loader(make, "train", 2, 1, 4)
               for name, make in (("a", plain(10)), ("b", stream(5)))}  # fmt: skip
    set_epoch(loaders, 3)
    assert loaders["a"].sampler.epoch == 3 and loaders["b"].dataset.epoch == 3
    whole = {k: batches(v) for k, v in loaders.items()}
    saved = elastic.record(loaders, 3, 2, 2, 1, config(10), elastic.asked(config(10)))
    assert saved["units"] == [10, 5]
    assert elastic.resume(loaders, elastic.Position.of(saved), 3, 2) == 2
    assert {k: batches(v) for k, v in loaders.items()} == {k: v[2:] for k, v in whole.items()}


class FewIds(ShardedStream):
    """23 ids from 1000 on, in 3 shards: a short stream beside DATA."""

    def __init__(self) -> None:
        super().__init__([7, 9, 7], shuffle=True)

    def read(self, shard: int) -> range:
        start = 1000 + sum(self.lengths[:shard])
        return range(start, start + self.lengths[shard])


def two_loaders(mode: str, short: str, rank: int) -> Any:
    """{"a": 101 rows, batch 5 (11 steps a rank), "b": 23 rows, batch 4 (3 steps a rank)} on
    rank `rank` of 2, as the Lightning wrapper returns them (a dict: Lightning's cycling)."""
    b = FewIds() if short == "stream" else TensorDataset(torch.arange(1000, 1023))
    loaders = {"a": DataLoader(DATA, batch_size=5, shuffle=True),
               "b": DataLoader(b, batch_size=4, shuffle=short != "stream")}  # fmt: skip
    given = loaders if mode == "dict" else CombinedLoader(loaders, mode)
    return combine_train(sharding.shard_loaders(given, "train", 2, rank, seed=5))


def combined_steps(loaders: Any, first: int = 0) -> list[dict[str, list[int] | None]]:
    """The rest of the epoch from step `first` on, as Lightning's fit loop reads it: an epoch
    of len(combined) steps."""
    mode = getattr(loaders, "_mode", "max_size_cycle")
    combined = loaders if isinstance(loaders, CombinedLoader) else CombinedLoader(loaders, mode)
    steps = iter(combined)
    return [{k: None if v is None else v[0].tolist() for k, v in next(steps)[0].items()}
            for _ in range(first, len(combined))]  # fmt: skip


@pytest.mark.quick
@pytest.mark.parametrize("short", ["plain", "stream"])
@pytest.mark.parametrize("mode", ["dict", "max_size_cycle", "max_size", "min_size"])
def test_several_train_loaders_resume_each_by_its_own_count(mode: str, short: str) -> None:
    """Two train loaders combined as Lightning does (a dict: the short one cycled), on 2 ranks:
    stopped after any step of epoch 1 and resumed, each rank reads the rest of the epoch the
    uninterrupted run read, in an epoch of the same length: a cycled loader resumes inside
    its own pass and reads its later passes whole."""
    cfg = config(5)
    for rank in (0, 1):
        whole_run = two_loaders(mode, short, rank)
        set_epoch(whole_run, 1)
        whole = combined_steps(whole_run)
        for cut in range(1, len(whole)):
            stopped = two_loaders(mode, short, rank)
            set_epoch(stopped, 1)
            saved = elastic.record(stopped, 1, cut, 2, 1, cfg, elastic.asked(cfg))
            resumed = two_loaders(mode, short, rank)
            set_epoch(resumed, 1)
            assert elastic.resume(resumed, elastic.Position.of(saved), 1, 2) == cut
            assert combined_steps(resumed, cut) == whole[cut:], (rank, cut, saved)


@pytest.mark.quick
def test_a_resumed_cycled_loader_records_its_own_count_again() -> None:
    """Resumed at step 4 and stopped again at step 8: the second checkpoint places the cycled
    loader where the uninterrupted run had it (its pass restarted inside the epoch)."""
    cfg = config(5)
    whole = two_loaders("dict", "plain", 0)
    set_epoch(whole, 1)
    at_8 = elastic.record(whole, 1, 8, 2, 1, cfg, elastic.asked(cfg))
    once = two_loaders("dict", "plain", 0)
    set_epoch(once, 1)
    elastic.resume(once, elastic.Position.of(elastic.record(once, 1, 4, 2, 1, cfg, {})), 1, 2)
    combined_steps(once, 4)  # the rest of the epoch: b cycled once more
    assert elastic.record(once, 1, 8, 2, 1, cfg, elastic.asked(cfg))["own"] == at_8["own"]


@pytest.mark.quick
def test_an_order_of_its_own_restarts_the_epoch_with_a_warning(caplog) -> None:
    class Mine(DistributedSampler):
        pass

    loader = shard_loader(DataLoader(DATA, sampler=Mine(DATA, 2, 0)), "train", 2, 0, 0)
    assert isinstance(loader.sampler, Mine) and not sharding.resumable(loader)
    saved = elastic.record(loader, 0, 3, 2, 1, config(1), {})
    assert elastic.resume(loader, elastic.Position.of(saved), 0, 2) == 0
    assert "this epoch restarts from its beginning" in caplog.text


# --- real processes: the world changes under a run -----------------------------------------
# Rows that 1, 2 and 3 processes share out without padding, in whole global batches (40, 60):
# a resized run trains the same samples in each step, but two things differ where an epoch
# does not divide: the padding (the epoch's first rows again, fewer than the processes), and
# a partial last step, whose gradient Lightning (and so the raw trainer) scales by
# 1/accumulate whatever the micro-batches present, so another accumulation weighs it anew.
ROWS = 480


def train_args(tmp_path: Path, log_dir: Path, batch: int) -> list[str]:
    """2 epochs of the ROWS rows of tests.user_data.RecordedSource, a stop check every step."""
    return [f"paths.log_dir={log_dir}", *QUIET, *recorded_data(tmp_path, ROWS),
            f"data.batch_size={batch}", "trainer.max_epochs=2", "test=false",
            "callbacks.early_stopping=null", "trainer.num_sanity_val_steps=0",
            "callbacks.fault_tolerance.check_every_n_steps=1"]  # fmt: skip


def job(module: str, nproc: int, args: list[str], run: str, tag: str) -> tuple[int, str]:
    cmd = (
        launcher(["-m", module, *args], nproc)
        if nproc > 1
        else [sys.executable, "-m", module, *args]
    )
    return finish(start(cmd, RUN_ID=run, RECORD_TAG=tag), 240)


def global_step(run_dir: Path, module: str) -> int:
    ckpt = run_dir / "checkpoints" / ("last.pt" if module == "project.raw_train" else "last.ckpt")
    return int(torch.load(ckpt, weights_only=True)["global_step"])


@pytest.mark.distributed
@pytest.mark.parametrize(
    "module",
    [
        "project.train",
        "project.raw_train",  # feature:raw
    ],
)
@pytest.mark.parametrize(
    "w0, w1, batch",
    [(2, 1, 20), pytest.param(1, 2, 40, marks=pytest.mark.slow),
     pytest.param(2, 3, 30, marks=pytest.mark.slow)],
)  # fmt: skip
def test_preempted_mid_epoch_then_continued_on_another_world_size(
    tmp_path: Path, module: str, w0: int, w1: int, batch: int
) -> None:
    """Stopped in the middle of epoch 0 on w0 processes, continued on w1 with the same run
    folder: every row of the epoch trained once (padding aside), the same number of optimizer
    steps as the run that never stopped, the final weights within the stated tolerance."""
    log_dir = tmp_path / "logs"
    args = train_args(tmp_path, log_dir, batch)
    code, out = job(module, w0, args, "whole", "whole")
    assert code == 0, out[-3000:]
    cut = [*args, "fault_injection.at_step=4", "fault_injection.mode=sigterm"]
    code, out = job(module, w0, cut, "cut", "first")
    assert code == EXIT_PREEMPTED, out[-3000:]
    code, out = job(module, w1, args, "cut", "second")  # data.batch_size as given
    kept = f"the global batch of {batch * w0} is kept"
    assert code == 0 and kept in out and "Resuming epoch 0" in out, out[-3000:]
    runs = log_dir / "train" / "runs"
    assert global_step(runs / "cut", module) == global_step(runs / "whole", module)
    # Epoch 0: what the first attempt read, and what the second read before its epoch 1.
    first, second = recorded_reads(tmp_path, "first"), recorded_reads(tmp_path, "second")
    rest = [i for r in second for i in r[: -math.ceil(ROWS / w1)]]
    counts = collections.Counter([i for r in first for i in r] + rest)
    assert set(counts) == set(range(ROWS)), sorted(set(range(ROWS)) - set(counts))[:10]
    # Twice: the padding (< w1), and the batch each rank had fetched when it stopped (both
    # trainers check for a stop after fetching the next batch: read, never trained).
    assert sum(counts.values()) - ROWS < w0 * batch + w1, collections.Counter(counts.values())
    a, b = final_weights(runs / "cut"), final_weights(runs / "whole")
    largest = max(float((a[key] - b[key]).abs().max()) for key in a)
    print(f"largest weight difference, {w0} -> {w1} processes, {module}: {largest:.1e}")
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=1e-5)


@pytest.mark.distributed
def test_a_world_size_that_cannot_keep_the_global_batch_is_one_line(tmp_path: Path) -> None:
    """A run of global batch 21 (1 process) continued on 2: one line with the numbers and the
    fix, exit 2, its checkpoint untouched. Then a checkpoint from before data positions were
    recorded: it resumes, and one line says the epoch restarts."""
    log_dir = tmp_path / "logs"
    args = [*train_args(tmp_path, log_dir, 21), "fault_injection.at_step=4",
            "fault_injection.mode=sigterm"]  # fmt: skip
    code, out = job("project.train", 1, args, "odd", "first")
    assert code == EXIT_PREEMPTED, out[-3000:]
    last = log_dir / "train" / "runs" / "odd" / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    code, out = job("project.train", 1, [*args, "trainer.devices=2"], "odd", "second")
    assert code == 2, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in out, out[-3000:]
    assert "global batch of 21 cannot be split over 2" in errors[0], errors
    assert "keep_global_batch=false" in errors[0] and last.read_bytes() == before
    ckpt = torch.load(last, weights_only=True)
    del ckpt[elastic.KEY]  # as written before this change
    torch.save(ckpt, last)
    code, out = job("project.train", 1, args[:-2], "odd", "third")
    assert code == 0 and "records no data position" in out and "restarts" in out, out[-3000:]
    assert "Resuming epoch" not in out


@pytest.mark.quick
def test_a_global_batch_that_follows_the_world_still_resumes_every_sample_once() -> None:
    """keep_global_batch=false: 4 batches of 10 on 2 ranks (position 80), continued on 3 ranks
    of 10 (80 is no whole number of their batches): the 21 samples left are read once, the
    raw trainer's loop knows how many batches are left, and a checkpoint one batch later
    records the true position (80 + 30), so a second resume is exact too."""
    before = [batches(shard_loader(plain(10), "train", 2, r, seed=1), 4) for r in (0, 1)]
    saved = elastic.record(shard_loader(plain(10), "train", 2, 0, 1), 0, 4, 2, 1, config(10), {})
    after, later = [], []
    for r in range(3):
        loader = shard_loader(plain(10), "train", 3, r, seed=1)
        set_epoch(loader, 0)
        assert elastic.resume(loader, elastic.Position.of(saved), 0, 3) == 2  # 80 // 30
        assert sharding.batches_left(loader) == 1 and len(loader) == 4
        after += batches(loader)
        again = elastic.record(loader, 0, 3, 3, 1, config(10), {})  # one batch later
        later.append(elastic.Position.of(again).consumed(0))
    read = [i for rank in before for b in rank for i in b] + [i for b in after for i in b]
    assert set(read) == set(range(N)) and len(read) - N < 3  # the padding: fewer than 3
    assert later == [110, 110, 110]


def lightning_epoch(tmp_path: Path, ckpt: Path | None) -> list[list[int]]:
    """One epoch of 10 batches of 4 (ids 0..39 in order) in this process, with a
    ModelCheckpoint every 3 optimizer steps; resumed from `ckpt` when given. Returns the
    batches trained."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from project.engine.checkpoints.resume import Resume
    from project.engine.checkpoints.run import RunCheckpoints
    from project.engine.distributed.ddp import Topology
    from project.engine.lightning.callbacks import RunState
    from project.engine.lightning.datamodule import shard_datamodule
    from project.engine.run.skeleton import Run

    seen: list[list[int]] = []

    class Data(pl.LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(TensorDataset(torch.arange(40).float()), batch_size=4)

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch, index):
            seen.append(batch[0].long().tolist())
            return self.layer(batch[0][:, None]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    cfg = config(4)
    owner = RunCheckpoints(cfg, tmp_path, None, {}, elastic.asked(cfg))  # callbacks off
    saved = torch.load(ckpt, weights_only=True)[elastic.KEY] if ckpt else None
    data = Data()
    shard_datamodule(data, 0, elastic.Position.of(saved))
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1,
                            filename="{step}")  # fmt: skip
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False,
                         num_sanity_val_steps=0,
                         callbacks=[RunState(Run(cfg, tmp_path, Topology(1, 1, None), Resume(),
                                                 owner)), every])  # fmt: skip
    trainer.fit(Model(), data, ckpt_path=ckpt, weights_only=True)
    return seen


@pytest.mark.quick
def test_a_checkpoint_written_after_a_batch_resumes_after_it(tmp_path: Path) -> None:
    """ModelCheckpoint(every_n_train_steps=3) writes in on_train_batch_end, before Lightning
    counts that batch as completed: the position still counts it, so the resumed epoch trains
    the 7 batches the checkpoint had not (not batch 3 again, and the last one too)."""
    whole = lightning_epoch(tmp_path / "whole", None)
    assert whole == [list(range(4 * b, 4 * b + 4)) for b in range(10)]
    assert lightning_epoch(tmp_path / "resumed", tmp_path / "whole" / "step=3.ckpt") == whole[3:]
