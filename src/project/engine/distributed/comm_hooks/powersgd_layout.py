"""PowerSGD's state in one fixed layout, whatever DDP's bucket layout: what makes a resumed
PowerSGD run bitwise the uninterrupted one (BucketLayouts says why and how).

torch's powerSGD_hook gets a `FixedBucket` (the bucket's gradients copied into the fixed
layout) and PowerSGD's per-bucket state follows the parameters when DDP regroups its buckets.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

ALIGN_BYTES = 64  # each gradient in PowerSGD's buffer starts on a 64-byte boundary


@dataclass(frozen=True)
class Layout:
    """One DDP bucket's gradients in the fixed layout, worked out once per DDP layout."""

    names: tuple[str, ...]  # its parameters in the model's order: the fixed layout's order
    ddp_slots: tuple[tuple[int, int], ...]  # per gradient in DDP's order: (offset, numel)
    order: tuple[int, ...]  # per fixed-layout position: the gradient's place in DDP's order
    length: int


class BucketLayouts:
    """PowerSGD sees every bucket in one fixed layout, whatever DDP's is, so a resume is exact.

    DDP lays a bucket out in parameter order for the first step of every process and in the
    order gradients became ready afterwards (sometimes with other members), and the CPU's
    matrix kernels round differently for a matrix at another 16-byte alignment. So while
    PowerSGD compresses, the hook hands it a copy of the bucket with its gradients in the
    model's parameter order, each starting on a 64-byte boundary, and copies the result back
    into DDP's buffer: PowerSGD's per-bucket state (error feedback, P and Q, flat tensors in
    that order) and every rounding are then the same in a resumed run as in the
    uninterrupted one.

    PowerSGD keys its state by `bucket.index()`; the hook gives it a key per set of members
    instead (`key`). When DDP regroups, a new key's state is assembled from the slices of
    the keys that held its parameters, and a key is dropped once none of its parameters is
    left with it. Every bucket goes through the hook once per step, so by the end of every
    step each key holds all of its parameters: nothing is pending between steps, where
    checkpoints are written (`saved` checks it).
    """

    def __init__(self, state: Any, named_parameters: Any) -> None:
        self.state = state
        named = list(named_parameters)
        self.by_id = {id(p): name for name, p in named}
        self.position = {name: i for i, (name, _) in enumerate(named)}
        self.shapes = {name: tuple(p.shape) for name, p in named}
        self.itemsize = {name: p.element_size() for name, p in named}
        self.names: dict[int, tuple[str, ...]] = {}  # key -> its parameters, in order
        self.owner: dict[str, int] = {}  # parameter -> the key whose state holds its slices
        self.whole: dict[tuple[str, ...], int] = {}  # members -> the key holding all of them
        self.seen: dict[tuple[int, ...], Layout] = {}  # DDP's members (ids, its order)
        self.cache: dict[tuple[str, ...], Any] = {}  # members -> slots, slices
        self.gloo: dict[str, bool] = {}  # device type -> whether its collectives run on gloo

    def hook(self, state, bucket):  # no annotations: DDP checks them against dist.GradBucket
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        if state.iter < state.start_powerSGD_iter:
            # torch's plain all-reduce (and its step count) on DDP's own bucket: an all-reduce
            # is element-wise, the fixed layout would change nothing but cost two copies.
            return powerSGD_hook.powerSGD_hook(state, bucket)
        layout = self.layout_of(bucket)
        fixed = FixedBucket(bucket, layout, self.key(layout.names))
        with cuda_rng_kept():
            done = powerSGD_hook.powerSGD_hook(state, fixed)
        if self.one_at_a_time(fixed.buffer().device.type):
            # PowerSGD starts its second and third all-reduce from callbacks, which gloo runs
            # on its own threads: with two buckets in flight, the ranks issued them in other
            # orders and hung or aborted. One bucket at a time keeps every rank's order.
            done.wait()
        return done.then(fixed.copy_back)

    def one_at_a_time(self, device_type: str) -> bool:
        """Whether the process group runs this device's collectives on gloo (the backend
        decides, not the tensors: gloo on CUDA tensors has the same callback threads)."""
        if device_type not in self.gloo:
            import torch.distributed as dist

            backend = str(dist.get_backend(self.state.process_group))
            if ":" in backend:  # "cpu:gloo,cuda:nccl": a backend per device type
                backend = dict(p.split(":", 1) for p in backend.split(",")).get(device_type, "")
            self.gloo[device_type] = backend == "gloo"
        return self.gloo[device_type]

    def layout_of(self, bucket: Any) -> Layout:
        """The fixed layout of a DDP bucket (computed the first time DDP lays it out so)."""
        params = bucket.parameters()
        ids = tuple(id(p) for p in params)
        if ids not in self.seen:
            ddp_names = [self.by_id[i] for i in ids]
            names = tuple(sorted(ddp_names, key=self.position.__getitem__))
            slots, length = self.slots(names)
            self.seen[ids] = Layout(
                names, tuple(slots[n] for n in ddp_names),
                tuple(ddp_names.index(n) for n in names), length,
            )  # fmt: skip
        return self.seen[ids]

    def slots(self, names: Any) -> tuple[dict[str, tuple[int, int]], int]:
        """Each parameter's (offset, length) in the fixed layout (64-byte aligned, in `names`
        order), and the layout's length."""
        names = tuple(names)
        if ("slots", names) not in self.cache:
            out, offset = {}, 0
            for name in names:
                numel, align = math.prod(self.shapes[name]), ALIGN_BYTES // self.itemsize[name]
                out[name] = (offset, numel)
                offset += -(-numel // align) * align
            self.cache["slots", names] = (out, offset)
        return self.cache["slots", names]

    def slices(self, names: Any) -> dict[str, dict[str, tuple[int, int]]]:
        """Each parameter's (offset, length) in the bucket's error, P and Q tensors (the error
        in the fixed layout; P and Q as powerSGD_hook groups them: by matrix shape, first seen
        first)."""
        from project.engine.private_api import powersgd_compresses

        names = tuple(names)
        if ("slices", names) in self.cache:
            return self.cache["slices", names]
        out: dict[str, dict[str, tuple[int, int]]] = {}
        groups: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
        for name, (offset, numel) in self.slots(names)[0].items():
            out[name] = {"error": (offset, numel)}
            n, m = self.shapes[name][0], numel // self.shapes[name][0]
            rank = min(n, m, self.state.matrix_approximation_rank)
            if powersgd_compresses(n, m, rank, self.state.min_compression_rate):
                groups.setdefault((n, m), []).append((name, n * rank, m * rank))
        p = q = 0
        for members in groups.values():
            for name, p_len, q_len in members:
                out[name].update(p=(p, p_len), q=(q, q_len))
                p, q = p + p_len, q + q_len
        self.cache["slices", names] = out
        return out

    def tables(self) -> dict[str, dict[int, Any]]:
        """PowerSGD's per-bucket tensors: the error feedback, the P and the Q factors."""
        s = self.state
        return {"error": s.error_dict, "p": s.p_memory_dict, "q": s.q_memory_dict}

    def key(self, names: tuple[str, ...]) -> int:
        """PowerSGD's key for a bucket of `names`: the key holding all their state, or a new
        one assembled from the slices of the keys holding it."""
        if names in self.whole:
            return self.whole[names]
        key = max(self.names, default=-1) + 1
        for table, flat in self.assembled(names).items():
            self.tables()[table][key] = flat
        old = {self.owner[n] for n in names if n in self.owner}
        self.names[key], self.whole[names] = names, key
        self.owner.update(dict.fromkeys(names, key))
        for k in old:
            if self.whole.get(self.names[k]) == k:
                del self.whole[self.names[k]]  # lost a parameter: no longer a bucket's key
            if all(self.owner[n] != k for n in self.names[k]):
                del self.names[k]
                for table in self.tables().values():
                    table.pop(k, None)
        return key

    def assembled(self, names: tuple[str, ...]) -> dict[str, Any]:
        """The error, P and Q tensors of a bucket of `names`, from their owners' slices; a
        table is left out unless every parameter's owner has it (PowerSGD then starts it
        afresh, as for a new bucket)."""
        import torch

        where, out = self.slices(names), {}
        for table_name, table in self.tables().items():
            sources = [self.owner.get(n) for n in names]
            if not all(s in table for s in sources):
                continue
            pairs = zip(names, sources, strict=True)
            members = [(n, s) for n, s in pairs if table_name in where[n]]
            first = table[sources[0]]
            length = (self.slots(names)[1] if table_name == "error"
                      else sum(where[n][table_name][1] for n, _ in members))  # fmt: skip
            flat = torch.zeros(length, dtype=first.dtype, device=first.device)
            for name, source in members:
                start, numel = where[name][table_name]
                was = self.slices(self.names[source])[name][table_name][0]
                flat[start : start + numel] = table[source][was : was + numel]
            out[table_name] = flat
        return out

    def saved(self) -> dict[int, list[str]]:
        """Every key's members, for a checkpoint (written between steps)."""
        pending = [k for k, names in self.names.items() if self.whole.get(names) != k]
        if pending:  # not an assert: `python -O` must not save incomplete state silently
            raise RuntimeError(f"PowerSGD state of keys {pending} is split mid-regrouping")
        return {k: list(names) for k, names in self.names.items()}

    def restore(self, layouts: dict[int, tuple[str, ...]]) -> None:
        """The keys of a loaded state (only those with state: older files also list keys
        whose state had moved, and hold state no key lists)."""
        tables = self.tables().values()
        self.names = {k: n for k, n in layouts.items() if any(k in t for t in tables)}
        for table in tables:
            for k in set(table) - set(self.names):
                del table[k]
        self.owner = {name: k for k, names in self.names.items() for name in names}
        self.whole = {n: k for k, n in self.names.items() if all(self.owner[x] == k for x in n)}


class FixedBucket:
    """A DDP bucket's gradients copied into the fixed layout of `BucketLayouts`; the methods
    of `dist.GradBucket` that powerSGD_hook calls (`index` is the state's key)."""

    def __init__(self, bucket: Any, layout: Layout, key: int) -> None:
        self.bucket, self.layout, self.key = bucket, layout, key
        self._buffer = bucket.buffer().new_zeros(layout.length)
        self.ddp_grads = bucket.gradients()
        views = []
        for (start, numel), grad in zip(layout.ddp_slots, self.ddp_grads, strict=True):
            views.append(self._buffer[start : start + numel].view_as(grad).copy_(grad))
        self._grads = [views[i] for i in layout.order]

    def buffer(self) -> Any:
        return self._buffer

    def gradients(self) -> list[Any]:
        return self._grads

    def index(self) -> int:
        return self.key

    def is_last(self) -> bool:
        return self.bucket.is_last()

    def copy_back(self, fut: Any) -> Any:
        """PowerSGD's result (the fixed layout) into DDP's bucket buffer, which DDP reads."""
        result = fut.value()
        for (start, numel), grad in zip(self.layout.ddp_slots, self.ddp_grads, strict=True):
            grad.copy_(result[start : start + numel].view_as(grad))
        return self.bucket.buffer()


@contextlib.contextmanager
def cuda_rng_kept() -> Iterator[None]:
    """torch's powerSGD_hook draws new factors after `torch.manual_seed` inside
    `fork_rng(devices=[])`: the CPU generator comes back, every CUDA generator stays reseeded
    (GPU dropout after a resume would differ from the uninterrupted run). Put them back.
    CUDA not initialised (a model on the CPU): no CUDA generator to keep (torch queues the
    seed for a CUDA start that such a run never makes)."""
    import torch

    if not torch.cuda.is_initialized():
        yield
        return
    states = torch.cuda.get_rng_state_all()
    try:
        yield
    finally:
        torch.cuda.set_rng_state_all(states)
