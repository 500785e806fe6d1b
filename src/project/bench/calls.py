"""Function calls per training step, for each trainer on 1 and N processes.

    python -m project.bench.calls [--nproc 2] [--epochs 20] [--batches 2 6] [overrides...]

A step's time on a shared machine moves by tens of percent from one run to the next; the
number of function calls a training step makes does not, so it shows what a loop costs
without the noise (docs/performance.md). Each trainer runs twice under cProfile (every rank,
through `--child`, from the first training step on), with `trainer.limit_train_batches` at
each of `--batches` and the same epochs, so validation and the per-epoch work cancel out:
calls per step is the difference of rank 0's calls over the difference of its steps. Prints
the calls per step of each trainer and process count, then the functions Lightning calls most
often beyond what the raw loop calls. A profiled run is 2-3x slower than a plain one: read
counts here, step times in `project.compare`.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import re
import sys
import tempfile
from pathlib import Path

from project.engine.launch import torchrun
from project.engine.launch.torchrun import TRAINERS

# The best checkpoint and early stopping act when the validation loss says so, which differs
# between the two runs of a pair; off, every epoch does the same work in both.
FIXED_WORK = [
    *("callbacks.model_checkpoint=null", "callbacks.early_stopping=null", "test=false"),
    "step_stats=true",
]
PROFILE = "rank{rank}.pstats"


def child(module: str, out_dir: str, overrides: list[str]) -> None:
    """Run one trainer in this process, under cProfile from its first training step on (what
    comes before differs between two runs: the first one also byte-compiles the modules it
    imports, builds caches); each rank writes its profile."""
    from project.engine.shared.step_stats import StepStats  # both trainers record steps here

    profile, record_step = cProfile.Profile(), StepStats.step_start

    def step_start(stats: StepStats) -> None:
        if not stats.step_starts:
            profile.enable()
        record_step(stats)

    StepStats.step_start = step_start  # type: ignore[method-assign]
    entry = __import__(module, fromlist=["main"])
    sys.argv = [module, *overrides]
    try:
        entry.main()
    finally:
        profile.disable()
        profile.dump_stats(Path(out_dir, PROFILE.format(rank=os.environ.get("RANK", "0"))))


def calls_by_function(path: Path) -> dict[str, int]:
    """Calls of each function in a cProfile dump, keyed `file:line(name)`."""
    counts: dict[str, int] = {}
    for (file, line, name), (_, calls, *_) in pstats.Stats(str(path)).stats.items():
        name = re.sub(r" at 0x[0-9a-f]+", "", name)  # built-ins' addresses differ per process
        file = re.split(r"site-packages/|/src/|/lib/python3\.\d+/", file)[-1]
        key = f"{file}:{line}({name})"
        counts[key] = counts.get(key, 0) + calls
    return counts


def per_step(short: dict[str, int], long: dict[str, int], steps: int) -> dict[str, float]:
    """Calls per step of each function from two runs that differ by `steps` steps."""
    if steps <= 0:
        raise SystemExit(f"the two runs differ by {steps} steps: lower --batches")
    names = set(short) | set(long)
    return {k: (long.get(k, 0) - short.get(k, 0)) / steps for k in names}


def run_once(module: str, nproc: int, overrides: list[str], out: Path) -> tuple[dict, int]:
    """One profiled run; rank 0's calls by function and its number of training steps."""
    run_dir = out / "run"
    target = ["-m", "project.bench.calls", "--child", module, str(out)]
    args = [*overrides, *FIXED_WORK, f"trainer.devices={nproc}", f"hydra.run.dir={run_dir}"]
    torchrun.run_to_end([*target, *args], nproc, f"{module} x{nproc}")
    from project.engine.shared.step_stats import STATS_FILE  # imports torch: not before here

    steps = len(json.loads((run_dir / STATS_FILE).read_text())["step_starts_s"])
    return calls_by_function(out / PROFILE.format(rank=0)), steps


def table(totals: dict[tuple[str, int], float]) -> str:
    """Markdown: calls per step of each trainer and process count."""
    lines = ["| trainer | processes | calls per training step (rank 0) |", "|---|---|---|"]
    lines += [f"| {t} | {n} | {c:.0f} |" for (t, n), c in totals.items()]
    return "\n".join(lines)


def most_added(lightning: dict[str, float], raw: dict[str, float], top: int = 15) -> str:
    """The functions Lightning's step calls most often beyond the raw step's calls of them."""
    added = {k: c - raw.get(k, 0.0) for k, c in lightning.items()}
    rows = sorted(added.items(), key=lambda kv: -kv[1])[:top]
    return "\n".join(f"{extra:8.1f}  {name}" for name, extra in rows)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(argv[1], argv[2], argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="the second process count")
    parser.add_argument("--epochs", type=int, default=20, help="epochs of each run")
    parser.add_argument(
        "--batches",
        type=int,
        nargs=2,
        default=[2, 6],
        metavar=("A", "B"),
        help="training batches per epoch of the two runs (default 2 6)",
    )
    args, overrides = parser.parse_known_args(argv)
    if args.nproc < 1:
        parser.error("--nproc must be at least 1")
    overrides = [*overrides, f"trainer.max_epochs={args.epochs}"]
    steps_of: dict[tuple[str, int], dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in sorted({1, args.nproc}):
            for trainer, module in TRAINERS.items():
                print(f"{trainer} x{nproc}", flush=True)
                (short, n_short), (long, n_long) = (
                    run_once(module, nproc, [*overrides, f"trainer.limit_train_batches={b}"],
                             Path(tmp, f"{trainer}{nproc}-{b}"))
                    for b in args.batches
                )  # fmt: skip
                steps_of[(trainer, nproc)] = per_step(short, long, n_long - n_short)
    print(table({key: sum(calls.values()) for key, calls in steps_of.items()}))
    if "raw" in TRAINERS:
        print(f"\nCalls per step Lightning adds most, {args.nproc} process(es):")
        print(most_added(steps_of[("lightning", args.nproc)], steps_of[("raw", args.nproc)]))


if __name__ == "__main__":
    main()
