"""Training throughput, the same in both trainers: the task's units (samples, tokens) per
second over all ranks, between two logged steps."""

from __future__ import annotations

import time


class Throughput:
    """Counts a rank's units every step; `rate()` on a logged step gives the job's units per
    second since the previous one (every rank trains the same number of steps, so this
    rank's count times the world size is the job's)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.units = 0
        self.since = time.perf_counter()

    def count(self, units: int) -> None:
        self.units += units

    def rate(self) -> float:
        now = time.perf_counter()
        rate = self.units * self.world_size / max(now - self.since, 1e-9)
        self.units, self.since = 0, now
        return rate
