"""LightningDataModules written the way Lightning's docs show them (plain DataLoaders, no
sharding, no resumable sampler), a weighted sampler, a user's own sharded stream, and a bug:
what users bring. Every sample read is recorded in <record_dir>/reads-rank<R>[-worker<W>].txt
(reads-<RECORD_TAG>-rank<R>.txt when that variable is set: one file per attempt of a run; a
`{restart}` in it is torchrun's restart count) so
tests can see which rank (and worker) read what; a stream's workers also record their
parents in <record_dir>/parents-rank<R>-worker<W>.txt. `RecordedSource` is the same data as a
DataSource, which both trainers read; `SlowSource` too, with slow or stuck reads."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader, Dataset, WeightedRandomSampler, get_worker_info

from project.data.source import DataSource
from project.data.stream import ShardedStream


def rank() -> int:
    """This process's global rank under any launcher (torchrun's or Lightning's)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


class Recorded(Dataset):
    """n samples of 64 features and a class 0-9, a fixed function of the index."""

    def __init__(self, split: str, n: int, offset: int, record_dir: str) -> None:
        self.split, self.n, self.offset, self.record_dir = split, n, offset, record_dir

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        tag = os.environ.get("RECORD_TAG", "").format(restart=restart)
        tag = f"{tag}-" if tag else ""
        with open(Path(self.record_dir) / f"reads-{tag}rank{rank()}.txt", "a") as f:
            f.write(f"{self.split} {i}\n")
        g = torch.Generator().manual_seed(self.offset + i)
        x = torch.rand(64, generator=g)
        return x, (x[:10].argmax()).long()


class RecordedSource(DataSource):
    """`Recorded` samples as a data source (`data.dataset._target_`): both trainers read it."""

    def __init__(self, record_dir: str, n_train: int = 400, n_val: int = 101) -> None:
        self.record_dir, self.sizes = record_dir, {"train": n_train, "val": n_val, "test": n_val}

    def prepare(self) -> None:
        pass

    def dataset(self, split: str) -> Dataset:
        offset = {"train": 0, "val": 10**6, "test": 2 * 10**6}[split]
        return Recorded(split, self.sizes[split], offset, self.record_dir)


class Slow(Recorded):
    """`Recorded`, each read taking `read_s` (a slow disk, a decoder); on rank `stall_rank`,
    the `stall_at`-th read of this process never returns (a stuck loader)."""

    def __init__(self, split: str, n: int, offset: int, record_dir: str, read_s: float,
                 stall_at: int | None, stall_rank: int) -> None:  # fmt: skip
        super().__init__(split, n, offset, record_dir)
        self.read_s, self.stall_at, self.stall_rank, self.reads = read_s, stall_at, stall_rank, 0

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads += 1
        if self.reads == self.stall_at and rank() == self.stall_rank:
            while True:
                time.sleep(3600)
        time.sleep(self.read_s)
        return super().__getitem__(i)


class SlowSource(RecordedSource):
    """`Slow` samples to train on, as a data source (both trainers read it)."""

    def __init__(self, record_dir: str, n_train: int = 400, read_s: float = 0.0,
                 stall_at: int | None = None, stall_rank: int = 1) -> None:  # fmt: skip
        super().__init__(record_dir, n_train)
        self.slow = (read_s, stall_at, stall_rank)

    def dataset(self, split: str) -> Dataset:
        if split != "train":
            return super().dataset(split)
        return Slow(split, self.sizes[split], 0, self.record_dir, *self.slow)


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


class Imbalanced(Recorded):
    """One sample in ten is class 1, the rest class 0: the case WeightedRandomSampler is for."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, _ = super().__getitem__(i)
        return x, torch.tensor(int(i % 10 == 0))


def balancing_weights(n: int) -> list[float]:
    """Weights that draw both classes of `Imbalanced(n)` equally often."""
    return [9.0 if i % 10 == 0 else 1.0 for i in range(n)]


class WeightedDataModule(PlainDataModule):
    """Training draws from a WeightedRandomSampler, as a user balancing classes writes it."""

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        self.train_set = Imbalanced("train", self.hparams.n_train, 0, self.hparams.record_dir)

    def train_dataloader(self) -> DataLoader:
        n = self.hparams.n_train
        sampler = WeightedRandomSampler(balancing_weights(n), num_samples=n)
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, sampler=sampler)


class ShardFiles(ShardedStream):
    """A user's stream over .npy files of sample ids (one file a shard): sample v is 64
    features and the class v % 10. Reads are recorded per rank and DataLoader worker."""

    def __init__(self, split: str, folder: str, record_dir: str) -> None:
        self.files = sorted(Path(folder).glob("*.npy"))
        super().__init__([len(np.load(f, mmap_mode="r")) for f in self.files])
        self.split, self.record_dir = split, record_dir

    def read(self, shard: int) -> Samples:
        return Samples(np.load(self.files[shard]), self)

    def sample(self, v: int) -> tuple[torch.Tensor, torch.Tensor]:
        info = get_worker_info()
        record = Path(self.record_dir)
        name = f"rank{rank()}-worker{info.id if info else 0}.txt"
        with open(record / f"reads-{name}", "a") as f:
            f.write(f"{self.split} {v}\n")
        if info:  # the process that forked this worker, and the rank it serves
            parent = multiprocessing.parent_process()
            (record / f"parents-{name}").write_text(f"{os.getppid()} {parent and parent.pid}")
        x = torch.rand(64, generator=torch.Generator().manual_seed(v))
        x[-1] = v  # the id, so a test can tell the samples of a batch
        return x, torch.tensor(v % 10)


class Samples:
    """A shard's samples, made (and recorded) only when indexed."""

    def __init__(self, ids: np.ndarray, stream: ShardFiles) -> None:
        self.ids, self.stream = ids, stream

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.stream.sample(int(self.ids[i]))


class StreamDataModule(pl.LightningDataModule):
    """Train and validation streams over the shard files of `folder`, read by 2 workers."""

    def __init__(self, folder: str, record_dir: str, batch_size: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()

    def _loader(self, split: str) -> DataLoader:
        h = self.hparams
        stream = ShardFiles(split, h.folder, h.record_dir)
        return DataLoader(stream, batch_size=h.batch_size, num_workers=2)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")


class RankDependentDataModule(PlainDataModule):
    """A bug users hit: each rank builds a train set of another length (e.g. node-local
    folders that differ)."""

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        extra = rank() * 20
        self.train_set = Recorded("train", self.hparams.n_train + extra, 0, self.hparams.record_dir)


class RefusingDataModule(PlainDataModule):
    """Bad input that a rank finds and refuses in one line (e.g. its node-local data folder is
    missing): `refusing` is the rank that refuses ("every": all of them), `when` is "built"
    (before the process group is up: the local rank, which Lightning's launcher sets) or
    "setup" (once it is up)."""

    def __init__(self, record_dir: str, refusing: int | str = 1, when: str = "setup") -> None:
        super().__init__(record_dir)
        self.refusing, self.when = refusing, when
        if when == "built":
            self._refuse(int(os.environ.get("LOCAL_RANK", "0")))

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        if self.when == "setup":
            self._refuse(rank())

    def _refuse(self, me: int) -> None:
        from project.engine.errors import UserError

        if self.refusing in ("every", me):  # every rank alike: one line, the same on each
            who = "every rank" if self.refusing == "every" else f"rank {me}"
            if who == "every rank" and me == 0:
                time.sleep(2)  # rank 0 refuses last: the others have printed their line
            raise UserError(f"the data folder of {who} is missing (refused when {self.when})")


class OwnBatchDataModule(pl.LightningDataModule):
    """A datamodule whose batch size the run cannot set (`per_rank_batch`, not
    `data.batch_size`), with a train split of `n_train` samples and a test split."""

    def __init__(self, record_dir: str, n_train: int = 480, n_val: int = 101,
                 per_rank_batch: int = 20, drop_last: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str | None = None) -> None:
        h = self.hparams
        self.sets = {
            split: Recorded(split, h.n_train if split == "train" else h.n_val, offset, h.record_dir)
            for split, offset in (("train", 0), ("val", 10**6), ("test", 2 * 10**6))
        }

    def train_dataloader(self) -> DataLoader:
        h = self.hparams
        return DataLoader(self.sets["train"], batch_size=h.per_rank_batch, shuffle=True,
                          drop_last=h.drop_last)  # fmt: skip

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.sets["val"], batch_size=self.hparams.per_rank_batch)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.sets["test"], batch_size=self.hparams.per_rank_batch)


class TwoLoadersDataModule(pl.LightningDataModule):
    """Two train loaders of different lengths, as Lightning's docs write them: a dict (Lightning
    cycles the short one, `max_size_cycle`) or a CombinedLoader of `mode`; validation is a
    CombinedLoader too. Each step trains on both loaders' batches together. Reads are recorded
    as "a i", "b i", "val_a i", "val_b i"."""

    def __init__(self, record_dir: str, mode: str = "dict", n_a: int = 200, n_b: int = 50,
                 batch_size: int = 10) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str | None = None) -> None:
        h, d = self.hparams, self.hparams.record_dir
        self.train_sets = {"a": Recorded("a", h.n_a, 0, d), "b": Recorded("b", h.n_b, 5000, d)}
        self.val_sets = {"a": Recorded("val_a", 30, 10**6, d), "b": Recorded("val_b", 17, 0, d)}

    def _loaders(self, sets: dict[str, Dataset], shuffle: bool) -> dict[str, DataLoader]:
        return {k: DataLoader(s, batch_size=self.hparams.batch_size, shuffle=shuffle)
                for k, s in sets.items()}  # fmt: skip

    def train_dataloader(self) -> dict[str, DataLoader] | CombinedLoader:
        loaders, mode = self._loaders(self.train_sets, shuffle=True), self.hparams.mode
        return loaders if mode == "dict" else CombinedLoader(loaders, mode)

    def val_dataloader(self) -> CombinedLoader:
        return CombinedLoader(self._loaders(self.val_sets, shuffle=False), "max_size")

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        parts = [b for b in batch.values() if b is not None]  # max_size: None once one ran out
        return [torch.cat(t) for t in zip(*parts, strict=True)]
