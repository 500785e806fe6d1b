"""Per-step timings, losses and peak memory of a training run, written as JSON by rank 0.

Plain PyTorch so both trainers record the same thing the same way; `project.compare` reads
the files. Losses are kept as tensors until the end: no `.item()` (a GPU sync) per step.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import torch

STATS_FILE = "step_stats.json"


class StepStats:
    """Call `step_start()` before each training batch and `record_loss()` after it."""

    def __init__(self) -> None:
        self.first_step_unix: float | None = None
        self.step_starts: list[float] = []
        self.losses: list[torch.Tensor] = []
        self.unit, self.units_per_step = "samples", 0  # the task's count of one step, all ranks

    def step_start(self) -> None:
        if self.first_step_unix is None:
            self.first_step_unix = time.time()  # wall clock: comparable with the launch time
        self.step_starts.append(time.perf_counter())

    def record_units(self, unit: str, per_step: int) -> None:
        """What one step processes over all ranks (the task's `unit`): compare's throughput."""
        self.unit, self.units_per_step = unit, per_step

    def record_loss(self, loss: torch.Tensor) -> None:
        self.losses.append(loss.detach())

    def write(self, run_dir: str | Path) -> Path:
        t0 = self.step_starts[0] if self.step_starts else 0.0
        stats = {
            "first_step_unix": self.first_step_unix,
            "step_starts_s": [t - t0 for t in self.step_starts],
            "losses": torch.stack(self.losses).float().tolist() if self.losses else [],
            "unit": self.unit,
            "units_per_step": self.units_per_step,
            # ru_maxrss is in KiB on Linux: the peak resident memory of this process (rank 0).
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "peak_gpu_mib": (
                torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_initialized() else None
            ),
        }
        path = Path(run_dir) / STATS_FILE
        path.write_text(json.dumps(stats))
        return path
