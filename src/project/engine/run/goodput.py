"""Where a run's time went, across all its attempts: `<run>/goodput.json`.

Rank 0's ledger (project.engine.distributed.ledger) books the time between two of its marks
to one bucket: `startup` (process start to the first step), `productive` (training steps),
`validation` (and the epoch-end metric sync), `checkpoint` (saves), and what failures cost:
`detection` (a stall until the hang report, a peer's death until it was noticed), `restart`
(from a failed attempt's last sign of life to the next attempt's first step, when torchrun
restarted the job or the scheduler requeued it), `reload` (reading the checkpoint),
`recomputed` (steps trained again because the checkpoint resumed from was older than the
step the failed attempt had reached); `other` is testing after training and the shutdown.

Each attempt adds its record when it ends; an attempt killed before it could (SIGKILL, a
lost node) is added by the next one from its ledger file, which outlives the process.
`wall_s` is the attempts' time plus the gaps between the attempts of one job (same
TORCHELASTIC_RUN_ID or SLURM_JOB_ID, or a torchrun restart): a rerun days later does not
count the days.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from project.engine.distributed import ledger as ledgers
from project.engine.distributed.ledger import BUCKETS, RESTART, Ledger, Record

STARTUP = BUCKETS.index("startup")

FILE = "goodput.json"
ENDINGS = {ledgers.RUNNING: "killed", ledgers.ENDED_OK: "finished",
           ledgers.ENDED_STOPPED: "stopped", ledgers.ENDED_HUNG: "hung",
           ledgers.ENDED_FAILED: "failed"}  # fmt: skip

log = logging.getLogger(__name__)


def _load(run_dir: Path) -> dict[str, Any]:
    path = run_dir / FILE
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"attempts": []}
    return {k: kept[k] for k in ("attempts", "open") if k in kept}


def _attempt(record: Record, info: dict[str, Any]) -> dict[str, Any]:
    """One attempt's record (`info`: what `begin` noted); `reached`: the optimizer steps it
    completed (a step begun and lost is not trained "again")."""
    resumed_from, replay_until = info.get("resumed_from", 0), info.get("replay_until", 0)
    return {
        "started": record.started, "ended": record.end or record.at, "job": record.job,
        "how": ENDINGS.get(record.ended, "?"),
        "buckets": dict(zip(BUCKETS, record.buckets, strict=True)),
        "resumed_from": resumed_from, "reached": record.step,
        "replay_until": replay_until, "restarted": info.get("restarted", False),
    }  # fmt: skip


def begin(ledger: Ledger, resumed_from: int) -> None:
    """Rank 0, before its ledger file is opened: fold in an attempt that died without closing
    its record, and book this attempt's start-up as a restart and its first steps as
    recomputed where an earlier attempt had got further."""
    if ledger.run_dir is None or (path := ledger.path_of(0)) is None:
        return
    state = _load(ledger.run_dir)
    previous = ledgers.read(path)
    known = {a["started"] for a in state["attempts"]}
    if previous is not None and previous.started not in known and previous.rank == 0:
        state["attempts"].append(_attempt(previous, state.get("open", {})))
    attempts = state["attempts"]
    if attempts:
        ledger.replay_until = max(a["reached"] for a in attempts)
        ledger.resumed_after_failure = attempts[-1]["how"] != "finished"
    if ledger.resumed_after_failure:  # what this attempt's start-up booked so far, too
        ledger.buckets[RESTART] += ledger.buckets[STARTUP]
        ledger.buckets[STARTUP] = 0.0
    # a torchrun restart of this job (also when its run id says nothing: static rendezvous)
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    state["open"] = {"started": ledger.started, "resumed_from": resumed_from,
                     "replay_until": ledger.replay_until, "restarted": restarted}  # fmt: skip
    _write(ledger.run_dir, state)


def close(ledger: Ledger, how: int) -> dict[str, Any] | None:
    """Rank 0 at the attempt's end: its record added, goodput.json and one line written
    (once: the hang report's thread and the main thread may both get here)."""
    with _closing:
        if ledger.ended:
            return None
        ledger.ended = True
        return _close(ledger, how)


_closing = threading.Lock()


def _close(ledger: Ledger, how: int) -> dict[str, Any] | None:
    ledger.end(how)
    record = ledger.record()
    if ledger.run_dir is None or record is None or ledger.rank != 0:
        return None
    state = _load(ledger.run_dir)
    state["attempts"].append(_attempt(record, state.pop("open", {})))
    summary = _write(ledger.run_dir, state)
    log.info(line(summary))
    return summary


def summarise(attempts: list[dict[str, Any]]) -> dict[str, Any]:
    """The totals over the attempts: wall time, buckets, steps trained again."""
    buckets = dict.fromkeys(BUCKETS, 0.0)
    wall, recomputed = 0.0, 0
    for i, a in enumerate(attempts):
        wall += a["ended"] - a["started"]
        for name, seconds in a["buckets"].items():
            buckets[name] += seconds
        previous = attempts[i - 1] if i else None
        same_job = a["job"] and a["job"] == (previous or {}).get("job")
        if previous and (same_job or a.get("restarted")):
            gap = max(0.0, a["started"] - previous["ended"])  # the launcher's restart
            wall += gap
            buckets["restart"] += gap
        recomputed += max(0, min(a["reached"], a["replay_until"]) - a["resumed_from"])
    share = buckets["productive"] / wall if wall > 0 else 0.0
    return {"wall_s": round(wall, 3), "buckets": {k: round(v, 3) for k, v in buckets.items()},
            "recomputed_steps": recomputed, "productive_share": round(share, 4),
            "attempts": len(attempts)}  # fmt: skip


def _write(run_dir: Path, state: dict[str, Any]) -> dict[str, Any]:
    summary = summarise(state["attempts"])
    path = run_dir / FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary | state, indent=2))
    tmp.replace(path)
    return summary


def line(summary: dict[str, Any]) -> str:
    """One line: the productive share, then every bucket that is not zero."""
    spent = ", ".join(f"{k} {v:.1f} s" for k, v in summary["buckets"].items() if v >= 0.05)
    return (f"Goodput: {100 * summary['productive_share']:.0f}% of {summary['wall_s']:.1f} s "
            f"was productive training ({spent}; {summary['recomputed_steps']} steps trained "
            f"again; {summary['attempts']} attempt(s)): {FILE}")  # fmt: skip


def so_far(ledger: Ledger) -> dict[str, float]:
    """Rank 0 at the end of training: the goodput until now, for the tracking logger."""
    if ledger.run_dir is None:
        return {}
    state = _load(ledger.run_dir)
    ledger.mark(ledger.phase, ledger.step)  # book the time until now
    record = ledger.record()
    if record is None:
        return {}
    now = _attempt(record, state.get("open", {}))
    now["ended"] = record.at
    return scalars(summarise([*state["attempts"], now]))


def scalars(summary: dict[str, Any]) -> dict[str, float]:
    """A summary as the tracking logger's scalars (`goodput/*`)."""
    logged = {f"goodput/{k}_s": v for k, v in summary["buckets"].items()}
    return logged | {"goodput/productive_share": summary["productive_share"],
                     "goodput/recomputed_steps": float(summary["recomputed_steps"])}  # fmt: skip
