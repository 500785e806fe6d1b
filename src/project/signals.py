"""Coordinated stop on SIGTERM / SIGUSR1 for both trainers, for the price of one tiny
all-reduce every N steps instead of a blocking broadcast every step.

Schedulers signal before they kill: Kubernetes and most schedulers send SIGTERM, SLURM sends
SIGUSR1 (`--signal`). torchrun forwards SIGTERM to every worker. The handler only sets a flag
(no collectives inside a signal handler: they could interleave with DDP's own); every
`every_n_steps` steps all ranks all-reduce their flags, so either every rank stops after the
same step or none does. The same collective carries "a checkpoint is due" for time-based
checkpoint cadence, whose clocks differ per rank.

Lightning 2.6 instead broadcasts a flag from rank 0 before every training step and calls
`.item()` on it (a CPU-GPU sync on GPU): ~1.3x slower steps on a small model (Lightning
issue #21487).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterable
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignal:
    """A stop flag set by signal handlers, agreed on by all ranks every `every_n_steps` steps."""

    def __init__(self, every_n_steps: int = 10, signals: Iterable[int] = STOP_SIGNALS) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.signals = tuple(signals)
        self.received: int | None = None  # the signal number, once one arrived on this rank
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handler)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def check(
        self, step: int, device: torch.device, due: bool = False, force: bool = False
    ) -> tuple[bool, bool]:
        """(stop, save): agreed by all ranks, with one collective every N steps.

        stop: some rank received a signal. save: some rank says a checkpoint is `due` (e.g.
        its clock says the time-based cadence has passed). Every rank must call this with the
        same `step` (and `force`) so that the all-reduces pair up; `force=True` checks now.
        """
        if not force and step % self.every_n_steps != 0:
            return False, False
        flags = torch.tensor([0 if self.received is None else 1, int(due)], device=device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, save = (bool(v) for v in flags.tolist())
        if stop:
            # print, not log (rank zero only): every rank reports what it saw.
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            name = signal.Signals(self.received).name if self.received else "a peer's signal"
            print(f"[rank {rank}] stopping before batch {step}: {name} received",
                  file=sys.stderr, flush=True)  # fmt: skip
        return stop, save
