"""Coordinated stop on SIGTERM / SIGUSR1 / SIGUSR2 / SIGINT for both trainers, for the price of
one tiny all-reduce every few optimizer steps instead of a blocking broadcast every step.

Schedulers signal before they kill: Kubernetes and most schedulers send SIGTERM, SLURM sends
SIGUSR1 (`--signal` in launch/slurm.sbatch; submitit's jobs: SIGUSR2), a terminal sends
SIGINT (Ctrl-C) to every process of the job. The handler only sets a flag (no collectives
inside a signal handler: they could interleave with DDP's own); at agreed points all ranks
all-reduce their flags, so either every rank stops after the same optimizer step or none does.

The checks happen only at the start of a gradient-accumulation window (never with partial
gradients in memory, so a stop resumes exactly), every `every_n_steps` windows at most. The
same collective carries "a checkpoint is due" for time-based checkpoints (clocks differ per
rank) and the slowest rank's step and save times: from them every rank derives the same next
check, so that a stop (the windows until the next check plus one save) fits in `budget_s`,
the grace time between the scheduler's signal and its SIGKILL (torchrun: 30 s).
Both trainers make their stop/save decisions here, so they cannot differ.

Lightning instead broadcasts a flag from rank 0 before every training step and calls
`.item()` on it (a CPU-GPU sync on GPU), which slows a small model's steps noticeably
(docs/performance.md; Lightning issue #21487).
"""

from __future__ import annotations

import logging
import math
import signal
import sys
import time
from collections.abc import Iterable
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from project.engine.distributed.ledger import STOP_CHECK

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)

log = logging.getLogger(__name__)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class StopSignal:
    """A stop flag set by signal handlers, agreed on by all ranks at window starts, and the
    "save last checkpoint now" decision (every N optimizer steps / every T seconds)."""

    def __init__(
        self,
        *,
        every_n_steps: int,
        budget_s: float | None,
        save_every_n_train_steps: int | None,
        save_every_n_seconds: float | None,
        signals: Iterable[int] = STOP_SIGNALS,
    ) -> None:
        # No defaults: configs/callbacks/fault_tolerance.yaml is their one home, read by the
        # run's checkpoint owner (project.engine.checkpoints.run), which builds this.
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.signals = tuple(signals)
        self.save_every_n_train_steps = save_every_n_train_steps
        self.save_every_n_seconds = save_every_n_seconds
        self.budget_s = budget_s
        self.received: int | None = None  # the signal number, once one arrived on this rank
        self.interval = every_n_steps  # windows between two checks (adapts to slow steps)
        self.save_s = 0.0  # how long the last checkpoint save took on this rank
        self._previous: dict[int, Any] = {}
        self._last_save = time.monotonic()
        self._saved_step = -1
        self._windows = 0  # windows since the last check
        self._last_check = time.monotonic()
        self._warned = False
        # Set by the trainers: the check marks the ledger before its collective, and carries
        # the ranks' step timings for straggler detection (no collective of their own).
        self.ledger: Any = None  # project.engine.distributed.ledger.Ledger
        self.stragglers: Any = None  # project.engine.distributed.stragglers.Stragglers

    @property
    def saved_step(self) -> int:
        """The optimizer step of the last checkpoint written (or resumed from)."""
        return self._saved_step

    def install(self) -> None:
        self._last_save = self._last_check = time.monotonic()
        self._windows = 0
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handler)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def mark_saved(self, step: int, seconds: float | None = None) -> None:
        """A checkpoint of optimizer step `step` is on disk (restarts both cadences); `seconds`:
        how long writing it took (feeds the stop budget)."""
        self._saved_step, self._last_save = step, time.monotonic()
        if seconds is not None:
            self.save_s = seconds

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        # A repeated signal changes nothing: with Ctrl-C every process gets SIGINT from the
        # terminal and again from torchrun, which forwards it.
        if self.received is None:
            self.received = signum

    def check(self, device: torch.device, step: int = 0) -> tuple[bool, bool]:
        """(stop, save) at the start of an accumulation window, at optimizer step `step`.

        stop: some rank received a signal. save: a checkpoint is due, by time on some rank's
        clock or every `save_every_n_train_steps` steps. Every rank must call this at the same
        windows, so that the all-reduces pair up.
        """
        n = self.save_every_n_train_steps
        save = bool(n and step > 0 and step % n == 0 and step != self._saved_step)
        self._windows += 1
        if self._windows < self.interval:
            return False, save
        now = time.monotonic()
        window_s = (now - self._last_check) / self._windows
        self._windows, self._last_check = 0, now
        seconds = self.save_every_n_seconds
        due = seconds is not None and now - self._last_save >= seconds
        timings = self.stragglers.payload() if self.stragglers is not None else []
        flags = torch.tensor(
            [0 if self.received is None else 1, int(due), window_s, self.save_s, *timings],
            device=device, dtype=torch.float64,
        )  # fmt: skip
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            if self.ledger is not None:
                self.ledger.mark(STOP_CHECK, step)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, time_save, slowest_window_s, slowest_save_s, *timings = flags.tolist()
        self._adapt(slowest_window_s, slowest_save_s)
        if self.stragglers is not None:
            self.stragglers.judge(timings, step)
        if stop:
            # print, not log (rank zero only): every rank reports what it saw.
            name = signal.Signals(self.received).name if self.received else "a peer's signal"
            # One write per line: ranks share the terminal.
            sys.stderr.write(f"[rank {_rank()}] stopping after step {step}: {name} received\n")
            sys.stderr.flush()
        return bool(stop), save or bool(time_save)

    def _adapt(self, window_s: float, save_s: float) -> None:
        """The next check interval: as many windows as fit in the budget after one save, at
        most `every_n_steps`. Identical on every rank (computed from all-reduced values)."""
        if not self.budget_s or window_s <= 0:
            return
        fits = math.floor((self.budget_s - save_s) / window_s)
        self.interval = max(1, min(self.every_n_steps, fits))
        if fits < 1 and not self._warned and _rank() == 0:
            self._warned = True
            log.warning(
                f"a stop may take {window_s + save_s:.1f} s (one step {window_s:.1f} s + one "
                f"checkpoint save {save_s:.1f} s), more than the stop budget of "
                f"{self.budget_s:.0f} s (callbacks.fault_tolerance.stop_budget_s): a "
                "scheduler may kill the job before last.ckpt is written; raise the grace time "
                "(SLURM --signal=TERM@<s>, Kubernetes terminationGracePeriodSeconds) and the budget"
            )
