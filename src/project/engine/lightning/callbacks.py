"""The template's own Lightning extensions (the rest come from Lightning, see configs/callbacks):
the run's checkpoint state (always on: last.ckpt, coordinated stop, exact resume, the data
position), atomic checkpoint writes, per-step statistics and fault injection."""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from project.engine.checkpoints import sharded, whole
from project.engine.checkpoints.remote import is_url
from project.engine.checkpoints.resume import check_same_on_every_rank
from project.engine.checkpoints.state import atomic_save
from project.engine.data import sharding
from project.engine.distributed import comm_hooks, faults, hangs
from project.engine.distributed import ledger as ledgers
from project.engine.distributed.ddp import CollectiveTimeout
from project.engine.distributed.ledger import Ledger
from project.engine.lightning.datamodule import batches_done, fit_epoch
from project.engine.private_api import kill_launched_ranks, skip_sigterm_broadcast
from project.engine.run import console, watch
from project.engine.shared.step_stats import StepStats

if TYPE_CHECKING:
    from project.engine.run.skeleton import Run

log = logging.getLogger(__name__)


class RunState(pl.Callback):
    """The run's checkpoint owner (project.engine.checkpoints.run) inside Lightning; always on
    (train.py adds it, whatever the callbacks config). It writes the template's entries into
    every checkpoint (ModelCheckpoint's too), owns `last.ckpt` and the coordinated stop, and
    restores what a resumed run continues with.

    - At the start of every accumulation window, every few windows, all ranks all-reduce
      (signal received?, time-based checkpoint due?), so they stop or save after the same
      optimizer step (project.engine.distributed.signals). This replaces Lightning's per-step
      blocking broadcast and its signal handler.
    - On a stop: save `last.ckpt`, then Lightning's own shutdown (SIGTERMException); the run
      skeleton exits with EXIT_PREEMPTED (project.engine.distributed.exits).
    - With fault tolerance on, the end-of-epoch checkpoint is written before the first batch
      of the next epoch (a mid-epoch checkpoint with nothing of that epoch done: the restart
      point Lightning resumes exactly), and the last one when training ends, marked
      finished. Lightning's ModelCheckpoint(save_last=True) is not used for this: it
      refreshes last.ckpt only when the monitored metric improves, and writes last-v1.ckpt
      when a last.ckpt exists.
    - Exact resume: the RNG states travel in the checkpoint; the train loader starts where a
      mid-epoch checkpoint's epoch stood, on any world size (datamodule.start_where_fit_resumes);
      every epoch reaches the loaders' orders (Lightning sets the epoch on samplers only, not
      on an iterable dataset such as a ShardedStream, nor the workers' seeds).
    - The run's diagnostics (project.engine.run.watch): the ledger's marks at each phase of a
      step, the hang watchdog, the ranks' step timings for straggler detection, goodput.
    """

    def __init__(self, run: Run) -> None:
        self.checkpoints = checkpoints = run.checkpoints
        self.run, self.ledger = run, run.ledger
        self.stop = checkpoints.stop_signal()
        self.watch: watch.Watch | None = None
        self._backward_at = 0.0  # where the span of collectives the stragglers time began
        self._resuming = False  # fit continues from a checkpoint: restore at train start
        self._rng: dict[str, Any] | None = None  # its generators' states (not all of it)
        self.timeouts = CollectiveTimeout(None, None, 1)  # the strategy's, at train start

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # the process group is up; Lightning loads the checkpoint later
            check_same_on_every_rank(self.run.resume, self.checkpoints.sharded)

    # --- state in the checkpoint ---
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        done = batches_done(trainer.fit_loop.epoch_loop.batch_progress)
        checkpoint.update(self.checkpoints.entries(
            trainer.train_dataloader, fit_epoch(trainer), done, trainer.world_size,
            trainer.accumulate_grad_batches,
        ))  # fmt: skip
        # Every save (this callback's, ModelCheckpoint's every_n_train_steps): the other ranks
        # wait while rank 0 writes.
        self.outside_steps(ledgers.CHECKPOINT, trainer)

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Restored at train start, after Lightning's own seeding. Only the RNG states are kept:
        # Lightning frees the rest once it restored it.
        self._resuming, self._rng = True, self.checkpoints.rng_of(checkpoint)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._resuming:  # continue the interrupted RNG streams
            self.checkpoints.restore_rng(self._rng)
            self._resuming, self._rng = False, None
            step, device = trainer.global_step, trainer.strategy.root_device
            self.checkpoints.load_hook(comm_hook(trainer), Path(trainer.ckpt_path), step, device)
        strategy = trainer.strategy  # the template's DDPStrategy, or one process ("auto")
        step_s, long = getattr(strategy, "step_timeout_s", None), getattr(strategy, "timeout", None)
        self.timeouts = CollectiveTimeout(step_s, long, trainer.world_size)
        # Lightning registered its signal handlers just before this hook; ours replace them
        # and Lightning's teardown restores the original ones afterwards.
        self.stop.install()
        self.watch = watch.start(
            self.run, trainer.global_rank, trainer.world_size, trainer.global_step,
            self.timeouts, self.stop, log_to(trainer),
            kill_children=lambda: kill_launched_ranks(trainer, signal.SIGKILL),
            close_loggers=lambda: [lg.finalize("failed") for lg in trainer.loggers],
        )  # fmt: skip
        self.stop.mark_saved(trainer.global_step)  # a resumed run starts from a checkpoint
        if not skip_sigterm_broadcast(trainer):  # the check below does its job every few steps
            log.warning("this Lightning has no per-step SIGTERM broadcast to replace")

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Before each later epoch's iterator is made (the first: datamodule.py).
        sharding.set_epoch(trainer.train_dataloader, fit_epoch(trainer))

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx % trainer.accumulate_grad_batches:
            self.ledger.mark(ledgers.STEP, trainer.global_step)  # the batch came
            self._backward_at = time.perf_counter()
            return  # inside an accumulation window: partial gradients are not checkpointed
        stragglers = self.stop.stragglers
        if stragglers is not None:
            stragglers.window_end()
        self.ledger.window_start()  # the window just ended counts for the deadline set now
        self.timeouts.in_steps(3 * self.ledger.window_s)
        stop, save = self.stop.check(trainer.strategy.root_device, trainer.global_step)
        epoch_end = self.checkpoints.periodic and batch_idx == 0
        if save or stop or (epoch_end and trainer.global_step != self.stop.saved_step):
            self.save(trainer, say=stop)
        if stop:
            raise SIGTERMException()
        self.ledger.mark(ledgers.STEP, trainer.global_step)
        if stragglers is not None:
            stragglers.window_start()
        self._backward_at = time.perf_counter()  # FSDP's collectives begin with the forward

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        # Lightning fetches the next batch after this hook (and validation, which marks its
        # own phase): a stuck loader is then "waiting for data", not the step before it.
        self.ledger.mark(ledgers.DATA, trainer.global_step)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: Any, loss: Any) -> None:
        stragglers = self.stop.stragglers  # sharded: the span began with the forward
        if stragglers is not None and not stragglers.sharded:
            self._backward_at = time.perf_counter()

    def on_after_backward(self, trainer: pl.Trainer, pl_module: Any) -> None:
        # DDP: the last backward of a window is the syncing one; FSDP: every forward and
        # backward gathers the weights (project.engine.distributed.stragglers).
        if self.stop.stragglers is not None:
            self.stop.stragglers.synced(time.perf_counter() - self._backward_at)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.ledger.mark(ledgers.OPTIMIZER, trainer.global_step)

    def outside_steps(self, phase: int, trainer: pl.Trainer) -> None:
        """Anything but a training step begins: long timeouts, the ledger, no step timing."""
        self.timeouts.outside_steps()
        self.ledger.mark(phase, trainer.global_step)
        if self.stop.stragglers is not None:
            self.stop.stragglers.pause()

    def save(self, trainer: pl.Trainer, say: bool = False) -> None:
        """Write last.ckpt (every rank calls this; rank 0 writes, atomically). `say`: a line
        on the console (a stop, the end); the epochs' saves go to the log file only."""
        if trainer.fast_dev_run:
            return  # like ModelCheckpoint: debug runs leave no checkpoint to resume
        self.outside_steps(ledgers.CHECKPOINT, trainer)  # the others wait while rank 0 writes
        began, path, hook = time.monotonic(), self.checkpoints.last, comm_hook(trainer)
        self.checkpoints.save_hook(hook, trainer.global_step)  # every rank its own file
        with getattr(trainer.strategy, "writing_last", contextlib.nullcontext)():
            trainer.save_checkpoint(path, weights_only=False)  # full state: a resume point
        sharded = getattr(trainer.strategy, "sharded_last", None)  # strategy=fsdp's
        if say and sharded is not None:  # a stop or the end: published before the run says so
            sharded.wait()
        # a URL folder: every rank uploads its files, then rank 0 publishes them as `last`
        self.checkpoints.publish(hook, trainer.global_step, trainer.strategy.root_device)
        self.checkpoints.prune_hook(hook, trainer.global_step)
        took = time.monotonic() - began
        if sharded is not None:  # in the background: a stop's save costs a whole one
            took = max(took, sharded.write_s)
        self.stop.mark_saved(trainer.global_step, took)
        level = logging.INFO if say else logging.DEBUG
        log.log(level, f"Saved {self.checkpoints.where} at step {trainer.global_step}")

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.outside_steps(ledgers.VALIDATION, trainer)  # and ModelCheckpoint's saves after it

    def on_validation_batch_end(self, *args: Any) -> None:
        self.ledger.touch()  # a long validation is progress, not a hang

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.outside_steps(ledgers.EPOCH_END, trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.stop.restore()
        self.outside_steps(ledgers.EPOCH_END, trainer)
        self.checkpoints.finish(trainer.callback_metrics)
        if self.checkpoints.saves_at_end():
            self.save(trainer, say=True)
        watch.end(self.watch, trainer.global_step, log_to(trainer))
        for early in trainer.early_stopping_callbacks:  # Lightning says it only when verbose
            if early.stopped_epoch and trainer.is_global_zero:
                log.info(stopped_early(early))

    def on_exception(self, trainer: pl.Trainer, pl_module: Any, exception: BaseException) -> None:
        hangs.report_peer_failure(exception)  # a dead peer: the report (it never returns)
        self.stop.restore()


def stopped_early(early: pl.callbacks.EarlyStopping) -> str:
    """Why EarlyStopping ended the run: patience (the line both trainers print), or its own
    reason (a threshold, a metric that is not finite)."""
    from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason

    if early.stopping_reason != EarlyStoppingReason.PATIENCE_EXHAUSTED:
        return f"Early stopping after epoch {early.stopped_epoch}: {early.stopping_reason_message}"
    best = early.best_score.item() if early.best_score.isfinite() else None
    return console.stopped_early(early.monitor, best, early.patience, early.stopped_epoch)


def log_to(trainer: pl.Trainer) -> watch.LogMetrics | None:
    """Rank 0's loggers, for the straggler timings and the goodput."""
    if not trainer.is_global_zero or not trainer.loggers:
        return None

    def log_metrics(metrics: dict[str, float], step: int) -> None:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step)

    return log_metrics


def comm_hook(trainer: pl.Trainer) -> comm_hooks.CommHook | None:
    """The strategy's gradient-communication hook (project.engine.lightning.strategy)."""
    return getattr(trainer.strategy, "comm_hook", None)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning writes checkpoints straight into the target file; a kill midway leaves a
    truncated last.ckpt. This writes a temp file, fsyncs and renames it over the target.
    Loading is booked to the ledger's reload phase (goodput). `staging`: where a sharded save
    at a URL is copied to be read."""

    def __init__(self, ledger: Ledger | None = None, staging: Path | None = None) -> None:
        super().__init__()
        self.ledger, self.staging = ledger, staging

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        # A sharded save (strategy=fsdp's, given to a run on one process or under DDP):
        # gathered whole on each process (checkpoints.whole.resumable). A URL here is a
        # sharded `last`'s folder (RunCheckpoints): any other URL was downloaded first.
        if is_url(str(path)) or sharded.names_save(str(path)):
            read = functools.partial(whole.resumable, str(path), staging=self.staging)
            return self.booked(read)
        return self.booked(functools.partial(super().load_checkpoint, path, *args, **kwargs))

    def booked(self, read: Callable[[], Any]) -> Any:
        """`read()` booked to the ledger's reload phase (goodput), but the weights to test."""
        if self.ledger is None or self.ledger.phase == ledgers.TEST:
            return read()
        with self.ledger.during(ledgers.RELOAD):
            return read()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        atomic_save(checkpoint, path)


class FaultInjection(pl.Callback):
    """Kill (or fail) a chosen rank at a chosen step: `fault_injection.*` in configs/train.yaml."""

    def __init__(self, cfg: dict[str, Any], ledger: Ledger | None = None) -> None:
        self.cfg, self.ledger = cfg, ledger

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        faults.maybe_fail(trainer.global_step, trainer.global_rank, self.cfg, self.ledger)


class StepStatsCallback(pl.Callback):
    """Records per-step times and losses into <run dir>/step_stats.json (for project.compare)."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = Path(run_dir)
        self.stats = StepStats()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.stats.units_per_step:
            task = pl_module.task
            self.stats.record_units(task.unit, task.count(batch) * trainer.world_size)
        self.stats.step_start()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, *args: Any
    ) -> None:
        # outputs["loss"] is what backward saw: the loss divided by accumulate_grad_batches.
        self.stats.record_loss(outputs["loss"])

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.stats.write(self.run_dir)
