"""The raw PyTorch DDP trainer: the same training as `project.train`, without Lightning.

    python -m project.raw_train [overrides]                                  # one process
    torchrun --standalone --nproc-per-node=2 -m project.raw_train [overrides] # DDP
    TRAINER=raw launch/single_node.sh [overrides]                            # the same, scripted

It reads the same Hydra configs and builds the same network (project.nets), data
(project.digits), optimizer and scheduler (project.optim), so it is a readable account of what
Lightning does for you, a way to debug distributed problems without framework layers, and a
baseline for Lightning's overhead (`python -m project.compare`). What had to match for the
per-step losses to be bitwise equal to Lightning's is marked "parity:" below.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from project.config import CONFIG_DIR, register_resolvers, to_plain
from project.console import (
    METRICS_FILE,
    read_metrics,
    report_metrics,
    report_user_errors,
    run_cli,
)
from project.errors import UserError
from project.launcher import EXIT_PREEMPTED, report_exit
from project.resume import (
    atomic_save,
    find_resume,
    project_state,
    training_identity,
)

log = logging.getLogger("project.raw_train")

# --- Which config keys this trainer reads --------------------------------------------------
# Every leaf of the training config must be in one of these (tests/test_raw_parity.py checks
# every option of every group), so a key that changes Lightning's training cannot be silently
# ignored here. A trailing ".*" covers a whole subtree.
CONSUMED = {
    "seed", "train", "test", "test_ckpt", "ckpt_path", "optimized_metric", "optimized_mode",
    "step_stats",
    "data.*", "model.*", "strategy.*", "paths.*",
    "trainer.accelerator", "trainer.devices", "trainer.num_nodes", "trainer.sync_batchnorm",
    "trainer.min_epochs", "trainer.max_epochs", "trainer.precision",
    "trainer.accumulate_grad_batches", "trainer.gradient_clip_val",
    "trainer.gradient_clip_algorithm", "trainer.check_val_every_n_epoch",
    "trainer.log_every_n_steps", "trainer.deterministic", "trainer.benchmark",
    "trainer.limit_train_batches", "trainer.limit_val_batches", "trainer.limit_test_batches",
    "trainer.num_sanity_val_steps", "trainer.fast_dev_run", "trainer.use_distributed_sampler",
    "callbacks.model_checkpoint", "callbacks.model_checkpoint.dirpath",
    "callbacks.model_checkpoint.monitor", "callbacks.model_checkpoint.mode",
    "callbacks.early_stopping.*", "callbacks.fault_tolerance.*", "auto_resume",
    "fault_injection.*",
}  # fmt: skip
# Keys that change what is shown or named, not what is trained.
PRESENTATION = {
    "task_name", "tags", "logger.*", "trainer._target_",
    "trainer.default_root_dir", "trainer.enable_progress_bar", "trainer.enable_model_summary",
    "trainer.profiler", "callbacks.progress_bar.*", "callbacks.model_summary.*",
    "callbacks.lr_monitor.*", "callbacks.model_checkpoint._target_",
    "callbacks.model_checkpoint.filename", "callbacks.model_checkpoint.save_top_k",
    "callbacks.model_checkpoint.auto_insert_metric_name",
    "callbacks.model_checkpoint.every_n_epochs",
    "callbacks.model_checkpoint.save_last",  # must stay false: fault_tolerance owns last.*
}  # fmt: skip
# Lightning features this trainer does not implement: refused when set (see check_config).
REFUSED = {"trainer.overfit_batches": 0.0, "trainer.detect_anomaly": False}
LAST = "last.pt"  # the raw trainer's checkpoints are its own format, not Lightning's .ckpt
SUPPORTED_PRECISION = ("32-true", "32", 32, "bf16-mixed", "16-mixed")


def classify(key: str) -> str | None:
    """ "consumed", "presentation", "refused" or None (unknown: a test fails on it)."""
    for kind, keys in (
        ("consumed", CONSUMED),
        ("presentation", PRESENTATION),
        ("refused", REFUSED),
    ):
        subtrees = [k[:-2] for k in keys if k.endswith(".*")]
        if key in keys or any(key == t or key.startswith(t + ".") for t in subtrees):
            return kind
    return None


def check_config(cfg: DictConfig) -> None:
    for key, default in REFUSED.items():
        group, name = key.split(".")
        value = cfg[group].get(name, default)
        if value not in (default, None, 0, False):
            raise UserError(f"{key}={value} is a Lightning feature the raw trainer does not have")
    if cfg.trainer.precision not in SUPPORTED_PRECISION:
        raise UserError(
            f"trainer.precision={cfg.trainer.precision} is not supported by the raw trainer: "
            f"use one of {', '.join(map(str, SUPPORTED_PRECISION[2:]))} or 32-true"
        )


# --- Data ------------------------------------------------------------------------------------
def limit(n_batches: int, value: Any) -> int:
    """Lightning's limit_*_batches: None -> all, int -> that many, float -> that fraction."""
    if value is None:
        return n_batches
    if isinstance(value, float) and value <= 1.0:
        return int(n_batches * value)
    return min(n_batches, int(value))


def make_loaders(cfg: DictConfig, world: int, rank: int) -> dict[str, Any]:
    """train/val/test loaders: the same `make_loader` the LightningDataModule uses."""
    from project.digits import DigitsDataset, make_loader, split_indices

    d = cfg.data
    splits = split_indices(len(DigitsDataset(d.data_dir)), d.val_fraction, d.test_fraction, d.seed)
    return {
        stage: make_loader(
            DigitsDataset(d.data_dir, indices),
            d.batch_size,
            stage == "train",
            world,
            rank,
            d.seed,
            d.num_workers,
            d.pin_memory,
            d.persistent_workers,
        )
        for stage, indices in zip(("train", "val", "test"), splits, strict=True)
    }


# --- The trainer -----------------------------------------------------------------------------
class RawTrainer:
    """One training run: set-up in __init__, then fit() and test(). Rank 0 logs and saves."""

    def __init__(self, cfg: DictConfig, output_dir: Path) -> None:
        import torch
        import torch.distributed as dist
        from hydra.utils import instantiate
        from torch.nn.parallel import DistributedDataParallel

        from project import ddp
        from project.digits import check_writable, materialise
        from project.optim import build_optimizer, build_scheduler
        from project.signals import StopSignal
        from project.step_stats import StepStats

        self.cfg, self.output_dir, t = cfg, output_dir, cfg.trainer
        topology = ddp.resolve_topology(t)
        if topology.world_size > 1 and topology.launcher is None:
            raise UserError(
                f"the raw trainer does not start processes itself ({topology.world_size} "
                "requested): run it under torchrun, e.g. TRAINER=raw NPROC_PER_NODE=2 "
                "launch/single_node.sh"
            )
        check_config(cfg)
        ddp.check_hardware(cfg.get("strategy"), t)
        threads = ddp.configure_threads(topology)

        # Process group: env:// (torchrun set MASTER_ADDR/PORT, RANK, WORLD_SIZE).
        self.world = topology.world_size
        self.rank = int(os.environ.get("RANK", 0))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        on_gpu = ddp.on_gpu(str(t.accelerator))
        self.device = torch.device(f"cuda:{local_rank}" if on_gpu else "cpu")
        if on_gpu:
            torch.cuda.set_device(self.device)
        strategy = dict(to_plain(cfg.get("strategy")) or {})
        if self.world > 1:
            timeout = instantiate(strategy.get("timeout")) if strategy.get("timeout") else None
            backend = strategy.get("process_group_backend") or ("nccl" if on_gpu else "gloo")
            dist.init_process_group(
                backend, timeout=timeout, device_id=self.device if on_gpu else None
            )
        self.is_zero = self.rank == 0
        log.info(
            f"raw trainer: {topology.devices} process(es) per node x {topology.num_nodes} "
            f"node(s), device {self.device}, {threads} thread(s) per process"
        )

        # Data: written once per node (local rank 0), read memory-mapped by every rank.
        check_writable(cfg.data.data_dir)
        if local_rank == 0:
            materialise(cfg.data.data_dir)
        self.barrier()

        # parity: seed python/numpy/torch exactly like lightning's seed_everything, then build
        # the network, so both trainers draw the same initial weights.
        seed_everything(cfg.seed)
        torch.use_deterministic_algorithms(bool(t.get("deterministic")), warn_only=True)
        if t.get("benchmark") is not None:
            torch.backends.cudnn.benchmark = bool(t.benchmark)
        self.loaders = make_loaders(cfg, self.world, self.rank)
        net = instantiate(cfg.model.net).to(self.device)
        if t.get("sync_batchnorm") and self.world > 1:
            net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net)
        if cfg.model.get("compile"):
            net.compile()
        self.net = net
        # DDP with the same options the Lightning strategy config sets (keys after
        # start_method go straight to DistributedDataParallel there too).
        ddp_kwargs = {
            k: v for k, v in strategy.items()
            if k not in ("_target_", "process_group_backend", "timeout", "start_method")
        }  # fmt: skip
        self.model = (
            DistributedDataParallel(net, device_ids=[local_rank] if on_gpu else None, **ddp_kwargs)
            if self.world > 1
            else net
        )
        self.optimizer = build_optimizer(net.parameters(), to_plain(cfg.model.optimizer))
        built = build_scheduler(self.optimizer, to_plain(cfg.model.get("scheduler")))
        self.scheduler, self.sched_interval, self.sched_every = built or (None, "epoch", 1)

        precision = str(t.precision)
        self.autocast_dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(
            precision
        )
        self.scaler = torch.amp.GradScaler(self.device.type) if precision == "16-mixed" else None

        ft = self.fault_tolerance = to_plain(cfg.callbacks.get("fault_tolerance")) or {}
        self.stop = StopSignal(
            ft.get("check_every_n_steps", 10),
            save_every_n_train_steps=ft.get("every_n_train_steps"),
            save_every_n_seconds=ft.get("every_n_seconds"),
            budget_s=ft.get("stop_budget_s", 25.0),
        )
        self.identity = training_identity(to_plain(cfg))
        self.finished = False  # set when fit ends normally: last.pt then says so
        self.final_metrics: dict[str, float] = {}
        self.stats = StepStats() if cfg.get("step_stats") else None
        self.writer = None
        if self.is_zero and cfg.get("logger"):
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(output_dir / "tensorboard"))
        self.global_step = 0  # optimizer steps, like Lightning's trainer.global_step
        self.epoch = 0
        self.batch_in_epoch = 0
        self.best: float | None = None
        self.early = EarlyStopping(cfg.callbacks.get("early_stopping"))
        self.resumed = False

    # --- helpers ---
    def barrier(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()

    def log_scalar(self, name: str, value: float, step: int) -> None:
        if self.writer is not None:
            self.writer.add_scalar(name, value, step)

    def autocast(self) -> contextlib.AbstractContextManager:
        import torch

        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def batches(self, stage: str, n: int) -> Iterator[tuple[Any, Any]]:
        for i, (x, y) in enumerate(self.loaders[stage]):
            if i >= n:
                break
            yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def n_batches(self, stage: str) -> int:
        t = self.cfg.trainer
        if t.get("fast_dev_run"):
            return 1 if t.fast_dev_run is True else int(t.fast_dev_run)
        return limit(len(self.loaders[stage]), t.get(f"limit_{stage}_batches"))

    # --- evaluation ---
    def evaluate(self, stage: str, n: int) -> dict[str, float]:
        """Mean of per-batch mean losses and accuracy over all ranks' batches (like torchmetrics'
        MeanMetric and MulticlassAccuracy synced at compute())."""
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        self.model.eval()
        totals = torch.zeros(4, device=self.device, dtype=torch.float64)
        with torch.no_grad():
            for x, y in self.batches(stage, n):
                with self.autocast():
                    logits = self.model(x)
                    loss = F.cross_entropy(logits, y)
                # On the device: one sync per evaluation, not one per batch.
                totals[0] += loss.double()
                totals[1] += 1
                totals[2] += (logits.argmax(1) == y).sum()
                totals[3] += y.numel()
        if dist.is_initialized():
            dist.all_reduce(totals)
        self.model.train()
        loss_sum, batches, correct, seen = totals.tolist()
        return {f"{stage}/loss": loss_sum / max(batches, 1), f"{stage}/acc": correct / max(seen, 1)}

    # --- training ---
    def train_step(self, x: Any, y: Any, accumulate: int, sync: bool) -> tuple[Any, Any]:
        """Forward + backward of one batch; gradients are all-reduced only when `sync`.

        Returns the batch's mean loss (detached) and logits.
        """
        import torch.nn.functional as F

        no_sync = getattr(self.model, "no_sync", None)
        context = contextlib.nullcontext() if sync or no_sync is None else no_sync()
        with context:
            with self.autocast():
                logits = self.model(x)
                loss = F.cross_entropy(logits, y)  # parity: mean cross-entropy
            # parity: Lightning divides by the accumulation count before backward.
            scaled = loss / accumulate
            (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        return loss.detach(), logits.detach()

    def optimizer_step(self) -> None:
        import torch

        t = self.cfg.trainer
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        if t.get("gradient_clip_val"):
            params = self.net.parameters()
            if t.get("gradient_clip_algorithm", "norm") == "value":
                torch.nn.utils.clip_grad_value_(params, t.gradient_clip_val)
            else:
                torch.nn.utils.clip_grad_norm_(params, t.gradient_clip_val)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        if (
            self.scheduler
            and self.sched_interval == "step"
            and self.global_step % self.sched_every == 0
        ):
            self.scheduler.step()

    def fit(self) -> dict[str, float]:
        import torch

        from project import faults

        cfg, t = self.cfg, self.cfg.trainer
        accumulate = int(t.get("accumulate_grad_batches") or 1)
        n_train, n_val = self.n_batches("train"), self.n_batches("val")
        max_epochs = 1 if t.get("fast_dev_run") else int(t.max_epochs)
        lr_name = f"lr-{type(self.optimizer).__name__}"  # LearningRateMonitor's name
        metrics: dict[str, float] = {}
        self.stop.install()
        self.stop.mark_saved(self.global_step)  # a resumed run starts from a checkpoint
        try:
            # Like Lightning: a few validation batches before training catch a broken
            # validation step before a long epoch (not when resuming). parity: Lightning
            # isolates the global RNG around it.
            sanity = min(int(t.get("num_sanity_val_steps") or 0), n_val)
            if sanity > 0 and not t.get("fast_dev_run") and not self.resumed:
                with isolated_rng():
                    self.evaluate("val", sanity)
            self.model.train()
            for epoch in range(self.epoch, max_epochs):
                self.epoch = epoch
                sampler = self.loaders["train"].sampler
                sampler.set_epoch(epoch)  # parity: a new shuffle each epoch, as Lightning
                if self.batch_in_epoch:  # resuming mid-epoch: skip what was trained on
                    sampler.skip_batches(self.batch_in_epoch, self.loaders["train"].batch_size)
                    log.info(f"Resuming mid-epoch: skipping {self.batch_in_epoch} batches")
                self.log_scalar(lr_name, self.optimizer.param_groups[0]["lr"], self.global_step)
                loss_sum = torch.zeros((), device=self.device)
                correct = torch.zeros((), device=self.device, dtype=torch.long)
                seen = 0
                first = self.batch_in_epoch
                for i, (x, y) in enumerate(self.batches("train", n_train - first), start=first):
                    if self.stats:
                        self.stats.step_start()
                    self.batch_in_epoch = i  # batches of this epoch already trained on
                    if i % accumulate == 0:  # a window start: no partial gradients to lose
                        stop, save = self.stop.check(self.device, self.global_step)
                        if save or stop:
                            self.save_last()
                        if stop:
                            raise Preempted()
                    sync = (i + 1) % accumulate == 0 or i + 1 == n_train
                    loss, logits = self.train_step(x, y, accumulate, sync)
                    if sync:
                        self.optimizer_step()
                    loss_sum += loss
                    correct += (logits.argmax(1) == y).sum()
                    seen += y.numel()
                    if self.stats:
                        self.stats.record_loss(loss / accumulate)  # what backward saw
                    if sync and self.global_step % int(t.log_every_n_steps) == 0:
                        self.log_scalar("train/loss_step", loss.item(), self.global_step)
                    faults.maybe_fail(self.global_step, self.rank, cfg.get("fault_injection"))
                self.batch_in_epoch = 0
                metrics.update(self.epoch_train_metrics(loss_sum, correct, seen, n_train - first))
                epoch_done = (epoch + 1) % self.sched_every == 0
                if self.scheduler and self.sched_interval == "epoch" and epoch_done:
                    self.scheduler.step()
                validate = n_val > 0 and (epoch + 1) % int(t.check_val_every_n_epoch) == 0
                if validate:
                    metrics.update(self.evaluate("val", n_val))
                for name, value in metrics.items():
                    self.log_scalar(name, value, self.global_step)
                self.epoch = epoch + 1  # what a checkpoint written now resumes at
                if validate:
                    self.save_best(metrics)
                    if self.early.should_stop(metrics) and epoch + 1 >= int(t.min_epochs or 0):
                        log.info(f"Early stopping after epoch {epoch}")
                        break
                if self.fault_tolerance and epoch + 1 < max_epochs:
                    self.save_last()  # every epoch end (the last one is saved as finished)
        finally:
            self.stop.restore()
        if self.fault_tolerance and not t.get("fast_dev_run"):
            self.finished, self.final_metrics = True, dict(metrics)
            self.save_last()
        if self.stats and self.is_zero:
            self.stats.write(self.output_dir)
        return metrics

    def epoch_train_metrics(
        self, loss_sum: Any, correct: Any, seen: int, n: int
    ) -> dict[str, float]:
        import torch
        import torch.distributed as dist

        values = [float(loss_sum), n, float(correct), seen]  # one sync per epoch, not per step
        totals = torch.tensor(values, device=self.device, dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(totals)
        loss_total, batches, right, total = totals.tolist()
        return {"train/loss": loss_total / max(batches, 1), "train/acc": right / max(total, 1)}

    # --- checkpoints ---
    def checkpoint_dir(self) -> Path:
        ckpt_cfg = self.cfg.callbacks.get("model_checkpoint") or {}
        return Path(ckpt_cfg.get("dirpath") or self.output_dir / "checkpoints")

    def last_path(self) -> Path:
        return Path(self.fault_tolerance.get("dirpath") or self.checkpoint_dir()) / LAST

    def save_last(self) -> None:
        """Write last.pt (rank 0, atomically); every rank waits until it is on disk."""
        began = time.monotonic()
        if self.is_zero:
            atomic_save(self.state_dict(), self.last_path())
            log.info(f"Saved {self.last_path()} at step {self.global_step}")
        self.barrier()
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
            atomic_save(self.state_dict(), self.checkpoint_dir() / "best.pt")

    def state_dict(self) -> dict[str, Any]:
        from project.resume import rng_state

        return {
            "model": self.net.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "epoch": self.epoch,  # the epoch to run (or continue)
            "batch_in_epoch": self.batch_in_epoch,  # its batches already trained on
            "global_step": self.global_step,
            "best": self.best,
            "early_stopping": {"best": self.early.best, "wait": self.early.wait},
            "rng": rng_state(),
            "config": to_plain(self.cfg),
            "project": project_state(self.identity, self.finished, self.final_metrics),
        }

    def load(self, path: str | Path, weights_only: bool = False) -> None:
        """Resume from a checkpoint of this trainer (or, weights_only, take its weights)."""
        import torch

        from project.resume import set_rng_state

        state = torch.load(path, map_location=self.device, weights_only=True)
        self.net.load_state_dict(state["model"])
        if weights_only:
            return
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler and state["scheduler"]:
            self.scheduler.load_state_dict(state["scheduler"])
        self.epoch, self.global_step, self.best = (
            state["epoch"],
            state["global_step"],
            state["best"],
        )
        self.batch_in_epoch = state.get("batch_in_epoch", 0)
        self.early.best = state["early_stopping"]["best"]
        self.early.wait = state["early_stopping"]["wait"]
        set_rng_state(state["rng"])  # continue the interrupted random streams
        self.resumed = True
        log.info(f"Resumed from {path}: epoch {self.epoch}, batch {self.batch_in_epoch}, "
                 f"step {self.global_step}")  # fmt: skip

    def close(self) -> None:
        import torch.distributed as dist

        if self.writer is not None:
            self.writer.close()
        if dist.is_initialized():
            # Tear down in this order, or gloo can deadlock (seen here, torch 2.13): the last
            # reference to the process group must not be dropped by the DDP Reducer (its
            # destructor joins gloo's worker thread while holding the GIL, and that thread may
            # still need the GIL to free the tensors of a finished collective). So: drop DDP
            # first (the group's registry keeps it alive), let the worker thread finish
            # (sleep releases the GIL), then destroy the group.
            self.model = self.net
            time.sleep(0.1)
            dist.destroy_process_group()


class EarlyStopping:
    """Lightning's EarlyStopping rule: stop after `patience` checks without an improvement of
    at least `min_delta` in `monitor`."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.best: float | None = None
        self.wait = 0

    def should_stop(self, metrics: dict[str, float]) -> bool:
        if not self.cfg or self.cfg.monitor not in metrics:
            return False
        value, sign = metrics[self.cfg.monitor], (1 if self.cfg.mode == "min" else -1)
        if self.best is None or sign * (value - self.best) < -abs(self.cfg.min_delta):
            self.best, self.wait = value, 0
        else:
            self.wait += 1
        return self.wait >= self.cfg.patience


class Preempted(Exception):
    """Every rank agreed to stop on a signal (see project.signals)."""


def seed_everything(seed: int) -> None:
    """What lightning's seed_everything does: python, numpy and torch (all devices)."""
    import numpy as np
    import torch

    os.environ["PL_GLOBAL_SEED"] = str(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@contextlib.contextmanager
def isolated_rng() -> Iterator[None]:
    """Restore the python, numpy and torch (CPU and CUDA) RNG states on exit."""
    from project.resume import rng_state, set_rng_state

    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


def run(cfg: DictConfig) -> dict[str, float]:
    """Fit, then test the last weights; returns the final metrics (rank 0 writes metrics.json)."""
    from hydra.core.hydra_config import HydraConfig

    from project import ddp

    output_dir = Path(HydraConfig.get().runtime.output_dir)
    trainer = RawTrainer(cfg, output_dir)
    metrics: dict[str, float] = {}
    try:
        # An explicit ckpt_path wins; else (auto_resume) the last.pt a previous attempt of
        # this run left: a torchrun restart, a requeued job, the same RUN_ID again.
        last = trainer.last_path() if trainer.fault_tolerance else None
        resume = find_resume(to_plain(cfg), last, kind="model")
        if resume.finished and (earlier := read_metrics(output_dir)):
            log.info(f"This run already finished ({resume.path}); its results are kept in "
                     f"{output_dir / METRICS_FILE}")  # fmt: skip
            return earlier
        if resume.path:
            trainer.load(resume.path)
        if cfg.train and not resume.finished:
            try:
                with ddp.peer_failures_reported():
                    metrics.update(trainer.fit())
            except Preempted:
                log.info(
                    f"Stopped by a signal at step {trainer.global_step}; {LAST} is saved. Run "
                    f"the same command again to resume. Exit {EXIT_PREEMPTED}."
                )
                sys.exit(EXIT_PREEMPTED)  # the finally below still closes the process group
        elif resume.finished:  # training finished, its testing did not: test only
            metrics.update(resume.metrics)
        if cfg.test:
            best = trainer.checkpoint_dir() / "best.pt"
            if cfg.train and cfg.get("test_ckpt") == "best" and best.is_file():
                trainer.load(str(best), weights_only=True)  # like Lightning's ckpt_path="best"
            test = trainer.evaluate("test", trainer.n_batches("test"))
            for name, value in test.items():
                trainer.log_scalar(name, value, trainer.global_step)
            metrics.update(test)
        if trainer.is_zero:
            report_metrics(output_dir, metrics)
    finally:
        trainer.close()  # destroy_process_group on every exit path
    if not math.isfinite(metrics.get("train/loss", 0.0)):
        raise RuntimeError("training diverged: the train loss is not finite")
    return metrics


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def _hydra_main(cfg: DictConfig) -> float | None:
    metrics = report_user_errors(lambda: run(cfg))
    return metrics.get(cfg.get("optimized_metric"))


def main() -> None:
    register_resolvers()
    with report_exit():  # tells project.launcher (when it started us) how we ended
        run_cli(_hydra_main)


if __name__ == "__main__":
    main()
