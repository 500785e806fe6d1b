"""Everything distributed, in one place: how many processes, which strategy, peer failures.

- `resolve_topology` makes `trainer.devices` / `trainer.num_nodes` follow the launcher's
  environment (read by project.engine.launch.env), and stops every rank at start-up when an
  explicit value contradicts it (never N silent copies), or asks for several nodes without a
  launcher (never a silent wait for nodes nothing starts).
- `build_strategy` gives a single-process run no DDP wrapper at all, and a multi-process run
  the DDPStrategy from the `strategy` config, checked against the hardware before `fit`.
- `check_options` refuses, at start-up, DDP options that cannot work on this hardware or
  together with the trainer options (before any process group is made).
- `errors_reported` turns "another rank is gone" (a hang report while training runs) and
  "these parameters got no gradient" into one line each; `CollectiveTimeout` makes a peer
  that stopped responding inside the training steps reported in `strategy.step_timeout_s`,
  not `strategy.timeout`.

Entry points import this after Hydra has composed the config. Lightning is imported only
where a Lightning object is needed: the raw trainer uses this module without it.
"""

from __future__ import annotations

import ast
import contextlib
import datetime
import importlib.metadata
import inspect
import logging
import os
import re
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import DictConfig, open_dict
from torch.nn.parallel import DistributedDataParallel

from project.engine.distributed import hangs
from project.engine.distributed.exits import EXIT_FAILED, fail
from project.engine.distributed.fsdp import options as fsdp_options
from project.engine.distributed.hangs import is_peer_failure, report_peer_failure
from project.engine.errors import UserError
from project.engine.launch.env import Launcher, detect_launcher
from project.engine.private_api import set_collective_timeout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Topology:
    devices: int
    num_nodes: int
    launcher: Launcher | None

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes


def _explicit_int(value: Any, key: str) -> int | None:
    """None for "auto"/null, else a positive int (or -1: all GPUs, Lightning's meaning)."""
    if value in (None, "auto"):
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise UserError(f"{key}={value!r} must be a number of processes or auto") from None
    if number < 1 and not (key == "trainer.devices" and number == -1):
        raise UserError(f"{key}={value!r} must be >= 1 (or auto)")
    return number


def resolve_topology(trainer_cfg: DictConfig, env: Mapping[str, str] = os.environ) -> Topology:
    """Fill `devices`/`num_nodes` ("auto") from the launcher, or check explicit values against it.

    Without an external launcher "auto" means 1; `devices > 1` then makes Lightning start the
    processes itself, on this node only: `num_nodes > 1` is refused (rank 0 would wait for
    the other nodes' ranks, which nothing starts, for the whole process-group timeout).
    """
    launcher = detect_launcher(env)
    devices = _explicit_int(trainer_cfg.get("devices", "auto"), "trainer.devices")
    num_nodes = _explicit_int(trainer_cfg.get("num_nodes", "auto"), "trainer.num_nodes")
    # Lightning's own multi-node start (NODE_RANK and MASTER_ADDR set by hand on each node) and
    # its MPI and LSF environments start the other nodes' processes: only a bare run is refused.
    by_hand = any(key in env for key in ("NODE_RANK", "GROUP_RANK", "OMPI_COMM_WORLD_SIZE",
                                         "PMI_SIZE", "LSB_JOBID"))  # fmt: skip
    if launcher is None and (num_nodes or 1) > 1 and not by_hand:
        raise UserError(
            f"trainer.num_nodes={num_nodes} needs a launcher on every node (plain python starts "
            "processes on this node only): start each node with launch/multinode.sh "
            "(docs/launching.md)"
        )
    if launcher is not None:
        for key, asked, got, what, flag in (
            ("trainer.devices", devices, launcher.devices, "processes per node", launcher.flags[0]),
            ("trainer.num_nodes", num_nodes, launcher.num_nodes, "node(s)", launcher.flags[1]),
        ):
            if asked is not None and asked != got:
                raise UserError(
                    f"{key}={asked} but {launcher.name} started {got} {what}: drop the {key} "
                    f"override (it follows the launcher) or start {launcher.name} with "
                    f"{flag}={asked}"
                )
        devices, num_nodes = launcher.devices, launcher.num_nodes
    topology = Topology(devices or 1, num_nodes or 1, launcher)
    with open_dict(trainer_cfg):
        trainer_cfg.devices, trainer_cfg.num_nodes = topology.devices, topology.num_nodes
    return topology


def configure_threads(topology: Topology, env: MutableMapping[str, str] = os.environ) -> int:
    """Give each rank cpus/processes-per-node threads unless OMP_NUM_THREADS is set.

    torchrun sets OMP_NUM_THREADS=1 only with several processes per node; oversubscribed
    threads make DDP several times slower and change losses in the last bits.
    """
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(1, topology.devices)))
    threads = int(env["OMP_NUM_THREADS"])
    torch.set_num_threads(threads)
    return threads


def on_gpu(accelerator: str) -> bool:
    """Whether `trainer.accelerator` means CUDA GPUs here ("auto": if there are any)."""
    if accelerator in ("gpu", "cuda"):
        return True
    return accelerator == "auto" and torch.cuda.is_available()


def _ddp_option_names() -> set[str]:
    names = _ddp_strategy_arguments() | set(
        inspect.signature(DistributedDataParallel.__init__).parameters
    )
    # the template's own (project.engine.lightning.strategy, raw trainer)
    names |= {"comm_hook", "step_timeout_s"}
    return names - {"self", "kwargs", "module", "process_group", "device_ids", "output_device"}


def _ddp_strategy_arguments() -> set[str]:
    """DDPStrategy's argument names, read from Lightning's source file: importing Lightning
    would cost the raw trainer (which checks the same strategy config) seconds per start."""
    source = importlib.metadata.distribution("lightning").locate_file(
        "lightning/pytorch/strategies/ddp.py"
    )
    tree = ast.parse(Path(source).read_text())
    for cls in tree.body:
        for node in cls.body if isinstance(cls, ast.ClassDef) and cls.name == "DDPStrategy" else []:
            if isinstance(node, ast.FunctionDef) and node.name == "__init__":
                a = node.args
                return {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
                        if x is not None}  # fmt: skip
    from lightning.pytorch.strategies import DDPStrategy  # another layout: import it after all

    return set(inspect.signature(DDPStrategy.__init__).parameters)


def check_options(
    strategy_cfg: DictConfig | None, trainer_cfg: DictConfig, world_size: int = 1
) -> None:
    """Reject options that cannot work on this hardware, or not together, now: not deep inside
    `fit` (docs/launching.md lists the combinations tried)."""
    gpu = on_gpu(str(trainer_cfg.get("accelerator", "auto")))
    if trainer_cfg.get("sync_batchnorm") and not gpu:
        raise UserError(
            "trainer.sync_batchnorm=true needs CUDA GPUs (SyncBatchNorm only runs on GPU "
            "modules): drop it on CPU"
        )
    if not strategy_cfg:
        return
    unknown = set(strategy_cfg) - _ddp_option_names() - {"_target_"}
    if unknown:
        raise UserError(
            f"strategy.{sorted(unknown)[0]} is not a DDPStrategy/DistributedDataParallel "
            "option: check the spelling in configs/strategy/"
        )
    backend = strategy_cfg.get("process_group_backend")
    if backend == "nccl" and not (gpu and dist.is_nccl_available()):
        raise UserError(
            "strategy.process_group_backend=nccl needs CUDA GPUs and a torch build with NCCL: "
            "use gloo on CPU (or leave it null to pick automatically)"
        )
    hook = (strategy_cfg.get("comm_hook") or {}).get("kind")
    if hook == "powersgd" and gpu and str(trainer_cfg.get("precision")) in ("16-mixed", "16"):
        # GradScaler scales the gradients before the all-reduce: one overflow step puts inf
        # into PowerSGD's error feedback and warm-start factors, which then stay NaN.
        raise UserError(
            "strategy=ddp_powersgd with trainer.precision=16-mixed on CUDA: one overflowing "
            "step would leave NaN in PowerSGD's error feedback for good: use "
            "trainer.precision=bf16-mixed (no loss scaling)"
        )
    accumulate = int(trainer_cfg.get("accumulate_grad_batches") or 1)
    if strategy_cfg.get("static_graph") and accumulate > 1 and world_size > 1:
        # DDP's reducer asserts inside backward (Lightning #19354, pytorch #143580).
        raise UserError(
            f"strategy.static_graph=true with trainer.accumulate_grad_batches={accumulate} "
            "crashes inside DDP (its no_sync steps break the static graph): use strategy=ddp, "
            "or trainer.accumulate_grad_batches=1"
        )


def build_strategy(strategy_cfg: DictConfig | None, topology: Topology) -> Any:
    """ "auto" (no DDP wrapper, nothing sharded) for one process in total, else the configured
    DDPStrategy or FSDPStrategy (whose data-parallel size is the whole world)."""
    if topology.world_size == 1 or not strategy_cfg:
        return "auto"
    if fsdp_options.chosen(strategy_cfg):
        return instantiate(strategy_cfg, data_parallel_size=topology.world_size)
    return instantiate(strategy_cfg)


# DDP names parameters that got no gradient by their index in the order it registered them.
UNUSED = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)")
_parameter_names: list[str] = []  # the DDP model's parameters, in that order


def remember_parameters(model: DistributedDataParallel) -> None:
    """Call after wrapping a model in DDP (both trainers): for `errors_reported` to name the
    parameters an error gives by index. Both trainers' modules hold the task as `task`."""
    named = model.module.named_parameters()
    _parameter_names[:] = [name.removeprefix("task.") for name, p in named if p.requires_grad]


def unused_parameters(err: BaseException) -> tuple[int, list[str]] | None:
    """(rank, parameter names) when `err` is DDP's "no gradient for these parameters"."""
    found = UNUSED.search(str(err))
    if found is None:
        return None
    indices = [int(i) for i in found[2].split()]
    names = [_parameter_names[i] if i < len(_parameter_names) else f"#{i}" for i in indices]
    return int(found[1]), names


@contextlib.contextmanager
def errors_reported() -> Iterator[None]:
    """One line instead of a traceback wall: "another rank is gone" (exit 1), "these
    parameters got no gradient" (exit 2: the model or the strategy must change)."""
    try:
        yield
    except RuntimeError as err:
        if unused := unused_parameters(err):
            rank, names = unused
            fail(
                f"rank {rank}: these parameters got no gradient in a training step, which DDP "
                f"needs: {', '.join(names)}. Use them in the loss (or delete them), or train "
                "with strategy=ddp_unused (find_unused_parameters=true, a little slower)"
            )
        if not is_peer_failure(err):
            raise
        report_peer_failure(err)  # while training runs: every live rank reports, rank 0 prints
        fail(
            "a distributed collective failed: another rank died or stopped responding "
            f"({type(err).__name__}: {str(err).splitlines()[0][:160]}); see the other ranks' "
            "output for the cause",
            code=EXIT_FAILED,
        )


DEFAULT_TIMEOUT = datetime.timedelta(seconds=600)  # strategy.timeout when it is unset


def outside_steps_timeout(timeout: datetime.timedelta | None) -> datetime.timedelta:
    """How long a collective outside the training steps waits before it fails: `timeout`
    (strategy.timeout, 600 s when unset) and CollectiveTimeout.REPORT_S (the hang report's
    margin). The checkpoint group's own collectives (sharded saves) get it too."""
    return (timeout or DEFAULT_TIMEOUT) + datetime.timedelta(seconds=CollectiveTimeout.REPORT_S)


class CollectiveTimeout:
    """Two deadlines, for both trainers: how long a rank may make no progress before the hang
    report (project.engine.distributed.hangs), and, REPORT_S longer, how long a collective
    may wait before it fails (the backstop when the report cannot run).

    Until this attempt's first optimizer step has ended, `strategy.timeout` (600 s:
    process-group set-up, first-time compilation, workers starting); inside the training steps
    after it, `strategy.step_timeout_s` (120 s), so a peer gone without closing its
    connections (a power loss, a cut cable, a wedged GPU, a deadlock) is reported in two
    minutes instead of ten. A dead process is noticed at once either way (gloo and NCCL see
    its connections close). The timeout is per rank and the waiting rank's counts, so the
    short one starts only at the second window after anything that can keep one rank long
    (the attempt's start, an epoch start with its workers, validation, a checkpoint save, a
    recompile or a shard download: project.engine.run.long_work): by then every rank
    has passed a collective since. Inside the steps the deadline grows to three of the
    slowest recent steps when they are that slow (the trainers measure the window that just
    ended before they call `in_steps`, so the first short deadline already counts it). The
    trainers call `start` when training starts, `in_steps` at every accumulation window start
    and `outside_steps` before anything else.
    """

    REPORT_S = 30.0  # a collective fails this much after the report's deadline

    def __init__(
        self, step_s: float | None, long: datetime.timedelta | None, world_size: int
    ) -> None:
        self.long = (long or DEFAULT_TIMEOUT).total_seconds()
        step = step_s if step_s and world_size > 1 else None
        self.step = min(step, self.long) if step else None  # never longer than `timeout`
        self.world_size = world_size
        self.windows = 0  # window starts since the last long phase
        self.short = False  # the step timeout is in force
        self.current = self.step or self.long  # the step deadline, stretched for slow steps

    def deadline(self) -> float:
        """Seconds without progress before the hang report, in the current phase."""
        return self.current if self.short else self.long

    def _set(self) -> None:
        seconds = self.deadline() + self.REPORT_S
        set_collective_timeout(datetime.timedelta(seconds=seconds))
        if (watchdog := hangs.active()) is not None:  # its backstop follows the deadline
            watchdog.rearm()

    def start(self) -> None:
        """When training starts: the collectives wait REPORT_S longer than the report."""
        if self.world_size > 1:
            self._set()

    def in_steps(self, slow_s: float = 0.0) -> None:
        """At an accumulation window start; `slow_s`: what the slowest recent steps need (3 of
        them: a model whose steps take minutes is not hung after step_timeout_s)."""
        self.windows += 1
        if self.step is None or self.windows < 2:
            return
        wanted = max(self.step, slow_s)
        if not self.short or wanted > 1.1 * self.current:
            self.short, self.current = True, wanted
            self._set()

    def outside_steps(self) -> None:
        """Before validation, a checkpoint save, the end of an epoch or of training."""
        self.windows = 0
        if self.short:
            self.short = False
            self._set()
