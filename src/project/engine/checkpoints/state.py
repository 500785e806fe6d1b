"""A checkpoint's own state beyond model and optimizer, for both trainers: the RNG states,
the `project` entry, atomic writes and a checked read.

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

from project.engine.checkpoints.remote import is_url
from project.engine.errors import UserError


def numpy_state_saved(state: tuple[Any, ...]) -> tuple[Any, ...]:
    """A numpy RandomState's `get_state()` with its key array as a tensor (weights_only-safe)."""
    name, keys, *rest = state
    return (name, torch.from_numpy(keys.copy()), *rest)


def numpy_state_loaded(saved: tuple[Any, ...]) -> tuple[Any, ...]:
    """`numpy_state_saved` back into what `RandomState.set_state()` takes."""
    name, keys, *rest = saved
    return (name, keys.cpu().numpy(), *rest)


def rng_state() -> dict[str, Any]:
    """The python, numpy and torch (CPU and CUDA) RNG states."""
    return {
        "python": random.getstate(),
        "numpy": numpy_state_saved(np.random.get_state()),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np.random.set_state(numpy_state_loaded(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def atomic_save(obj: Any, path: str | Path) -> None:
    """torch.save to a temp file in the same folder, fsync, then rename over `path`.

    A write killed midway leaves the previous `path` intact (rename is atomic on POSIX). A URL
    (a ModelCheckpoint's s3://... folder) is written by fsspec: an object store shows an
    object only once its upload completed.
    """
    if is_url(path):
        import fsspec

        with fsspec.open(str(path), "wb") as f:
            torch.save(obj, f)
        return
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


def project_state(
    identity: dict[str, Any],
    finished: bool = False,
    metrics: dict[str, float] | None = None,
    callbacks: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The `project` entry of a checkpoint (plain values: loads with weights_only=True);
    `callbacks`: the run's callbacks config (a resume with others says so)."""
    state = {"identity": identity, "finished": finished, "metrics": dict(metrics or {})}
    return state | ({"callbacks": callbacks} if callbacks is not None else {})


def read_checkpoint(path: str | Path, what: str = "checkpoint") -> dict[str, Any]:
    """torch.load(weights_only=True) of `path`, or a one-line UserError naming the file and the
    problem. Memory-mapped: checking a large checkpoint does not read all of it."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{what} {p} does not exist (or is a folder): give a checkpoint file")
    try:
        try:
            ckpt = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:  # not a zip file: mmap is refused, so load it plainly
            if "mmap" not in str(err):
                raise
            ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as err:
        with open(p, "rb") as f:
            zipped = f.read(4) == b"PK\x03\x04"  # torch.save writes a zip archive
        reason = " ".join(f"{type(err).__name__}: {err}".split())[:160]
        reason = reason if zipped else "not a torch.save file: no zip archive inside"
        raise UserError(
            f"{what} {p} cannot be read ({reason}); it was left as it is: move it away to "
            "start over, or pass ckpt_path=<another checkpoint>"
        ) from err
    if not isinstance(ckpt, dict):
        raise UserError(f"{what} {p} is not a checkpoint of this project (no dict inside)")
    return ckpt
