"""What the counts of batches and drop_last mean when a run continues on another world size
(project.engine.data.elastic, sharding.drop_incomplete_steps): a count
`trainer.limit_train_batches`, `val_check_interval`, `limit_val_batches` or
`limit_test_batches` keeps the samples it counted, or stops the run with one line naming a
count that works; drop_last drops an epoch's incomplete optimizer step, so an epoch has the
same steps on any world size. The arithmetic in milliseconds, then real runs stopped on 2
processes and continued on 1, and the other way round."""

from __future__ import annotations

import collections
import math
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

from project.engine.data import elastic, sharding
from project.engine.data.sharding import drop_incomplete_steps, set_epoch, shard_loader
from project.engine.distributed.exits import EXIT_PREEMPTED
from project.engine.errors import UserError
from tests.helpers import (
    QUIET,
    final_weights,
    finish,
    launcher,
    recorded_data,
    recorded_reads,
    start,
)
from tests.helpers import user_data as user_data_args

DATA = TensorDataset(torch.arange(480))
KEYS = ("limit_train_batches", "val_check_interval", "limit_val_batches", "limit_test_batches")
GIVEN = dict(zip(KEYS, (10, 5, 2, 3), strict=True))


# --- the counts: the arithmetic -------------------------------------------------------------
def config(batch: int | None = 20, accumulate: int = 1, **counts: object) -> DictConfig:
    """A run's config with the template's datamodule (`batch`: data.batch_size) or one of its
    own (None), and the trainer's counts."""
    trainer = {"accumulate_grad_batches": accumulate, "check_val_every_n_epoch": 1,
               **dict.fromkeys(KEYS), **counts}  # fmt: skip
    return OmegaConf.create({"data": {} if batch is None else {"batch_size": batch},
                             "trainer": trainer})  # fmt: skip


def written(cfg: DictConfig, world: int, command: dict, units: int = 20) -> elastic.Position:
    """What a checkpoint of `cfg` (its train loader of `units` a batch) on `world` processes
    records, 4 batches into epoch 0, the command having given `command`."""
    loader = shard_loader(DataLoader(DATA, batch_size=units), "train", world, 0, 0)
    accumulate = cfg.trainer.accumulate_grad_batches
    return elastic.Position.of(elastic.record(loader, 0, 4, world, accumulate, cfg, command))


def counts(cfg: DictConfig) -> tuple:
    return tuple(cfg.trainer[key] for key in KEYS)


def resumed(command: DictConfig, saved: elastic.Position, world: int) -> DictConfig:
    """`command` (a config as the command gives it) fitted to continue `saved` on `world`."""
    elastic.fit_global_batch(command, saved, world, elastic.asked(command))
    return command


@pytest.mark.quick
def test_every_count_keeps_its_samples_from_2_to_1_process_and_back() -> None:
    """The template's datamodule: 20 a process x 2 continued on 1 process is 20 x 2
    accumulated, so every count of batches doubles; written there and continued on 2 again,
    each is what the command gave."""
    command = elastic.asked(config(**GIVEN))
    on_one = resumed(config(**GIVEN), written(config(**GIVEN), 2, command), world=1)
    assert (on_one.data.batch_size, on_one.trainer.accumulate_grad_batches) == (20, 2)
    assert counts(on_one) == (20, 10, 4, 6)
    on_two = resumed(config(**GIVEN), written(on_one, 1, command), world=2)
    assert (on_two.data.batch_size, on_two.trainer.accumulate_grad_batches) == (20, 1)
    assert counts(on_two) == (10, 5, 2, 3)
    # Fractions (a share of each rank's batches) and null stay as they are.
    shares = {"limit_train_batches": 0.5, "limit_val_batches": 0.25}
    on_one = resumed(config(**shares), written(config(**shares), 2, {}), world=1)
    assert counts(on_one) == (0.5, None, 0.25, None)


@pytest.mark.quick
def test_a_datamodule_of_its_own_gets_its_counts_when_its_loader_is_built() -> None:
    """Its batch is its own (20 a process, or a global 40 it divides by the world): the counts
    are fitted to the loader as built, and written where checkpoints record them."""
    command = elastic.asked(config(None, **GIVEN))
    saved = written(config(None, **GIVEN), 2, command)
    cfg = resumed(config(None, **GIVEN), saved, world=1)
    assert counts(cfg) == (10, 5, 2, 3)  # nothing to fit before the loader is built
    fixed = shard_loader(DataLoader(DATA, batch_size=20), "train", 1, 0, 0)
    fitted = elastic.fit_loader_counts(cfg, saved, fixed, 1, command)
    assert fitted == dict(zip(KEYS, (20, 10, 4, 6), strict=True)) and counts(cfg) == (20, 10, 4, 6)
    divided = shard_loader(DataLoader(DATA, batch_size=40), "train", 1, 0, 0)  # 40 / 1
    assert elastic.fit_loader_counts(config(None, **GIVEN), saved, divided, 1, command) == {}


@pytest.mark.quick
def test_a_count_with_no_whole_equivalent_is_one_line_naming_one_that_works() -> None:
    """3 batches of 20 on 1 process are 60 samples; 2 processes of 20 take 40 a batch: one
    line naming the nearest count, which the command may then give (it is followed)."""
    given = {"limit_val_batches": 3}
    saved = written(config(accumulate=2, **given), 1, elastic.asked(config(accumulate=2, **given)))
    with pytest.raises(UserError) as err:
        resumed(config(accumulate=2, **given), saved, world=2)
    line = str(err.value)
    assert "\n" not in line and "trainer.limit_val_batches=3 counted 60 samples" in line, line
    assert "set trainer.limit_val_batches=1 (40 samples" in line, line
    assert "resume on 1 process(es)" in line, line
    followed = resumed(config(accumulate=2, limit_val_batches=1), saved, world=2)
    assert followed.trainer.limit_val_batches == 1


@pytest.mark.quick
def test_the_commands_own_count_is_followed_and_an_interval_across_epochs_refused() -> None:
    command = elastic.asked(config(**GIVEN))
    saved = written(config(**GIVEN), 2, command)
    changed = resumed(config(**{**GIVEN, "val_check_interval": 7}), saved, world=1)
    assert counts(changed) == (20, 7, 4, 6)
    across = {**GIVEN, "check_val_every_n_epoch": None}
    saved = written(config(**across), 2, elastic.asked(config(**across)))
    with pytest.raises(UserError, match=r"check_val_every_n_epoch=null counts batches"):
        resumed(config(**across), saved, world=1)
    assert counts(resumed(config(**across), saved, world=2)) == (10, 5, 2, 3)  # same world


# --- drop_last: whole optimizer steps on any world size ---------------------------------------
ROWS = TensorDataset(torch.arange(500))


def dropping(world: int, rank: int, batch: int, shape: str) -> DataLoader:
    """A train loader of the 500 ROWS with drop_last, as a user writes it, sharded."""
    if shape == "weighted":
        sampler = WeightedRandomSampler([1.0 + i % 3 for i in range(500)], num_samples=500)
        loader = DataLoader(ROWS, batch_size=batch, sampler=sampler, drop_last=True)
    else:
        loader = DataLoader(ROWS, batch_size=batch, shuffle=True, drop_last=True)
    return shard_loader(loader, "train", world, rank, seed=3)


def epoch_steps(world: int, accumulate: int, batch: int, shape: str,
                resume: elastic.Position | None = None) -> list[list[int]]:  # fmt: skip
    """The samples of each optimizer step of epoch 0, all ranks together."""
    ranks = []
    for rank in range(world):
        loader = dropping(world, rank, batch, shape)
        set_epoch(loader, 0)
        drop_incomplete_steps(loader, accumulate, world)
        elastic.resume(loader, resume, 0, world)
        ranks.append([b[0].tolist() for b in loader])
        assert len(loader) * batch == 480 // world  # what Lightning counts the epoch by
    steps = math.ceil(len(ranks[0]) / accumulate)
    return [sorted(i for r in ranks for b in r[s * accumulate : (s + 1) * accumulate] for i in b)
            for s in range(steps)]  # fmt: skip


@pytest.mark.quick
@pytest.mark.parametrize("shape", ["plain", "weighted"])
def test_drop_last_drops_the_incomplete_global_batch_on_any_world_size(shape: str) -> None:
    """500 rows, a global batch of 40: 12 whole steps of the same samples on 2 processes of 20,
    1 of 20 x 2 accumulated and 4 of 10 (each rank's micro-batch drop alone left 13 steps on
    1 process: a last one of 20), also when 2 processes stop after 4 steps and 1 continues."""
    whole = epoch_steps(2, 1, 20, shape)
    assert len(whole) == 12 and all(len(step) == 40 for step in whole)
    assert epoch_steps(1, 2, 20, shape) == whole
    assert epoch_steps(4, 1, 10, shape) == whole
    first = dropping(2, 0, 20, shape)
    set_epoch(first, 0)
    saved = elastic.Position.of(elastic.record(first, 0, 4, 2, 1, config(20), {}))
    assert epoch_steps(1, 2, 20, shape, resume=saved) == whole[4:]


@pytest.mark.quick
def test_drop_last_says_what_accumulation_drops_and_refuses_an_epoch_without_a_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With accumulation the incomplete last window is dropped too: one warning with the
    samples an epoch loses; a step larger than the epoch would train nothing: one line."""
    loader = dropping(2, 0, 20, "plain")  # 500 rows, 2 processes of 20: steps of 40 x a
    sharding.log.addHandler(caplog.handler)  # the project's loggers need not propagate
    try:
        sharding._warned.discard("drop_last")
        drop_incomplete_steps(loader, 1, 2)  # what the DataLoader dropped already: no line
        assert "drop_last" not in caplog.text
        drop_incomplete_steps(loader, 5, 2)  # steps of 200: 400 of 500 kept (480 by the loader)
    finally:
        sharding.log.removeHandler(caplog.handler)
    assert "100 of 500 samples an epoch are not trained on (20 without accumulation)" in (
        caplog.text)  # fmt: skip
    with pytest.raises(UserError, match=r"drop_last: the epoch has 500 samples, less than one"):
        drop_incomplete_steps(loader, 16, 2)  # one step is 640 samples


# --- real processes: stopped on one world size, continued on another ---------------------------
COUNTED = ["trainer.limit_train_batches=10", "trainer.limit_val_batches=2",
           "trainer.limit_test_batches=2", "test=true"]  # fmt: skip
CASES = {
    # 2 -> 1: every count of a datamodule of its own (20 a process) keeps its samples; 10
    # steps an epoch
    "2-to-1": ("project.train", 2, 1, 20, {"n_train": 480},
               [*COUNTED, "+trainer.val_check_interval=5"]),
    # 1 -> 2: an interval of 20 batches is 10 on 2 processes (Lightning's ValueError before);
    # drop_last keeps 12 steps an epoch of 500 rows (13 on 1 process before)
    "1-to-2": ("project.train", 1, 2, 24, {"n_train": 500, "drop_last": True}, [
               "trainer.accumulate_grad_batches=2", "+trainer.val_check_interval=20",
               "trainer.limit_val_batches=2", "test=false"]),
    # the raw trainer, the template's datamodule (data.batch_size=20): 2 -> 1
    "raw-2-to-1": ("project.raw_train", 2, 1, 20, None, [*COUNTED, "data.batch_size=20"]),
}  # fmt: skip


def job(module: str, nproc: int, args: list[str], run: str, tag: str) -> tuple[int, str]:
    target = ["-m", module, *args]
    cmd = launcher(target, nproc) if nproc > 1 else [sys.executable, *target]
    return finish(start(cmd, RUN_ID=run, RECORD_TAG=tag), 240)


def reads(tmp_path: Path, tags: list[str], split: str) -> collections.Counter:
    return collections.Counter(i for tag in tags for rank in recorded_reads(tmp_path, tag, split)
                               for i in rank)  # fmt: skip


def global_step(run_dir: Path) -> int:
    """The optimizer steps a run's last checkpoint (either trainer's) counts."""
    ckpt = next(p for p in (run_dir / "checkpoints").glob("last.*") if p.suffix in (".pt", ".ckpt"))
    return int(torch.load(ckpt, weights_only=True)["global_step"])


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_a_run_continued_on_another_world_size_counts_the_same_samples(
    tmp_path: Path, case: str
) -> None:
    """Stopped after step 4 on w0 processes, continued on w1: the same optimizer steps as the
    run that never stopped, validation at the same samples with the same samples evaluated,
    the same test samples, the final weights within float rounding."""
    module, w0, w1, optimizer_steps, data, counted = CASES[case]
    log_dir = tmp_path / "logs"
    data_args = ([*recorded_data(tmp_path, 480), *QUIET] if data is None
                 else user_data_args(tmp_path, "OwnBatchDataModule", **data))  # fmt: skip
    args = [f"paths.log_dir={log_dir}", *data_args, "trainer.max_epochs=2",
            "callbacks.early_stopping=null", "trainer.num_sanity_val_steps=0",
            "callbacks.fault_tolerance.check_every_n_steps=1", *counted]  # fmt: skip
    code, out = job(module, w0, args, "whole", "whole")
    assert code == 0, out[-3000:]
    cut = [*args, "fault_injection.at_step=4", "fault_injection.mode=sigterm"]
    code, out = job(module, w0, cut, "cut", "first")
    assert code == EXIT_PREEMPTED, out[-3000:]
    code, out = job(module, w1, args, "cut", "second")
    assert code == 0 and "Resuming epoch 0" in out, out[-3000:]
    runs = log_dir / "train" / "runs"
    steps = [global_step(runs / run) for run in ("whole", "cut")]
    assert steps == [optimizer_steps, optimizer_steps], steps
    for split in ("val", "test"):  # validations at the same samples, each of the same rows
        assert reads(tmp_path, ["whole"], split) == reads(tmp_path, ["first", "second"], split)
    a, b = final_weights(runs / "cut"), final_weights(runs / "whole")
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=1e-5)
    assert "the counts of batches keep their samples" in out, out[-3000:]


@pytest.mark.distributed
def test_a_count_that_cannot_be_kept_stops_the_resumed_run_in_one_line(tmp_path: Path) -> None:
    """3 validation batches of 20 on 1 process (60 samples) continued on 2 processes of 20:
    one line naming the count that works, exit 2, the checkpoint untouched."""
    log_dir = tmp_path / "logs"
    args = [f"paths.log_dir={log_dir}", *user_data_args(tmp_path, "OwnBatchDataModule"),
            "trainer.max_epochs=1", "trainer.num_sanity_val_steps=0", "test=false",
            "trainer.accumulate_grad_batches=2", "trainer.limit_val_batches=3"]  # fmt: skip
    stop = ["fault_injection.at_step=2", "fault_injection.mode=sigterm"]
    code, out = job("project.train", 1, [*args, *stop], "odd", "first")
    assert code == EXIT_PREEMPTED, out[-3000:]
    last = log_dir / "train" / "runs" / "odd" / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    code, out = job("project.train", 2, args, "odd", "second")
    assert code == 2, out[-3000:]
    errors = [ln for ln in out.splitlines() if ln.startswith("error: ")]  # once, not a rank
    assert len(errors) == 1 and "Traceback" not in out, out[-3000:]
    assert all("set trainer.limit_val_batches=1 (40 samples" in e for e in errors), errors
    assert last.read_bytes() == before
