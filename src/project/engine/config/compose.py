"""Hydra/OmegaConf resolvers and config helpers. Light imports only (no torch, no Lightning):
this runs before `--help` and `--cfg job` answer.
"""

from __future__ import annotations

import importlib
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from project.engine.errors import UserError
from project.engine.launch.env import is_rank_zero, run_id

# src/project/engine/config/compose.py -> repo root (the folder that holds `configs/`).
ROOT_DIR = Path(__file__).resolve().parents[4]
CONFIG_DIR = ROOT_DIR / "configs"


def register_resolvers() -> None:
    """Idempotent: safe to call from every entry point."""
    if not OmegaConf.has_resolver("run_id"):
        OmegaConf.register_new_resolver("run_id", run_id)
    if not OmegaConf.has_resolver("root_dir"):
        OmegaConf.register_new_resolver("root_dir", lambda: str(ROOT_DIR))
    if not OmegaConf.has_resolver("config_subdir"):
        OmegaConf.register_new_resolver("config_subdir", config_subdir)


def config_subdir(name: str, run_dir: str) -> str | None:
    """Where Hydra saves this attempt's config snapshot, relative to the run folder.

    Global rank 0 only (other ranks: null, nothing written). A run folder's first attempt gets
    `name` (.hydra/); a later attempt in the same folder (resume, restart, requeue, the same
    RUN_ID again) gets `name/attempt-N/`, so the record of how the run began is never
    overwritten, also not by an attempt whose config is then refused.
    """
    if not is_rank_zero():
        return None
    first = Path(run_dir) / name
    if not (first / "config.yaml").exists():
        return name
    n = 1
    while (first / f"attempt-{n}").exists():
        n += 1
    return f"{name}/attempt-{n}"


def to_plain(cfg: Any) -> Any:
    """DictConfig/ListConfig -> plain dicts/lists, resolved (for checkpoints and loggers)."""
    if isinstance(cfg, DictConfig) or OmegaConf.is_list(cfg):
        return OmegaConf.to_container(cfg, resolve=True)
    return cfg


def to_plain_tree(tree: Any) -> Any:
    """`to_plain` all through plain dicts and lists too: a checkpoint's entries that hold an
    OmegaConf container somewhere inside (weights_only loading refuses those)."""
    if isinstance(tree, dict):
        return {k: to_plain_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [to_plain_tree(v) for v in tree]
    return to_plain(tree)


def targets(node: Any, prefix: str) -> Iterator[tuple[str, str]]:
    """(dotted key, class path) of every `_target_` below `node`."""
    if isinstance(node, DictConfig):
        for key in node:
            value = node._get_node(key)
            if key == "_target_" and isinstance(value._value(), str):
                yield f"{prefix}{key}", value._value()
            else:
                yield from targets(value, f"{prefix}{key}.")


def check_targets(
    cfg: DictConfig, groups: tuple[str, ...] = ("model", "data"), skip: Collection[str] = ()
) -> None:
    """Every `_target_` of these groups (but the keys in `skip`) names something that exists:
    else one line naming the key, before any process group or data is set up (Hydra would say
    it deep inside fit)."""
    for group in groups:
        for key, target in targets(cfg.get(group), f"{group}."):
            if key in skip:
                continue
            module, _, name = target.rpartition(".")
            try:
                found = hasattr(importlib.import_module(module), name) if module else False
            except ModuleNotFoundError as err:
                raise UserError(
                    f"{key}={target} cannot be imported ({err}): check the module path "
                    "(your code lives in src/<package>/models, data, tasks)"
                ) from None
            if not found:
                raise UserError(f"{key}={target}: {module or 'no module'} has no {name!r}")
