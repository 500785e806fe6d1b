"""Naming a slow rank: each rank's own work per step, compared across ranks.

DDP's gradient all-reduce evens out the ranks' step times: a rank 200 ms slower than the
others makes every rank's step 200 ms longer, the others spending it waiting inside the
all-reduce. So what is compared is each rank's time outside the gradient sync: a window
(one optimizer step, its micro-batches) from its start to the next window's start, less the
backward that synced the gradients (its compute and its wait) and less the stop check. The
slow rank's is long and its sync short; the others' the other way round. Under FSDP every
forward and backward holds collectives (the weights' all-gathers), so there the sync is every
micro-batch's forward and backward.

The numbers travel in the stop check's all-reduce (project.engine.distributed.signals), which
the ranks run every few steps anyway: no collective is added. Every rank gets every rank's
means and judges the same way (no rank-dependent control flow); rank 0 says it: a rank whose
time is more than `share` above the ranks' median (and `min_ms` above it; of two ranks,
above the other one) at
`patience` checks in a row is named in one warning line, at most once every
`warn_every_n_steps` steps, and rank 0 logs every rank's times to the tracking logger
(`ranks/busy_ms/rank<R>`, `ranks/sync_ms/rank<R>`).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)

LOGGED_RANKS = 64  # beyond this many ranks, the slowest ones and the median are logged


class Stragglers:
    """Per-window timings of this rank, and the verdict on all ranks' (see the module)."""

    def __init__(
        self,
        rank: int,
        world: int,
        *,
        share: float,
        min_ms: float,
        patience: int,
        warn_every_n_steps: int,
        log_metrics: Callable[[dict[str, float], int], None] | None = None,
        sharded: bool = False,
    ) -> None:
        self.rank, self.world = rank, world
        self.sharded = sharded  # FSDP: the sync is every micro-batch's forward and backward
        # what the line calls the sync: DDP's gradient all-reduce, or FSDP's whole step
        self.sync_name = "forward and backward" if sharded else "gradient sync"
        self.waits_in = "every forward and backward (FSDP's collectives)" if sharded else \
            "every gradient all-reduce"  # fmt: skip
        self.share, self.min_ms, self.patience = share, min_ms, patience
        self.warn_every = warn_every_n_steps
        self.log_metrics = log_metrics
        self._start: float | None = None  # this window's start (after the stop check)
        self._sync = 0.0  # the window's syncing backward
        self._busy = self._synced = 0.0  # sums since the last check
        self._n = 0
        self.streaks = [0] * world
        self.warned_at: int | None = None
        self.named: list[int] = []  # the ranks named in the last warning

    @classmethod
    def of(
        cls, cfg: Mapping[str, Any] | None, rank: int, world: int,
        log_metrics: Callable[[dict[str, float], int], None] | None = None,
        sharded: bool = False,
    ) -> Stragglers | None:  # fmt: skip
        """From the `stragglers` config block (None: off, or one process); `sharded`:
        strategy=fsdp (every forward and backward holds collectives)."""
        if not cfg or world < 2:
            return None
        return cls(rank, world, share=float(cfg["share"]), min_ms=float(cfg["min_ms"]),
                   patience=int(cfg["patience"]), warn_every_n_steps=int(cfg["warn_every_n_steps"]),
                   log_metrics=log_metrics, sharded=sharded)  # fmt: skip

    # --- on the per-step path ---
    def window_end(self) -> None:
        """At a window start, before the stop check: the previous window is complete."""
        if self._start is not None:
            self._busy += time.perf_counter() - self._start - self._sync
            self._synced += self._sync
            self._n += 1
            self._start = None

    def window_start(self) -> None:
        """After the stop check."""
        self._start, self._sync = time.perf_counter(), 0.0

    def synced(self, seconds: float) -> None:
        """The backward that all-reduced the gradients took `seconds` (compute + wait); when
        `sharded`, one more forward and backward of this window (FSDP gathers the weights in
        each, so a slow peer is waited for in any of them)."""
        self._sync = self._sync + seconds if self.sharded else seconds

    def pause(self) -> None:
        """Validation, a checkpoint save, an epoch's end: the current window is not a step."""
        self._start = None

    # --- at a stop check ---
    def payload(self) -> list[float]:
        """This rank's mean busy and sync ms since the last check, in its own slots (the
        others 0: the all-reduce takes the maximum)."""
        values = [0.0] * (2 * self.world)
        if self._n:
            values[2 * self.rank] = 1000 * self._busy / self._n
            values[2 * self.rank + 1] = 1000 * self._synced / self._n
        self._busy = self._synced = 0.0
        self._n = 0
        return values

    def judge(self, values: list[float], step: int) -> None:
        """Every rank's means (all-reduced): name a persistent straggler, log the times."""
        busy, sync = values[0::2], values[1::2]
        if min(busy) <= 0:
            return  # a rank measured no whole window since the last check
        # The others' median: of two ranks the other one; of more the median of all, which one
        # slow rank cannot move (one sort per check, not one per rank: thousands of ranks).
        median = statistics.median(busy)
        for r, ms in enumerate(busy):
            base = busy[1 - r] if self.world == 2 else median
            slow = ms > base * (1 + self.share) and ms - base > self.min_ms
            self.streaks[r] = self.streaks[r] + 1 if slow else 0
        if self.rank == 0 and self.log_metrics is not None:
            self.log_metrics(self._logged(busy, sync), step)
        named = [r for r, n in enumerate(self.streaks) if n >= self.patience]
        due = self.warned_at is None or step - self.warned_at >= self.warn_every
        if named and due:
            self.warned_at, self.named = step, named
            if self.rank == 0:
                log.warning(self.line(named, busy, sync, step))

    def line(self, named: list[int], busy: list[float], sync: list[float], step: int) -> str:
        worst = max(named, key=lambda r: busy[r])
        median = statistics.median(b for r, b in enumerate(busy) if r not in named)
        others = statistics.median(s for r, s in enumerate(sync) if r not in named)
        rest = ", ".join(str(r) for r in named if r != worst)
        more = f" (and rank {rest})" if rest else ""
        return (
            f"straggler: rank {worst}{more} works {busy[worst]:.1f} ms per step outside the "
            f"{self.sync_name} against {median:.1f} ms for the other ranks (median) "
            f"(+{100 * (busy[worst] / median - 1):.0f}%) for {self.streaks[worst]} checks in a "
            f"row, up to step {step}; the other ranks wait for it about {others:.1f} ms in "
            f"{self.waits_in}. Look at that rank's host: data loading, a throttled "
            "or shared device (docs/troubleshooting.md#a-straggler-line)"
        )

    def _logged(self, busy: list[float], sync: list[float]) -> dict[str, float]:
        ranks = range(self.world)
        if self.world > LOGGED_RANKS:
            ranks = sorted(ranks, key=lambda r: -busy[r])[:8]
        logged = {f"ranks/busy_ms/rank{r}": busy[r] for r in ranks}
        logged |= {f"ranks/sync_ms/rank{r}": sync[r] for r in ranks}
        logged["ranks/busy_ms/median"] = statistics.median(busy)
        return logged
