"""A DataSource from its config, and the plain DataLoaders both trainers batch it with.

No Lightning here: the raw trainer imports this module, and importing Lightning would cost it
seconds at every start for nothing.
"""

from __future__ import annotations

import random
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from hydra.utils import instantiate
from torch.utils.data import DataLoader

from project.data.source import DataSource
from project.data.stream import ShardedStream
from project.engine.config.compose import to_plain
from project.engine.errors import UserError


def build_source(dataset: Any) -> DataSource:
    """The `data.dataset` config as a DataSource (both trainers and eval build it here)."""
    source = instantiate(dict(to_plain(dataset)))
    if not isinstance(source, DataSource):
        raise UserError(
            f"data.dataset._target_={dataset['_target_']} is not a project.data.source."
            "DataSource: subclass it (prepare + dataset(split))"
        )
    return source


def plain_loader(
    dataset: Any,
    stage: str,
    batch_size: int,
    num_workers: int = 0,
    pin_memory: bool = False,
    persistent_workers: bool = False,
    shuffle: bool = True,
    lanes: int | None = None,
    shuffle_block: int | None = None,
) -> DataLoader:
    """What a user would write: shuffled for training (unless `shuffle` is off), in order
    otherwise (both trainers' loaders, from the `data` config's loading keys). A stream
    shuffles itself (project.data.stream), so it is told instead of the DataLoader, with its
    layout (`lanes`, `shuffle_block`: project.data.lanes; None: the stream's own)."""
    shuffle = shuffle and stage == "train"
    if isinstance(dataset, ShardedStream):
        dataset.shuffle, shuffle = shuffle, False
        dataset.lanes = dataset.lanes if lanes is None else lanes
        dataset.shuffle_block = dataset.shuffle_block if shuffle_block is None else shuffle_block
    rank = dist.get_rank() if dist.is_initialized() else 0
    return DataLoader(
        dataset, batch_size=batch_size, shuffle=shuffle, num_workers=num_workers,
        pin_memory=pin_memory, persistent_workers=persistent_workers and num_workers > 0,
        worker_init_fn=partial(seed_worker, rank=rank) if num_workers > 0 else None,
    )  # fmt: skip


def seed_worker(worker_id: int, rank: int) -> None:
    """Seed a DataLoader worker's torch, numpy and random from its torch seed and the rank.
    Torch seeds each worker from a base drawn from the rank's generator + the worker's id;
    that generator is seeded alike on every rank, so without the rank mixed in worker w of
    every rank would draw (augment) alike. Lightning's pl_worker_init_function does the same,
    but a worker that unpickles it imports Lightning (seconds, at every worker start)."""
    seeds = np.random.SeedSequence([torch.initial_seed(), rank]).generate_state(4)
    torch.manual_seed(int(seeds[0]) << 32 | int(seeds[1]))
    random.seed(int(seeds[2]))
    np.random.seed(int(seeds[3]))
