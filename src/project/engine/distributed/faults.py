"""Fault injection for tests and failure drills, shared by both trainers.

    python train.py fault_injection.at_step=30 fault_injection.rank=1   # SIGKILL rank 1 at step 30
    python train.py ... fault_injection.mode=hang    # rank 1 stops responding (peers time out)

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

MODES = ("sigkill", "sigterm", "sigint", "exception", "hang")


class InjectedFault(RuntimeError):
    """Raised by fault_injection.mode=exception."""


def maybe_fail(step: int, rank: int, cfg: Mapping[str, Any] | None) -> None:
    """Fail now if `cfg` asks for this (global) step on this rank."""
    if not cfg or cfg.get("at_step") is None:
        return
    if step != int(cfg["at_step"]) or rank != int(cfg.get("rank", 0)):
        return
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    mode = cfg.get("mode", "sigkill")
    # print, not log: the logging config is rank-zero only, and this must show on any rank.
    print(f"fault injection: {mode} on rank {rank} at step {step}", file=sys.stderr, flush=True)
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode in ("sigterm", "sigint"):
        os.kill(os.getpid(), signal.SIGTERM if mode == "sigterm" else signal.SIGINT)
    elif mode == "exception":
        raise InjectedFault(f"fault injection: exception on rank {rank} at step {step}")
    elif mode == "hang":  # a rank that stops responding (deadlock, stuck I/O, a wedged GPU)
        while True:
            time.sleep(3600)
    else:
        raise ValueError(f"fault_injection.mode={mode!r} is not one of {', '.join(MODES)}")
