"""A DataSource from its config, and the plain DataLoaders both trainers batch it with.

No Lightning here: the raw trainer imports this module, and importing Lightning would cost it
seconds at every start for nothing.
"""

from __future__ import annotations

from typing import Any

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
) -> DataLoader:
    """What a user would write: shuffled for training (unless `shuffle` is off), in order
    otherwise (both trainers' loaders, from the `data` config's loading keys). A stream
    shuffles itself (project.data.stream), so it is told instead of the DataLoader."""
    shuffle = shuffle and stage == "train"
    if isinstance(dataset, ShardedStream):
        dataset.shuffle, shuffle = shuffle, False
    return DataLoader(
        dataset, batch_size=batch_size, shuffle=shuffle, num_workers=num_workers,
        pin_memory=pin_memory, persistent_workers=persistent_workers and num_workers > 0,
    )  # fmt: skip
