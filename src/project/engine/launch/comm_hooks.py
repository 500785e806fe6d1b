"""DDP gradient-communication hooks from config (`strategy.comm_hook`), the same in both trainers.

    strategy=ddp_fp16       gradients all-reduced as float16 (half the bytes), then restored
    strategy=ddp_bf16       the same in bfloat16 (float32's range, fewer mantissa bits)
    strategy=ddp_powersgd   PowerSGD: low-rank gradient compression with error feedback

Lightning's DDPStrategy registers its `ddp_comm_hook` only on CUDA and ignores it elsewhere;
the template's strategy (project.engine.lightning.strategy) and the raw trainer both call
`CommHook.register` on their DDP model on every device, so what runs on a CPU test machine is
what runs on GPUs.

PowerSGD keeps state on every rank (its error-feedback memory, low-rank factors and step
counter) that differs between ranks: `state_dict()` / `load_state_dict()` carry it through a
checkpoint, one file per rank beside the last checkpoint (project.engine.checkpoints.state).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from project.engine.errors import UserError

KINDS = ("fp16", "bf16", "powersgd")
POWERSGD_KEYS = (
    "matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate",
    "use_error_feedback", "warm_start", "orthogonalization_epsilon", "random_seed",
    "batch_tensors_with_same_shape",
)  # fmt: skip


class CommHook:
    """One hook: `kind` and, for PowerSGD, the PowerSGDState arguments."""

    def __init__(self, kind: str, **powersgd: Any) -> None:
        if kind not in KINDS:
            raise UserError(f"strategy.comm_hook.kind={kind!r} is not one of {', '.join(KINDS)}")
        unknown = sorted(set(powersgd) - set(POWERSGD_KEYS))
        if unknown or (powersgd and kind != "powersgd"):
            key = unknown[0] if unknown else sorted(powersgd)[0]
            raise UserError(
                f"strategy.comm_hook.{key} is not an option of the {kind} hook: see "
                "configs/strategy/ddp_powersgd.yaml"
            )
        self.kind, self.powersgd = kind, powersgd
        self.state: Any = None  # PowerSGD's per-rank state, once registered

    def register(self, model: Any) -> None:
        """Register on a DistributedDataParallel model (before its first backward)."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        if self.kind == "fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif self.kind == "bf16":
            on_cuda = next(model.parameters()).is_cuda
            hook = default_hooks.bf16_compress_hook if on_cuda else _bf16_gloo
            model.register_comm_hook(None, hook)
        else:
            self.state = powerSGD_hook.PowerSGDState(process_group=None, **self.powersgd)
            self.layouts = BucketLayouts(self.state, model.module.named_parameters())
            model.register_comm_hook(self.state, self.layouts.hook)

    @property
    def stateful(self) -> bool:
        """Whether this hook has per-rank state a checkpoint must carry (PowerSGD)."""
        return self.kind == "powersgd"

    def state_dict(self) -> dict[str, Any]:
        """This rank's PowerSGD state (tensors and plain values: loads with weights_only)."""
        if self.state is None:
            return {}
        from project.engine.checkpoints.state import numpy_state_saved

        slots = [s for s in type(self.state).__slots__ if s not in ("process_group", "rng")]
        rng = numpy_state_saved(self.state.rng.get_state())
        state = {s: getattr(self.state, s) for s in slots} | {"rng": rng}
        return state | {"layouts": {i: list(names) for i, names in self.layouts.names.items()}}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue from this rank's saved PowerSGD state."""
        from project.engine.checkpoints.state import numpy_state_loaded

        saved = dict(saved)
        self.layouts.names = {int(i): list(n) for i, n in saved.pop("layouts", {}).items()}
        self.state.rng.set_state(numpy_state_loaded(saved.pop("rng")))
        for key, value in saved.items():
            setattr(self.state, key, value)


class BucketLayouts:
    """PowerSGD's state follows the parameters when DDP lays its buckets out anew.

    PowerSGD keeps its per-rank state per gradient bucket, as flat tensors in the order of the
    bucket's parameters. DDP builds its buckets in parameter order and rebuilds them after the
    first step of every process, in the order gradients became ready. A run resumed from a
    checkpoint therefore takes its first step with another layout than the one the saved state
    was made with. This hook records each bucket's layout and, when it changes, moves every
    parameter's slice of the error, P and Q tensors to its new place. (The resumed run then
    ends within the last bits of the uninterrupted one, not bitwise: that first step runs
    PowerSGD's matrix products on tensors at other buffer offsets; docs/fault-tolerance.md.)
    """

    def __init__(self, state: Any, named_parameters: Any) -> None:
        self.state = state
        named = list(named_parameters)
        self.by_id = {id(p): name for name, p in named}
        self.shapes = {name: tuple(p.shape) for name, p in named}
        self.names: dict[int, list[str]] = {}  # bucket index -> its parameters, in order
        self.pieces: dict[str, dict[str, Any]] = {}  # per parameter, while buckets move

    def hook(self, state, bucket):  # no annotations: DDP checks them against dist.GradBucket
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        names = [self.by_id[id(p)] for p in bucket.parameters()]
        index = bucket.index()
        if self.names.get(index, names) != names:
            self.split_all()
        self.names[index] = names
        if self.pieces and all(n in self.pieces for n in names):
            self.join(index, names)
        return powerSGD_hook.powerSGD_hook(state, bucket)

    def tables(self) -> dict[str, dict[int, Any]]:
        """PowerSGD's per-bucket tensors: the error feedback, the P and the Q factors."""
        s = self.state
        return {"error": s.error_dict, "p": s.p_memory_dict, "q": s.q_memory_dict}

    def slices(self, names: list[str]) -> dict[str, dict[str, tuple[int, int]]]:
        """Each parameter's (offset, length) in the bucket's error, P and Q tensors (as
        powerSGD_hook lays them out: P and Q grouped by matrix shape, first seen first)."""
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

        out: dict[str, dict[str, tuple[int, int]]] = {}
        offset, groups = 0, {}
        for name in names:
            shape = self.shapes[name]
            numel = math.prod(shape)
            out[name] = {"error": (offset, numel)}
            offset += numel
            n, m = shape[0], numel // shape[0]
            rank = min(n, m, self.state.matrix_approximation_rank)
            if _should_compress(n, m, rank, self.state.min_compression_rate)[0]:
                groups.setdefault((n, m), []).append((name, n * rank, m * rank))
        p = q = 0
        for members in groups.values():
            for name, p_len, q_len in members:
                out[name].update(p=(p, p_len), q=(q, q_len))
                p, q = p + p_len, q + q_len
        return out

    def split_all(self) -> None:
        """Every bucket's state into per-parameter pieces (by the layouts it was made with)."""
        dicts = self.tables()
        for index, names in self.names.items():
            for name, where in self.slices(names).items():
                for key, (start, length) in where.items():
                    if index in dicts[key]:
                        flat = dicts[key][index]
                        self.pieces.setdefault(name, {})[key] = flat[start : start + length]
            for table in dicts.values():
                table.pop(index, None)

    def join(self, index: int, names: list[str]) -> None:
        """Bucket `index`'s state, assembled from the pieces in its new layout."""
        import torch

        where = self.slices(names)
        for key, table in self.tables().items():
            parts = [self.pieces[n][key] for n in names if key in where[n]]
            if parts and all(key in self.pieces[n] for n in names if key in where[n]):
                table[index] = torch.cat(parts).clone()
        for name in names:
            self.pieces.pop(name, None)


def state_file(last: Path, step: int | str, rank: int) -> Path:
    """Where rank `rank` keeps its hook state for the checkpoint of optimizer step `step`."""
    return last.with_name(f"{last.stem}.comm_hook.step{step}.rank{rank}.pt")


def save_state(hook: CommHook | None, last: Path, step: int) -> None:
    """Every rank, just before the last checkpoint of `step` is written: its own hook state.
    Named by the step, so a write killed midway never pairs a checkpoint with other state."""
    if hook is None or not hook.stateful:
        return
    import torch.distributed as dist

    from project.engine.checkpoints.state import atomic_save

    rank, world = dist.get_rank(), dist.get_world_size()
    atomic_save({"world_size": world, **hook.state_dict()}, state_file(last, step, rank))


def prune_state(hook: CommHook | None, last: Path, step: int) -> None:
    """After the last checkpoint of `step` is on disk: this rank's older hook states go."""
    if hook is None or not hook.stateful:
        return
    import torch.distributed as dist

    rank = dist.get_rank()
    keep = state_file(last, step, rank)
    for path in last.parent.glob(state_file(last, "*", rank).name):
        if path != keep:
            path.unlink(missing_ok=True)


def load_state(
    hook: CommHook | None, last: Path, step: int, device: Any, required: bool = True
) -> None:
    """On resume from the checkpoint `last` of `step`: this rank's hook state, or one line
    saying why it cannot be restored (training on without it would silently diverge). Not
    `required` (an explicit ckpt_path, e.g. of a run without PowerSGD): start it afresh."""
    if hook is None or not hook.stateful:
        return
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    path = state_file(last, step, rank)
    if not path.is_file() and not required:
        return
    if not path.is_file():
        raise UserError(
            f"{path.name} is missing beside {last.name}: the PowerSGD state of rank {rank} at "
            f"step {step} cannot be restored (another world size, or files moved); start a new "
            f"run from the weights: ckpt_path={last} with another RUN_ID"
        )
    saved = torch.load(path, map_location=device, weights_only=True)
    if saved.pop("world_size") != world:
        raise UserError(
            f"{last} was trained with PowerSGD on another number of processes: its per-rank "
            f"state cannot be restored on {world}; resume with the same world size"
        )
    hook.load_state_dict(saved)


def _bf16_gloo(state, bucket):  # no annotations: DDP checks them against dist.GradBucket
    """torch's bf16 hook, off CUDA: DDP refuses `bf16_compress_hook` by name unless it runs on
    CUDA with NCCL >= 2.10, but gloo all-reduces bfloat16 on CPU (tests/test_comm_hooks.py)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)
