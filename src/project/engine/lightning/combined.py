"""Several train loaders in one epoch (a dict or list of them, or Lightning's CombinedLoader),
each resumed by its own count.

Lightning combines several train loaders with `max_size_cycle` unless told otherwise: the
epoch is as long as the longest loader, and a shorter one is read again (`iter()` on it
again) each time it runs out. After a mid-epoch resume a short loader's first pass starts
where its own count stood (sharding.own_position, recorded in the checkpoint), not where the
epoch's batch count would put it; its later passes in that epoch read its order whole. A new
iterator looks the same to its sampler either way, so `Cycled` tells it (sharding.restart)
before each later pass. The other modes read each loader once an epoch (`max_size` gives
None for one that ran out, `min_size` stops with the shortest): the epoch's count places them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

from lightning.pytorch.utilities import CombinedLoader

from project.engine.data import sharding
from project.engine.private_api import combined_mode, reread_through

log = logging.getLogger(__name__)
CYCLE = "max_size_cycle"  # Lightning's mode for several train loaders given without one


class _Again:
    """A loader as Lightning's cycling sees it: every `iter()` is a later pass."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        sharding.restart(self.loader)
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


class Cycled(CombinedLoader):
    """Lightning's CombinedLoader in `max_size_cycle` whose later passes of a loader read it
    whole (the first pass of the epoch was made by `iter()` on the loaders themselves)."""

    def __iter__(self) -> Cycled:
        super().__iter__()
        reread_through(self, _Again)
        return self


def combine_train(loaders: Any) -> Any:
    """The sharded train `loaders` as Lightning will combine them, each cycled loader told so
    (sharding.cycle_in_epoch) and re-read whole after its first pass. One loader, or another
    mode, is returned as it is; so is a subclass of CombinedLoader (its own behaviour kept,
    with one warning that a cycled loader's mid-epoch resume is not exact)."""
    if isinstance(loaders, CombinedLoader):
        mode, iterables = combined_mode(loaders), loaders.iterables
    elif isinstance(loaders, Mapping | list | tuple):
        mode, iterables = CYCLE, loaders
    else:
        return loaders
    if mode != CYCLE or len(sharding.flat(iterables)) < 2:
        return loaders
    if isinstance(loaders, CombinedLoader) and type(loaders) is not CombinedLoader:
        log.warning(
            f"the train loaders come in a {type(loaders).__name__} (a CombinedLoader of your "
            f"own, {CYCLE}): a mid-epoch resume re-reads a cycled loader from its resume point"
        )
        return loaders
    sharding.cycle_in_epoch(iterables)
    return Cycled(iterables, CYCLE)
