"""The raw trainer's random generators, handled as Lightning handles them (parity: the same
seeds at the same points give both trainers the same initial weights and dropout masks)."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator

import numpy as np
import torch

from project.engine.checkpoints.state import rng_state, set_rng_state


def seed_everything(seed: int) -> None:
    """What lightning's seed_everything does: python, numpy and torch (all devices)."""
    os.environ["PL_GLOBAL_SEED"] = str(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@contextlib.contextmanager
def isolated_rng() -> Iterator[None]:
    """Restore the python, numpy and torch (CPU and CUDA) RNG states on exit."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)
