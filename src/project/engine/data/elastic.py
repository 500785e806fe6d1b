"""What a run keeps when its world size changes (a torchrun restart with fewer or more nodes, a
requeue onto fewer nodes, a rerun on other devices): where the epoch stands, and the global
batch. Both trainers use it.

- **The data position.** A checkpoint records the epoch, the batches each rank had done, and
  the world, accumulation and per-rank batch they were done with (`record`). Every train
  loader's order is one sequence of positions shared by all ranks at any world size
  (project.engine.data.samplers), so the interrupted run had read positions
  [0, batches x units x world) of it together (plus an offset when that epoch itself had
  been resumed at a position that was no whole number of its batches); `resume` starts each
  loader there, on any world size, and tells the trainer how many of its own batches that is.
- **The global batch** (per-rank batch x accumulation x world) is the run's too: on another
  world size `fit_global_batch` sets `data.batch_size` and `trainer.accumulate_grad_batches`
  (and a count `trainer.limit_train_batches`) so that an optimizer step takes the same
  samples as before, before anything is built. The per-rank batch is kept when it divides,
  else the largest that does, up to the configured one (memory); no whole-number split is one
  line with the numbers. A datamodule of its own, whose batch the run cannot set, gets the
  accumulation that keeps the global batch when its loader is built (`fit_accumulation`).
  `keep_global_batch=false`, or a command that changes the batch size, accumulation or limit
  itself, lets the global batch follow (one logged line).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from omegaconf import DictConfig, open_dict

from project.engine.data import sharding
from project.engine.errors import UserError

log = logging.getLogger(__name__)

KEY = "data_position"  # the checkpoint's entry (plain values: loads with weights_only=True)
LISTS = ("units", "offsets", "asked", "own")  # the tuples (lists in the checkpoint)
ASKED = ("data.batch_size", "trainer.accumulate_grad_batches", "trainer.limit_train_batches")


def asked(cfg: Any) -> dict[str, Any]:
    """The batch keys as the command gave them (before `fit_global_batch` sets any)."""
    data, trainer = cfg.get("data") or {}, cfg.get("trainer") or {}
    return {ASKED[0]: data.get("batch_size"), ASKED[1]: trainer.get("accumulate_grad_batches"),
            ASKED[2]: trainer.get("limit_train_batches")}  # fmt: skip


@dataclass(frozen=True)
class Position:
    """Where an epoch stood when a checkpoint was written."""

    epoch: int  # the epoch to run or continue
    batches: int  # the batches of it each rank had done
    world: int  # the processes that did them
    accumulate: int  # batches per optimizer step then
    units: tuple[int, ...]  # per train loader: positions one batch took (units_per_batch)
    offsets: tuple[int, ...] = ()  # per train loader: positions read before its first batch
    follows: bool = False  # the first loader's batch was data.batch_size (which can be set)
    limit: int | None = None  # trainer.limit_train_batches then, when a count of batches
    asked: tuple[Any, ...] = ()  # the ASKED keys as the command gave them
    own: tuple[int, ...] = ()  # per train loader: positions of its current pass read by all
    # ranks together (its own count: a short loader cycled inside the epoch is in a later pass)

    @property
    def global_batch(self) -> int:
        """Positions of the first train loader one optimizer step took."""
        return self.units[0] * self.accumulate * self.world

    def consumed(self, loader: int) -> int:
        """Positions of train loader `loader`'s epoch read by all ranks together."""
        offset = self.offsets[loader] if self.offsets else 0
        return self.batches * self.units[loader] * self.world + offset

    @classmethod
    def of(cls, saved: dict[str, Any] | None) -> Position | None:
        """A checkpoint's `KEY` entry as a Position (None: none recorded)."""
        if not saved:
            return None
        tuples = {k: tuple(saved.get(k) or ()) for k in LISTS}
        return cls(**{**saved, **tuples})


def record(
    loaders: Any, epoch: int, batches: int, world: int, accumulate: int, cfg: DictConfig,
    command: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """The checkpoint entry for the train `loaders` at `batches` of `epoch` (`command`: the
    batch keys as the command gave them, `asked(cfg)` before fit_global_batch)."""
    limit = cfg.trainer.get("limit_train_batches")
    flat = sharding.flat(loaders)
    units = tuple(sharding.units_per_batch(loader) for loader in flat)
    offsets = tuple(sharding.epoch_start(loader, epoch) % (u * world)
                    for loader, u in zip(flat, units, strict=True))  # fmt: skip
    position = Position(
        epoch, batches, world, accumulate, units, offsets,
        units[:1] == ((cfg.get("data") or {}).get("batch_size"),),
        limit if isinstance(limit, int) and not isinstance(limit, bool) else None,
        tuple(command.get(key) for key in ASKED),
        tuple(sharding.own_position(loader, epoch, batches, world) for loader in flat),
    )  # fmt: skip
    saved = asdict(position)
    saved.update({k: list(saved[k]) for k in LISTS})
    return saved


_warned: set[str] = set()


def _restart_warning(why: str) -> int:
    if why not in _warned:
        _warned.add(why)
        log.warning(f"resuming mid-epoch, but {why}: this epoch restarts from its beginning")
    return 0


def resume(loaders: Any, position: Position | None, epoch: int, world: int) -> int:
    """Start each train loader's `epoch` where `position` says the run stood; returns the
    batches of it each rank has done at this world size (0: the epoch starts whole)."""
    if position is None or position.epoch != epoch or position.consumed(0) == 0:
        return 0
    flat = sharding.flat(loaders)
    if len(flat) != len(position.units):
        return _restart_warning(
            f"the checkpoint was written with {len(position.units)} train loader(s) and there "
            f"are {len(flat)} now"
        )
    kept = [type(loader).__name__ for loader in flat if not sharding.resumable(loader)]
    if kept:
        return _restart_warning(f"the train loader's order is its own ({kept[0]} kept as is)")
    # The epoch's batches done at this world size, from the positions the batches took;
    # each loader then starts at its own count (older checkpoints: the same for all).
    done = min(position.consumed(i) // (sharding.units_per_batch(loader) * world)
               for i, loader in enumerate(flat))  # fmt: skip
    for i, loader in enumerate(flat):
        own = position.own[i] if position.own else position.consumed(i)
        sharding.resume_at(loader, epoch, own, done)
    log.info(
        f"Resuming epoch {epoch} at global position {position.consumed(0)} (read by "
        f"{position.world} process(es)): skipping the {done} batches each of {world} "
        "process(es) would have trained on"
    )
    return done


def fit_accumulation(
    loaders: Any, position: Position | None, world: int, accumulate: int, keep: bool
) -> int:
    """The accumulation that keeps the run's global batch with the train loaders as built (a
    datamodule of its own keeps its batch size: only the accumulation can change); one line
    when none does."""
    if position is None or not keep:
        return accumulate
    flat = sharding.flat(loaders)[: len(position.units)]
    units = [sharding.units_per_batch(loader) for loader in flat]
    wanted = [position.units[i] * position.accumulate * position.world for i in range(len(flat))]

    def keeps(a: int) -> bool:
        return all(u * a * world == g for u, g in zip(units, wanted, strict=True))

    if keeps(accumulate):
        return accumulate
    fitted = wanted[0] // (units[0] * world)
    if fitted >= 1 and keeps(fitted):
        log.warning(
            f"{world} process(es), {position.world} when the checkpoint was written: the "
            f"global batch of {wanted[0]} is kept as {units[0]} per process (the train "
            f"loader's own) x {fitted} accumulated (trainer.accumulate_grad_batches={fitted})"
        )
        return fitted
    raise UserError(
        f"the train loader takes {units[0]} per batch x {accumulate} accumulated x {world} "
        f"process(es) = {units[0] * accumulate * world} per optimizer step, and no whole "
        f"accumulation makes it this run's global batch of {wanted[0]} ({position.units[0]} x "
        f"{position.accumulate} x {position.world}): make its batch size follow "
        "data.batch_size, run on a world size that divides it, or set keep_global_batch=false "
        "to let the global batch follow the world size"
    )


def split_global_batch(
    global_batch: int, world: int, batch: int, batch_fixed: bool
) -> tuple[int, int]:
    """(per-rank batch, accumulation) with batch x accumulation x world = global_batch: the
    per-rank batch `batch` when it divides, else the largest that does below it (unless
    `batch_fixed`)."""
    per_rank, rest = divmod(global_batch, world)
    if rest == 0 and per_rank % batch == 0:
        return batch, per_rank // batch
    if rest == 0 and not batch_fixed:
        largest = max(d for d in range(1, min(batch, per_rank) + 1) if per_rank % d == 0)
        return largest, per_rank // largest
    fix = "data.batch_size and trainer.accumulate_grad_batches" if not batch_fixed else (
        "trainer.accumulate_grad_batches")  # fmt: skip
    raise UserError(
        f"the run's global batch of {global_batch} cannot be split over {world} process(es) "
        f"with {'a per-rank batch of ' + str(batch) if batch_fixed else 'whole numbers'}: run "
        f"on a world size that divides {global_batch // batch if batch_fixed else global_batch}"
        f", set {fix} so that their product x {world} = {global_batch}, or "
        "keep_global_batch=false to let the global batch follow the world size"
    )


def fit_global_batch(
    cfg: DictConfig, position: Position | None, world: int, command: dict[str, Any]
) -> None:
    """Set this attempt's per-rank batch and accumulation (in `cfg`) so that the run's global
    batch stays what its checkpoint recorded (see the module docstring); `command`: the batch
    keys as the command gave them. A command that changed one of them sets
    `keep_global_batch=false` for this attempt: its own values win."""
    if position is None:
        return
    changed = [k for k, was in zip(ASKED, position.asked, strict=False) if command[k] != was]
    if changed:
        with open_dict(cfg):
            cfg.keep_global_batch = False
        log.warning(f"the command changed {', '.join(changed)}: the global batch follows it")
    if not position.follows or not (cfg.get("data") or {}).get("batch_size"):
        return  # a datamodule of its own: fit_accumulation, when its loader is built
    trainer, run = cfg.trainer, position.global_batch
    batch, accumulate = cfg.data.batch_size, int(trainer.get("accumulate_grad_batches") or 1)
    now = batch * accumulate * world
    if now == run:
        return
    if not cfg.get("keep_global_batch", True):
        log.warning(
            f"the global batch is now {now} ({batch} x {accumulate} accumulated x {world} "
            f"process(es)), {run} when the checkpoint was written (keep_global_batch=false)"
        )
        return
    batch, accumulate = split_global_batch(run, world, batch, batch_fixed=False)
    limit = _scaled_limit(trainer.get("limit_train_batches"), position, batch, world)
    with open_dict(cfg):
        cfg.data.batch_size, trainer.accumulate_grad_batches = batch, accumulate
        if limit is not None:
            trainer.limit_train_batches = limit
    log.warning(
        f"{world} process(es), {position.world} when the checkpoint was written: the global "
        f"batch of {run} is kept as {batch} per process x {accumulate} accumulated "
        f"(data.batch_size={batch}, trainer.accumulate_grad_batches={accumulate}"
        f"{f', trainer.limit_train_batches={limit}' if limit is not None else ''}); "
        "keep_global_batch=false lets it follow the world size"
    )


def _scaled_limit(limit: Any, position: Position, batch: int, world: int) -> int | None:
    """A count `trainer.limit_train_batches` for the new per-rank batch and world, so that an
    epoch still takes the same samples (None: no count to scale)."""
    if position.limit is None or not isinstance(limit, int) or isinstance(limit, bool):
        return None
    samples = position.limit * position.units[0] * position.world
    if samples % (batch * world):
        raise UserError(
            f"trainer.limit_train_batches={position.limit} ({samples} samples an epoch) is no "
            f"whole number of batches of {batch} x {world} process(es): give a fraction, or "
            "a count that suits both world sizes"
        )
    return samples // (batch * world)
