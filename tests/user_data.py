"""A LightningDataModule written the way Lightning's docs show it (plain DataLoaders, no
sharding, no resumable sampler): what a user brings. Every sample read is recorded in
<record_dir>/reads-rank<R>.txt so tests can see which rank read what."""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset


class Recorded(Dataset):
    """n samples of 64 features and a class 0-9, a fixed function of the index."""

    def __init__(self, split: str, n: int, offset: int, record_dir: str) -> None:
        self.split, self.n, self.offset = split, n, offset
        rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
        self.record = Path(record_dir) / f"reads-rank{rank}.txt"

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        with open(self.record, "a") as f:
            f.write(f"{self.split} {i}\n")
        g = torch.Generator().manual_seed(self.offset + i)
        x = torch.rand(64, generator=g)
        return x, (x[:10].argmax()).long()


class PlainDataModule(pl.LightningDataModule):
    def __init__(self, record_dir: str, n_train: int = 400, n_val: int = 101,
                 batch_size: int = 20) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str | None = None) -> None:
        h = self.hparams
        self.train_set = Recorded("train", h.n_train, 0, h.record_dir)
        self.val_set = Recorded("val", h.n_val, 10**6, h.record_dir)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)
