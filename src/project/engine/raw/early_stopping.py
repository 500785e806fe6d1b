"""The raw trainer's early stopping: Lightning's EarlyStopping rule, written out."""

from __future__ import annotations

from typing import Any


class EarlyStopping:
    """Lightning's EarlyStopping rule: stop after `patience` checks without an improvement of
    at least `min_delta` in `monitor`."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.best: float | None = None
        self.wait = 0

    def should_stop(self, metrics: dict[str, float]) -> bool:
        if not self.cfg or self.cfg.monitor not in metrics:
            return False
        value, sign = metrics[self.cfg.monitor], (1 if self.cfg.mode == "min" else -1)
        if self.best is None or sign * (value - self.best) < -abs(self.cfg.min_delta):
            self.best, self.wait = value, 0
        else:
            self.wait += 1
        return self.wait >= self.cfg.patience
