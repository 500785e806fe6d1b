"""The LightningDataModule: the multi-GPU data pattern around the plain digits dataset.

`prepare_data` runs in one process per node and writes the arrays once (atomically);
`setup` runs on every rank and memory-maps them. The loaders shard the data across ranks
with a resumable DistributedSampler (project.digits.make_loader).
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from project.digits import (
    DigitsDataset,
    check_writable,
    make_loader,
    materialise,
    split_indices,
)


class DigitsDataModule(pl.LightningDataModule):
    """scikit-learn's 8x8 digits with a seeded train/val/test split."""

    def __init__(
        self,
        data_dir: str,
        batch_size: int = 64,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        seed: int = 42,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.data_dir = Path(data_dir)
        check_writable(self.data_dir)  # fail before any process or trainer is started
        split_indices(10, val_fraction, test_fraction, seed)  # validates the fractions now

    def prepare_data(self) -> None:
        materialise(self.data_dir)

    def setup(self, stage: str | None = None) -> None:
        full = DigitsDataset(self.data_dir)
        train, val, test = split_indices(
            len(full), self.hparams.val_fraction, self.hparams.test_fraction, self.hparams.seed
        )
        self.train_set = DigitsDataset(self.data_dir, train)
        self.val_set = DigitsDataset(self.data_dir, val)
        self.test_set = DigitsDataset(self.data_dir, test)

    def _loader(self, dataset: DigitsDataset, shuffle: bool) -> DataLoader:
        # The datamodule shards the data itself (Trainer(use_distributed_sampler=False)): the
        # same resumable sampler as the raw trainer, one process or many.
        trainer = self.trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer else (1, 0)
        h = self.hparams
        return make_loader(
            dataset, h.batch_size, shuffle, world, rank, h.seed,
            h.num_workers, h.pin_memory, h.persistent_workers,
        )  # fmt: skip

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)
