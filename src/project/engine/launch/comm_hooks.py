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

import logging
import math
from pathlib import Path
from typing import Any

from project.engine.errors import UserError

log = logging.getLogger(__name__)

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
        for index, names in self.layouts.names.items():
            error = saved.get("error_dict", {}).get(index)
            if error is not None and len(error) != self.layouts.slots(names)[1]:
                raise UserError(
                    "the PowerSGD state beside this checkpoint has another layout (written by "
                    "an older template): start a new run from its weights (ckpt_path=... with "
                    "another RUN_ID)"
                )
        self.state.rng.set_state(numpy_state_loaded(saved.pop("rng")))
        for key, value in saved.items():
            setattr(self.state, key, value)


ALIGN = 16  # elements: each gradient in PowerSGD's buffer starts on a 64-byte boundary


class BucketLayouts:
    """PowerSGD sees every bucket in one fixed layout, whatever DDP's is, so a resume is exact.

    DDP lays a bucket out in parameter order for the first step of every process and in the
    order gradients became ready afterwards (sometimes with other members), and the CPU's
    matrix kernels round differently for a matrix at another 16-byte alignment. So the hook
    hands PowerSGD a copy of the bucket with its gradients in the model's parameter order, each
    starting on a 64-byte boundary, and copies the result back into DDP's buffer: PowerSGD's
    per-bucket state (error feedback, P and Q, flat tensors in that order) and every rounding
    are then the same in a resumed run as in the uninterrupted one. When a bucket's members
    change, every parameter's slice of the state moves with it.
    """

    def __init__(self, state: Any, named_parameters: Any) -> None:
        self.state = state
        named = list(named_parameters)
        self.by_id = {id(p): name for name, p in named}
        self.position = {name: i for i, (name, _) in enumerate(named)}
        self.shapes = {name: tuple(p.shape) for name, p in named}
        self.names: dict[int, list[str]] = {}  # bucket index -> its parameters, in order
        self.pieces: dict[str, dict[str, Any]] = {}  # per parameter, while buckets move

    def hook(self, state, bucket):  # no annotations: DDP checks them against dist.GradBucket
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        ddp_names = [self.by_id[id(p)] for p in bucket.parameters()]
        names = sorted(ddp_names, key=self.position.__getitem__)
        index = bucket.index()
        if self.names.get(index, names) != names:
            self.split_all()
        self.names[index] = names
        if self.pieces and all(n in self.pieces for n in names):
            self.join(index, names)
        fixed = FixedBucket(bucket, ddp_names, names, *self.slots(names))
        done = powerSGD_hook.powerSGD_hook(state, fixed)
        if not fixed.buffer().is_cuda:
            # PowerSGD starts its second and third all-reduce from callbacks, which gloo runs
            # on its own threads: with two buckets in flight, the ranks issued them in other
            # orders and hung or aborted. One bucket at a time keeps every rank's order.
            done.wait()
        return done.then(fixed.copy_back)

    def slots(self, names: list[str]) -> tuple[dict[str, tuple[int, int]], int]:
        """Each parameter's (offset, length) in the fixed layout (aligned, in `names` order),
        and the layout's length."""
        out, offset = {}, 0
        for name in names:
            numel = math.prod(self.shapes[name])
            out[name] = (offset, numel)
            offset += -(-numel // ALIGN) * ALIGN
        return out, offset

    def tables(self) -> dict[str, dict[int, Any]]:
        """PowerSGD's per-bucket tensors: the error feedback, the P and the Q factors."""
        s = self.state
        return {"error": s.error_dict, "p": s.p_memory_dict, "q": s.q_memory_dict}

    def slices(self, names: list[str]) -> dict[str, dict[str, tuple[int, int]]]:
        """Each parameter's (offset, length) in the bucket's error, P and Q tensors (the error
        in the fixed layout; P and Q as powerSGD_hook groups them: by matrix shape, first seen
        first)."""
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

        out: dict[str, dict[str, tuple[int, int]]] = {}
        groups: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
        for name, (offset, numel) in self.slots(names)[0].items():
            out[name] = {"error": (offset, numel)}
            n, m = self.shapes[name][0], numel // self.shapes[name][0]
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
        lengths = {"error": self.slots(names)[1]}
        for key, table in self.tables().items():
            members = [n for n in names if key in where[n]]
            if not members or not all(key in self.pieces[n] for n in members):
                continue
            end = max(sum(where[n][key]) for n in members)
            flat = torch.zeros(lengths.get(key, end), dtype=self.pieces[members[0]][key].dtype,
                               device=self.pieces[members[0]][key].device)  # fmt: skip
            for name in members:
                start, length = where[name][key]
                flat[start : start + length] = self.pieces[name][key]
            table[index] = flat
        for name in names:
            self.pieces.pop(name, None)


class FixedBucket:
    """A DDP bucket's gradients copied into the fixed layout of `BucketLayouts`; the methods
    of `dist.GradBucket` that powerSGD_hook calls."""

    def __init__(
        self, bucket: Any, ddp_names: list[str], names: list[str], slots: dict, length: int
    ) -> None:
        self.bucket, self.slots = bucket, slots
        self._buffer = bucket.buffer().new_zeros(length)
        self.ddp_grads = dict(zip(ddp_names, bucket.gradients(), strict=True))
        self._grads = []
        for name in names:
            start, numel = slots[name]
            view = self._buffer[start : start + numel].view_as(self.ddp_grads[name])
            self._grads.append(view.copy_(self.ddp_grads[name]))

    def buffer(self) -> Any:
        return self._buffer

    def gradients(self) -> list[Any]:
        return self._grads

    def index(self) -> int:
        return self.bucket.index()

    def is_last(self) -> bool:
        return self.bucket.is_last()

    def copy_back(self, fut: Any) -> Any:
        """PowerSGD's result (the fixed layout) into DDP's bucket buffer, which DDP reads."""
        result = fut.value()
        for name, grad in self.ddp_grads.items():
            start, numel = self.slots[name]
            grad.copy_(result[start : start + numel].view_as(grad))
        return self.bucket.buffer()


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
    `required` (an explicit ckpt_path, e.g. of a run without PowerSGD): start it afresh.
    Written by another number of processes (an elastic restart with fewer or more nodes):
    start afresh with one warning, on every rank alike, since error feedback is per rank and
    cannot be redistributed."""
    if hook is None or not hook.stateful:
        return
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    path = state_file(last, step, rank)
    if not path.is_file() and not required:
        return
    # A rank the saving run did not have reads rank 0's file for its world size.
    found = path if path.is_file() else state_file(last, step, 0)
    saved = torch.load(found, map_location=device, weights_only=True) if found.is_file() else {}
    saved_world = saved.pop("world_size", None)
    if saved_world is not None and saved_world != world:
        if rank == 0:
            log.warning(
                f"PowerSGD state of step {step} was written by {saved_world} processes, this run "
                f"has {world}: PowerSGD starts afresh (its per-rank error feedback cannot be "
                "redistributed)"
            )
        return
    if not path.is_file():
        raise UserError(
            f"{path.name} is missing beside {last.name}: the PowerSGD state of rank {rank} at "
            f"step {step} cannot be restored (files moved or deleted); start a new run from "
            f"the weights: ckpt_path={last} with another RUN_ID"
        )
    hook.load_state_dict(saved)


def _bf16_gloo(state, bucket):  # no annotations: DDP checks them against dist.GradBucket
    """torch's bf16 hook, off CUDA: DDP refuses `bf16_compress_hook` by name unless it runs on
    CUDA with NCCL >= 2.10, but gloo all-reduces bfloat16 on CPU (tests/test_comm_hooks.py)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)
