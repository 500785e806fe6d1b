"""`strategy=fsdp` checked before any process group starts, and what `fully_shard` gets.

`check` refuses, in one line each naming the option and the fix, what FSDP cannot do here:
DDP-only options, float16 mixed precision, `model.compile`, SyncBatchNorm, another start
method than popen, a `blocks` class the network lacks or parameters outside it, and (on
several processes) a run folder's one-file `last` to continue. The fault-tolerance `last` of
both trainers is sharded (project.engine.checkpoints.sharded), in a folder or at a URL
(`callbacks.fault_tolerance.dirpath=s3://...`: every rank writes its shards there); the
best-k checkpoints of `callbacks.model_checkpoint` are one file, the whole state gathered; an
explicit `ckpt_path` may be sharded or one file (a DDP run's: each rank keeps its shards of it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from project.engine.errors import UserError

# DistributedDataParallel's options and the template's DDP hook: FSDP has no all-reduce buckets.
DDP_ONLY = ("comm_hook", "find_unused_parameters", "static_graph", "gradient_as_bucket_view",
            "bucket_cap_mb", "broadcast_buffers", "forward_sync_buffers")  # fmt: skip
KEYS = ("_target_", "blocks", "reshard_after_forward", "cpu_offload", "async_save",
        "process_group_backend", "timeout", "step_timeout_s", "start_method")  # fmt: skip
PRECISIONS = {"32-true": None, "32": None, "bf16-mixed": torch.bfloat16}
# Exactly the template's: Lightning's own FSDPStrategy (FSDP1) is another thing with that name.
TARGET = "project.engine.lightning.strategy.FSDPStrategy"


def chosen(strategy_cfg: Any) -> bool:
    """Whether the `strategy` config is the template's FSDPStrategy (configs/strategy/fsdp.yaml)."""
    return (strategy_cfg or {}).get("_target_") == TARGET


@dataclass(frozen=True)
class ShardOptions:
    """What every `fully_shard` call gets, from the strategy config and trainer.precision."""

    reshard_after_forward: bool = True
    param_dtype: torch.dtype | None = None  # bf16-mixed: gathered weights and compute in bf16
    cpu_offload: bool = False

    @classmethod
    def of(cls, strategy: Any, precision: Any) -> ShardOptions:
        return cls(
            reshard_after_forward=bool(strategy.get("reshard_after_forward", True)),
            param_dtype=PRECISIONS.get(str(precision)),
            cpu_offload=bool(strategy.get("cpu_offload", False)),
        )

    def kwargs(self) -> dict[str, Any]:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        # Gradients are reduced in float32 whatever the compute dtype: a sum over ranks in
        # bf16 loses the low bits that the optimizer's small updates live in.
        mp = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32)
        # Pinned host memory needs an accelerator (on a CPU-only machine pinning fails).
        pin = torch.accelerator.is_available()
        offload = CPUOffloadPolicy(pin_memory=pin) if self.cpu_offload else OffloadPolicy()
        return {"reshard_after_forward": self.reshard_after_forward, "mp_policy": mp,
                "offload_policy": offload}  # fmt: skip


def check(cfg: DictConfig, world_size: int) -> None:
    """Everything `strategy=fsdp` refuses that the config alone shows (the checkpoint rules:
    `check_checkpoints`)."""
    strategy = cfg.strategy
    if ddp_only := [k for k in DDP_ONLY if k in strategy]:  # set at all, even to false
        raise UserError(
            f"strategy.{ddp_only[0]} is a DDP option and strategy=fsdp has no all-reduce to "
            "apply it to: drop it, or use strategy=ddp"
        )
    if unknown := sorted(set(strategy) - set(KEYS) - set(DDP_ONLY)):
        raise UserError(
            f"strategy.{unknown[0]} is not an FSDPStrategy option: check the spelling in "
            "configs/strategy/fsdp.yaml"
        )
    precision = str(cfg.trainer.get("precision"))
    if precision not in PRECISIONS:
        why = " (float16 needs a gradient scaler that knows the shards)" * (
            "16" in precision and "bf" not in precision
        )
        raise UserError(
            f"trainer.precision={precision} is not supported with strategy=fsdp{why}: use "
            "bf16-mixed or 32-true"
        )
    if cfg.model.get("compile"):
        raise UserError(
            "model.compile=true is not supported with strategy=fsdp yet (compiling across "
            "the sharded blocks is untested here): set model.compile=false"
        )
    callbacks = cfg.get("callbacks") or {}
    sync_bn = [f"callbacks.{k}.sync_batchnorm" for k, v in callbacks.items()
               if isinstance(v, (dict, DictConfig)) and v.get("sync_batchnorm")]  # fmt: skip
    if cfg.trainer.get("sync_batchnorm"):
        sync_bn.insert(0, "trainer.sync_batchnorm")
    if sync_bn:
        raise UserError(
            f"{sync_bn[0]}=true is not supported with strategy=fsdp (SyncBatchNorm is a DDP "
            "conversion): set it false, or use strategy=ddp"
        )
    start = strategy.get("start_method") or "popen"
    if start != "popen":
        raise UserError(
            f"strategy.start_method={start}: strategy=fsdp starts ranks only as popen "
            "(Lightning's ModelParallelStrategy): set strategy.start_method=popen or use torchrun"
        )
    check_network(cfg)


def check_network(cfg: DictConfig) -> None:
    """`blocks` and the parameters outside the network, on the network built on the meta
    device (no memory, no random draws): a typo answers in a second, not after start-up. A
    network that cannot be built there is checked when it is sharded."""
    from project.engine.distributed.fsdp.plan import (
        check_parameters_in_net,
        check_running_statistics,
        named_blocks,
    )
    from project.tasks.task import build_task

    try:
        with torch.device("meta"):
            task = build_task(cfg.model.task, cfg.model.net)
    except Exception:
        return
    if blocks := cfg.strategy.get("blocks"):
        named_blocks(task.net, blocks)
    check_parameters_in_net(task)
    check_running_statistics(task.net)


def check_checkpoints(cfg: DictConfig, resume: Path | str | None) -> None:
    """On several processes: a run folder's one-file `last` to continue is one line (an
    explicit `ckpt_path` may be one file)."""
    url = "://" in str(resume)  # a sharded `last`'s folder by URL (checkpoints.remote.is_url)
    if resume is not None and not url and not Path(resume).is_dir() and not cfg.get("ckpt_path"):
        raise UserError(
            f"this run folder's {Path(resume).name} is a one-file checkpoint, which strategy=fsdp "
            "on several processes cannot load (it resumes sharded ones): resume it with the "
            "strategy it was written with, or start a new run (another RUN_ID)"
        )
