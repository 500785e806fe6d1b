"""The raw trainer's checkpoints: last.pt (resume), best.pt (the monitored metric), loading
either. What ModelCheckpoint and the template's RunState do for Lightning.

Paths, the stop's save schedule and the entries every checkpoint of either trainer carries
(the data position, RNG streams, the run's command) are project.engine.checkpoints.run's;
this mixin adds what only the raw trainer holds (its model, optimizer, scheduler, scaler,
loop counters, early stopping) and writes it the way Lightning does: rank 0, atomically,
every rank waiting until it is on disk.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import torch

from project.engine.checkpoints.state import atomic_save
from project.engine.config.compose import to_plain
from project.engine.data import elastic
from project.engine.distributed import ledger as ledgers

log = logging.getLogger(__name__)


class Checkpointing:
    """Mixed into RawTrainer (project.engine.raw.trainer), whose attributes it reads (not
    imported here for a type: the trainer imports this module)."""

    def save_last(self, say: bool = False) -> None:
        """Write last.pt (rank 0, atomically); every rank waits until it is on disk. `say`: a
        line on the console (a stop, the end); the epochs' saves go to the log file only."""
        self.outside_steps(ledgers.CHECKPOINT)  # the others wait while rank 0 writes
        began, path = time.monotonic(), self.checkpoints.last
        self.checkpoints.save_hook(self.comm_hook, self.global_step)  # every rank its own
        if self.is_zero:
            atomic_save(self.state_dict(), path)
            log.log(
                logging.INFO if say else logging.DEBUG, f"Saved {path} at step {self.global_step}"
            )
        self.barrier()
        self.checkpoints.prune_hook(self.comm_hook, self.global_step)
        self.stop.mark_saved(self.global_step, time.monotonic() - began)

    def save_best(self, metrics: dict[str, float]) -> None:
        """After validation: best.pt when the monitored metric improved (strictly)."""
        ckpt_cfg = self.cfg.callbacks.get("model_checkpoint") or {}
        monitor = ckpt_cfg.get("monitor") or self.cfg.optimized_metric
        mode = ckpt_cfg.get("mode") or self.cfg.optimized_mode
        value = metrics.get(monitor)
        improved = value is not None and (
            self.best is None or (value < self.best if mode == "min" else value > self.best)
        )
        if improved:
            self.best = value
        if self.is_zero and ckpt_cfg and improved:
            atomic_save(self.state_dict(), self.checkpoints.best)

    def state_dict(self) -> dict[str, Any]:
        accumulate = int(self.cfg.trainer.get("accumulate_grad_batches") or 1)
        entries = self.checkpoints.entries(self.loaders["train"], self.epoch, self.batch_in_epoch,
                                           self.world, accumulate)  # fmt: skip
        return entries | {
            "model": self.task.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "scaler": self.scaler.state_dict(),
            "epoch": self.epoch,  # the epoch to run (or continue)
            "batch_in_epoch": self.batch_in_epoch,  # its batches already trained on
            "global_step": self.global_step,
            "best": self.best,
            "early_stopping": {"best": self.early.best, "wait": self.early.wait},
            "config": to_plain(self.cfg),
        }

    def load(self, path: str | Path, weights_only: bool = False) -> None:
        """Resume from a checkpoint of this trainer (or, weights_only, take its weights)."""
        # a resume's load is a failure's cost (goodput); the weights to test are not
        nothing = contextlib.nullcontext()
        with nothing if weights_only else self.ledger.during(ledgers.RELOAD):
            state = torch.load(path, map_location=self.device, weights_only=True)
        self.task.load_state_dict(state["model"])
        if weights_only:
            return
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler and state["scheduler"]:
            self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.epoch, self.global_step = state["epoch"], state["global_step"]
        self.best = state["best"]
        self.position = elastic.Position.of(state.get(elastic.KEY))
        self.early.best = state["early_stopping"]["best"]
        self.early.wait = state["early_stopping"]["wait"]
        self.checkpoints.restore_rng(self.checkpoints.rng_of(state))  # continue the streams
        self.checkpoints.load_hook(self.comm_hook, Path(path), self.global_step, self.device)
        self.resumed = True
        log.info(f"Resumed from {path}: epoch {self.epoch}, step {self.global_step}")
