"""The strategies of configs/strategy/: Lightning's DDPStrategy with the template's additions,
and FSDPStrategy (FSDP2 over every rank, `strategy=fsdp`, at the end of this file).

DDPStrategy's additions:

- `comm_hook`: a gradient-communication hook (project.engine.distributed.comm_hooks) registered on
  every device; Lightning's own `ddp_comm_hook` is registered on CUDA only.
- `step_timeout_s`: the collective timeout inside training steps after the first one
  (project.engine.distributed.ddp.CollectiveTimeout; `timeout` stays the one before and outside
  them).
- Every checkpoint save is booked outside the step deadline (weights-only ones too, which
  Lightning hides from the callbacks): project.engine.run.long_work.
- DDP errors about parameters that got no gradient keep torch's parameter indices (Lightning
  replaces the whole message), so the run skeleton can name the parameters
  (project.engine.distributed.ddp.unused_parameters_reported).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from lightning.pytorch.strategies import ModelParallelStrategy, SingleDeviceStrategy
from torch.distributed.fsdp import FSDPModule

from project.engine.checkpoints import sharded
from project.engine.checkpoints.remote import is_url
from project.engine.checkpoints.sharded import ShardedLast
from project.engine.config.compose import to_plain_tree
from project.engine.distributed import ddp
from project.engine.distributed import ledger as ledgers
from project.engine.distributed.comm_hooks import CommHook
from project.engine.distributed.fsdp import plan
from project.engine.distributed.fsdp.options import ShardOptions
from project.engine.errors import UserError
from project.engine.run import long_work


class DDPStrategy(LightningDDPStrategy):
    def __init__(
        self, comm_hook: CommHook | None = None, step_timeout_s: float | None = None,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(**kwargs)
        self.comm_hook, self.step_timeout_s = comm_hook, step_timeout_s
        self.timeout = kwargs.get("timeout")

    def configure_ddp(self) -> None:
        super().configure_ddp()  # wraps the module in DistributedDataParallel
        ddp.remember_parameters(self.model)
        if self.comm_hook is not None:
            self.comm_hook.register(self.model)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        # The start of every checkpoint save, on every rank: a weights-only one too, which
        # Lightning does not announce to the callbacks. Rank 0 writes, the others wait.
        long_work.outside_steps(ledgers.CHECKPOINT)
        return super().lightning_module_state_dict()

    def on_exception(self, exception: BaseException) -> None:
        if not ddp.UNUSED.search(str(exception)):
            super().on_exception(exception)


class ShardedLastWriter:
    """A strategy whose run writes its `last` sharded (project.engine.checkpoints.sharded):
    train.py sets `sharded_at` (folder, name, the one-file path RunState saves to); setup
    makes the ShardedLast (every rank: its gloo group), teardown closes it. A save to that
    path writes model and optimizer as shards, every other entry of the checkpoint as it is
    (`common`), each rank's RNG states its own, published once every rank's part is
    complete. Mixed in before a Lightning strategy."""

    sharded_at: tuple[str, str, Path] | None = None  # folder (or URL), name, one-file path
    sharded_last: ShardedLast | None = None
    async_save = False  # the sharded `last` written in the background
    _writing_last = False  # RunState's save of the sharded `last` is under way

    @contextlib.contextmanager
    def writing_last(self) -> Iterator[None]:
        """Around RunState's save of `last`: Lightning's own collection of the model's and
        optimizer's state is skipped when it is sharded (ShardedLast takes the shards
        itself; FSDPStrategy's collection would gather the whole state on rank 0)."""
        self._writing_last = self.sharded_last is not None
        try:
            yield
        finally:
            self._writing_last = False

    def lightning_module_state_dict(self) -> dict[str, Any]:
        # The start of every save, on every rank (as DDPStrategy's): outside the step deadline.
        long_work.outside_steps(ledgers.CHECKPOINT)
        return {} if self._writing_last else super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {} if self._writing_last else super().optimizer_state(optimizer)

    def open_sharded_last(self) -> None:
        if self.sharded_at is not None and self.sharded_last is None:
            folder, name, _ = self.sharded_at
            timeout = ddp.outside_steps_timeout(getattr(self, "timeout", None))
            self.sharded_last = ShardedLast(folder, name, "lightning", timeout)

    def teardown(self) -> None:
        if self.sharded_last is not None:  # its group goes before the default one
            self.sharded_last.close()
            self.sharded_last = None
        super().teardown()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        if self.sharded_last is None or Path(filepath) != self.sharded_at[2]:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        checkpoint.pop("state_dict", None)
        checkpoint.pop("optimizer_states", None)
        common = to_plain_tree(checkpoint)
        self.sharded_last.save(int(common["global_step"]), self.lightning_module.task,
                               self.optimizers[0], common, {"rng": common.get("rng")},
                               asynchronous=self.async_save)  # fmt: skip


class OneProcessShardedLast(ShardedLastWriter, SingleDeviceStrategy):
    """One process continuing a run folder whose `last` is sharded (a run of several
    processes under strategy=fsdp, resumed on one): it keeps writing that `last` sharded, so
    the folder's manifest stays the newest save. The sharded save loads through the
    checkpoint IO (AtomicCheckpointIO gathers it whole)."""

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        self.open_sharded_last()


class FSDPStrategy(ShardedLastWriter, ModelParallelStrategy):
    """FSDP2 (`fully_shard`) over the whole world: Lightning's mesh with data_parallel = world
    size and tensor_parallel = 1, whose data-parallel dimension is the default process group
    (torch 2.13), the one the step timeout and the hang report watch, as for DDP.
    TaskModule.configure_model shards the network with `shard`, as the raw trainer does.
    configs/strategy/fsdp.yaml explains the keys; project.engine.distributed.fsdp.options
    checked them before any process started. `data_parallel_size`: the world size, which
    build_strategy passes (the config cannot know it)."""

    def __init__(
        self, data_parallel_size: int, blocks: Sequence[str] | None = None,
        reshard_after_forward: bool = True, cpu_offload: bool = False, async_save: bool = False,
        process_group_backend: str | None = None, timeout: datetime.timedelta | None = None,
        step_timeout_s: float | None = None, start_method: str = "popen",
    ) -> None:  # fmt: skip
        timeout = timeout or datetime.timedelta(seconds=1800)  # torch's default
        # Any save but the sharded `last` (ModelCheckpoint's best-k) is one file: the whole
        # state gathered (a collective), written by rank 0, as under DDP: eval.py, a test's
        # `best` and any trainer read it.
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=1,
                         save_distributed_checkpoint=False,
                         process_group_backend=process_group_backend, timeout=timeout)  # fmt: skip
        self.blocks = blocks or None
        self.reshard_after_forward, self.cpu_offload = reshard_after_forward, cpu_offload
        self.async_save = async_save  # the sharded `last` written in the background
        self.timeout, self.step_timeout_s = timeout, step_timeout_s  # read by RunState

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        # Lightning only checks that configure_model is overridden: a subclass of the module
        # that does not call ours would train a copy per rank, never synchronised.
        net = getattr(self.lightning_module, "task", None)
        if not isinstance(getattr(net, "net", None), FSDPModule):
            raise UserError(
                f"strategy=fsdp: {type(self.lightning_module).__name__}.configure_model did not "
                "shard the network: call super().configure_model() in yours"
            )
        self.open_sharded_last()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict:
        """A sharded save (a folder with DCP's index): model and optimizer loaded here (on
        the same world size: Lightning's own resume of this strategy), the rest returned."""
        # AtomicCheckpointIO books a load to goodput's reload (this strategy loads itself)
        booked = getattr(self.checkpoint_io, "booked", lambda read: read())
        if not sharded.is_sharded(str(checkpoint_path)):  # one file (a DDP run's)
            return booked(functools.partial(super().load_checkpoint, checkpoint_path, weights_only))
        group = self.sharded_last.group if self.sharded_last is not None else None
        loaded = booked(functools.partial(
            sharded.load, str(checkpoint_path), self.lightning_module.task,
            self.optimizers[0] if self.optimizers else None, "ckpt_path", group,
        ))  # fmt: skip
        checkpoint = dict(loaded.common)
        if loaded.own and loaded.mine is not None:  # each rank continues its own streams
            checkpoint["rng"] = loaded.mine["rng"]
        return checkpoint

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        if not is_url(str(filepath)):
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        # A best-k at a URL (callbacks.model_checkpoint.dirpath=s3://...): ModelParallelStrategy
        # would make it the local path s3:/... (Path(url)). The whole state is gathered already
        # (save_distributed_checkpoint=False): rank 0 writes it through the checkpoint IO
        # (fsspec), as DDPStrategy does. Every rank takes this branch: the URL is the config's.
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options)

    def shard(self, task: torch.nn.Module) -> None:
        """`fully_shard` the task's network (idempotent: configure_model runs again for test)."""
        strategy = {"reshard_after_forward": self.reshard_after_forward,
                    "cpu_offload": self.cpu_offload}  # fmt: skip
        options = ShardOptions.of(strategy, self.precision_plugin.precision)
        plan.shard(task, self.device_mesh["data_parallel"], self.blocks, **options.kwargs())

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        # Lightning's own holds gradients only for a DistributedDataParallel model: on the
        # non-final batches of an accumulation window FSDP would reduce-scatter every time.
        with plan.gradients_held(self.lightning_module.task.net):
            yield
