"""The LightningDataModule around any DataSource (project.data), and the sharding guard every
datamodule gets, the template's or a user's own.

`prepare_data` runs `source.prepare()` in one process per node; `setup` builds the split
datasets on every rank. The loaders are plain `DataLoader(dataset, shuffle=...)`: sharding
and the resumable order come from `shard_datamodule` (project.engine.data.sharding), the same
code the raw trainer runs.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from project.data.source import SPLITS
from project.engine.config.compose import to_plain
from project.engine.data import elastic, sharding
from project.engine.data.loaders import build_source, plain_loader
from project.engine.lightning.combined import combine_train

log = logging.getLogger(__name__)


class DataModule(pl.LightningDataModule):
    """Batches of a DataSource. `dataset` is its config (a `_target_` dict), kept in the
    checkpoint's hyperparameters so eval.py can rebuild the same split."""

    def __init__(
        self,
        dataset: dict[str, Any],
        batch_size: int = 64,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        shuffle: bool = True,
        lanes: int | None = None,
        shuffle_block: int | None = None,
    ) -> None:
        super().__init__()
        dataset = to_plain(dataset)
        self.save_hyperparameters()
        self.source = build_source(dataset)  # validates paths and fractions before any fit
        self.sets: dict[str, Any] = {}

    def prepare_data(self) -> None:
        self.source.prepare()

    def setup(self, stage: str | None = None) -> None:
        self.sets = {split: self.source.dataset(split) for split in SPLITS}

    def teardown(self, stage: str | None = None) -> None:
        self.source.teardown()  # e.g. a remote stream's shard cache

    def _loader(self, stage: str) -> DataLoader:
        h = self.hparams
        return plain_loader(
            self.sets[stage], stage, h.batch_size, h.num_workers, h.pin_memory,
            h.persistent_workers, h.shuffle, h.lanes, h.shuffle_block,
        )  # fmt: skip

    def transfer_batch_to_device(
        self, batch: Any, device: torch.device, dataloader_idx: int
    ) -> Any:
        # The loaders yield CPU tensors: on a CPU run there is nothing to move, and Lightning's
        # default walks the whole batch every step to find that out.
        if device.type == "cpu":
            return batch
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")


def shard_datamodule(
    datamodule: pl.LightningDataModule,
    seed: int,
    position: elastic.Position | None = None,
    keep_global_batch: bool = True,
    cfg: DictConfig | None = None,
    command: dict[str, Any] | None = None,
) -> None:
    """Make every loader `datamodule` returns sharded over the trainer's ranks (in place), the
    train loaders started where a resumed run's `position` says its epoch stood; with the
    run's `cfg` and `command` (elastic.asked), its counts of batches fitted to them.

    Wraps the `*_dataloader` methods it defines; the rank and world size are read from the
    trainer when Lightning asks for the loaders.
    """
    source = getattr(datamodule, "source", None)  # the template's: it names a larger split
    for stage in SPLITS:
        name = f"{stage}_dataloader"
        if not is_overridden(name, datamodule):
            continue
        original = getattr(datamodule, name)

        def sharded(original: Any = original, stage: str = stage) -> Any:
            trainer = datamodule.trainer
            world, rank = (trainer.world_size, trainer.global_rank) if trainer else (1, 0)
            loaders = sharding.shard_loaders(original(), stage, world, rank, seed)
            if stage != "train" and world > 1:  # a rank without a batch; unequal ones (fsdp)
                fsdp = hasattr(trainer.strategy, "shard")
                sharding.same_eval_batches(loaders, stage, fsdp, source)
            if stage == "train":
                loaders = combine_train(loaders)  # several: each resumed by its own count
            if stage == "train" and trainer is not None:
                check_evaluations(datamodule, trainer, cfg)
                fit_to_run(loaders, trainer, position, keep_global_batch, cfg, command)
                start_where_fit_resumes(loaders, trainer, position)
            return loaders

        setattr(datamodule, name, sharded)


def check_evaluations(datamodule: pl.LightningDataModule, trainer: pl.Trainer,
                      cfg: DictConfig | None) -> None:  # fmt: skip
    """Before training, on several processes: the loaders of the splits this run will
    evaluate, built (sharded) and checked now, not when Lightning asks for them (the test
    split's after fit; validation's after an epoch without a sanity check): a rank without a
    batch of one is refused before training, not after it."""
    module, tests = trainer.lightning_module, bool(cfg is not None and cfg.get("test"))
    evaluated = {"val": trainer.limit_val_batches != 0 and is_overridden("validation_step", module),
                 "test": tests and trainer.limit_test_batches != 0
                 and is_overridden("test_step", module)}  # fmt: skip
    for stage, used in evaluated.items() if trainer.world_size > 1 else ():
        if used and is_overridden(f"{stage}_dataloader", datamodule):
            getattr(datamodule, f"{stage}_dataloader")()  # the sharded one: it checks them


def fit_to_run(
    loaders: Any, trainer: pl.Trainer, position: elastic.Position | None, keep_global_batch: bool,
    cfg: DictConfig | None, command: dict[str, Any] | None,
) -> None:  # fmt: skip
    """The train loaders as built, fitted to the run (project.engine.data.elastic): a
    datamodule of its own keeps its batch size, so only the accumulation can keep the global
    batch; the counts of batches keep their samples; drop_last drops incomplete optimizer
    steps. Lightning reads each after this call (its limits and val_check_batch; a resumed
    fit runs its first evaluation after it)."""
    world = trainer.world_size
    elastic.apply_layout(loaders, position, world)  # the run's lanes, also on another world
    trainer.accumulate_grad_batches = elastic.fit_accumulation(
        loaders, position, world, trainer.accumulate_grad_batches, keep_global_batch
    )
    if cfg is not None:
        fitted = elastic.fit_loader_counts(cfg, position, loaders, world, command or {})
        for key, value in fitted.items():
            setattr(trainer, key, value)
    sharding.drop_incomplete_steps(loaders, trainer.accumulate_grad_batches, world)


def batches_done(progress: Any) -> int:
    """The batches of the epoch trained, from Lightning's batch progress: a checkpoint written
    in on_train_batch_end (ModelCheckpoint's every_n_train_steps) has not counted the batch
    just trained as completed yet (Lightning adds it when it restarts from there)."""
    current = progress.current
    return current.processed if current.completed == current.processed - 1 else current.completed


def fit_epoch(trainer: pl.Trainer) -> int:
    """The epoch Lightning gives the samplers' `set_epoch` (its fit loop's own count)."""
    return trainer.fit_loop.epoch_progress.current.processed


def start_where_fit_resumes(
    loaders: Any, trainer: pl.Trainer, position: elastic.Position | None
) -> None:
    """Give the train loaders the epoch, and after a mid-epoch checkpoint the place where the
    epoch stood, before Lightning makes its first iterator (its fit loop does that before any
    hook runs, and DataLoader workers copy the order then). Lightning itself sets the epoch
    later, on samplers only, and would continue a resumed epoch at the batch count it saved,
    which on another world size is another place: its count is set to this world's."""
    fit = trainer.fit_loop
    epoch = fit_epoch(trainer)
    sharding.set_epoch(loaders, epoch)
    if not (fit.restarting and fit.epoch_progress.current.started > epoch):
        return  # not in the middle of an epoch
    done = elastic.resume(loaders, position, epoch, trainer.world_size)
    progress = fit.epoch_loop.batch_progress
    shift = done - batches_done(progress)  # Lightning's own restart logic then makes it `done`
    for counts in (progress.current, progress.total):
        counts.ready += shift
        counts.started += shift
        counts.processed += shift
        counts.completed += shift
