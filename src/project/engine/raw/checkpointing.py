"""The raw trainer's checkpoints: last.pt (resume), best.pt (the monitored metric), loading
either. What ModelCheckpoint and the template's RunState do for Lightning.

Paths, the stop's save schedule and the entries every checkpoint of either trainer carries
(the data position, RNG streams, the run's command) are project.engine.checkpoints.run's;
this mixin adds what only the raw trainer holds (its model, optimizer, scheduler, scaler,
loop counters, early stopping) and writes it the way Lightning does: rank 0, atomically,
every rank waiting until it is on disk.

Under strategy=fsdp on several processes (and in a run folder that already holds one, on any
world size) `last` is sharded (project.engine.checkpoints.sharded): every rank writes its own
shards of model and optimizer, rank 0 the rest of the same entries once (`common`), each rank
its RNG states; a manifest publishes the save once every rank's part is complete. A resume
reshards onto the world size it runs on; the rest is read as from last.pt.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import torch

from project.engine.checkpoints import sharded, whole
from project.engine.checkpoints.resume import check_same_on_every_rank
from project.engine.checkpoints.sharded import ShardedLast
from project.engine.checkpoints.state import atomic_save
from project.engine.config.compose import to_plain, to_plain_tree
from project.engine.data import elastic
from project.engine.distributed import ddp
from project.engine.distributed import ledger as ledgers

log = logging.getLogger(__name__)


class Checkpointing:
    """Mixed into RawTrainer (project.engine.raw.trainer), whose attributes it reads (not
    imported here for a type: the trainer imports this module)."""

    def open_last(self) -> None:
        """Every rank, once the process group is up, before any group or load of its own:
        the ranks picked the same checkpoint to continue from; a sharded `last` gets its
        own gloo group (ShardedLast), made on every rank now."""
        c = self.checkpoints
        check_same_on_every_rank(self.run.resume, c.sharded)
        timeout = ddp.outside_steps_timeout(self.timeout)
        self.sharded_last = ShardedLast(c.sharded_dir, c.sharded_name, "raw", timeout) \
            if c.sharded else None  # fmt: skip

    def save_last(self, say: bool = False) -> None:
        """Write last.pt (rank 0, atomically); every rank waits until it is on disk. `say`: a
        line on the console (a stop, the end); the epochs' saves go to the log file only."""
        self.outside_steps(ledgers.CHECKPOINT)  # the others wait while rank 0 writes
        began, path = time.monotonic(), self.checkpoints.last
        self.checkpoints.save_hook(self.comm_hook, self.global_step)  # every rank its own
        if self.sharded_last is not None:  # every rank its shards, then the manifest
            state = self.state_dict(with_model=False)
            background = bool(self.cfg.strategy.get("async_save"))  # strategy=fsdp's key
            self.sharded_last.save(self.global_step, self.task, self.optimizer, state,
                                   {"rng": state["rng"]}, asynchronous=background)  # fmt: skip
            if say:  # a stop or the end: written and published before the run says so
                self.sharded_last.wait()
        elif self.is_zero:
            atomic_save(self.state_dict(), path)
        self.barrier()
        # a URL folder: every rank uploads its files, then rank 0 publishes them as `last`
        self.checkpoints.publish(self.comm_hook, self.global_step, self.device)
        if self.is_zero:
            level = logging.INFO if say else logging.DEBUG
            log.log(level, f"Saved {self.checkpoints.where} at step {self.global_step}")
        self.checkpoints.prune_hook(self.comm_hook, self.global_step)
        took = time.monotonic() - began
        if self.sharded_last is not None:  # in the background: a stop's save costs a whole one
            took = max(took, self.sharded_last.write_s)
        self.stop.mark_saved(self.global_step, took)

    def last_path(self) -> Path | str:
        """Where `last` is: last.pt, or the manifest of a sharded one."""
        c = self.checkpoints
        return c.sharded_manifest if c.sharded else c.last

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
        if ckpt_cfg and improved:  # every rank: under FSDP the state is gathered (collective)
            state = self.state_dict()
            if self.is_zero:
                atomic_save(state, self.checkpoints.best)

    def state_dict(self, with_model: bool = True) -> dict[str, Any]:
        """What last.pt holds; `with_model` false: all but model and optimizer (a sharded
        save writes those itself), as plain values (weights_only loading takes no config
        objects). Under FSDP every rank calls it (the whole state is gathered) and rank 0
        holds the result (the others: empty model and optimizer entries)."""
        accumulate = int(self.cfg.trainer.get("accumulate_grad_batches") or 1)
        entries = self.checkpoints.entries(self.loaders["train"], self.epoch, self.batch_in_epoch,
                                           self.world, accumulate)  # fmt: skip
        if not with_model:
            return to_plain_tree(entries | self.loop_state())
        if sharded.holds_shards(self.task):  # one file all the same: the whole state
            model, optimizer = whole.gathered_state(self.task, self.optimizer)
        else:
            model, optimizer = self.task.state_dict(), self.optimizer.state_dict()
        return entries | self.loop_state() | {"model": model, "optimizer": optimizer}

    def loop_state(self) -> dict[str, Any]:
        return {
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
        if sharded.is_sharded(str(path)):
            state = self.load_sharded(path, weights_only)
        else:
            with nothing if weights_only else self.ledger.during(ledgers.RELOAD):
                state = torch.load(path, map_location=self.device, weights_only=True)
            if sharded.holds_shards(self.task):  # a DDP run's last.pt under strategy=fsdp
                sharded.load_whole(self.task, None if weights_only else self.optimizer, state)
            else:
                self.task.load_state_dict(state["model"])
                if not weights_only:
                    self.optimizer.load_state_dict(state["optimizer"])
        if weights_only:
            return
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

    def load_sharded(self, path: str | Path, weights_only: bool) -> dict[str, Any]:
        """Every rank: model (and optimizer) from a sharded save, resharded onto this world
        size; returns the rest of its entries, with this rank's own RNG states where the
        world size is the one that saved it (else rank 0's, as from last.pt)."""
        group = self.sharded_last.group if self.sharded_last is not None else None
        optimizer = None if weights_only else self.optimizer
        nothing = contextlib.nullcontext()
        with nothing if weights_only else self.ledger.during(ledgers.RELOAD):
            loaded = sharded.load(str(path), self.task, optimizer, "ckpt_path", group)
        state = dict(loaded.common)
        if loaded.own and loaded.mine is not None:
            state["rng"] = loaded.mine["rng"]
        return state
