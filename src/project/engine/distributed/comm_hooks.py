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
Every rank saves and loads its file at the same point, and the ranks agree on the outcome
(`agreed`): one rank's missing, unreadable or unwritable file stops all of them with the same
line, instead of one rank failing while the others wait in their next collective.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
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
# What a rank found when it read its state file; the ranks act on the highest of them.
OK, CHANGED, UNREADABLE, ABSENT, OTHER_WORLD = range(5)


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
        self.device: Any = None  # the model's device, once registered

    def register(self, model: Any) -> None:
        """Register on a DistributedDataParallel model (before its first backward)."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        self.device = next(model.parameters()).device
        if self.kind == "fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif self.kind == "bf16":
            hook = default_hooks.bf16_compress_hook if self.device.type == "cuda" else _bf16_gloo
            model.register_comm_hook(None, hook)
        else:
            self.state = powerSGD_hook.PowerSGDState(process_group=None, **self.powersgd)
            self.layouts = BucketLayouts(self.state, model.module.named_parameters())
            model.register_comm_hook(self.state, self.layouts.hook)

    @property
    def stateful(self) -> bool:
        """Whether this hook has per-rank state a checkpoint must carry (PowerSGD)."""
        return self.kind == "powersgd"

    def config(self) -> dict[str, Any]:
        """Every PowerSGDState argument as this run uses it (torch's default where not set)."""
        import inspect

        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        defaults = inspect.signature(PowerSGDState.__init__).parameters
        return {key: self.powersgd.get(key, defaults[key].default) for key in POWERSGD_KEYS}

    def state_dict(self) -> dict[str, Any]:
        """This rank's PowerSGD state (tensors and plain values: loads with weights_only)."""
        if self.state is None:
            return {}
        from project.engine.checkpoints.state import numpy_state_saved
        from project.engine.private_api import powersgd_slots

        slots = [s for s in powersgd_slots(self.state) if s not in ("process_group", "rng")]
        rng = numpy_state_saved(self.state.rng.get_state())
        state = {s: getattr(self.state, s) for s in slots} | {"rng": rng}
        return state | {"config": self.config(), "layouts": self.layouts.saved()}

    def check(self, saved: dict[str, Any], last: Path | None = None) -> tuple[int, str]:
        """(OK, "") when `saved` can continue this run; else (CHANGED or UNREADABLE, the
        problem + "\\n" + its fix)."""
        where = f"beside {last.name}" if last else "beside this checkpoint"
        ckpt = f"ckpt_path={last or '...'}"
        new_run = f"start a new run from its weights ({ckpt} with another RUN_ID)"
        layouts = {int(i): list(n) for i, n in saved.get("layouts", {}).items()}
        for index, names in layouts.items():
            error = saved.get("error_dict", {}).get(index)
            unknown = any(n not in self.layouts.shapes for n in names)  # another model
            if unknown or (error is not None and len(error) != self.layouts.slots(names)[1]):
                return UNREADABLE, (
                    f"the PowerSGD state {where} has another layout (written by an older "
                    f"template, or for another model)\n{new_run}"
                )
        # Saved before `config` was: the hyperparameters are PowerSGDState's own slots.
        before = {k: saved[k] for k in POWERSGD_KEYS if k in saved} | saved.get("config", {})
        for key, now in self.config().items():
            if key in before and before[key] != now:
                return CHANGED, (
                    f"strategy.comm_hook.{key}={now!r} differs from the {before[key]!r} the "
                    f"PowerSGD state {where} was saved with\nresume with "
                    f"strategy.comm_hook.{key}={before[key]!r}, or {new_run}; PowerSGD starts "
                    "afresh there"
                )
        return OK, ""

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue from this rank's saved PowerSGD state (one line if it cannot)."""
        from project.engine.checkpoints.state import numpy_state_loaded

        code, problem = self.check(saved)
        if code != OK:
            raise UserError(problem.replace("\n", "; "))
        saved = dict(saved)
        saved.pop("config", None)
        layouts = {int(i): tuple(n) for i, n in saved.pop("layouts", {}).items()}
        self.state.rng.set_state(numpy_state_loaded(saved.pop("rng")))
        for key, value in saved.items():
            setattr(self.state, key, value)
        self.layouts.restore(layouts)


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


def state_file(last: Path, step: int | str, rank: int) -> Path:
    """Where rank `rank` keeps its hook state for the checkpoint of optimizer step `step`."""
    return last.with_name(f"{last.stem}.comm_hook.step{step}.rank{rank}.pt")


def save_state(hook: CommHook | None, last: Path, step: int) -> None:
    """Every rank, just before the last checkpoint of `step` is written: its own hook state.
    Named by the step, so a write killed midway never pairs a checkpoint with other state.
    A write that fails on any rank stops every rank with the same line."""
    if hook is None or not hook.stateful:
        return
    from project.engine.checkpoints.state import atomic_save

    rank, world = rank_and_world()
    path = state_file(last, step, rank)
    # Complete: checkpoints are written between optimizer steps, when no part of PowerSGD's
    # state waits between buckets (hook.state_dict checks it: BucketLayouts.saved). Whatever
    # fails on this rank is agreed on below, so no rank leaves before the others' collective.
    code, text = OK, ""
    try:
        atomic_save({"world_size": world, **hook.state_dict()}, path)
    except Exception as err:  # torch.save's zip writer raises RuntimeError
        code = UNREADABLE
        text = (
            f"the PowerSGD state of rank {rank} could not be written to {path} "
            f"({one_line(err)}): check the space and write access in {path.parent}, then run "
            "the same command again (it resumes from the checkpoint before)"
        )
    codes, first = agreed(code, text, collective_device(hook))
    if max(codes) != OK:
        raise UserError(first)


def prune_state(hook: CommHook | None, last: Path, step: int) -> None:
    """After the last checkpoint of `step` is on disk: this rank's older hook states go."""
    if hook is None or not hook.stateful:
        return
    rank, _ = rank_and_world()
    keep = state_file(last, step, rank)
    for path in last.parent.glob(state_file(last, "*", rank).name):
        if path != keep:
            path.unlink(missing_ok=True)


def load_state(
    hook: CommHook | None, last: Path, step: int, device: Any, required: bool = True
) -> None:
    """On resume from the checkpoint `last` of `step`: every rank its own hook state, or every
    rank the same line saying why it cannot be restored (training on without it would
    silently diverge). Not `required` (an explicit ckpt_path: a new run from a checkpoint):
    PowerSGD starts afresh instead, with one warning unless no rank has a file. Written by
    another number of processes (an elastic restart with fewer or more nodes): afresh with
    one warning, on every rank alike, since error feedback is per rank and cannot be
    redistributed."""
    if hook is None or not hook.stateful:
        return
    code, text, saved = read_state(hook, last, step, device)
    codes, first = agreed(code, text, collective_device(hook))
    problem, _, fix = first.partition("\n")
    worst = max(codes)
    if worst == OK:
        hook.load_state_dict(saved)
    elif worst == OTHER_WORLD or not required:
        if rank_and_world()[0] == 0 and set(codes) != {ABSENT}:
            log.warning(problem if worst == OTHER_WORLD else f"{problem}: PowerSGD starts afresh")
    else:
        raise UserError(f"{problem}; {fix}")


def read_state(
    hook: CommHook, last: Path, step: int, device: Any
) -> tuple[int, str, dict[str, Any]]:
    """This rank's saved state, or what is wrong with it: (code, problem + "\\n" + fix,
    state). A rank the saving run did not have reads rank 0's file for its world size."""
    import torch

    rank, world = rank_and_world()
    path = state_file(last, step, rank)
    found = path if path.is_file() else state_file(last, step, 0)
    lost = f"the PowerSGD state of rank {rank} at step {step} cannot be restored"
    new_run = f"start a new run from the weights: ckpt_path={last} with another RUN_ID"
    try:
        saved = torch.load(found, map_location=device, weights_only=True) if found.is_file() else {}
    except Exception as err:  # truncated, not a checkpoint, unreadable: whatever torch.load raises
        unreadable = f"{found.name} beside {last.name} cannot be read ({one_line(err)})"
        return UNREADABLE, f"{unreadable}: {lost}\n{new_run}", {}
    saved_world = saved.pop("world_size", None)
    if saved_world is not None and saved_world != world:
        return OTHER_WORLD, (
            f"PowerSGD state of step {step} was written by {saved_world} processes, this run "
            f"has {world}: PowerSGD starts afresh (its per-rank error feedback cannot be "
            "redistributed)"
        ), {}  # fmt: skip
    if not path.is_file():
        missing = f"{path.name} is missing beside {last.name}"
        return ABSENT, f"{missing}: {lost} (files moved or deleted)\n{new_run}", {}
    code, problem = hook.check(saved, last)
    return code, problem, saved


def agreed(code: int, text: str, device: Any) -> tuple[list[int], str]:
    """Every rank's `code` (OK: nothing wrong), and the `text` of the first rank with the
    highest code: the same on every rank, so that all go on or all stop with one message.
    Without a process group of several ranks: this rank's own."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [code], text
    rank, world = dist.get_rank(), dist.get_world_size()
    codes = torch.zeros(world, dtype=torch.int64, device=device)
    codes[rank] = code
    dist.all_reduce(codes)
    found = codes.tolist()
    top = max(range(world), key=lambda r: (found[r], -r))
    if found[top] == OK:
        return found, ""
    message = torch.zeros(TEXT_BYTES, dtype=torch.uint8, device=device)
    if rank == top:
        raw = text.encode()[:TEXT_BYTES]
        message[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    dist.broadcast(message, src=top)
    return found, bytes(message.cpu().tolist()).rstrip(b"\0").decode(errors="ignore")


TEXT_BYTES = 2048  # the longest message `agreed` passes on (a line naming two paths)


def collective_device(hook: CommHook) -> Any:
    """Where `agreed` puts its tensors: the CPU wherever gloo serves it, else the model's
    device (NCCL takes CUDA tensors only)."""
    import torch
    import torch.distributed as dist

    if hook.device is None or not dist.is_initialized() or "gloo" in str(dist.get_backend()):
        return torch.device("cpu")
    return hook.device


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size (the trainers call these functions under DDP)."""
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def one_line(err: BaseException) -> str:
    """An exception as a short part of a one-line message: its type and first sentence."""
    text = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
    first = " ".join(text.split()).split(". ")[0].rstrip(".")
    return f"{type(err).__name__}: {first[:120]}"


def _bf16_gloo(state, bucket):  # no annotations: DDP checks them against dist.GradBucket
    """torch's bf16 hook, off CUDA: DDP refuses `bf16_compress_hook` by name unless it runs on
    CUDA with NCCL >= 2.10, but gloo all-reduces bfloat16 on CPU (tests/test_comm_hooks.py)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)
