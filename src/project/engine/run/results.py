"""A run's final metrics: what both trainers return, log and keep in metrics.json."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.json"  # a run's final metrics, written by global rank 0

log = logging.getLogger(__name__)


def as_floats(metrics: Mapping[str, Any]) -> dict[str, float]:
    """{name: float} from tensors or numbers (Lightning's callback_metrics, the raw trainer's)."""
    return {k: float(v) for k, v in metrics.items()}


def write_metrics(run_dir: Path, metrics: Mapping[str, float]) -> None:
    """Rank 0 at the end of a run (both trainers): metrics.json and one line per fact."""
    (run_dir / METRICS_FILE).write_text(json.dumps(dict(metrics), indent=2, sort_keys=True))
    log_metrics(metrics)
    log.info(f"Run folder: {run_dir}")


def log_metrics(metrics: Mapping[str, float]) -> None:
    # .5g: a learning rate of 8.2e-06 reads as that, not 0.0000
    log.info("Metrics: " + ", ".join(f"{k}={v:.5g}" for k, v in sorted(metrics.items())))


def read_metrics(run_dir: Path) -> dict[str, float]:
    """The final metrics a finished run wrote ({} if it wrote none)."""
    path = run_dir / METRICS_FILE
    return json.loads(path.read_text()) if path.is_file() else {}
