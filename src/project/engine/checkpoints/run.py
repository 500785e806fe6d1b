"""One owner of a run's checkpoint state, for both trainers: built once in preflight
(project.engine.run.skeleton), handed to the raw trainer and to Lightning's RunState callback.

It knows where the run's checkpoints live (the folder, `last`, the raw trainer's `best.pt`),
when the resume point `last` is written, and what every checkpoint of either trainer carries
beside the trainer's own model, optimizer and scheduler state:

    project        what the run trains, whether it finished, its final metrics
    rng            the python, numpy and torch (CPU, CUDA) generators
    data_position  where the train loader's epoch stands, for any world size (engine.data.elastic)
    comm hook      PowerSGD's per-rank state: one file per rank beside `last` (comm_hook_files)

When `last` is written: on a stop signal always (the stop's "resume with: RUN_ID=..." is
then true with or without callbacks.fault_tolerance); with fault tolerance on also
at every epoch end, at its cadences and when training ends (marked finished). A run folder
that holds a `last` gets the finished one too, so a finished run is never trained again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from project.engine.checkpoints import comm_hook_files
from project.engine.checkpoints.resume import callbacks_record, checkpoint_dir
from project.engine.checkpoints.state import project_state, rng_state, set_rng_state
from project.engine.config.compose import CONFIG_DIR, to_plain
from project.engine.data import elastic
from project.engine.distributed.comm_hooks import CommHook
from project.engine.distributed.signals import StopSignal
from project.engine.errors import UserError

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
        self.folder = checkpoint_dir(cfg, output_dir)
        folder = Path(self.settings.dirpath) if self.settings.dirpath else self.folder
        self.last = folder / (last_name or self.settings.filename)
        # Decided once, before any process group: ranks must agree on the final save.
        self.had_last = self.last.exists()
        self.best = self.folder / "best.pt"  # the raw trainer's (Lightning's: ModelCheckpoint)
        self.finished = False  # set when training ends: `last` then says so
        self.metrics: dict[str, float] = {}  # the final fit metrics, with `finished`

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
        comm_hook_files.save_state(hook, self.last, step)

    def prune_hook(self, hook: CommHook | None, step: int) -> None:
        comm_hook_files.prune_state(hook, self.last, step)

    def load_hook(self, hook: CommHook | None, path: Path, step: int, device: torch.device) -> None:
        """A resume from `last` needs the hook's files; from another checkpoint (ckpt_path)
        the hook may start afresh."""
        comm_hook_files.load_state(hook, Path(path), step, device, required=Path(path) == self.last)
