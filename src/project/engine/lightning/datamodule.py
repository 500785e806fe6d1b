"""The LightningDataModule around any DataSource (project.data), and the sharding guard every
datamodule gets, the template's or a user's own.

`prepare_data` runs `source.prepare()` in one process per node; `setup` builds the split
datasets on every rank. The loaders are plain `DataLoader(dataset, shuffle=...)`: sharding
and the resumable order come from `shard_datamodule` (project.engine.shared.sharding), the same
code the raw trainer runs.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import DataLoader

from project.data.source import SPLITS
from project.engine.config.compose import to_plain
from project.engine.shared import sharding
from project.engine.shared.loaders import build_source, plain_loader

log = logging.getLogger("project.engine.lightning.datamodule")


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

    def _loader(self, stage: str) -> DataLoader:
        h = self.hparams
        return plain_loader(
            self.sets[stage], stage, h.batch_size, h.num_workers, h.pin_memory,
            h.persistent_workers, h.shuffle,
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


def shard_datamodule(datamodule: pl.LightningDataModule, seed: int) -> None:
    """Make every loader `datamodule` returns sharded over the trainer's ranks (in place).

    Wraps the `*_dataloader` methods it defines; the rank and world size are read from the
    trainer when Lightning asks for the loaders.
    """
    for stage in SPLITS:
        name = f"{stage}_dataloader"
        if not is_overridden(name, datamodule):
            continue
        original = getattr(datamodule, name)

        def sharded(original: Any = original, stage: str = stage) -> Any:
            trainer = datamodule.trainer
            world, rank = (trainer.world_size, trainer.global_rank) if trainer else (1, 0)
            loaders = sharding.shard_loaders(original(), stage, world, rank, seed)
            if stage == "train" and trainer is not None:
                start_where_fit_resumes(loaders, trainer)
            return loaders

        setattr(datamodule, name, sharded)


def fit_epoch(trainer: pl.Trainer) -> int:
    """The epoch Lightning gives the samplers' `set_epoch` (its fit loop's own count)."""
    return trainer.fit_loop.epoch_progress.current.processed


def start_where_fit_resumes(loader: Any, trainer: pl.Trainer) -> None:
    """Give the train loader the epoch, and after a mid-epoch checkpoint the batches already
    done, before Lightning makes its first iterator (its fit loop does that before any hook
    runs, and DataLoader workers copy the order then). Lightning itself sets the epoch later,
    on samplers only, and continues a resumed epoch without skipping anything."""
    fit = trainer.fit_loop
    epoch = fit_epoch(trainer)
    sharding.set_epoch(loader, epoch)
    started_not_done = fit.restarting and fit.epoch_progress.current.started > epoch
    done = fit.epoch_loop.batch_progress.current.completed if started_not_done else 0
    if done and sharding.resume_at(loader, epoch, done):
        log.info(f"Resuming mid-epoch: skipping the {done} batches already trained on")
