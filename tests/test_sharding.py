"""Every loader sharded across ranks: the template's, a user's plain DataLoader, a user's
custom sampler or batch sampler; data of another length on one rank refused."""

from __future__ import annotations

import collections
import inspect
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, WeightedRandomSampler

from project.data.stream import ShardedStream
from project.engine.data import sharding
from project.engine.data.samplers import EvalShardSampler, ResumableSampler, ShardedDraws
from project.engine.data.sharding import resume_at, set_epoch, shard_loader
from project.engine.distributed.exits import EXIT_BAD_INPUT, EXIT_PREEMPTED
from project.engine.errors import UserError
from tests.helpers import (
    assert_same_weights,
    finish,
    launcher,
    one_error_line,
    recorded_data,
    recorded_reads,
    start,
    torchrun,
    user_data,
)
from tests.user_data import balancing_weights

DATA = TensorDataset(torch.arange(101))


def indices(loader: DataLoader) -> list[int]:
    return [int(i) for (batch,) in loader for i in batch]


@pytest.mark.quick
def test_a_plain_shuffled_loader_is_sharded_and_resumable() -> None:
    plain = DataLoader(DATA, batch_size=10, shuffle=True, drop_last=False)
    shards = [shard_loader(plain, "train", 2, r, seed=3) for r in (0, 1)]
    assert all(isinstance(s.sampler, ResumableSampler) for s in shards)
    seen = [indices(s) for s in shards]
    # DistributedSampler pads the train shards to equal length (one repeated sample here).
    assert set(seen[0]) | set(seen[1]) == set(range(101)) and len(seen[0]) == len(seen[1]) == 51
    assert shards[0].batch_size == 10 and seen[0] != sorted(seen[0])  # shuffled
    assert indices(shards[0]) == seen[0]  # the order is a function of (seed, epoch) only
    assert resume_at(shards[0], 0, 2 * 10 * 2)  # 2 batches of 10 on each of 2 ranks
    assert indices(shards[0]) == seen[0][20:]  # a mid-epoch resume continues where it was


@pytest.mark.quick
@pytest.mark.parametrize("world", [1, 2, 3])
def test_evaluation_counts_every_sample_once(world: int) -> None:
    plain = DataLoader(DATA, batch_size=8)
    seen = collections.Counter()
    for rank in range(world):
        shard = shard_loader(plain, "val", world, rank, seed=0)
        assert isinstance(shard.sampler, EvalShardSampler)
        seen.update(indices(shard))
    assert seen == collections.Counter(range(101))


@pytest.mark.quick
def test_a_padded_distributed_sampler_for_validation_is_replaced() -> None:
    from torch.utils.data import DistributedSampler

    padded = DataLoader(DATA, batch_size=8, sampler=DistributedSampler(DATA, 2, 0, shuffle=False))
    assert isinstance(shard_loader(padded, "test", 2, 0, 0).sampler, EvalShardSampler)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))


@pytest.mark.quick
def test_what_cannot_be_sharded_stops_a_multi_process_run(caplog, monkeypatch) -> None:
    monkeypatch.setattr(sharding, "_warned", set())  # the warning is once per process
    loader = DataLoader(Stream(), batch_size=2)
    with pytest.raises(UserError, match=r"cannot be sharded across the 2 processes.*ShardedStream"):
        shard_loader(loader, "train", 2, 0, 0)
    assert shard_loader(loader, "train", 1, 0, 0) is loader  # one process: used as it is
    assert "not exact" in caplog.text  # ... with one warning about mid-epoch resume


def reads(tmp_path: Path, split: str) -> list[list[int]]:
    """What each rank read of `split`, in order."""
    lines = [(tmp_path / f"reads-rank{r}.txt").read_text().split("\n") for r in (0, 1)]
    return [[int(x.split()[1]) for x in rank if x.startswith(split)] for rank in lines]


@pytest.mark.distributed
def test_a_user_datamodule_is_sharded_under_ddp(tmp_path: Path, base_args) -> None:
    """A LightningDataModule returning DataLoader(dataset, shuffle=True), as Lightning's docs
    write it, under 2-process torchrun: the ranks split the train set and every validation
    sample is counted once."""
    cmd = [*torchrun(["-m", "project.train"]), *base_args, *user_data(tmp_path, "PlainDataModule"),
           "trainer.max_epochs=1", "trainer.num_sanity_val_steps=0", "test=false",
           f"hydra.run.dir={tmp_path}/run"]  # fmt: skip
    code, out = finish(start(cmd), timeout=180)
    assert code == 0, out[-3000:]
    train, val = reads(tmp_path, "train"), reads(tmp_path, "val")
    assert set(train[0]) | set(train[1]) == set(range(400)) and not set(train[0]) & set(train[1])
    assert collections.Counter(val[0] + val[1]) == collections.Counter(range(101))


# --- a user's own sampler or batch sampler ---------------------------------------------------
def weighted_draws(n: int, seed: int) -> list[int]:
    """What WeightedRandomSampler(balancing_weights(n), n) draws when seeded with `seed`."""
    weights = torch.tensor(balancing_weights(n), dtype=torch.double)
    generator = torch.Generator().manual_seed(seed)
    return torch.multinomial(weights, n, True, generator=generator).tolist()


def rank_shares(draws: list[int], world: int) -> list[list[int]]:
    """Each rank's share of one epoch's draws: r, r+w, ... of the draws padded to a multiple
    of w with the first ones (as DistributedSampler pads)."""
    padded = draws + draws[: -len(draws) % world]
    return [padded[r::world] for r in range(world)]


@pytest.mark.quick
def test_a_weighted_sampler_is_shared_out_draw_by_draw() -> None:
    """Each rank takes its share of the same seeded draws: no draw taken twice, the class
    balance of the weights kept, a new draw every epoch, and a mid-epoch resume continues."""
    n = 101
    plain = DataLoader(DATA, batch_size=8, sampler=WeightedRandomSampler(balancing_weights(n), n))
    shards = [shard_loader(plain, "train", 2, r, seed=5) for r in (0, 1)]
    assert all(isinstance(s.sampler, ShardedDraws) and s.batch_size == 8 for s in shards)
    for epoch in (0, 1):
        for shard in shards:
            set_epoch(shard, epoch)
        assert [indices(s) for s in shards] == rank_shares(weighted_draws(n, 5 + epoch), 2)
    assert len(shards[0]) == len(shards[1]) == 7  # 51 draws each: the same number of steps
    drawn = indices(shards[0]) + indices(shards[1])
    assert abs(sum(i % 10 == 0 for i in drawn) / len(drawn) - 0.5) < 0.15  # balanced classes
    whole = indices(shards[1])
    assert resume_at(shards[1], 1, 3 * 8 * 2) and indices(shards[1]) == whole[24:]
    set_epoch(shards[1], 0)
    assert indices(shards[1]) == rank_shares(weighted_draws(n, 5), 2)[1]  # that epoch only


class Pairs(torch.utils.data.Sampler):
    """A custom batch sampler: batches of 2 neighbours, in a random order of pairs."""

    def __len__(self) -> int:
        return 50

    def __iter__(self):
        return iter([[2 * p, 2 * p + 1] for p in torch.randperm(50).tolist()])


@pytest.mark.quick
def test_a_custom_batch_sampler_is_shared_out_batch_by_batch() -> None:
    plain = DataLoader(DATA, batch_sampler=Pairs())
    shards = [shard_loader(plain, "train", 2, r, seed=1) for r in (0, 1)]
    batches = [[b.tolist() for (b,) in s] for s in shards]
    assert len(batches[0]) == len(batches[1]) == len(shards[0]) == 25
    assert all(b[1] == b[0] + 1 and b[0] % 2 == 0 for b in batches[0] + batches[1])  # kept whole
    assert sorted(i for b in batches[0] + batches[1] for i in b) == list(range(100))
    assert [[b.tolist() for (b,) in s] for s in shards] == batches  # seeded, not global RNG
    assert resume_at(shards[0], 0, 20 * 2) and [b.tolist() for (b,) in shards[0]] == batches[0][20:]
    val = [[b.tolist() for (b,) in shard_loader(plain, "val", 3, r, 1)] for r in range(3)]
    assert sorted(i for v in val for b in v for i in b) == list(range(100))  # once, no padding


class Unrepeatable(torch.utils.data.Sampler):
    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)  # its own state: every pass draws anew

    def __len__(self) -> int:
        return 101

    def __iter__(self):
        return iter(self.rng.permutation(101).tolist())


class Endless(torch.utils.data.Sampler):
    def __iter__(self):
        return iter(range(10**9))


class Lying(torch.utils.data.Sampler):
    def __len__(self) -> int:
        return 50

    def __iter__(self):
        return iter(range(40))


@pytest.mark.quick
@pytest.mark.parametrize(
    "sampler, needle",
    [
        (Unrepeatable(), "draws differently on two passes with the same seed"),
        (Endless(), "has no length, so the ranks cannot agree how many steps"),
        (Lying(), "says it has 50 draws but made 40"),
    ],
)
def test_a_sampler_the_ranks_cannot_share_is_one_line(sampler, needle) -> None:
    with pytest.raises(UserError, match=needle) as err:
        shard_loader(DataLoader(DATA, sampler=sampler), "train", 2, 0, 0)
    assert "\n" not in str(err.value)


@pytest.mark.distributed
@pytest.mark.parametrize("launch", ["lightning", "torchrun"])
def test_a_weighted_sampler_trains_under_ddp(tmp_path: Path, base_args, launch: str) -> None:
    """A user's WeightedRandomSampler under Lightning's launcher and under torchrun: each rank
    reads its share of the same seeded draws (none taken twice), every epoch anew, and the
    draws keep the weights' class balance."""
    args = [*base_args, *user_data(tmp_path, "WeightedDataModule"), "seed=7",
            "trainer.max_epochs=2", "trainer.num_sanity_val_steps=0", "test=false",
            f"hydra.run.dir={tmp_path}/run"]  # fmt: skip
    if launch == "lightning":
        cmd = [sys.executable, "-m", "project.train", *args, "trainer.devices=2"]
    else:
        cmd = [*torchrun(["-m", "project.train"]), *args]
    code, out = finish(start(cmd), timeout=180)
    assert code == 0, out[-3000:]
    epochs = [rank_shares(weighted_draws(400, 7 + epoch), 2) for epoch in (0, 1)]
    assert reads(tmp_path, "train") == [epochs[0][r] + epochs[1][r] for r in (0, 1)]
    drawn = [i for rank in reads(tmp_path, "train") for i in rank]
    assert abs(sum(i % 10 == 0 for i in drawn) / len(drawn) - 0.5) < 0.06  # 1 in 10 without


@pytest.mark.distributed
def test_a_weighted_sampler_resumes_exactly_after_a_preemption(
    tmp_path: Path, base_args, log_dir: Path
) -> None:
    """Stopped mid-epoch under the template's torchrun and rerun, the run ends with the weights
    of one that was never stopped."""
    args = [*base_args, *user_data(tmp_path, "WeightedDataModule"), "trainer.max_epochs=3",
            "test=false", "callbacks.early_stopping=null"]  # fmt: skip
    cut = [*args, "fault_injection.at_step=15", "fault_injection.mode=sigterm"]
    jobs = [start(launcher(["-m", "project.train", *a]), RUN_ID=run) for a, run in
            ((args, "whole"), (cut, "cut"))]  # fmt: skip
    (whole, _), (stopped, out) = (finish(job, 240) for job in jobs)
    assert whole == 0 and stopped == EXIT_PREEMPTED, out[-3000:]
    code, out = finish(start(launcher(["-m", "project.train", *args]), RUN_ID="cut"), 240)
    assert code == 0 and "skipping" in out, out[-3000:]
    assert_same_weights(log_dir / "train/runs/whole", log_dir / "train/runs/cut")


@pytest.mark.distributed
def test_data_of_another_length_on_one_rank_is_one_line_on_every_rank(
    tmp_path: Path, base_args
) -> None:
    data = user_data(tmp_path, "RankDependentDataModule")
    cmd = [*launcher(["-m", "project.train"]), *base_args, *data, f"hydra.run.dir={tmp_path}/run"]
    code, out = finish(start(cmd), timeout=120)
    assert code == EXIT_BAD_INPUT, out[-3000:]
    errors = [ln for ln in out.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 2 and "Traceback" not in out, out[-3000:]
    assert all("the train data has" in e and "between 400 and 420" in e for e in errors), errors
    assert not (tmp_path / "run" / "checkpoints").exists()


# --- several train loaders: a dict, a CombinedLoader of any mode ------------------------------
def named_reads(record_dir: Path, tag: str, name: str) -> list[list[int]]:
    """What each rank of one attempt read of the loader recorded as `name`, in order."""
    files = sorted(record_dir.glob(f"reads-{tag}-rank*.txt"))
    return [[int(i) for n, i in (line.split() for line in f.read_text().splitlines())
             if n == name] for f in files]  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize(("mode", "cuts"), [("dict", (8, 3)), ("max_size", (8,)),
                                            ("min_size", (4,))])  # fmt: skip
def test_several_train_loaders_are_sharded_and_resume_each_by_its_own_count(
    tmp_path: Path, base_args, log_dir: Path, mode: str, cuts: tuple[int, ...]
) -> None:
    """Train loaders {"a": 200 rows, "b": 50 rows}, batch 10, 2 processes, as a dict
    (Lightning cycles b: 10 steps an epoch, b read 3 1/3 times) or a CombinedLoader; validation
    a CombinedLoader. The ranks read disjoint rows of every loader; stopped at each cut and
    rerun, the run ends with the weights of the run never stopped: every loader placed by its
    own count, the epoch as long as ever, the run not ended early."""
    args = [*base_args, *user_data(tmp_path, "TwoLoadersDataModule", mode=mode),
            "trainer.max_epochs=2", "test=false", "callbacks.early_stopping=null",
            "callbacks.fault_tolerance.check_every_n_steps=1"]  # fmt: skip
    steps = 3 if mode == "min_size" else 10  # an epoch: the shortest loader's, or the longest's
    stop = ["fault_injection.mode=sigterm"]
    runs = {"whole": args} | {f"cut{c}": [*args, *stop, f"fault_injection.at_step={c}"]
                              for c in cuts}  # fmt: skip
    jobs = {run: start(launcher(["-m", "project.train", *a]), RUN_ID=run, RECORD_TAG=run)
            for run, a in runs.items()}  # fmt: skip
    ended = {run: finish(job, 240) for run, job in jobs.items()}
    assert ended["whole"][0] == 0, ended["whole"][1][-3000:]
    for c in cuts:
        code, out = ended[f"cut{c}"]
        assert code == EXIT_PREEMPTED, out[-3000:]
        ckpt = torch.load(log_dir / f"train/runs/cut{c}/checkpoints/last.ckpt", weights_only=True)
        assert ckpt["data_position"]["batches"] == c % steps  # stopped where the test says
        job = start(launcher(["-m", "project.train", *args]), RUN_ID=f"cut{c}",
                    RECORD_TAG=f"cut{c}-again")  # fmt: skip
        code, out = finish(job, 240)
        assert code == 0 and "skipping" in out, out[-3000:]
        assert_same_weights(log_dir / "train/runs/whole", log_dir / f"train/runs/cut{c}")
    for name, first in (("a", 20), ("b", 20), ("val_b", None)):
        ranks = [rows[:first] for rows in named_reads(tmp_path, "whole", name)]
        assert not set(ranks[0]) & set(ranks[1]), (name, ranks)
    val_b = named_reads(tmp_path, "whole", "val_b")
    assert set(val_b[0]) | set(val_b[1]) == set(range(17))


# --- a rebuilt loader keeps every option the user set ----------------------------------------
def seed_worker_twice(worker_id: int) -> None:  # a user's worker_init_fn (picklable)
    pass


class MyLoader(DataLoader):
    """A user's DataLoader subclass without an __init__ of its own."""


@pytest.mark.quick
def test_a_rebuilt_loader_keeps_every_option_the_user_set() -> None:
    """Every DataLoader option survives the rebuild around the sharded sampler (in_order,
    pin_memory_device, prefetch_factor, persistent_workers, the worker start method, ...),
    and so does the class of a subclass without an __init__ of its own. The user's generator
    is never drawn from (it may be shared; its state is in no checkpoint): its seed replaces
    the run's as the base of the workers' seeds, so it still decides what they draw."""
    user = MyLoader(DATA, batch_size=7, shuffle=True, num_workers=2, collate_fn=list,
                    timeout=9, worker_init_fn=seed_worker_twice, multiprocessing_context="spawn",
                    generator=torch.Generator().manual_seed(123), prefetch_factor=5,
                    persistent_workers=True, pin_memory_device="cpu", in_order=False)  # fmt: skip
    user_state = user.generator.get_state()
    rebuilt = shard_loader(user, "train", 2, 1, seed=0)
    sampling = ("self", "dataset", "batch_size", "shuffle", "sampler", "batch_sampler",
                "drop_last", "generator")  # fmt: skip
    kept = {k: getattr(user, k) for k in inspect.signature(DataLoader.__init__).parameters
            if k not in sampling}  # fmt: skip
    assert {k: getattr(rebuilt, k) for k in kept} == kept
    assert type(rebuilt) is MyLoader and isinstance(rebuilt.sampler, ResumableSampler)
    assert rebuilt.batch_size == 7 and rebuilt.sampler.shuffle
    assert rebuilt.generator is not user.generator
    assert torch.equal(user.generator.get_state(), user_state)  # never drawn from
    set_epoch(rebuilt, 4)
    assert rebuilt.generator.initial_seed() == sharding.worker_seed(123, 4)
    other = DataLoader(DATA, batch_size=7, generator=torch.Generator().manual_seed(124))
    set_epoch(other := shard_loader(other, "train", 2, 1, seed=0), 4)
    assert other.generator.initial_seed() == sharding.worker_seed(124, 4)


@pytest.mark.quick
def test_a_combined_loader_is_sharded_in_its_mode() -> None:
    """A CombinedLoader (Lightning's idiom for several loaders) has every loader sharded and
    keeps its mode: the ranks read disjoint rows of each."""
    from lightning.pytorch.utilities import CombinedLoader

    def ranks(stage: str, mode: str) -> list[list[int]]:
        read = []
        for rank in (0, 1):
            even, short = TensorDataset(torch.arange(100)), TensorDataset(torch.arange(200, 250))
            loaders = {"a": DataLoader(even, batch_size=10, shuffle=True),  # even: no padding
                       "b": DataLoader(short, batch_size=10)}  # fmt: skip
            combined = sharding.shard_loaders(CombinedLoader(loaders, mode), stage, 2, rank, 0)
            assert isinstance(combined, CombinedLoader) and combined._mode == mode
            set_epoch(combined, 0)
            read.append([int(i) for step in combined for part in step[0].values()
                         if part is not None for i in part[0]])  # fmt: skip
        return read

    for stage, mode in (("train", "min_size"), ("train", "max_size"), ("val", "max_size")):
        read = ranks(stage, mode)
        assert read[0] and read[1] and not set(read[0]) & set(read[1]), (stage, mode)
    val = ranks("val", "max_size")
    assert sorted(val[0] + val[1]) == [*range(100), *range(200, 250)]


# --- a resume at an epoch boundary, with DataLoader workers ----------------------------------
@pytest.mark.distributed
def test_a_resume_at_an_epoch_boundary_draws_the_next_epochs_order_with_workers(
    tmp_path: Path, base_args, log_dir: Path
) -> None:
    """Lightning >= 2.5.3 makes the first iterator after a resume before it sets the samplers'
    epoch, so a loader with workers takes the epoch-0 shuffle again (Lightning issue 21938).
    The template's loaders, 2 workers per rank, stopped at the end of epoch 0 and rerun: each
    rank reads epoch 1's rows, and the run ends with the weights of the run never stopped."""
    args = [*base_args, *recorded_data(tmp_path, 160), "data.batch_size=20",
            "data.num_workers=2", "trainer.max_epochs=2", "test=false",
            "callbacks.early_stopping=null", "trainer.num_sanity_val_steps=0",
            "callbacks.fault_tolerance.check_every_n_steps=1"]  # 4 steps an epoch  # fmt: skip
    cut = [*args, "fault_injection.at_step=4", "fault_injection.mode=sigterm"]
    jobs = [start(launcher(["-m", "project.train", *a]), RUN_ID=run, RECORD_TAG=run)
            for a, run in ((args, "whole"), (cut, "cut"))]  # fmt: skip
    (whole, out), (stopped, cut_out) = (finish(job, 240) for job in jobs)
    assert whole == 0 and stopped == EXIT_PREEMPTED, (out + cut_out)[-3000:]
    ckpt = torch.load(log_dir / "train/runs/cut/checkpoints/last.ckpt", weights_only=True)
    assert (ckpt["data_position"]["epoch"], ckpt["data_position"]["batches"]) == (1, 0)
    code, out = finish(start(launcher(["-m", "project.train", *args]), RUN_ID="cut",
                             RECORD_TAG="again"), 240)  # fmt: skip
    assert code == 0, out[-3000:]
    epochs = [(set(rows[:80]), set(rows[80:])) for rows in recorded_reads(tmp_path, "whole")]
    again = [set(rows) for rows in recorded_reads(tmp_path, "again")]
    assert all(e0 != e1 for e0, e1 in epochs)  # the orders differ: the check below can fail
    assert again == [e1 for _, e1 in epochs]
    assert_same_weights(log_dir / "train/runs/whole", log_dir / "train/runs/cut")


@pytest.mark.quick
def test_unequal_eval_batches_are_refused_for_fsdp_with_sizes_that_work() -> None:
    # 269 samples on 2 ranks are 135 and 134: in batches of 67 that is 3 batches and 2, and the
    # rank with 3 would wait for good in an all-gather (every FSDP forward is one).
    data = TensorDataset(torch.arange(269.0))
    loaders = [shard_loader(DataLoader(data, batch_size=67), "val", 2, r, 0) for r in (0, 1)]
    assert sorted(len(loader) for loader in loaders) == [2, 3]
    with pytest.raises(UserError, match="gives 3 batches on some ranks and 2 on others") as e:
        sharding.same_eval_batches({"a": loaders[0]}, "val")
    sizes = [int(b) for b in e.value.args[0].split("batch size of ")[1].split(" (")[0].split(", ")]
    assert sizes and 67 not in sizes
    for size in sizes:  # every size offered gives both ranks as many batches
        ranks = [shard_loader(DataLoader(data, batch_size=size), "val", 2, r, 0) for r in (0, 1)]
        assert len(ranks[0]) == len(ranks[1])
        sharding.same_eval_batches(ranks[0], "val")
    sharding.same_eval_batches(shard_loader(DataLoader(data, batch_size=64), "val", 2, 0, 0), "val")


# --- an evaluation split with fewer batches than processes ------------------------------------
class Rows(ShardedStream):
    """A stream of `lengths` elements per shard (data=chars_stream's shape)."""

    def read(self, shard: int) -> list[int]:
        return list(range(self.lengths[shard]))


def refusal(dataset: object, source: object = None, rank: int = 1, **loading: object) -> str:
    """The line refusing `dataset` as a val split on 2 processes ("" where it is taken)."""
    loader = shard_loader(DataLoader(dataset, **loading), "val", 2, rank, seed=0)
    try:
        sharding.same_eval_batches(loader, "val", fsdp=False, source=source)
    except UserError as err:
        return str(err)
    return ""


@pytest.mark.quick
def test_an_eval_split_that_leaves_a_rank_without_a_batch_is_one_line_with_the_fix(
    data_dir: Path,
) -> None:
    """A rank without a val/test batch skips the evaluation its peers run: the raw trainer's
    ranks went out of step (the others waiting in the metrics' sync until strategy.timeout),
    Lightning stopped that rank alone. Refused alike on every rank (a function of the world
    size, no collective), naming the split, its batches, the processes and the fix."""
    one = refusal(TensorDataset(torch.arange(1.0)), batch_size=64)
    assert one == refusal(TensorDataset(torch.arange(1.0)), rank=0, batch_size=64)
    assert one.startswith("the val split has 1 batch(es) (1 element(s) in batches of 64) for 2 "
                          "processes, so rank 1 would evaluate none"), one  # fmt: skip
    assert one.endswith(": use a val split of 2 elements, or at most 1 process(es) (fewer "
                        "trainer.devices)"), one  # fmt: skip
    dropped = refusal(TensorDataset(torch.arange(127.0)), batch_size=64, drop_last=True)
    assert "use a val split of 128 elements, or at most 1 process(es)" in dropped, dropped
    stream = refusal(Rows([1]), batch_size=32)  # data=chars_stream with one val window
    assert stream.startswith("the val split has 1 batch(es) (1 element(s) in batches of 32)")
    # Taken: a batch on every rank, or on none (an empty split is evaluated nowhere).
    assert refusal(Rows([1, 1]), batch_size=32) == ""
    for n, drop in [(2, False), (0, False), (100, True)]:
        assert refusal(TensorDataset(torch.arange(float(n))), batch_size=64, drop_last=drop) == ""
    # The shipped digits: the fraction named is the least (in two digits) that works.
    from project.data.digits import Digits

    tiny = Digits(str(data_dir), val_fraction=0.0006)
    line = refusal(tiny.dataset("val"), tiny, batch_size=64)
    assert "use data.dataset.val_fraction=0.00084 or more, or at most 1 process(es)" in line
    assert refusal(Digits(str(data_dir), val_fraction=0.00084).dataset("val"), batch_size=64) == ""
    assert len(Digits(str(data_dir), val_fraction=0.00083).dataset("val")) == 1


@pytest.mark.quick
def test_the_text_sources_name_the_least_fraction_that_gives_a_split_its_windows(
    tmp_path: Path,
) -> None:
    """data=chars: the fraction setting; data=chars_stream: the prepare command's (the
    fraction is cut when the shards are written)."""
    from project.data.prepare import prepare
    from project.data.text import CharCorpus
    from project.data.text_stream import CharStream

    hint = CharCorpus().larger("val", 2) or ""
    fraction = float(re.fullmatch(r"data.dataset.val_fraction=([0-9.]+) or more", hint)[1])
    assert len(CharCorpus(val_fraction=fraction).dataset("val")) == 2
    assert len(CharCorpus(val_fraction=fraction - 1e-5).dataset("val")) == 1
    assert prepare(None, tmp_path / "one", 64, 1024, 0.0002, 0.05)["val"] == 1
    hint = CharStream(str(tmp_path / "one")).larger("val", 2) or ""
    fraction = float(re.search(r"prepare --val-fraction ([0-9.]+) for the same corpus", hint)[1])
    assert prepare(None, tmp_path / "two", 64, 1024, fraction, 0.05)["val"] == 2
    assert prepare(None, tmp_path / "less", 64, 1024, fraction - 1e-5, 0.05)["val"] == 1
    # more than a split beside the training one can hold: no fraction is offered
    assert CharCorpus().larger("val", 10**9) is None


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("module", "split"),
    [
        ("project.raw_train", "val"),  # feature:raw
        ("project.train", "test"),
    ],
)
def test_an_eval_split_with_fewer_batches_than_processes_is_refused_before_training(
    tmp_path: Path, base_args, module: str, split: str
) -> None:
    """One sample in a split on 2 processes. It was: the raw trainer's ranks out of step
    until strategy.timeout, then a hang report; Lightning's rank 1 traceback ("zero length"),
    for the test split after the whole training. Now exit 2 with one line, before training."""
    args = [*base_args, f"data.dataset.{split}_fraction=0.0006", "trainer.max_epochs=1",
            "trainer.limit_train_batches=2", "trainer.num_sanity_val_steps=0",
            f"hydra.run.dir={tmp_path}/run"]  # fmt: skip
    code, out = finish(start([*launcher(["-m", module]), *args]), timeout=90)
    assert code == EXIT_BAD_INPUT, out[-3000:]
    line = one_error_line(out)
    assert f"the {split} split has 1 batch(es) (1 element(s) in batches of 64) for 2 " in line
    assert f"use data.dataset.{split}_fraction=0.00084 or more, or at most 1 process" in line
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing was trained
