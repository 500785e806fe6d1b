"""What exact resume needs beyond model and optimizer state, for both trainers: the RNG
states, atomic checkpoint writes, where a run's last checkpoint lives, and the checks that a
checkpoint may be resumed by this config.

Every checkpoint of either trainer carries a `project` entry: the config keys that define
what is trained (`training_identity`), whether the run finished, and its final fit metrics.
A run folder is only continued by the same training (`check_resumable`); a finished run is
reported, never trained again. RNG states are stored as tensors and plain Python values so
checkpoints still load with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from project.engine.console import METRICS_FILE, read_metrics
from project.engine.errors import UserError

log = logging.getLogger("project.engine.resume")

LAST_CKPT = "last.ckpt"  # FaultTolerance's resume point (Lightning's checkpoint format)
LAST_PT = "last.pt"  # the raw trainer's: its own format, whatever the config names


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


# What a run trains: a checkpoint is only resumed by a config that agrees on these (dotted
# prefixes). Where the data lives and how it is loaded may change between attempts.
IDENTITY = ("seed", "model", "data")
NOT_IDENTITY = ("model.compile", "data.dataset.data_dir", "data.num_workers", "data.pin_memory",
                "data.persistent_workers")  # fmt: skip
ARCHITECTURE = ("model.net", "model.task")  # what must match for the weights to load at all


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1} (lists stay values)."""
    if not isinstance(tree, Mapping):
        return {prefix[:-1]: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}{key}."))
    return flat


def training_identity(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The flattened config keys that define what this run trains (see IDENTITY)."""
    flat = flatten({k: cfg.get(k) for k in IDENTITY})
    return {
        k: v for k, v in flat.items()
        if not any(k == n or k.startswith(n + ".") for n in NOT_IDENTITY)
    }  # fmt: skip


def project_state(
    identity: dict[str, Any], finished: bool = False, metrics: dict[str, float] | None = None
) -> dict[str, Any]:
    """The `project` entry of a checkpoint (plain values: loads with weights_only=True)."""
    return {"identity": identity, "finished": finished, "metrics": dict(metrics or {})}


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


def saved_identity(ckpt: dict[str, Any]) -> tuple[dict[str, Any] | None, bool]:
    """(identity, complete): what the checkpoint says it trained. Checkpoints written before
    the `project` entry existed still name their network (Lightning's hyper_parameters, the
    raw trainer's config): then only the architecture can be compared."""
    if isinstance(ckpt.get("project"), dict) and "identity" in ckpt["project"]:
        return ckpt["project"]["identity"], True
    net = (ckpt.get("hyper_parameters") or {}).get("net")
    net = net or ((ckpt.get("config") or {}).get("model") or {}).get("net")
    return (flatten({"model": {"net": net}}), False) if net else (None, False)


def check_resumable(
    path: str | Path, ckpt: dict[str, Any], cfg: Mapping[str, Any], explicit: bool
) -> None:
    """Refuse (one line, naming the keys) a checkpoint trained with another config.

    Auto-resume (`explicit=False`) continues a run folder only with the same training
    (IDENTITY); an explicit ckpt_path may change anything but the network architecture.
    """
    saved, complete = saved_identity(ckpt)
    if saved is None:
        return
    now = training_identity(cfg)
    keys = sorted(set(saved) | set(now))
    if explicit or not complete:
        keys = [k for k in keys if k.startswith(tuple(a + "." for a in ARCHITECTURE))]
    diff = [k for k in keys if saved.get(k) != now.get(k)]
    if not diff:
        return
    shown = "; ".join(f"{k}: {saved.get(k)!r} there, {now.get(k)!r} now" for k in diff[:4])
    more = f" (+{len(diff) - 4} more)" if len(diff) > 4 else ""
    if explicit:
        raise UserError(
            f"ckpt_path={path} holds another network ({shown}{more}): pass the model "
            "overrides it was trained with"
        )
    raise UserError(
        f"{path} was trained with another config ({shown}{more}), so this run folder belongs "
        "to another run: use another RUN_ID for a new run (the folder is left as it is)"
    )


def checkpoint_dir(cfg: Mapping[str, Any], output_dir: Path) -> Path:
    """The run's checkpoint folder: callbacks.model_checkpoint.dirpath, else <run>/checkpoints."""
    ckpt = (cfg.get("callbacks") or {}).get("model_checkpoint") or {}
    return Path(ckpt.get("dirpath") or output_dir / "checkpoints")


def last_checkpoint(
    cfg: Mapping[str, Any], output_dir: Path, name: str | None = None
) -> Path | None:
    """Where `callbacks.fault_tolerance` keeps the run's last checkpoint (None: that callback
    is off), read from the config alone so that a run can be checked before anything heavy
    is imported or built. `name` replaces the configured file name (the raw trainer's)."""
    ft = (cfg.get("callbacks") or {}).get("fault_tolerance")
    if not ft:
        return None
    folder = Path(ft.get("dirpath") or checkpoint_dir(cfg, output_dir))
    return folder / (name or ft.get("filename") or LAST_CKPT)


@dataclass
class Resume:
    """Where a run continues from: `path` (None: from scratch), and what the checkpoint says."""

    path: Path | None = None
    finished: bool = False  # auto-resume found a run that finished training
    metrics: dict[str, float] = field(default_factory=dict)  # its final fit metrics


def find_resume(cfg: Mapping[str, Any], last: Path | None, kind: str) -> Resume:
    """An explicit ckpt_path, else (auto_resume) the run folder's `last` checkpoint, checked.

    `kind` is the key every checkpoint of the trainer has ("state_dict": Lightning, "model":
    the raw trainer): the other trainer's checkpoint is refused with one line.
    """
    explicit = cfg.get("ckpt_path")
    if explicit:
        path, what = Path(explicit), "ckpt_path"
    elif cfg.get("auto_resume") and last is not None and last.exists():
        path, what = last, "the run's last checkpoint"
    else:
        return Resume()
    ckpt = read_checkpoint(path, what)
    if kind not in ckpt:
        own = "a .ckpt of train.py" if kind == "state_dict" else "a .pt of the raw trainer"
        raise UserError(
            f"{what} {path} is not a checkpoint of this trainer (it has no {kind!r}): give "
            f"{own}; each trainer resumes from its own"
        )
    check_resumable(path, ckpt, cfg, explicit=bool(explicit))
    state = ckpt.get("project") or {}
    finished = bool(state.get("finished")) and not explicit  # explicit: Lightning decides
    return Resume(path, finished, state.get("metrics") or {})


def finished_results(resume: Resume, output_dir: Path) -> dict[str, float]:
    """The results a run that already finished kept in its folder, said so in the log; {}
    when there is work left (not finished, or it died before writing its results)."""
    earlier = read_metrics(output_dir) if resume.finished else {}
    if earlier:
        log.info(
            f"This run already finished ({resume.path}); its results are kept in "
            f"{output_dir / METRICS_FILE}. For more training start a new run from its "
            f"weights: ckpt_path={resume.path} trainer.max_epochs=<more>"
        )
    return earlier
