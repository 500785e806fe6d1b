"""Sharded checkpoints of FSDP2 models (`fully_shard`) with torch.distributed.checkpoint (DCP):
each rank writes its own shards, a load reshards them onto any world size. The raw trainer's
`last` under strategy=fsdp on several processes (project.engine.raw.checkpointing) is one.

A save goes to a fresh folder, and `last` is a manifest that names the newest complete one:

    <folder>/last-step40/.metadata          DCP's index of every shard (rank 0)
    <folder>/last-step40/__0_0.distcp       rank 0's shards of model and optimizer
    <folder>/last-step40/__1_0.distcp       rank 1's
    <folder>/last-step40/common.pt          plain entries saved once (step, data position ...)
    <folder>/last-step40/rank0.pt           rank 0's own entries (its RNG states ...)
    <folder>/last-step40/rank1.pt
    <folder>/last.json                      {"step": 40, "folder": "last-step40", "world": 2}

Rank 0 writes the manifest only after every rank said its part is complete (an all-reduce on
the checkpoint's own gloo group), then removes the older folders. A save cut midway (a killed
rank, a full disk) leaves a folder no manifest names: the previous `last` stays, and the next
published save removes the leftover. The folder may be an fsspec URL (s3://...): DCP writes
and reads it through fsspec, and the manifest is one small object a store shows whole or not.

Checkpoint collectives (DCP's own, and the agreement before publishing) run on a gloo group of
their own, so an asynchronous save's collectives, issued from DCP's thread, never interleave
with training's on the default group.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from project.engine.checkpoints.remote import exists, is_url, join, open_url, short
from project.engine.checkpoints.state import atomic_save
from project.engine.distributed.exits import TemporaryFailure
from project.engine.errors import UserError

FORMAT = "dcp"  # the manifest's "format": what wrote the folder it names
COMMON = "common.pt"  # in each save's folder: plain entries saved once, by rank 0
METADATA = ".metadata"  # DCP's index: a folder without it is no complete DCP checkpoint


def own_file(rank: int) -> str:
    """Rank `rank`'s entries in a save's folder."""
    return f"rank{rank}.pt"


@dataclass
class Loaded:
    """What a load restored beside model and optimizer."""

    step: int
    common: dict[str, Any]  # the plain entries saved once
    mine: dict[str, Any] | None  # this rank's own entries; None on another world size
    world: int  # the world size that saved it
    own: bool  # the same world size now: `mine` is this rank's
    folder: str  # the save's folder (path or URL)
    trainer: str  # which trainer wrote it


@contextlib.contextmanager
def one_process_quiet() -> Iterator[None]:
    """DCP without a process group (one process) warns at every call that it assumes one
    process: meant so here, so not said."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def world() -> tuple[int, int]:
    """(rank, world size), (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def failed(err: BaseException) -> str:
    """A save's failure as part of one line. DCP raises CheckpointException, a BaseException
    (so `except Exception` misses it) whose text is every failing rank's whole traceback: the
    first failing rank's error says it."""
    if isinstance(err, CheckpointException) and err.failures:
        rank, wrapped = min(err.failures.items(), key=lambda failure: failure[0])
        return f"rank {rank}: {short(wrapped[0])}"
    return short(err)


def read_bytes(path: str) -> bytes:
    """A file's content, local or by fsspec URL."""
    if not is_url(path):
        return Path(path).read_bytes()
    fs, inner = open_url(path, "checkpoint")
    return fs.cat_file(inner)


def read_entries(path: str) -> dict[str, Any]:
    """A `common.pt` or `rank<R>.pt` (tensors and plain values: weights_only)."""
    return torch.load(io.BytesIO(read_bytes(path)), map_location="cpu", weights_only=True)


def is_sharded(folder: str) -> bool:
    """Whether `folder` holds a complete save of this module (DCP's index and `common.pt`)."""
    if is_url(folder):
        fs, inner = open_url(folder, "checkpoint")
        return fs.isfile(join(inner, METADATA)) and fs.isfile(join(inner, COMMON))
    return (Path(folder) / METADATA).is_file() and (Path(folder) / COMMON).is_file()


def names_save(path: str) -> bool:
    """Whether `path` names a sharded save rather than a one-file checkpoint: a folder, a
    manifest (`.json`), or a `last` only a manifest publishes (`resolve` reads it). By URL:
    a folder with DCP's index, or a manifest of this module (one file may be published
    beside it: project.engine.checkpoints.remote)."""
    if is_url(path):
        fs, inner = open_url(path, "ckpt_path")
        inner = inner.rstrip("/")
        manifest = inner if inner.endswith(".json") else f"{inner}.json"
        with contextlib.suppress(OSError, ValueError, AttributeError):
            if fs.isfile(join(inner, METADATA)):
                return True
            return fs.isfile(manifest) and json.loads(fs.cat_file(manifest)).get("format") == FORMAT
        return False
    p = Path(path)
    return p.is_dir() or p.suffix == ".json" or (not p.exists() and Path(f"{path}.json").is_file())


def resolve(path: str | Path, what: str) -> str:
    """The save folder `path` names: a save's folder itself, or `<folder>/<name>` (or its
    `<name>.json`) published by a manifest. One line (UserError) for anything else."""
    path = str(path).rstrip("/")
    manifest = path if path.endswith(".json") else f"{path}.json"
    if is_sharded(path):
        return path
    fs, inner = open_url(manifest, what) if is_url(manifest) else (None, manifest)
    found = fs.isfile(inner) if fs else Path(manifest).is_file()
    if not found:
        raise UserError(
            f"{what}={path} is not a sharded checkpoint (no {METADATA} and {COMMON} inside, "
            "and no manifest beside it): give a save folder (<name>-step<N>) or <folder>/<name>"
        )
    published = read_manifest(manifest, what)
    folder = join(path.rpartition("/")[0], published["folder"])
    if not is_sharded(folder):
        raise UserError(
            f"{manifest} publishes {published['folder']}, which is missing or incomplete: "
            "move the manifest away to start over"
        )
    return folder


def read_manifest(path: str, what: str) -> dict[str, Any]:
    """The manifest at `path` (it exists), checked; one line (UserError) where it is not one."""
    try:
        manifest = json.loads(read_bytes(path))
    except (OSError, ValueError) as err:
        raise UserError(
            f"{what}: the manifest {path} cannot be read ({short(err)}): move it away to start over"
        ) from None
    keys = {"format", "step", "folder", "world"}
    if not isinstance(manifest, dict) or not keys <= set(manifest):
        raise UserError(f"{what}: {path} is not a manifest of sharded checkpoints (it lacks "
                        f"{sorted(keys - set(manifest or {}))})")  # fmt: skip
    if manifest["format"] != FORMAT:
        raise UserError(f"{what}: {path} publishes a {manifest['format']!r} checkpoint, not a "
                        f"{FORMAT!r} one (sharded): give a sharded checkpoint")  # fmt: skip
    return manifest


def load(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    what: str = "ckpt_path",
    group: Any = None,
) -> Loaded:
    """Every rank: `model` and `optimizer` (sharded or not, any world size) from the save
    `path` names (`resolve`); returns the rest (`Loaded`). `group`: the process group DCP
    coordinates on (None: the default one)."""
    folder = resolve(path, what)
    common = read_entries(join(folder, COMMON))
    rank, size = world()
    optimizers = [optimizer] if optimizer is not None else []
    model_state, optim_state = get_state_dict(model, optimizers)
    state = {"model": model_state} | ({"optim": optim_state} if optimizer is not None else {})
    with one_process_quiet():
        dcp.load(state, checkpoint_id=folder, process_group=group)
    if optimizer is not None:
        set_state_dict(model, optimizers, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])  # fmt: skip
    else:
        set_model_state_dict(model, state["model"])
    own = common["world"] == size
    mine = read_entries(join(folder, own_file(rank))) if own else None
    return Loaded(common["step"], common["common"], mine, common["world"], own, folder,
                  common["trainer"])  # fmt: skip


def holds_shards(model: torch.nn.Module) -> bool:
    """Whether `model` is sharded (FSDP2: its parameters are DTensors)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def parameter_order(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of `optimizer`'s parameters in its order (what torch's layout numbers)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def load_whole(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]
) -> None:
    """Every rank: a one-file checkpoint's whole `model` state (and `optimizer` state, in
    torch's layout numbered by parameter order: whole.numbered's inverse) into a sharded
    model, each rank keeping its shards: a DDP run's checkpoint continued under strategy=fsdp."""
    whole = StateDictOptions(full_state_dict=True)
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=whole)
        return
    order = parameter_order(model, optimizer)
    saved = state["optimizer"]
    optim = {"state": {order[i]: v for i, v in saved["state"].items()},
             "param_groups": [{**g, "params": [order[i] for i in g["params"]]}
                              for g in saved["param_groups"]]}  # fmt: skip
    set_state_dict(model, [optimizer], model_state_dict=state["model"],
                   optim_state_dict=optim, options=whole)  # fmt: skip


class ShardedLast:
    """A run's sharded `last` in `folder` (a path or an fsspec URL), published as `<name>.json`.
    Every rank builds one (it makes the checkpoint's gloo group: a collective) and calls
    `save`, `wait` and `load` together. `trainer` is recorded: which trainer wrote it.
    `timeout`: how long a checkpoint collective waits for a peer (None: torch's 30 minutes;
    the trainers give their collectives' own outside the steps, ddp.outside_steps_timeout)."""

    def __init__(
        self, folder: str | Path, name: str, trainer: str, timeout: timedelta | None = None
    ) -> None:
        self.folder, self.name, self.trainer = str(folder).rstrip("/"), name, trainer
        self.rank, self.world = world()
        # Checkpoint collectives on a gloo group of their own (see the module docstring); on
        # one process too: DCP's async save needs a group with a CPU backend.
        distributed = dist.is_available() and dist.is_initialized()
        self.group = dist.new_group(backend="gloo", timeout=timeout) if distributed else None
        # An async save not yet published: (its future, step, folder name, files ok, why not).
        self.pending: tuple[Future, int, str, bool, str] | None = None
        # Seconds from the start of the newest published save to its publication: what a
        # stop's save costs (an async save blocks its caller only for a fraction of it).
        self.write_s = 0.0
        self._began = 0.0
        if is_url(self.folder):
            self.fs, self.root = open_url(self.folder, "checkpoint folder")
        else:
            Path(self.folder).mkdir(parents=True, exist_ok=True)
            self.fs, self.root = None, self.folder

    @property
    def manifest_path(self) -> str:
        return join(self.folder, f"{self.name}.json")

    def manifest(self) -> dict[str, Any] | None:
        """Every rank: what is published now (None: nothing), as rank 0 reads it. One view
        for all: a rank reading a stale copy (NFS attribute caching, a store's listing) would
        otherwise save beside or load another folder than its peers."""
        view: list[Any] = [None, ""]
        if self.rank == 0:
            try:
                view[0] = self.read_manifest()
            except Exception as err:  # said on every rank, not only rank 0
                view[1] = f"{err}" if isinstance(err, UserError) else short(err)
        if self.group is not None and self.world > 1:
            dist.broadcast_object_list(view, src=0, group=self.group)
        if view[1]:
            raise UserError(view[1])
        return view[0]

    def read_manifest(self) -> dict[str, Any] | None:
        """This process's own reading of the manifest (None: there is none)."""
        found = exists(self.manifest_path)  # a store that does not answer: one line, not "none"
        return read_manifest(self.manifest_path, "checkpoint") if found else None

    def published_step(self) -> int | None:
        """Every rank: the step published now (None: nothing)."""
        manifest = self.manifest()
        return manifest["step"] if manifest else None

    def save_folder(self, step: int) -> str:
        """A fresh folder for the save of `step`: never the published one (a second save at
        the same step goes beside it)."""
        published = (self.manifest() or {}).get("folder")
        base = f"{self.name}-step{step}"
        return base if base != published else f"{base}-b"

    # --- saving ------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        common: dict[str, Any],
        per_rank: dict[str, Any],
        asynchronous: bool = False,
    ) -> float:
        """Every rank: save `step` (model, optimizer, `common` once, this rank's `per_rank`)
        and publish it once every rank's part is complete; asynchronously, publish at the
        next `wait` (or `save`; one process without a process group saves synchronously).
        Returns the seconds the caller was blocked."""
        start = time.perf_counter()
        self.wait()  # one save in flight at a time: the previous one is published first
        self._began = time.perf_counter()
        name = self.save_folder(step)
        folder = join(self.folder, name)
        if self.rank == 0:
            self.remove(name)  # a cut save's leftover at this step: never mixed with this one
        self.agree(True, "")  # nobody writes before the leftover is gone
        optimizers = [optimizer] if optimizer is not None else []
        model_state, optim_state = get_state_dict(model, optimizers)
        state = {"model": model_state} | ({"optim": optim_state} if optimizer is not None else {})
        # A rank whose small files fail still takes part in DCP's collectives (skipping them
        # would leave its peers waiting); the failure is said in the agreement before publishing.
        ok, why = True, ""
        try:
            if self.rank == 0:
                atomic_save({"step": step, "world": self.world, "trainer": self.trainer,
                             "common": common}, join(folder, COMMON))  # fmt: skip
            self.write_own(folder, per_rank, step)
        except Exception as err:
            ok, why = False, short(err)
        # DCP's failures (CheckpointException, on every rank alike: its collectives gather
        # them) are said in the agreement before publishing; the previous `last` stays.
        if asynchronous and self.group is not None:  # DCP's async save needs a CPU group
            # The caller waits for DCP's staging (a copy of the state in memory) only; the
            # write runs in DCP's thread, its collectives on our group.
            try:
                future = dcp.async_save(state, checkpoint_id=folder, process_group=self.group)
            except CheckpointException as err:  # its planning failed: nothing is in flight
                future, ok, why = None, False, why or failed(err)
            if future is not None:
                if not isinstance(future, Future):  # a stager with a staging future of its own
                    future.staging_completion.result()
                    future = future.upload_completion
                self.pending = (future, step, name, ok, why)
                return time.perf_counter() - start
        else:
            try:
                with one_process_quiet():
                    dcp.save(state, checkpoint_id=folder, process_group=self.group)
            except (Exception, CheckpointException) as err:  # not KeyboardInterrupt, SystemExit
                ok, why = False, why or failed(err)
        self.publish(step, name, ok, why)
        return time.perf_counter() - start

    def write_own(self, folder: str, per_rank: dict[str, Any], step: int) -> None:
        """This rank's own entries, in the save's folder (a test overrides it to cut a save)."""
        atomic_save(per_rank, join(folder, own_file(self.rank)))

    def wait(self) -> None:
        """Finish an asynchronous save (every rank) and publish it; nothing when none."""
        if self.pending is None:
            return
        ok, why = self.finish_write()
        _, step, name, _, _ = self.pending
        self.pending = None
        self.publish(step, name, ok, why)

    def finish_write(self) -> tuple[bool, str]:
        """Wait for the pending save's write (its collectives run in DCP's thread on every
        rank, so no rank's main thread is needed): whether it succeeded, and why not."""
        future, _, _, ok, why = self.pending
        try:
            future.result()
        except (Exception, CheckpointException) as err:  # DCP's: see `save`
            ok, why = False, why or failed(err)
        return ok, why

    def publish(self, step: int, name: str, ok: bool, why: str) -> None:
        """Every rank, its part of the save of `step` written (`ok`) or not: only when every
        rank's is does rank 0 write the manifest, then remove the older folders. Raises on
        every rank otherwise; the previous `last` stays published."""
        before = self.published_step()
        kept = f"`last` stays step {before}" if before is not None else "nothing is published"
        self.agree(ok, f"rank {self.rank} could not save step {step} ({why}); {kept}")
        written, why = True, ""
        if self.rank == 0:
            manifest = {"format": FORMAT, "step": step, "folder": name, "world": self.world,
                        "trainer": self.trainer}  # fmt: skip
            try:
                self.write_manifest(manifest)
            except Exception as err:
                written, why = False, short(err)
        self.agree(written, f"the manifest {self.manifest_path} could not be written ({why}); "
                            f"{kept}")  # fmt: skip
        self.write_s = time.perf_counter() - self._began
        if self.rank == 0:
            for old in self.saves():
                if old != name:
                    self.remove(old)

    def agree(self, ok: bool, failure: str) -> None:
        """Every rank: whether every rank is `ok`; where one is not, every rank stops with
        the first failing rank's line (one line, exit 75: a full disk or a store's refusal may
        pass, and `last` is intact, so --max-restarts retries it as a crash)."""
        if self.world == 1:
            if not ok:
                raise TemporaryFailure(failure)
            return
        flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
        dist.all_reduce(flag, group=self.group)
        if flag.item() == 0:
            return
        lines: list[str] = [""] * self.world
        dist.all_gather_object(lines, "" if ok else failure, group=self.group)
        raise TemporaryFailure(next(line for line in lines if line))

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        """Whole or not at all: a temp file renamed over it (local), one PUT (object store)."""
        data = json.dumps(manifest).encode()
        if self.fs is not None:
            self.fs.pipe_file(join(self.root, f"{self.name}.json"), data)
            return
        path = Path(self.manifest_path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def saves(self) -> list[str]:
        """The names of the save folders under `folder`, published or not."""
        prefix = f"{self.name}-step"
        if self.fs is not None:
            names = [p.rstrip("/").rpartition("/")[2] for p in self.fs.ls(self.root, detail=False)]
        else:
            names = os.listdir(self.folder)
        return sorted(n for n in names if n.startswith(prefix))

    def remove(self, name: str) -> None:
        """Remove the save folder `name` (if it is there); tidying that fails is no failure."""
        import shutil

        try:
            if self.fs is not None:
                if self.fs.exists(join(self.root, name)):
                    self.fs.rm(join(self.root, name), recursive=True)
            else:
                shutil.rmtree(join(self.folder, name), ignore_errors=True)
        except OSError:
            pass

    # --- loading -----------------------------------------------------------------------------
    def load(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> Loaded | None:
        """Every rank: the published `last` into `model` and `optimizer` (None: nothing is
        published)."""
        self.wait()
        manifest = self.manifest()
        if manifest is None:
            return None
        return load(join(self.folder, manifest["folder"]), model, optimizer, "checkpoint",
                    self.group)  # fmt: skip

    def close(self) -> None:
        """Let the checkpoint's group go (before the default one). A pending save's write is
        finished but not published: closing is also a failure's way out, where a peer may
        never join the agreement (call `wait()` first to publish it; the trainers' stop and
        end saves do)."""
        try:
            if self.pending is not None:
                self.finish_write()
        finally:  # whatever the write ended with, the group goes (else gloo may abort, -6)
            self.pending = None
            if self.group is not None:
                dist.destroy_process_group(self.group)
                self.group = None
