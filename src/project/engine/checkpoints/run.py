"""One owner of a run's checkpoint state, for both trainers: built once in preflight
(project.engine.run.skeleton), handed to the raw trainer and to Lightning's RunState callback.

It knows where the run's checkpoints live (the folder, `last`, the raw trainer's `best.pt`),
when the resume point `last` is written, and what every checkpoint of either trainer carries
beside the trainer's own model, optimizer and scheduler state:

    project        what the run trains, whether it finished, its final metrics
    rng            the python, numpy and torch (CPU, CUDA) generators
    data_position  where the train loader's epoch stands, for any world size (engine.data.elastic)
    comm hook      PowerSGD's per-rank state: one file per rank beside `last` (comm_hook_files)

A checkpoint folder that is an fsspec URL (s3://bucket/run) is written through a local
staging folder and published there only once every file of `last` is uploaded
(project.engine.checkpoints.remote); a resume on another machine downloads it.

When `last` is written: on a stop signal always (the stop's "resume with: RUN_ID=..." is
then true with or without callbacks.fault_tolerance); with fault tolerance on also
at every epoch end, at its cadences and when training ends (marked finished). A run folder
that holds a `last` gets the finished one too, so a finished run is never trained again.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from project.engine.checkpoints import comm_hook_files
from project.engine.checkpoints.comm_hook_files import OK, UNREADABLE, agreed, one_line
from project.engine.checkpoints.remote import STAGING, RemoteLast, exists, is_url, join, probe
from project.engine.checkpoints.resume import callbacks_record, checkpoint_dir
from project.engine.checkpoints.state import project_state, rng_state, set_rng_state
from project.engine.config.compose import CONFIG_DIR, to_plain
from project.engine.data import elastic
from project.engine.distributed.comm_hooks import CommHook
from project.engine.distributed.signals import StopSignal
from project.engine.errors import UserError
from project.engine.launch.env import rank as launched_rank
from project.engine.launch.env import resume_command

# The one home of the fault-tolerance values: the config group's file. With the callback off
# its stop-check keys still apply (a stop always saves); its save cadences do not.
SETTINGS_FILE = CONFIG_DIR / "callbacks" / "fault_tolerance.yaml"
TARGET = "project.engine.checkpoints.run.FaultTolerance"


@dataclass(frozen=True)
class FaultTolerance:
    """`callbacks.fault_tolerance` (configs/callbacks/fault_tolerance.yaml explains each key;
    no defaults here: that file is their one home)."""

    dirpath: str | None  # where `last` lives (None: the run's checkpoint folder)
    filename: str  # Lightning's last checkpoint (the raw trainer's is always last.pt)
    check_every_n_steps: int  # windows between the ranks' stop checks, at most
    stop_budget_s: float | None  # seconds a stop may take (None: no adaptation)
    every_n_train_steps: int | None  # also save `last` every N optimizer steps
    every_n_seconds: float | None  # and every T seconds of training

    @classmethod
    def of(cls, cfg: Mapping[str, Any]) -> FaultTolerance:
        """The settings the run follows: `callbacks.fault_tolerance` (keys a user's own block
        leaves out come from the shipped file); when it is off, the shipped file's folder, file
        name and stop checks, and no save cadence (a stop still saves)."""
        given = (cfg.get("callbacks") or {}).get("fault_tolerance")
        if not given:
            return cls(**(shipped(cfg) | {"every_n_train_steps": None, "every_n_seconds": None}))
        given = dict(given)
        if given.pop("_target_", TARGET) != TARGET:
            raise UserError(
                f"callbacks.fault_tolerance._target_ must be {TARGET} (the settings both "
                "trainers' checkpoints follow): see configs/callbacks/fault_tolerance.yaml"
            )
        names = [f.name for f in fields(cls)]
        if unknown := sorted(set(given) - set(names)):
            raise UserError(
                f"callbacks.fault_tolerance.{unknown[0]} is not an option: see "
                "configs/callbacks/fault_tolerance.yaml"
            )
        return cls(**(shipped(cfg) | given))


def shipped(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The values configs/callbacks/fault_tolerance.yaml sets, its dirpath resolved against the
    run's `paths` (None where they cannot resolve it: then the run's checkpoint folder)."""
    paths = to_plain(cfg.get("paths")) or {}
    node = OmegaConf.merge({"paths": paths}, OmegaConf.load(SETTINGS_FILE)).fault_tolerance
    values = {k: node[k] for k in node if k not in ("_target_", "dirpath")}
    try:
        values["dirpath"] = node.dirpath
    except OmegaConfBaseException:  # e.g. a test's config without paths.output_dir
        values["dirpath"] = None
    return values


def probe_folder(folder: Path, what: str) -> None:
    """At start, before any process group or training: the local `folder` can be made and
    written (not a file, not below one, not on a read-only or virtual filesystem such as
    /proc); one line naming the key otherwise (exit 2). A real write, as root ignores
    permission bits: a temporary folder made where `folder` is (or would be made) and removed
    again, so a run refused later in preflight leaves nothing behind."""
    there = folder.absolute()
    while not os.path.lexists(there) and there != there.parent:  # its nearest existing part
        there = there.parent
    try:
        if not there.is_dir():
            reason = f"{there} is a file, not a folder"
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".write-probe-", dir=there))
            return
    except OSError as err:
        reason = f"nothing can be created in {there}: {err.strerror}"
    raise UserError(
        f"{what}={folder} cannot be written ({reason}): give a folder this user may write to, "
        "or an fsspec URL such as s3://bucket/folder"
    )


class RunCheckpoints:
    """Where a run's checkpoints live and what each carries (see the module docstring)."""

    def __init__(
        self, cfg: Any, output_dir: Path, last_name: str | None, identity: dict[str, Any],
        command: dict[str, Any],
    ) -> None:  # fmt: skip
        self.cfg = cfg  # the run's config: fit_world may still change its batch keys
        self.identity = identity  # what this run trains, as composed
        self.callbacks = callbacks_record(cfg)  # how (a resume with others says so)
        self.command = command  # the batch keys as the command gave them (engine.data.elastic)
        self.periodic = bool((cfg.get("callbacks") or {}).get("fault_tolerance"))
        self.settings = FaultTolerance.of(cfg)  # with fault tolerance off: stop checks only
        best_url = ((cfg.get("callbacks") or {}).get("model_checkpoint") or {}).get("dirpath")
        if is_url(best_url):  # the best checkpoints are written there through fsspec
            probe(str(best_url), "callbacks.model_checkpoint.dirpath")
        self.folder = checkpoint_dir(cfg, output_dir)
        name, dirpath = last_name or self.settings.filename, self.settings.dirpath
        self.remote: RemoteLast | None = None  # the URL `last` is published to, if any
        if is_url(dirpath):  # probed before any process group: a bad URL costs seconds
            probe(str(dirpath), "callbacks.fault_tolerance.dirpath")
            self.remote = RemoteLast(str(dirpath), name, output_dir / STAGING)
            self.last = self.remote.staging / name  # staged here, then uploaded
        else:
            if dirpath:  # found unwritable now, not at the first save after an epoch
                probe_folder(Path(dirpath), "callbacks.fault_tolerance.dirpath")
            self.last = (Path(dirpath) if dirpath else self.folder) / name
        # A sharded `last` (strategy=fsdp on several processes, project.engine.checkpoints
        # .sharded): the manifest <name>.json where the one-file `last` would be (in the URL
        # folder itself: every rank writes its shards there, nothing is staged), e.g.
        # last-pt.json publishing the folder last-pt-step40. A run folder that holds one
        # keeps writing its `last` sharded, on any world size (a 2 -> 1 resume too).
        self.sharded_name = self.last.name.replace(".", "-")
        self.sharded_dir = self.remote.url if self.remote else str(self.last.parent)
        self.sharded_manifest = join(self.sharded_dir, f"{self.sharded_name}.json")
        self.sharded = exists(self.sharded_manifest)
        # Decided once, before any process group: ranks must agree on the final save.
        self.had_last = self.sharded or (
            self.last.exists() if self.remote is None else bool(self.remote.manifest)
        )
        # What auto_resume continues from: the local `last`, the published one fetched, or
        # the folder a sharded `last` publishes (resolve checks it is complete; by URL, DCP
        # reads it there, or Lightning on one process copies it: whole.gathered).
        self.resume_last: Path | str | None = self.last
        if self.sharded:
            from project.engine.checkpoints.sharded import resolve

            folder = resolve(self.sharded_manifest, "the run's last checkpoint")
            self.resume_last = folder if is_url(folder) else Path(folder)
        elif self.remote is not None:
            self.resume_last = self.fetch_published()
        # the raw trainer's (Lightning's: ModelCheckpoint); at a URL written by rank 0 as one
        # object, which a store shows once complete, and downloaded to be tested
        self.best: Path | str = join(str(best_url), "best.pt") if is_url(best_url) else \
            self.folder / "best.pt"  # fmt: skip
        self.finished = False  # set when training ends: `last` then says so
        self.metrics: dict[str, float] = {}  # the final fit metrics, with `finished`

    @property
    def where(self) -> str:
        """Where `last` lives, as the log says it: its URL, or its local path."""
        if self.sharded:
            return self.sharded_manifest
        return f"{self.remote.url.rstrip('/')}/{self.last.name}" if self.remote else str(self.last)

    def fetch_published(self) -> Path | None:
        """The URL's published `last` and this rank's hook state (rank 0's too: a rank the
        saving run did not have reads its world size there), downloaded; None: none."""
        assert self.remote is not None
        step = self.remote.published_step()
        if step is None:
            return None
        ranks = sorted({0, launched_rank()})  # no process group yet
        return self.remote.fetch([comm_hook_files.state_file(self.last, step, r).name
                                  for r in ranks])  # fmt: skip

    def publish(self, hook: CommHook | None, step: int, device: torch.device) -> None:
        """Every rank, once `last` (rank 0) and the hook files (each rank) of `step` are
        staged: with a URL folder, each uploads its own files; only when every rank's upload
        completed does rank 0 write the manifest that makes them `last`. A failure stops
        every rank with one line; the previous `last` stays published."""
        if self.remote is None or self.sharded:  # (ShardedLast wrote to the URL itself)
            return
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) \
            if distributed else (0, 1)  # fmt: skip
        stateful = hook is not None and hook.stateful
        hook_files = [comm_hook_files.state_file(self.last, step, r) for r in range(world)]
        mine = [self.last] if rank == 0 else []
        mine += [hook_files[rank]] if stateful else []
        device = comm_hook_files.agreement_device(device)
        before = self.remote.published_step()
        kept = f"`last` stays step {before}" if before is not None else "nothing is published"
        together(lambda: self.remote.upload(mine), lambda err: (
            f"rank {rank} could not upload step {step}'s checkpoint to {self.remote.url} "
            f"({one_line(err)}); {kept}: check the credentials and the bucket, then resume "
            f"with {resume_command()}"), device)  # fmt: skip
        names = [self.last.name, *(p.name for p in hook_files if stateful)]
        together(lambda: self.remote.publish(step, names, writer=rank == 0), lambda err: (
            f"the manifest {self.where}.json could not be written ({one_line(err)}); {kept}: "
            f"check the credentials, then resume with {resume_command()}"), device)  # fmt: skip

    def stop_signal(self) -> StopSignal:
        """The coordinated stop with this run's cadences (no save cadence with fault tolerance
        off)."""
        s = self.settings
        return StopSignal(
            every_n_steps=s.check_every_n_steps,
            budget_s=s.stop_budget_s,
            save_every_n_train_steps=s.every_n_train_steps,
            save_every_n_seconds=s.every_n_seconds,
        )

    def saves_at_end(self) -> bool:
        """Whether training's end writes `last` (finished): fault tolerance on, or this run
        folder held one when the run started (a stop's) that would otherwise be resumed again.
        The same answer on every rank (read in preflight): the save is collective."""
        return self.periodic or self.had_last

    def finish(self, metrics: Mapping[str, float]) -> None:
        """Training ended: the next `last` says so, with these metrics."""
        self.finished, self.metrics = True, {k: float(v) for k, v in metrics.items()}

    # --- what every checkpoint carries ---------------------------------------------------------
    def entries(
        self, loaders: Any, epoch: int, batches: int, world: int, accumulate: int
    ) -> dict[str, Any]:
        """The template's entries of a checkpoint written now, the train `loaders` at
        `batches` of `epoch` (plain values and tensors: loads with weights_only=True)."""
        position = elastic.record(loaders, epoch, batches, world, accumulate, self.cfg,
                                  self.command)  # fmt: skip
        return {
            "project": project_state(self.identity, self.finished, self.metrics, self.callbacks),
            "rng": rng_state(),
            elastic.KEY: position,
        }

    @staticmethod
    def upgrade(checkpoint: dict[str, Any]) -> None:
        """A Lightning checkpoint of an older template kept the RNG states in the state of
        its FaultTolerance callback: moved to the top level, and that state dropped (the
        callback is gone; Lightning would ask for it in a warning)."""
        states = checkpoint.get("callbacks") or {}
        for key in [k for k in states if str(k).startswith("FaultTolerance")]:
            old = states.pop(key)
            if isinstance(old, dict) and "rng" in old:
                checkpoint.setdefault("rng", old["rng"])

    @classmethod
    def rng_of(cls, checkpoint: dict[str, Any]) -> dict[str, Any] | None:
        """The random generators' states a checkpoint holds (None: none)."""
        cls.upgrade(checkpoint)
        return checkpoint.get("rng")

    @staticmethod
    def restore_rng(rng: dict[str, Any] | None) -> None:
        """Continue the interrupted random streams (`rng_of` a checkpoint)."""
        if rng is not None:
            set_rng_state(rng)

    # --- the comm hook's per-rank files (every rank calls these at the same point) -------------
    def save_hook(self, hook: CommHook | None, step: int) -> None:
        """Every rank, first thing in a save of `last`: its hook state file."""
        if self.remote is not None:  # the staged copies stop being the published ones
            self.remote.forget_fetched()
        comm_hook_files.save_state(hook, self.last, step)

    def prune_hook(self, hook: CommHook | None, step: int) -> None:
        comm_hook_files.prune_state(hook, self.last, step)

    def load_hook(self, hook: CommHook | None, path: Path, step: int, device: torch.device) -> None:
        """A resume from `last` needs the hook's files; from another checkpoint (ckpt_path)
        the hook may start afresh."""
        comm_hook_files.load_state(hook, Path(path), step, device, required=Path(path) == self.last)


def together(action: Any, failure: Any, device: Any) -> None:
    """`action()` on every rank; where it fails on any, every rank stops with one line (the
    first failing rank's `failure(err)`), so no rank waits in a later collective alone."""
    code, text = OK, ""
    try:
        action()
    except Exception as err:
        code, text = UNREADABLE, failure(err)
    codes, first = agreed(code, text, device)
    if max(codes) != OK:
        raise UserError(first)
