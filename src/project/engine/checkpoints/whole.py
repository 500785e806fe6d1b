"""A sharded save (project.engine.checkpoints.sharded) gathered whole on one process,
without a process group: for `python -m project.consolidate` (`consolidated`: one plain file's
content), eval.py (its weights) and a Lightning run on one process or under DDP resuming from
it (`resumable`: the whole Lightning checkpoint it stands for). DCP's own reader fills every
entry its index lists. The index is read through DCP's FileSystemReader, which is local (its
fsspec twin is private): a folder at a URL (a run's sharded `last` in object storage, resumed
by Lightning on one process) is copied into a temporary folder in the run's staging first.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from project.engine.checkpoints.remote import download_folder, is_url, join
from project.engine.checkpoints.sharded import (
    COMMON,
    FORMAT,
    one_process_quiet,
    own_file,
    read_entries,
    resolve,
    world,
)
from project.engine.errors import UserError

CARRIED = (
    "hyper_parameters",
    "datamodule_hyper_parameters",
    "project",
)  # `common` entries copied into OUT as they are
PREFIX = "task."  # the LightningModule's attribute that holds the task (engine/lightning/module)


def numbered(optim: dict[str, Any], afresh: bool = True) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (DCP's get_state_dict) in torch's own layout:
    parameters numbered in the order of the param groups. `afresh`: the learning rates the
    schedule started at (a new run's); else as saved (a resume restores its schedule too)."""
    index: dict[str, int] = {}
    groups = []
    for group in optim["param_groups"]:
        ids = [index.setdefault(name, len(index)) for name in group["params"]]
        # A run started from this file begins its schedule afresh: from the learning rate the
        # schedule started at, not the one it had decayed to (Lightning loads these groups
        # after building the new scheduler, which would scale the decayed rate again).
        lr = {"lr": group["initial_lr"]} if afresh and "initial_lr" in group else {}
        groups.append({**group, "params": ids, **lr})
    state = {index[name]: value for name, value in optim["state"].items()}
    return {"state": state, "param_groups": groups}


def gathered_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every rank (a collective): a sharded model's whole state and its optimizer's (in
    torch's own layout, `numbered`, its learning rates as they are), in rank 0's CPU memory;
    the other ranks get empty dicts."""
    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim = get_state_dict(model, [optimizer], options=whole)
    return (model_state, numbered(optim, afresh=False)) if model_state else ({}, {})


def prefixed(weights: dict[str, Any], prefix: str) -> dict[str, Any]:
    """Every key under `prefix` (a key that starts with it is kept as it is)."""
    return {k if k.startswith(prefix) else f"{prefix}{k}": v for k, v in weights.items()}


def lightning_version() -> dict[str, str]:
    """The key Lightning reads first from any checkpoint it loads (its migration step)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return {"pytorch-lightning_version": version("lightning")}
    except PackageNotFoundError:
        return {}


def consolidated(
    ckpt: str, what: str = "CKPT", prefix: str = PREFIX, optimizer: bool = False
) -> dict[str, Any]:
    """The plain checkpoint `python -m project.consolidate` writes (see its docstring), in
    memory: the weights (optimizer too) of the sharded save `ckpt` names, every key under
    `prefix`, and the entries CARRIED names. `what` names `ckpt` in a one-line error."""
    if is_url(ckpt):  # copied whole to be read: the user picks the disk (and downloads once)
        raise UserError(f"{what}={ckpt} is a URL: copy the save folder here first (e.g. "
                        "`aws s3 sync`) and give its local path")  # fmt: skip
    folder = located(ckpt, what)
    common = read_entries(join(folder, COMMON))
    full = gathered(folder, None if optimizer else "model")
    result: dict[str, Any] = {"state_dict": prefixed(full["model"], prefix),
                              **lightning_version()}  # fmt: skip
    # What a Lightning checkpoint of the template carries beside the weights, where the
    # saving trainer put it in `common`: the network's and data's configs (eval.py builds
    # both from them) and the run's identity (a resume's checks read it).
    result |= {k: common["common"][k] for k in CARRIED if k in common["common"]}
    if optimizer:
        if "optim" not in full:
            raise UserError(f"{what}={ckpt} holds no optimizer state: leave out --optimizer")
        result |= {"optimizer_states": [numbered(full["optim"])], "lr_schedulers": []}
    result["consolidated_from"] = {
        "folder": folder, "step": common["step"], "world": common["world"],
        "trainer": common["trainer"],
    }  # fmt: skip
    return result


def located(ckpt: str, what: str) -> str:
    """The save folder `ckpt` names (sharded.resolve). A name nothing publishes is refused
    with the names its folder's manifests do publish: `<run>/checkpoints/last` answers that
    Lightning's sharded `last` is `last-ckpt` (the raw trainer's `last-pt`)."""
    try:
        return resolve(ckpt, what)
    except UserError as err:
        path = Path(ckpt.rstrip("/"))
        near = [] if is_url(ckpt) or path.exists() else published_in(path.parent)
        if not near:
            raise
        raise UserError(f"{err}; {path.parent} publishes {' and '.join(near)}: "
                        f"{what}={path.parent / near[0]}") from None  # fmt: skip


def published_in(folder: Path) -> list[str]:
    """The names the manifests of sharded saves in `folder` publish (`last-ckpt` for
    last-ckpt.json)."""
    names = []
    for manifest in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            if json.loads(manifest.read_text()).get("format") == FORMAT:
                names.append(manifest.stem)
    return names


def resumable(ckpt: str, what: str = "ckpt_path", staging: Path | None = None) -> dict[str, Any]:
    """The Lightning checkpoint a sharded save of train.py stands for, whole on this process:
    every entry it saved as it is (loops, callbacks, scheduler, the run's identity), the
    weights under `task.`, the optimizer's state in torch's layout with its learning rates as
    saved, and this rank's own random streams where the world size is the one that saved it
    (else rank 0's). What a run on one process or under DDP resumes from. `staging`: where a
    save at a URL is copied to be read (`gathered`)."""
    folder = resolve(ckpt, what)
    saved = read_entries(join(folder, COMMON))
    full = gathered(folder, staging=staging)
    rank, size = world()
    mine = read_entries(join(folder, own_file(rank))) if saved["world"] == size else {}
    return {
        **saved["common"],
        **({"rng": mine["rng"]} if mine.get("rng") is not None else {}),
        "state_dict": prefixed(full["model"], PREFIX),
        "optimizer_states": [numbered(full["optim"], afresh=False)],
    }


def gathered(folder: str, only: str | None = None, staging: Path | None = None) -> dict[str, Any]:
    """The whole state of a save folder (every rank's shards joined; by URL, copied into a
    temporary folder in `staging` first, the system's temporary folder without one) read on
    this process without a process group, nested as it was saved ({"model": ..., "optim":
    ...}); `only`: that top-level entry alone ("model": the optimizer's state is not read).
    Every entry DCP's index lists is made from its recorded size (a tensor) or left for DCP's
    reader to fill (a plain value), then put back where the index's mapping says."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if is_url(folder):  # the index is read by the local FileSystemReader: a copy is read
        if staging is not None:
            staging.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="sharded-save-", dir=staging) as local:
            download_folder(folder, Path(local) / "save")
            return gathered(str(Path(local) / "save"), only)
    reader = dcp.FileSystemReader(folder)
    index = reader.read_metadata()
    paths = {key: index.planner_data.get(key, (key,)) for key in index.state_dict_metadata}
    flat = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
            if isinstance(meta, TensorStorageMetadata) else None
            for key, meta in index.state_dict_metadata.items()
            if only is None or paths[key][0] == only}  # fmt: skip
    with one_process_quiet():
        dcp.load(flat, storage_reader=reader, no_dist=True)
    nested: dict[Any, Any] = {}
    for key, value in flat.items():
        *parents, last = paths[key]
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return as_lists(nested)


def as_lists(tree: Any) -> Any:
    """`tree` with each dict keyed 0..n-1 (a list DCP flattened by index) a list again."""
    if not isinstance(tree, dict):
        return tree
    tree = {key: as_lists(value) for key, value in tree.items()}
    if tree and all(type(k) is int for k in tree) and set(tree) == set(range(len(tree))):
        return [tree[i] for i in range(len(tree))]
    return tree
