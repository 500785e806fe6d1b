"""Fault injection for tests and failure drills, shared by both trainers.

    python train.py fault_injection.at_step=30 fault_injection.rank=1   # SIGKILL rank 1 at step 30
    python train.py ... fault_injection.mode=hang    # rank 1 stops responding (a hang report)
    python train.py ... fault_injection.mode=gil     # ... inside C code holding the GIL
    python train.py ... fault_injection.mode=desync  # rank 1 issues one extra all-reduce
    python train.py ... fault_injection.mode=slow fault_injection.slow_ms=50  # from step 30 on

Only the first attempt of a torchrun job fails (TORCHELASTIC_RESTART_COUNT=0), so a job run
with `--max-restarts` recovers instead of failing again at the same step after resuming.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping
from typing import Any

from project.engine.distributed.ledger import FAULT

MODES = ("sigkill", "sigterm", "sigint", "exception", "hang", "gil", "desync", "slow")


class InjectedFault(RuntimeError):
    """Raised by fault_injection.mode=exception."""


def maybe_fail(step: int, rank: int, cfg: Mapping[str, Any] | None, ledger: Any = None) -> None:
    """Fail now if `cfg` asks for this (global) step on this rank (`slow`: from it on).
    `ledger` (project.engine.distributed.ledger) records that the fault was injected."""
    if not cfg or cfg.get("at_step") is None or rank != int(cfg.get("rank", 0)):
        return
    mode, at = cfg.get("mode", "sigkill"), int(cfg["at_step"])
    if step < at or (step > at and mode != "slow"):
        return
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if mode == "slow":  # a straggler: its steps take this much longer (every step from `at`)
        time.sleep(float(cfg.get("slow_ms") or 0) / 1000)
        if step > at:
            return
    # print, not log: the logging config is rank-zero only, and this must show on any rank.
    print(f"fault injection: {mode} on rank {rank} at step {step}", file=sys.stderr, flush=True)
    if ledger is not None and mode != "slow":
        ledger.mark(FAULT, step)
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode in ("sigterm", "sigint"):
        os.kill(os.getpid(), signal.SIGTERM if mode == "sigterm" else signal.SIGINT)
    elif mode == "exception":
        raise InjectedFault(f"fault injection: exception on rank {rank} at step {step}")
    elif mode == "hang":  # a rank that stops responding (deadlock, stuck I/O, a wedged GPU)
        while True:
            time.sleep(3600)
    elif mode == "gil":  # a deadlock in C code that holds the GIL: none of its threads runs
        import ctypes

        libc = ctypes.PyDLL(None)  # PyDLL keeps the GIL during a call (CDLL drops it)
        mutex = ctypes.create_string_buffer(64)  # a zeroed pthread mutex: unlocked, not recursive
        libc.pthread_mutex_lock(mutex)
        libc.pthread_mutex_lock(mutex)  # waits for itself; a signal does not end the wait
    elif mode == "desync":  # rank-dependent code: a collective the other ranks do not issue
        extra_all_reduce(ledger, step)
    elif mode != "slow":
        raise ValueError(f"fault_injection.mode={mode!r} is not one of {', '.join(MODES)}")


def extra_all_reduce(ledger: Any, step: int) -> None:
    """One all-reduce only this rank issues; the ledger records it before it blocks."""
    import torch
    import torch.distributed as dist

    on_gpu = dist.get_backend() == "nccl"  # an NCCL group takes CUDA tensors only
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else None
    work = dist.all_reduce(torch.ones(1, device=device), async_op=True)
    if ledger is not None:
        ledger.mark(FAULT, step)  # after issuing: the ledger counts it
    work.wait()
