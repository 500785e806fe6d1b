"""The raw PyTorch DDP trainer: what Lightning does for this template, written out.

It runs the same task (project.tasks: network, loss, metrics), the same data source and loaders
(project.data, project.engine.data.sharding), the same optimizer and scheduler builders
(project.engine.shared.optim) from the same config, so its per-step losses are bitwise equal to
Lightning's. What had to match for that is marked "parity:".

| Lightning feature                                  | where it happens here                |
|----------------------------------------------------|--------------------------------------|
| Trainer(devices, num_nodes), DDPStrategy options   | `setup_distributed`, `wrap_model`     |
| the template's FSDPStrategy (strategy=fsdp, FSDP2)   | `wrap_model`, `no_sync` (fsdp/plan.py) |
| DDP comm hooks (the template's strategy.comm_hook) | `wrap_model`, raw/checkpointing.py    |
| seed_everything, deterministic, benchmark          | `__init__` (raw/rng.py)               |
| LightningDataModule prepare_data/setup, sampler    | `setup_data` (prepare once per node)  |
| LightningModule.training_step under DDP            | `Step.forward` -> `task.step` (step.py) |
| accumulate_grad_batches (no_sync inside a window)  | `train_epoch`, `backward`             |
| precision (autocast, GradScaler), gradient clipping | `autocast`, `backward`, `optimizer_step` |
| LR scheduler interval/frequency                    | `optimizer_step`, `end_epoch`         |
| num_sanity_val_steps, validation, test loops       | `sanity_check`, `evaluate`            |
| self.log of torchmetrics (synced at epoch end)     | `compute`, `log_scalar`               |
| limit_*_batches, fast_dev_run                      | `n_batches`                           |
| max_epochs, max_steps (mid-epoch too)              | `fit`, `train_epoch` (raw/limits.py)  |
| ModelCheckpoint (best), EarlyStopping              | raw/checkpointing.py, early_stopping.py |
| RunState: last checkpoint, stop on a signal        | `check_stop`, raw/checkpointing.py    |
| RunState: ledger, hang watchdog, stragglers        | `fit`, `check_stop`, `outside_steps`  |
| (paths, what a checkpoint carries: both trainers)  | engine/checkpoints/run.py             |
| TensorBoardLogger, LearningRateMonitor             | `log_scalar`                          |
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.tensorboard import SummaryWriter

from project.data.source import SPLITS
from project.engine.config.compose import to_plain
from project.engine.data import elastic, sharding
from project.engine.data.loaders import build_source, plain_loader
from project.engine.distributed import ddp, faults, hangs
from project.engine.distributed import ledger as ledgers
from project.engine.distributed.ddp import CollectiveTimeout, Topology
from project.engine.distributed.exits import Preempted, close_process_group
from project.engine.distributed.fsdp import options as fsdp_options
from project.engine.distributed.fsdp import plan
from project.engine.errors import UserError
from project.engine.launch import env
from project.engine.raw import limits
from project.engine.raw.checkpointing import Checkpointing
from project.engine.raw.early_stopping import EarlyStopping
from project.engine.raw.keys import check_config
from project.engine.raw.rng import isolated_rng, seed_everything
from project.engine.raw.step import Step, to_device
from project.engine.run import cli, console, watch
from project.engine.shared.metrics import stage_metrics
from project.engine.shared.optim import build_optimizer, build_scheduler
from project.engine.shared.shapes import checked_step
from project.engine.shared.step_stats import StepStats
from project.engine.shared.throughput import Throughput
from project.tasks.task import STAGES, build_task

if TYPE_CHECKING:
    from project.engine.run.skeleton import Run

log = logging.getLogger(__name__)

AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class RawTrainer(Checkpointing):
    """One training run: set-up in __init__, then fit() and test(). Rank 0 logs and saves.

    project.raw_train runs it inside the run skeleton both trainers share
    (project.engine.run.skeleton: checks, resume, the stop, metrics.json)."""

    def __init__(self, run: Run) -> None:
        cfg = run.cfg
        self.cfg, self.output_dir, self.run = cfg, run.output_dir, run
        self.checkpoints = run.checkpoints  # paths and what every checkpoint carries
        self.ledger = run.ledger  # what this rank is doing (the hang report, goodput)
        check_config(cfg)
        self.setup_distributed(run.topology)
        try:
            self.setup(run)
        except cli.user_errors():  # bad input: one line, exit 2 (cli.report_user_errors)
            # A gloo group left to interpreter shutdown can abort the process (-6). Not
            # NCCL's: its destroy waits for the peers, and the refusal may be this rank's alone.
            if dist.is_initialized() and dist.get_backend() == "gloo":
                self.close_groups()
            raise

    def setup(self, run: Run) -> None:
        """Everything after the process group: the checkpoint to continue from, the data,
        the task and its optimizer, the loop's settings."""
        cfg, t = run.cfg, run.cfg.trainer
        self.open_last()  # (raw/checkpointing.py)
        self.setup_data()
        # parity: seed python/numpy/torch exactly like lightning's seed_everything, then build
        # the task, so both trainers draw the same initial weights.
        seed_everything(cfg.seed)
        # Off is torch's default; calling it anyway imports torch._inductor (seconds per start).
        if t.get("deterministic"):
            torch.use_deterministic_algorithms(True, warn_only=True)
        if t.get("benchmark") is not None:
            torch.backends.cudnn.benchmark = bool(t.benchmark)
        self.task = build_task(cfg.model.task, cfg.model.net).to(self.device)
        self.metrics = {s: stage_metrics(self.task, s).to(self.device) for s in STAGES}
        self.model = self.wrap_model()
        if self.world > 1:
            # parity: Lightning's DDP strategy re-seeds (reset_seed) when it sets up the process
            # group in fit, after the model was built: dropout masks start from the seed.
            seed_everything(cfg.seed)
        self.optimizer = build_optimizer(self.task.parameters(), to_plain(cfg.model.optimizer))
        built = build_scheduler(self.optimizer, to_plain(cfg.model.get("scheduler")))
        self.scheduler, self.sched_interval, self.sched_every = built or (None, "epoch", 1)
        precision = str(t.precision)
        if precision == "16-mixed" and not self.on_gpu:
            precision = "bf16-mixed"  # parity: Lightning runs float16 AMP as bfloat16 on CPU
        self.autocast_dtype = AUTOCAST.get(precision)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=precision == "16-mixed")
        # What the step reads, as plain values: an OmegaConf lookup costs microseconds, several
        # a step (the loop is the reference Lightning is measured against).
        self.clip_val = t.get("gradient_clip_val")
        self.clip_by_value = t.get("gradient_clip_algorithm", "norm") == "value"
        self.log_every = int(t.log_every_n_steps)
        self.max_steps = limits.max_steps(t)  # optimizer steps (None: no limit)
        self.fault_injection = to_plain(cfg.get("fault_injection"))
        self.stop = self.checkpoints.stop_signal()
        self.stats = StepStats() if cfg.get("step_stats") else None
        self.throughput = Throughput(self.world)
        has_logger = self.is_zero and cfg.get("logger")
        self.writer = SummaryWriter(str(run.output_dir / "tensorboard")) if has_logger else None
        self.global_step = 0  # optimizer steps, like Lightning's trainer.global_step
        self.epoch = 0
        self.batch_in_epoch = 0
        self.position: elastic.Position | None = None  # where a resumed epoch stood
        self.best: float | None = None
        self.early = EarlyStopping(cfg.callbacks.get("early_stopping"))
        self.resumed = False
        self.watch: watch.Watch | None = None

    # --- set-up ------------------------------------------------------------------------------
    def setup_distributed(self, topology: Topology) -> None:
        """Process group from env:// (torchrun set MASTER_ADDR/PORT, RANK, WORLD_SIZE)."""
        t = self.cfg.trainer
        if topology.world_size > 1 and topology.launcher is None:
            raise UserError(
                f"the raw trainer does not start processes itself ({topology.world_size} "
                "requested): run it under torchrun, e.g. TRAINER=raw NPROC_PER_NODE=2 "
                "launch/single_node.sh"
            )
        self.world, self.rank, self.local_rank = topology.world_size, env.rank(), env.local_rank()
        self.on_gpu = ddp.on_gpu(str(t.accelerator))
        self.device = torch.device(f"cuda:{self.local_rank}" if self.on_gpu else "cpu")
        if self.on_gpu:
            torch.cuda.set_device(self.device)
        self.strategy = dict(to_plain(self.cfg.get("strategy")) or {})
        self.fsdp = fsdp_options.chosen(self.strategy) and topology.world_size > 1
        hook = self.strategy.get("comm_hook")
        self.comm_hook = instantiate(hook) if hook and topology.world_size > 1 else None
        s = self.strategy
        timeout = instantiate(s["timeout"]) if s.get("timeout") else None
        self.timeout = timeout  # strategy.timeout (None: unset)
        if self.world > 1:
            backend = s.get("process_group_backend") or ("nccl" if self.on_gpu else "gloo")
            device_id = self.device if self.on_gpu else None
            dist.init_process_group(backend, timeout=timeout, device_id=device_id)
        self.timeouts = CollectiveTimeout(s.get("step_timeout_s"), timeout, self.world)
        self.is_zero = self.rank == 0

    def setup_data(self) -> None:
        """The data source prepared once per node (local rank 0), then every rank's loaders:
        plain loaders sharded by the same code as Lightning's (project.engine.data.sharding)."""
        d = self.cfg.data
        source = self.source = build_source(d.dataset)
        if self.local_rank == 0:
            source.prepare()
        self.barrier()
        loading = (d.batch_size, d.num_workers, d.pin_memory, d.persistent_workers,
                   d.get("shuffle", True), d.get("lanes"), d.get("shuffle_block"))  # fmt: skip
        self.loaders = {
            s: sharding.shard_loader(plain_loader(source.dataset(s), s, *loading), s, self.world,
                            self.rank, self.cfg.seed)
            for s in SPLITS
        }  # fmt: skip
        # Each split it evaluates: a rank without a batch (any strategy), unequal ones (fsdp).
        for s in SPLITS[1:] if self.world > 1 else ():
            evaluated = s == "val" or self.cfg.get("test", True)
            if evaluated and self.cfg.trainer.get(f"limit_{s}_batches") != 0:
                sharding.same_eval_batches(self.loaders[s], s, self.fsdp, source)

    def wrap_model(self) -> nn.Module:
        """DDP with the options the Lightning strategy config sets (keys after start_method go
        straight to DistributedDataParallel there too)."""
        if self.cfg.trainer.get("sync_batchnorm") and self.world > 1:
            self.task = nn.SyncBatchNorm.convert_sync_batchnorm(self.task)
        if self.cfg.model.get("compile"):
            self.task.net.compile()
        step = Step(self.task, self.cfg.model.net)
        if self.world == 1:
            return step
        if self.fsdp:  # no wrapper: fully_shard hooks the network's own forward and backward
            from torch.distributed.device_mesh import init_device_mesh

            # one dimension over the whole world: the default group, as Lightning's mesh
            mesh = init_device_mesh(
                self.device.type, (self.world,), mesh_dim_names=("data_parallel",)
            )
            options = fsdp_options.ShardOptions.of(self.strategy, self.cfg.trainer.precision)
            plan.shard(self.task, mesh, self.strategy.get("blocks"), **options.kwargs())
            return step
        not_ddp = ("_target_", "process_group_backend", "timeout", "start_method", "comm_hook",
                   "step_timeout_s")  # fmt: skip
        kwargs = {k: v for k, v in self.strategy.items() if k not in not_ddp}
        device_ids = [self.local_rank] if self.on_gpu else None
        model = DistributedDataParallel(step, device_ids=device_ids, **kwargs)
        ddp.remember_parameters(model)
        if self.comm_hook is not None:
            self.comm_hook.register(model)
        return model

    # --- small helpers -----------------------------------------------------------------------
    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def log_scalar(self, name: str, value: float, step: int) -> None:
        if self.writer is not None:
            self.writer.add_scalar(name, value, step)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.log_scalar(name, value, step)

    def outside_steps(self, phase: int) -> None:
        """Anything but a training step begins: long timeouts, the ledger, no step timing."""
        self.timeouts.outside_steps()
        self.ledger.mark(phase, self.global_step)
        if self.stop.stragglers is not None:
            self.stop.stragglers.pause()

    def autocast(self) -> contextlib.AbstractContextManager:
        dtype = self.autocast_dtype
        return torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None)

    def batches(self, stage: str, n: int, first: int = 0) -> Iterator[tuple[int, Any]]:
        """(index, batch on the device) for batches first..n-1 of `stage` (the loader already
        skips the first `first` when resuming mid-epoch); batch n is never read."""
        fetch = self.ledger.fetching if stage == "train" else iter  # "waiting for data"
        loader = itertools.islice(self.loaders[stage], max(n - first, 0))
        for i, batch in enumerate(fetch(loader), start=first):
            yield i, to_device(batch, self.device)

    def n_batches(self, stage: str) -> int:
        """Lightning's limit_*_batches (None: all, int: that many, float: that fraction) and
        fast_dev_run."""
        t = self.cfg.trainer
        if t.get("fast_dev_run"):
            return 1 if t.fast_dev_run is True else int(t.fast_dev_run)
        total, value = len(self.loaders[stage]), t.get(f"limit_{stage}_batches")
        if value is None:
            return total
        if isinstance(value, float) and value <= 1.0:
            return int(total * value)
        return min(total, int(value))

    def compute(self, stage: str) -> dict[str, float]:
        """The stage's metrics over all ranks (torchmetrics syncs at compute), then reset."""
        values = {f"{stage}/{k}": float(m.compute()) for k, m in self.metrics[stage].items()}
        for metric in self.metrics[stage].values():
            metric.reset()
        return values

    # --- evaluation --------------------------------------------------------------------------
    def evaluate(self, stage: str, n: int) -> dict[str, float]:
        """The task's step on `n` batches of `stage` without gradients; synced metrics."""
        self.task.eval()
        with torch.no_grad():
            for _, batch in self.batches(stage, n):
                with self.autocast():
                    loss = checked_step(self.task, batch, self.metrics[stage], self.cfg.model.net)
                self.metrics[stage]["loss"].update(loss, self.task.weight(batch))
                self.ledger.touch()  # a long validation is progress, not a hang
        self.task.train()
        return self.compute(stage)

    def test(self) -> dict[str, float]:
        """The test loop: every test batch (or limit_test_batches), metrics logged."""
        metrics = self.evaluate("test", self.n_batches("test"))
        for name, value in metrics.items():
            self.log_scalar(name, value, self.global_step)
        return metrics

    def sanity_check(self) -> None:
        """Like Lightning: a few validation batches before training catch a broken validation
        step before a long epoch (not when resuming). parity: Lightning isolates the global
        RNG around it."""
        t = self.cfg.trainer
        sanity = min(int(t.get("num_sanity_val_steps") or 0), self.n_batches("val"))
        if sanity > 0 and not t.get("fast_dev_run") and not self.resumed:
            self.ledger.mark(ledgers.VALIDATION, self.global_step)  # as Lightning's books it
            with isolated_rng():
                self.evaluate("val", sanity)
            self.ledger.mark(ledgers.STARTUP, self.global_step)  # until the first step

    # --- training ----------------------------------------------------------------------------
    def backward(self, batch: Any, accumulate: int, sync: bool) -> torch.Tensor:
        """Forward + backward of one batch; gradients are all-reduced only when `sync`.
        Returns the batch's mean loss (detached)."""
        forward_at = time.perf_counter()  # FSDP's collectives begin with the forward
        with contextlib.nullcontext() if sync else self.no_sync():
            with self.autocast():
                loss = self.model(batch, self.metrics["train"])
            # parity: Lightning divides by the accumulation count before backward.
            began = forward_at if self.fsdp else time.perf_counter()
            self.scaler.scale(loss / accumulate).backward()
            # DDP: the syncing backward; FSDP: every forward and backward gathers the weights
            if (sync or self.fsdp) and self.stop.stragglers is not None:
                self.stop.stragglers.synced(time.perf_counter() - began)
        loss = loss.detach()
        self.metrics["train"]["loss"].update(loss, self.task.weight(batch))
        return loss

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Gradients held on this rank inside an accumulation window (DDP, FSDP), not synced."""
        if self.fsdp:
            return plan.gradients_held(self.task.net)
        no_sync = getattr(self.model, "no_sync", None)
        return contextlib.nullcontext() if no_sync is None else no_sync()

    def optimizer_step(self) -> None:
        self.ledger.mark(ledgers.OPTIMIZER, self.global_step)
        self.scaler.unscale_(self.optimizer)
        if self.clip_val:
            params = self.task.parameters()
            if self.clip_by_value:
                nn.utils.clip_grad_value_(params, self.clip_val)
            else:
                nn.utils.clip_grad_norm_(params, self.clip_val)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        step_due = self.global_step % self.sched_every == 0
        if self.scheduler and self.sched_interval == "step" and step_due:
            self.scheduler.step()

    def check_stop(self) -> None:
        """At an accumulation window start (no partial gradients to lose): every few windows
        the ranks agree whether to save last.pt and whether to stop (distributed/signals.py)."""
        stragglers = self.stop.stragglers
        if stragglers is not None:
            stragglers.window_end()
        self.ledger.window_start()  # the window just ended counts for the deadline set now
        self.timeouts.in_steps(3 * self.ledger.window_s)
        stop, save = self.stop.check(self.device, self.global_step)
        if save or stop:
            self.save_last(say=stop)
        if stop:
            raise Preempted(self.global_step, self.last_path())
        self.ledger.mark(ledgers.STEP, self.global_step)
        if stragglers is not None:
            stragglers.window_start()

    def train_epoch(self, epoch: int) -> bool:
        """One epoch of optimizer steps; resumes after the batches a checkpoint had done.
        Returns whether it ran to its last batch (not when max_steps ended it before)."""
        t, loader = self.cfg.trainer, self.loaders["train"]
        accumulate = int(t.get("accumulate_grad_batches") or 1)
        n_train = self.n_batches("train")
        sharding.set_epoch(loader, epoch)  # parity: a new shuffle each epoch, as Lightning
        # A resumed epoch starts where the checkpoint's stood, on any world size; with another
        # global batch (keep_global_batch=false) that need not be a whole number of batches.
        keep = self.cfg.get("keep_global_batch", True)
        if accumulate != elastic.fit_accumulation(loader, self.position, self.world, accumulate,
                                                  keep):  # fmt: skip
            raise RuntimeError("the raw trainer's loader follows data.batch_size: fit_world")
        sharding.drop_incomplete_steps(loader, accumulate, self.world)
        elastic.apply_layout(loader, self.position, self.world)  # for good: the stream keeps it
        first = elastic.resume(loader, self.position, epoch, self.world)
        self.position = None
        if (left := sharding.batches_left(loader)) is not None:
            n_train = min(n_train, first + left)
        lr_name = f"lr-{type(self.optimizer).__name__}"  # LearningRateMonitor's name
        self.log_scalar(lr_name, self.optimizer.param_groups[0]["lr"], self.global_step)
        cut = False  # max_steps ended the epoch before its last batch
        for i, batch in self.batches("train", n_train, first):
            if self.stats:
                if not self.stats.units_per_step:
                    self.stats.record_units(self.task.unit, self.task.count(batch) * self.world)
                self.stats.step_start()
            self.batch_in_epoch = i  # batches of this epoch already trained on
            if i % accumulate == 0:
                self.check_stop()
            sync = (i + 1) % accumulate == 0 or i + 1 == n_train
            loss = self.backward(batch, accumulate, sync)
            if sync:
                self.optimizer_step()
            if self.stats:
                self.stats.record_loss(loss / accumulate)  # what backward saw
            self.throughput.count(self.task.count(batch))
            if sync and self.global_step % self.log_every == 0:
                self.log_scalar("train/loss_step", loss.item(), self.global_step)
                rate = self.throughput.rate()
                self.log_scalar(f"train/{self.task.unit}_per_s", rate, self.global_step)
            faults.maybe_fail(self.global_step, self.rank, self.fault_injection, self.ledger)
            if sync and limits.reached(self.max_steps, self.global_step):
                cut = i + 1 < n_train
                break
        self.batch_in_epoch = 0
        return not cut

    def end_epoch(self, epoch: int, whole: bool = True) -> tuple[dict[str, float], bool]:
        """Train metrics, epoch scheduler step, validation, logging, best checkpoint.
        Returns the epoch's metrics and whether validation ran. parity: an epoch max_steps cut
        short (`whole` false) steps no epoch scheduler and is not validated, as Lightning's."""
        self.outside_steps(ledgers.EPOCH_END)
        t = self.cfg.trainer
        metrics = self.compute("train")
        epoch_due = (epoch + 1) % self.sched_every == 0
        if self.scheduler and self.sched_interval == "epoch" and epoch_due and whole:
            self.scheduler.step()
        n_val = self.n_batches("val")
        validate = whole and n_val > 0 and (epoch + 1) % int(t.check_val_every_n_epoch) == 0
        if validate:
            self.ledger.mark(ledgers.VALIDATION, self.global_step)
            metrics.update(self.evaluate("val", n_val))
        for name, value in metrics.items():
            self.log_scalar(name, value, self.global_step)
        self.epoch = epoch + 1  # what a checkpoint written now resumes at
        if validate:
            self.save_best(metrics)
        return metrics, validate

    def fit(self) -> dict[str, float]:
        """The loop Lightning's fit runs: sanity check, then epochs of train + validation."""
        t = self.cfg.trainer
        max_epochs = limits.max_epochs(t)
        metrics: dict[str, float] = {}
        self.stop.install()
        self.stop.mark_saved(self.global_step)  # a resumed run starts from a checkpoint
        writer = self.writer
        self.watch = watch.start(self.run, self.rank, self.world, self.global_step, self.timeouts,
                                 self.stop, self.log_metrics if writer else None,
                                 close_loggers=writer.close if writer else None)  # fmt: skip
        try:
            self.sanity_check()
            self.task.train()
            for epoch in itertools.count(self.epoch):
                # A resumed run may have reached either limit already: then nothing to train.
                if limits.reached(max_epochs, epoch) or self.steps_done():
                    break
                whole = self.train_epoch(epoch)
                epoch_metrics, validated = self.end_epoch(epoch, whole)
                metrics.update(epoch_metrics)
                stop = validated and self.early.should_stop(metrics)
                if self.steps_done():  # before an epoch-end save: the finished one follows
                    break
                if stop and epoch + 1 >= int(t.min_epochs or 0):
                    log.info(console.stopped_early(self.early.cfg.monitor, self.early.best,
                                                   self.early.cfg.patience, epoch))  # fmt: skip
                    break
                if self.checkpoints.periodic and not limits.reached(max_epochs, epoch + 1):
                    self.save_last()  # every epoch end (the last one is saved as finished)
        except RuntimeError as err:
            hangs.report_peer_failure(err)  # a dead peer: the report (it never returns)
            raise
        finally:
            self.stop.restore()
        self.checkpoints.finish(metrics)
        if self.checkpoints.saves_at_end() and not t.get("fast_dev_run"):
            self.save_last(say=True)
        watch.end(self.watch, self.global_step, self.log_metrics if self.writer else None)
        if self.stats and self.is_zero:
            self.stats.write(self.output_dir)
        return metrics

    def steps_done(self) -> bool:
        """Whether fit reached trainer.max_steps (rank 0 says so, as Lightning does)."""
        done = limits.reached(self.max_steps, self.global_step)
        if done and self.is_zero:
            log.info(f"fit stopped: max_steps={self.max_steps} reached")
        return done

    def close(self) -> None:
        try:
            self.source.teardown()  # e.g. a remote stream's shard cache (Lightning: fit's end)
            if self.writer is not None:
                self.writer.close()
        finally:
            self.close_groups()

    def close_groups(self) -> None:
        """The sharded `last`'s group (its pending save first), then the default group."""
        if getattr(self, "sharded_last", None) is not None:
            self.sharded_last.close()
            self.sharded_last = None
        if dist.is_initialized():
            # Tear down in this order, or gloo can deadlock: the last
            # reference to the process group must not be dropped by the DDP Reducer (its
            # destructor joins gloo's worker thread while holding the GIL, and that thread may
            # still need the GIL to free the tensors of a finished collective). So: drop DDP
            # first (the group's registry keeps it alive), then close the group.
            vars(self).pop("model", None)
            close_process_group()
