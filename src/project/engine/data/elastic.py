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
  so that an optimizer step takes the same samples as before, before anything is built. The
  per-rank batch is kept when it divides, else the largest that does, up to the configured
  one (memory); no whole-number split is one line with the numbers. A datamodule of its own,
  whose batch the run cannot set, gets the accumulation that keeps the global batch when its
  loader is built (`fit_accumulation`). `keep_global_batch=false`, or a command that changes
  the batch size or accumulation itself, lets the global batch follow (one logged line).
- **The counts of batches** (`COUNTS`: a count `trainer.limit_train_batches`,
  `val_check_interval`, `limit_val_batches`, `limit_test_batches`, each per rank) keep the
  samples they counted when the checkpoint was written (`fit_counts`: with the template's
  datamodule in `fit_global_batch`, with one of its own when its train loader is built), or
  stop the run with one line naming the count that would work. A command that changes one
  of them itself is followed as it is.
- **A shuffled stream's lanes** (project.data.lanes) are the run's too: recorded per train
  loader, used by every later attempt (`apply_layout`), and a world size that does not divide
  them, or a command asking for others, stops the run in one line before anything is built
  (`fit_layout`).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from omegaconf import DictConfig, open_dict

from project.data.lanes import check_world
from project.engine.data import sharding
from project.engine.errors import UserError

log = logging.getLogger(__name__)

KEY = "data_position"  # the checkpoint's entry (plain values: loads with weights_only=True)
BATCH_KEYS = ("data.batch_size", "trainer.accumulate_grad_batches")
# Trainer keys that count batches of one rank when they are ints (a float is a share of each
# rank's batches, the same share on any world size): they follow the per-rank batch x world.
COUNTS = ("trainer.limit_train_batches", "trainer.val_check_interval",
          "trainer.limit_val_batches", "trainer.limit_test_batches")  # fmt: skip
ASKED = (*BATCH_KEYS, *COUNTS)  # the order of Position.asked (older checkpoints: the first 3)


def asked(cfg: Any) -> dict[str, Any]:
    """The batch keys and counts as the command gave them (before `fit_global_batch` sets
    any)."""
    data, trainer = cfg.get("data") or {}, cfg.get("trainer") or {}
    return {BATCH_KEYS[0]: data.get("batch_size"),
            **{key: trainer.get(key.split(".")[1]) for key in ASKED[1:]}}  # fmt: skip


def count(value: Any) -> int | None:
    """`value` when it is a count of batches (an int, not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# Position's fields saved as lists
TUPLES = ("units", "offsets", "asked", "counts", "own", "lanes", "blocks")


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
    counts: tuple[int | None, ...] = ()  # the COUNTS keys in effect then (None: no count)
    own: tuple[int, ...] = ()  # per train loader: positions of its current pass read by all
    # ranks together (its own count: a short loader cycled inside the epoch is in a later pass)
    lanes: tuple[int, ...] = ()  # per train loader: a shuffled stream's lanes (0: none), the
    # run's for good (project.data.lanes); older checkpoints: () (streams were shard-major:
    # 1 lane, blocks of 1 row)
    blocks: tuple[int, ...] = ()  # per train loader: a shuffled stream's shuffle_block

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
        tuples = {k: tuple(saved.get(k) or ()) for k in TUPLES}
        return cls(**{**saved, **tuples})


def record(
    loaders: Any, epoch: int, batches: int, world: int, accumulate: int, cfg: DictConfig,
    command: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """The checkpoint entry for the train `loaders` at `batches` of `epoch` (`command`: the
    batch keys as the command gave them, `asked(cfg)` before fit_global_batch)."""
    in_effect = tuple(count(cfg.trainer.get(key.split(".")[1])) for key in COUNTS)
    flat = sharding.flat(loaders)
    units = tuple(sharding.units_per_batch(loader) for loader in flat)
    offsets = tuple(sharding.epoch_start(loader, epoch) % (u * world)
                    for loader, u in zip(flat, units, strict=True))  # fmt: skip
    position = Position(
        epoch, batches, world, accumulate, units, offsets,
        units[:1] == ((cfg.get("data") or {}).get("batch_size"),),
        in_effect[0], tuple(command.get(key) for key in ASKED), in_effect,
        tuple(sharding.own_position(loader, epoch, batches, world) for loader in flat),
        *zip(*(sharding.stream_layout(loader) for loader in flat), strict=True),
    )  # fmt: skip
    saved = asdict(position)
    saved.update({k: list(saved[k]) for k in TUPLES})
    return saved


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


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


def fit_layout(cfg: DictConfig, position: Position | None, world: int, where: str) -> None:
    """A resumed run keeps its streams' layout (project.data.lanes), recorded in its checkpoint
    (`where`): a world size that does not divide its lanes, or a command asking for other lanes
    or another shuffle_block, is one line (before anything is built or written)."""
    if position is None:
        return
    for lanes in dict.fromkeys(position.lanes):
        if lanes:
            check_world(lanes, world, f"resuming from {where}")
    data = cfg.get("data") or {}
    recorded = {"lanes": position.lanes[:1], "shuffle_block": position.blocks[:1]}
    for key, (value,) in ((k, v) for k, v in recorded.items() if v):
        if value and data.get(key) is not None and data.get(key) != value:
            raise UserError(
                f"data.{key}={data.get(key)}, and {where} was written with data.{key}={value}: "
                f"a run keeps its stream's layout; drop the override (or set data.{key}="
                f"{value}) to resume, or start a new run"
            )


def apply_layout(loaders: Any, position: Position | None, world: int) -> None:
    """Lay each train loader's shuffled stream out as the checkpoint recorded (`fit_layout`
    checked the world size at start; a datamodule of its own is checked here). A checkpoint
    from before the lanes keeps its run in the shard-major order it was training in (1 lane,
    blocks of 1 row): exact, on any world size."""
    if position is None:
        return
    flat = sharding.flat(loaders)
    recorded = zip(position.lanes, position.blocks, strict=True) if position.lanes else (
        [(1, 1)] * len(flat))  # fmt: skip
    for loader, (lanes, block) in zip(flat, recorded, strict=False):
        if lanes and sharding.stream_layout(loader)[0]:
            check_world(lanes, world, "resuming from the checkpoint")
            sharding.lay_out(loader, lanes, block)
            sharding.say_layout(lanes, block)
            if not position.lanes:
                _warn_once(
                    "the checkpoint was written before streams were laid out in lanes: this run "
                    "keeps the shard-major order it was trained in (data.lanes=1 "
                    "data.shuffle_block=1); a new run gets the lanes (docs/data.md)"
                )


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
    # Only fixes that exist: a world size that divides the batch, or the global batch let go
    # (the batch keys cannot help: no whole numbers make their product x world the batch).
    fits = [w for w in range(1, global_batch + 1) if global_batch % w == 0
            and (not batch_fixed or global_batch // w % batch == 0)]  # fmt: skip
    shown = ", ".join(map(str, fits[:12])) + (", ..." if len(fits) > 12 else "")
    raise UserError(
        f"the run's global batch of {global_batch} cannot be split over {world} process(es) "
        f"with {'a per-rank batch of ' + str(batch) if batch_fixed else 'whole numbers'}: run "
        f"on {shown} process(es), or set keep_global_batch=false to let the global batch "
        "follow the world size"
    )


def fit_global_batch(
    cfg: DictConfig, position: Position | None, world: int, command: dict[str, Any]
) -> None:
    """Set this attempt's per-rank batch and accumulation (in `cfg`) so that the run's global
    batch stays what its checkpoint recorded, and the counts of batches their samples (see the
    module docstring); `command`: the keys as the command gave them. A command that changed
    the batch size or accumulation sets `keep_global_batch=false` for this attempt: its own
    values win."""
    if position is None:
        return
    changed = [k for k in BATCH_KEYS if _changed(k, position, command)]
    if changed:
        with open_dict(cfg):
            cfg.keep_global_batch = False
        log.warning(f"the command changed {', '.join(changed)}: the global batch follows it")
    if not position.follows or not (cfg.get("data") or {}).get("batch_size"):
        return  # a datamodule of its own: fit_accumulation and fit_counts, when it is built
    trainer, run = cfg.trainer, position.global_batch
    batch, accumulate = cfg.data.batch_size, int(trainer.get("accumulate_grad_batches") or 1)
    now = batch * accumulate * world
    if now != run and not cfg.get("keep_global_batch", True):
        log.warning(
            f"the global batch is now {now} ({batch} x {accumulate} accumulated x {world} "
            f"process(es)), {run} when the checkpoint was written (keep_global_batch=false)"
        )
    elif now != run:
        batch, accumulate = split_global_batch(run, world, batch, batch_fixed=False)
        with open_dict(cfg):
            cfg.data.batch_size, trainer.accumulate_grad_batches = batch, accumulate
        log.warning(
            f"{world} process(es), {position.world} when the checkpoint was written: the "
            f"global batch of {run} is kept as {batch} per process x {accumulate} accumulated "
            f"(data.batch_size={batch}, trainer.accumulate_grad_batches={accumulate}); "
            "keep_global_batch=false lets it follow the world size"
        )
    set_counts(cfg, fit_counts(trainer, position, batch, world, command))


def _changed(key: str, position: Position, command: dict[str, Any]) -> bool:
    """Whether the command gives `key` another value than it did when the checkpoint was
    written (a key that checkpoint did not record: not changed)."""
    i = ASKED.index(key)
    return i < len(position.asked) and command.get(key) != position.asked[i]


def fit_counts(
    trainer: Any, position: Position, batch: int, world: int, command: dict[str, Any]
) -> dict[str, int]:
    """The COUNTS (trainer key -> count) that count, with `batch` per rank x `world`, the
    samples they counted when the checkpoint was written (`trainer`: the config's trainer
    keys); only those that differ from `trainer`'s. Evaluation batches are taken to follow the
    train batch (the template's datamodule uses one batch size for all). One line when a
    count has no whole-number equivalent, naming the counts that would work."""
    before, now = position.units[0] * position.world, batch * world
    fitted = {}
    for i, key in enumerate(COUNTS):
        name = key.split(".")[1]
        value = count(trainer.get(name))
        if value is None or _changed(key, position, command):
            continue  # not a count, or the command's own: as it is
        old = position.counts[i] if position.counts else (position.limit if i == 0 else value)
        if old is None:
            continue
        across_epochs = trainer.get("check_val_every_n_epoch", 1) is None
        if name == "val_check_interval" and before != now and across_epochs:
            raise UserError(
                f"trainer.val_check_interval={value} with check_val_every_n_epoch=null counts "
                f"batches of {position.units[0]} x {position.world} process(es) across epochs, "
                f"and this run's batches are {batch} x {world}: set "
                "trainer.check_val_every_n_epoch to a number of epochs, or resume on "
                f"{position.world} process(es)"
            )
        samples = old * before
        if samples % now:
            raise UserError(_no_whole_count(name, value, old, position, batch, world))
        if samples // now != value:
            fitted[name] = samples // now
    return fitted


def _no_whole_count(
    name: str, value: int, old: int, position: Position, batch: int, world: int
) -> str:
    """The one line for a count that no whole number of this world's batches equals."""
    samples, now = old * position.units[0] * position.world, batch * world
    low = samples // now  # the nearest whole counts, not the value given (it would fail again)
    near = min((n for n in (low, low + 1, low + 2) if n > 0 and n != value),
               key=lambda n: abs(n * now - samples))  # fmt: skip
    return (
        f"trainer.{name}={value} counted {samples} samples when the checkpoint was written "
        f"({old} batches of {position.units[0]} x {position.world} process(es)), and no whole "
        f"number of this run's batches of {batch} x {world} process(es) does: set "
        f"trainer.{name}={near} ({near * now} samples; a value the command changes is used as "
        f"given), a fraction, or resume on {position.world} process(es)"
    )


def set_counts(cfg: DictConfig, fitted: dict[str, int]) -> None:
    """Write the fitted counts into `cfg.trainer` (what checkpoints record), one line."""
    if not fitted:
        return
    with open_dict(cfg):
        was = {name: cfg.trainer.get(name) for name in fitted}
        cfg.trainer.update(fitted)
    log.warning(
        "on this world size the counts of batches keep their samples: "
        + ", ".join(f"trainer.{k}={v} (given {was[k]})" for k, v in fitted.items())
    )


def fit_loader_counts(
    cfg: DictConfig, position: Position | None, loaders: Any, world: int, command: dict[str, Any]
) -> dict[str, int]:
    """`fit_counts` for train loaders as built (a datamodule of its own: its batch size is
    its own), written into `cfg`; returns them for the trainer."""
    if position is None:
        return {}
    batch = sharding.units_per_batch(sharding.flat(loaders)[0])
    fitted = fit_counts(cfg.trainer, position, batch, world, command)
    set_counts(cfg, fitted)
    return fitted
