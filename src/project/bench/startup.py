"""Where the time from launch to the first training step goes, for both trainers.

    python -m project.bench.startup [--repeats 3] [hydra overrides...]

Runs `python -m project.train` and `python -m project.raw_train` on 1 process and as 2-process
torchrun jobs, with step_stats=true and a short run, and prints the median of each phase on
rank 0: python start (under torchrun: the agent's own start-up too; with the launcher's warm
start, also the warm process's imports, which the worker then skips), torch import, Lightning
import, Hydra import + compose + the template's config checks, data preparation, process-group
set-up, the sanity validation, and the rest (model, callbacks, loggers, trainer objects,
checkpoint lookup; for the raw trainer also the imports of its own modules, torchmetrics and
TensorBoard's writer, which Lightning's import phase holds). Measured without touching the
trainers: a child wrapper times the imports and wraps the few functions that mark a phase
(`--child`, used by this command itself).
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from project.engine.launch import torchrun
from project.engine.launch.torchrun import TRAINERS

# Short: only the start-up matters (the sanity check and one epoch of two steps).
SHORT = [
    *("trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=2"),
    *("test=false", "trainer.enable_progress_bar=false", "callbacks.progress_bar=null"),
]
# The launcher's warm process imports the entry module's WARM_IMPORTS before it forks the
# workers: the child wrapper is the entry module here, so it names what the trainer it runs
# names (the parent passes them in PRELOAD_ENV), and a worker starts as the trainer's would.
PRELOAD_ENV = "PROJECT_BENCH_PRELOAD"
WARM_IMPORTS = tuple(name for name in os.environ.get(PRELOAD_ENV, "").split(",") if name)
PHASES = (
    *("python start", "torch import", "Lightning import", "Hydra compose + config checks"),
    *("data", "process group", "sanity validation", "rest of set-up", "launch to first step"),
)


def timed(marks: dict[str, list[list[float]]], name: str, fn: Callable) -> Callable:
    """`fn` that also appends its [start, end] wall times to marks[name]."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            marks.setdefault(name, []).append([start, time.time()])

    return wrapper


def timed_source(marks: dict[str, list[list[float]]], build: Callable) -> Callable:
    """`build_source` whose source also times its `prepare()` and `dataset()` calls."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        source = timed(marks, "data", build)(*args, **kwargs)
        source.prepare = timed(marks, "data", source.prepare)
        source.dataset = timed(marks, "data", source.dataset)
        return source

    return wrapper


def child(module: str, overrides: list[str], marks_file: str) -> None:
    """Run one trainer in this process with its phases marked; rank 0 writes the marks."""
    marks: dict[str, Any] = {"interpreter": time.time()}
    import torch.distributed as dist

    marks["torch"] = time.time()
    if module == TRAINERS["lightning"]:
        import lightning.pytorch as pl

        marks["lightning"] = time.time()
        pl.Trainer._run_sanity_check = timed(marks, "sanity", pl.Trainer._run_sanity_check)
    from project.engine.data import loaders

    loaders.build_source = timed_source(marks, loaders.build_source)  # before its importers
    dist.init_process_group = timed(marks, "pg", dist.init_process_group)
    entry = __import__(module, fromlist=["main"])
    name = "train" if module == TRAINERS["lightning"] else "run"
    task = getattr(entry, name)

    def marked_task(cfg: Any) -> Any:
        marks["task"] = time.time()
        if module == TRAINERS["raw"]:  # imported here, where run() would import it
            from project.engine.raw.trainer import RawTrainer

            RawTrainer.sanity_check = timed(marks, "sanity", RawTrainer.sanity_check)
        return task(cfg)

    setattr(entry, name, marked_task)
    if os.environ.get("RANK", "0") == "0":
        atexit.register(lambda: Path(marks_file).write_text(json.dumps(marks)))
    sys.argv = [module, *overrides]
    entry.main()


def phases(marks: dict[str, Any], launched: float, first_step: float) -> dict[str, float]:
    """Seconds per phase from one rank 0's marks."""

    def total(name: str) -> float:
        return sum(end - start for start, end in marks.get(name, []))

    imported = marks.get("lightning", marks["torch"])
    inside = {"data": total("data"), "process group": total("pg"),
              "sanity validation": total("sanity")}  # fmt: skip
    return {
        "python start": marks["interpreter"] - launched,
        "torch import": marks["torch"] - marks["interpreter"],
        "Lightning import": imported - marks["torch"],
        "Hydra compose + config checks": marks["task"] - imported,
        **inside,
        "rest of set-up": first_step - marks["task"] - sum(inside.values()),
        "launch to first step": first_step - launched,
    }


def run_once(trainer: str, nproc: int, overrides: list[str], work: Path) -> dict[str, float]:
    run_dir, marks_file = work / "run", work / "marks.json"
    args = [*SHORT, *overrides, "step_stats=true", f"hydra.run.dir={run_dir}"]
    wrapper = ["-m", "project.bench.startup", "--child", TRAINERS[trainer], str(marks_file)]
    module = TRAINERS[trainer]
    preload = [module, *importlib.import_module(module).WARM_IMPORTS]
    env = torchrun.environment(OMP_NUM_THREADS="1", **{PRELOAD_ENV: ",".join(preload)})
    launched = time.time()
    torchrun.run_to_end([*wrapper, *args], nproc, f"{trainer} x{nproc}", env)
    # Imports torch: here, not in the child's timing.
    from project.engine.shared.step_stats import STATS_FILE

    first_step = json.loads((run_dir / STATS_FILE).read_text())["first_step_unix"]
    return phases(json.loads(marks_file.read_text()), launched, first_step)


def table(results: dict[str, list[dict[str, float]]]) -> str:
    """Markdown: one row per phase, one column per (trainer, processes), medians in seconds."""
    names = list(results)
    lines = ["| phase (s, median) | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for phase in PHASES:
        cells = [f"{statistics.median(r[phase] for r in results[n]):.2f}" for n in names]
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(argv[1], argv[3:], argv[2])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each (default 3)")
    args, overrides = parser.parse_known_args(argv)
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):  # interleaved: a slow phase of the machine hits all
            for nproc in (1, 2):
                for trainer in TRAINERS:
                    key = f"{trainer} x{nproc}"
                    work = Path(tmp, f"{key.replace(' ', '')}-{rep}")
                    print(f"[{rep + 1}/{args.repeats}] {key}", flush=True)
                    results.setdefault(key, []).append(run_once(trainer, nproc, overrides, work))
    print(table(results))


if __name__ == "__main__":
    main()
