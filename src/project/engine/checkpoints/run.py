"""One owner of a run's checkpoint state, for both trainers: built once in preflight
(project.engine.run.skeleton), handed to the raw trainer and to Lightning's RunState callback.

It knows where the run's checkpoints live (the folder, `last`, the raw trainer's `best.pt`),
when the resume point `last` is written, and what every checkpoint of either trainer carries
beside the trainer's own model, optimizer and scheduler state:

    project        what the run trains, whether it finished, its final metrics
    rng            the python, numpy and torch (CPU, CUDA) generators
    data_position  where the train loader's epoch stands, for any world size (engine.data.elastic)
    comm hook      PowerSGD's per-rank state: one file per rank beside `last`

When `last` is written: on a stop signal always (a stop's "run the same command again to
resume" is then true with or without callbacks.fault_tolerance); with fault tolerance on also
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

from project.engine.checkpoints import LAST_CKPT
from project.engine.checkpoints.resume import checkpoint_dir
from project.engine.checkpoints.state import project_state, rng_state, set_rng_state
from project.engine.config.compose import CONFIG_DIR
from project.engine.data import elastic
from project.engine.distributed import comm_hooks
from project.engine.distributed.signals import StopSignal
from project.engine.errors import UserError

# The one home of the fault-tolerance values: the config group's file. With the callback off
# its stop-check keys still apply (a stop always saves); its save cadences do not.
SETTINGS_FILE = CONFIG_DIR / "callbacks" / "fault_tolerance.yaml"
STOP_KEYS = ("check_every_n_steps", "stop_budget_s")
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
    def of(cls, cfg: Mapping[str, Any]) -> FaultTolerance | None:
        """The run's settings (None: callbacks.fault_tolerance is off); keys a user's own
        config leaves out come from the shipped file."""
        given = (cfg.get("callbacks") or {}).get("fault_tolerance")
        if not given:
            return None
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
        return cls(**({"dirpath": None} | shipped() | given))


def shipped() -> dict[str, Any]:
    """The values configs/callbacks/fault_tolerance.yaml sets (but its dirpath, an
    interpolation of the run folder)."""
    values = OmegaConf.to_container(OmegaConf.load(SETTINGS_FILE).fault_tolerance)
    return {k: v for k, v in values.items() if k not in ("_target_", "dirpath")}


class RunCheckpoints:
    """Where a run's checkpoints live and what each carries (see the module docstring)."""

    def __init__(
        self, cfg: Any, output_dir: Path, last_name: str | None, identity: dict[str, Any],
        command: dict[str, Any],
    ) -> None:  # fmt: skip
        self.cfg = cfg  # the run's config: fit_world may still change its batch keys
        self.identity = identity  # what this run trains, as composed
        self.command = command  # the batch keys as the command gave them (engine.data.elastic)
        self.settings = FaultTolerance.of(cfg)
        self.folder = checkpoint_dir(cfg, output_dir)
        folder = Path(self.settings.dirpath) if self.settings and self.settings.dirpath else None
        filename = self.settings.filename if self.settings else LAST_CKPT
        self.last = (folder or self.folder) / (last_name or filename)
        self.best = self.folder / "best.pt"  # the raw trainer's (Lightning's: ModelCheckpoint)
        self.finished = False  # set when training ends: `last` then says so
        self.metrics: dict[str, float] = {}  # the final fit metrics, with `finished`

    @property
    def periodic(self) -> bool:
        """Whether `last` is written at epoch ends, cadences and the end (fault tolerance on)."""
        return self.settings is not None

    def stop_signal(self) -> StopSignal:
        """The coordinated stop with this run's cadences (saves off with fault tolerance off)."""
        s = self.settings
        stop_keys = {k: getattr(s, k) for k in STOP_KEYS} if s else {
            k: v for k, v in shipped().items() if k in STOP_KEYS}  # fmt: skip
        return StopSignal(
            every_n_steps=stop_keys["check_every_n_steps"],
            budget_s=stop_keys["stop_budget_s"],
            save_every_n_train_steps=s.every_n_train_steps if s else None,
            save_every_n_seconds=s.every_n_seconds if s else None,
        )

    def saves_at_end(self) -> bool:
        """Whether training's end writes `last` (finished): fault tolerance on, or this run
        folder already holds one (a stop's) that would otherwise be resumed again."""
        return self.periodic or self.last.exists()

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
            "project": project_state(self.identity, self.finished, self.metrics),
            "rng": rng_state(),
            elastic.KEY: position,
        }

    @staticmethod
    def restore_rng(checkpoint: Mapping[str, Any]) -> bool:
        """Continue the interrupted random streams; False when the checkpoint has none.
        Lightning checkpoints written before this owner kept them in their FaultTolerance
        callback's state."""
        rng = checkpoint.get("rng")
        if rng is None:
            states = (checkpoint.get("callbacks") or {}).values()
            rng = next((s["rng"] for s in states if isinstance(s, dict) and "rng" in s), None)
        if rng is not None:
            set_rng_state(rng)
        return rng is not None

    # --- the comm hook's per-rank files (every rank calls these at the same point) -------------
    def save_hook(self, hook: comm_hooks.CommHook | None, step: int) -> None:
        comm_hooks.save_state(hook, self.last, step)

    def prune_hook(self, hook: comm_hooks.CommHook | None, step: int) -> None:
        comm_hooks.prune_state(hook, self.last, step)

    def load_hook(
        self, hook: comm_hooks.CommHook | None, path: Path, step: int, device: torch.device
    ) -> None:
        """A resume from `last` needs the hook's files; from another checkpoint (ckpt_path)
        the hook may start afresh."""
        comm_hooks.load_state(hook, Path(path), step, device, required=Path(path) == self.last)
