"""Hydra/OmegaConf resolvers and config helpers. Light imports only (no torch, no Lightning):
this runs before `--help` and `--cfg job` answer.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

# src/project/config.py -> repo root (the folder that holds `configs/`).
ROOT_DIR = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT_DIR / "configs"

_run_id: str | None = None


def run_id() -> str:
    """A name for this run, the same in every process of the run.

    Order: env RUN_ID (set it to resume a run, or to name one across nodes) -> the torchrun
    job id (shared by all ranks and kept across `--max-restarts`; agreed through torchrun's
    store when it has none) -> SLURM job id + a digest of the command's overrides (a requeued
    job reruns the same command and finds its folder; two different runs inside one
    allocation do not share one) -> a fresh timestamp with a random suffix (so two runs
    started in the same second never collide).
    """
    global _run_id
    if _run_id is None:
        fresh = time.strftime("%Y-%m-%d_%H-%M-%S") + "_" + secrets.token_hex(2)
        elastic = os.environ.get("TORCHELASTIC_RUN_ID")
        if os.environ.get("RUN_ID"):
            _run_id = os.environ["RUN_ID"]
        elif elastic not in (None, "", "none"):
            _run_id = f"torchrun-{elastic}"
        elif elastic is not None:  # torchrun without a job id: the ranks agree on one
            from project.ddp import shared_run_id

            _run_id = shared_run_id(fresh)
        elif os.environ.get("SLURM_JOB_ID"):
            _run_id = f"slurm-{os.environ['SLURM_JOB_ID']}-{command_digest(sys.argv[1:])}"
        else:
            _run_id = fresh
    return _run_id


def command_digest(overrides: list[str]) -> str:
    """6 hex digits naming a set of overrides (order-free; Hydra's own `hydra.*` ignored)."""
    kept = sorted(o for o in overrides if not o.startswith("hydra."))
    return hashlib.sha1("\0".join(kept).encode()).hexdigest()[:6]


def is_rank_zero() -> bool:
    """True in the process that is (or will be) global rank 0, judged from the launcher's env.

    torchrun and SLURM set RANK / SLURM_PROCID; Lightning's own launcher sets only LOCAL_RANK
    and NODE_RANK on the processes it starts.
    """
    for key in ("RANK", "SLURM_PROCID"):
        if key in os.environ:
            return int(os.environ[key]) == 0
    node = os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0"))
    return int(os.environ.get("LOCAL_RANK", 0)) == 0 and int(node) == 0


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
