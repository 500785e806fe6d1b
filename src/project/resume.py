"""What exact resume needs beyond model and optimizer state, for both trainers: the RNG
states, atomic checkpoint writes, and where a run's last checkpoint lives.

RNG states are stored as tensors and plain Python values so checkpoints still load with
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

# The exit code of a run that stopped on SIGTERM/SIGUSR1 after saving its checkpoint: run the
# same command again (or let the scheduler requeue it) to resume. 128 + SIGTERM, as a process
# killed by SIGTERM would report, so schedulers treat it as "terminated", not "failed".
EXIT_PREEMPTED = 143


def rng_state() -> dict[str, Any]:
    """The python, numpy and torch (CPU and CUDA) RNG states."""
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def atomic_save(obj: Any, path: str | Path) -> None:
    """torch.save to a temp file in the same folder, fsync, then rename over `path`.

    A write killed midway leaves the previous `path` intact (rename is atomic on POSIX).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def last_checkpoint(checkpoint_dir: str | Path, name: str) -> Path | None:
    """`checkpoint_dir/name` if a previous attempt of this run left it, else None."""
    path = Path(checkpoint_dir) / name
    return path if path.is_file() else None
