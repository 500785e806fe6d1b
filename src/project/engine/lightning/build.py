"""What train.py builds besides the user's data and model: the strategy, the callbacks and
loggers from their config groups, the profiler, and the Lightning-specific parts of a stop."""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from project.engine.checkpoints.remote import is_url
from project.engine.checkpoints.state import read_checkpoint
from project.engine.config.compose import to_plain
from project.engine.distributed import ddp
from project.engine.distributed.exits import Preempted, exit_now, say_once_for_my_ranks
from project.engine.distributed.hangs import is_peer_failure
from project.engine.errors import UserError
from project.engine.lightning.callbacks import FaultInjection, RunState, StepStatsCallback
from project.engine.lightning.strategy import OneProcessShardedLast
from project.engine.private_api import (
    kill_launched_ranks,
    launched_ranks,
    on_launched_rank_exit,
    pause_child_observer,
)
from project.engine.run.console import quiet_lightning
from project.engine.run.skeleton import Run

log = logging.getLogger(__name__)


def instantiate_all(group: Mapping[str, Any] | None) -> list[Any]:
    """Instantiate every non-null `{name: {_target_: ...}}` entry of a callbacks/logger group."""
    return [instantiate(c) for c in (group or {}).values() if c is not None]


def strategy(run: Run) -> Any:
    """The DDPStrategy of the `strategy` group, or "auto" for one process in total; one
    process continuing a run folder whose `last` is sharded keeps writing it so."""
    quiet_lightning()  # after Lightning's import: each of its lines once, rank 0 only
    built = ddp.build_strategy(run.cfg.get("strategy"), run.topology)
    if built == "auto" and run.checkpoints.sharded:
        return OneProcessShardedLast(one_device(run.cfg.trainer))
    return built


def one_device(trainer: DictConfig) -> torch.device:
    """The device Lightning picks for one process: `trainer.accelerator` ("auto": a CUDA GPU,
    else Apple's, else the CPU) and the GPU `trainer.devices` names as `[N]` (else the first)."""
    accelerator = str(trainer.get("accelerator") or "auto")
    devices = trainer.get("devices")
    index = int(devices[0]) if OmegaConf.is_list(devices) and len(devices) == 1 else 0
    if accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available():
        return torch.device("cuda", index)
    if accelerator in ("auto", "gpu", "mps") and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def callbacks(run: Run, loggers: list[Any]) -> list[Any]:
    """The `callbacks` group, fitted to the run: what the trainer flags switch off is left out,
    the run's checkpoint state is always kept (RunState, following callbacks.fault_tolerance,
    which is its settings, not a callback), the optional recorders are added."""
    cfg = run.cfg
    # fault_tolerance: the settings run.checkpoints already read (not built, not a callback).
    group = {k: v for k, v in (cfg.get("callbacks") or {}).items() if k != "fault_tolerance"}
    found, left_out = instantiate_all(group), []
    if not loggers:  # `logger=none` must just work: an LR monitor without a logger is an error
        left_out.append(pl.callbacks.LearningRateMonitor)
    if cfg.trainer.get("enable_progress_bar") is False:  # the flag every Lightning user knows
        left_out.append(pl.callbacks.ProgressBar)
    if cfg.trainer.get("enable_model_summary") is False:
        left_out.append(pl.callbacks.ModelSummary)
    found = [c for c in found if not isinstance(c, tuple(left_out))]
    check_one_last_checkpoint(found)
    found.append(RunState(run))
    if cfg.get("step_stats"):
        found.append(StepStatsCallback(str(run.output_dir)))
    if (cfg.get("fault_injection") or {}).get("at_step") is not None:
        found.append(FaultInjection(to_plain(cfg.fault_injection), run.ledger))
    return found


class NoProfiler(PassThroughProfiler):
    """Lightning's default profiler (it records nothing) without its per-call cost: Lightning
    wraps each hook call in `profiler.profile(name)`, about fifty a training step, and the
    default builds a generator-based context manager for each (docs/performance.md)."""

    _nothing = contextlib.nullcontext()

    def profile(self, action_name: str) -> contextlib.AbstractContextManager:
        return self._nothing


def profiler(cfg: DictConfig) -> Any:
    """`trainer.profiler` as configured (simple, advanced, pytorch, ...), else NoProfiler."""
    return cfg.trainer.get("profiler") or NoProfiler()


def check_one_last_checkpoint(callbacks: list[Any]) -> None:
    """A ModelCheckpoint with save_last would write a second last.ckpt beside the run's own
    (RunState's: Lightning then versions it, last-v1.ckpt, and auto-resume would read a stale
    one)."""
    for cb in callbacks:
        if isinstance(cb, pl.callbacks.ModelCheckpoint) and cb.save_last:
            raise UserError(
                "callbacks.model_checkpoint.save_last=true writes a second last.ckpt beside "
                "the run's own (callbacks.fault_tolerance sets when it is written): leave it false"
            )


def best_checkpoint(trainer: pl.Trainer, run: Run) -> Path | str | None:
    """This run's best checkpoint: what ModelCheckpoint found in this attempt, or (a finished
    run that is only tested) what its last checkpoint recorded. A URL stays one (a Path would
    make s3://b/k the local s3:/b/k): skeleton.checkpoint_to_test downloads it."""
    if run.fits:
        best = getattr(trainer.checkpoint_callback, "best_model_path", None)
    elif run.resume.path is not None:
        states = read_checkpoint(run.resume.path).get("callbacks", {}).values()
        best = next((s["best_model_path"] for s in states if s.get("best_model_path")), None)
    else:
        best = None
    if not best:
        return None
    return str(best) if is_url(best) else Path(best)


@contextlib.contextmanager
def stops_as_preempted(trainer: pl.Trainer, run: Run) -> Iterator[None]:
    """Lightning's SIGTERMException (raised by RunState once every rank agreed to stop)
    becomes the skeleton's Preempted; on any other failure the ranks Lightning's own launcher
    started are killed, so no rank is left behind (e.g. one hung while rank 0 timed out).
    Such a rank that failed first (exit 2 after its one-line error) gives the job its code."""
    if run.topology.launcher is None and run.topology.world_size > 1:  # Lightning starts them
        say_once_for_my_ranks()  # every rank refusing alike: the line once
        on_launched_rank_exit(end_with_launched_rank)
    try:
        yield
    except SIGTERMException:
        saved = None if trainer.fast_dev_run else run.checkpoints.last  # RunState.save
        raise Preempted(trainer.global_step, saved) from None
    except BaseException as err:
        pause_child_observer()  # this rank ends the others now, with its own code or theirs
        # A peer's closed connection reaches this rank just before the peer's exit does.
        code = launched_rank_code(trainer, PEER_EXIT_S if is_peer_failure(err) else 0.0)
        kill_launched_ranks(trainer, signal.SIGKILL)
        if code is not None:  # that rank said why (or printed its traceback): this is its echo
            raise SystemExit(code) from None
        raise


PEER_EXIT_S = 5.0  # how long a rank whose peer's connection closed waits for the peer's code


def launched_rank_code(trainer: pl.Trainer, wait_s: float) -> int | None:
    """The exit code of a rank Lightning's own launcher started that exited with one, waiting
    up to `wait_s` for one to end; None if none did (or one was killed by a signal)."""
    ranks, deadline = launched_ranks(trainer), time.monotonic() + wait_s
    while True:
        codes = [proc.poll() for proc in ranks]
        if failed := [c for c in codes if c]:
            return failed[0] if failed[0] > 0 else None
        if None not in codes or time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def end_with_launched_rank(ranks: list[Any], code: int) -> NoReturn:
    """Lightning's watcher saw a rank it started exit with `code` while this rank 0 runs on
    (e.g. waits for it to join the process group): the other ranks are killed, as Lightning
    does, and this one exits with that code instead of SIGKILL's 137."""
    for proc in ranks:
        if proc.poll() is None:
            proc.kill()
    exit_now(code)
