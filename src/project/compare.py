"""Run the Lightning and the raw trainer on the same config and show them side by side.

    python -m project.compare [--repeats 5] [--warmup 20] [hydra overrides...]
    python -m project.compare trainer.devices=2 experiment=bench   # each as 2-process torchrun
    python -m project.compare --from-runs LIGHTNING_RUN_DIR RAW_RUN_DIR  # e.g. multi-node runs
                                     # made by launch/multinode.sh with step_stats=true
    python -m project.compare --scaling experiment=bench   # 1 and 2 processes: scaling efficiency

Repetitions are interleaved (L, raw, raw, L, ...) so that a slow phase of the machine hits
both. Writes compare.md, compare.json and compare.png (losses overlaid, step-time histograms;
needs matplotlib: pip install -e ".[plot]") into logs/compare/runs/<run id>/, with each
trainer's runs below it: `tensorboard --logdir <that folder>` shows both trainers' curves.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

from project.engine.config import typos
from project.engine.config.compose import CONFIG_DIR, register_resolvers, run_id
from project.engine.config.schema import check_schema
from project.engine.distributed.exits import fail
from project.engine.launch import torchrun
from project.engine.launch.torchrun import TRAINERS
from project.engine.run.results import read_metrics
from project.engine.shared.step_stats import STATS_FILE


def compose(overrides: list[str]) -> Any:
    """The training config these overrides give (validates them before anything runs)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_resolvers()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose("train", overrides=overrides, return_hydra_config=True)


def target(module: str, overrides: list[str], run_dir: Path) -> list[str]:
    """What follows `python` (or torchrun's options) to run one trainer into `run_dir`."""
    return ["-m", module, *overrides, "step_stats=true", f"hydra.run.dir={run_dir}"]


def run_once(module: str, nproc: int, overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """Run one trainer to the end; returns its stats, metrics and launch/wall times."""
    launched = time.time()
    torchrun.run_to_end(target(module, overrides, run_dir), nproc, f"{module} in {run_dir}")
    wall = time.time() - launched
    result = read_run(run_dir)
    result.update(wall_s=wall, launch_to_first_step_s=result["stats"]["first_step_unix"] - launched)
    return result


def read_run(run_dir: Path) -> dict[str, Any]:
    stats_file = run_dir / STATS_FILE
    if not stats_file.is_file():
        fail(f"{stats_file} is missing: run the trainer with step_stats=true")
    stats = json.loads(stats_file.read_text())
    return {"stats": stats, "metrics": read_metrics(run_dir), "dir": str(run_dir)}


def steady_step_s(stats: dict[str, Any], warmup: int) -> float:
    """Median time between consecutive step starts after `warmup` steps (epoch boundaries,
    with validation in them, are a few outliers the median ignores)."""
    gaps = step_gaps_ms(stats, warmup)
    if not gaps:
        fail(f"only {len(stats['step_starts_s'])} steps ran: need more than --warmup={warmup}")
    return statistics.median(gaps) / 1000


def summarise(results: dict[str, list[dict[str, Any]]], warmup: int) -> dict[str, Any]:
    """The figures of the table, as JSON-ready numbers."""
    reference = results["raw"][0]["stats"]["losses"]
    diffs = [
        max((abs(a - b) for a, b in zip(r["stats"]["losses"], reference, strict=True)), default=0.0)
        for r in results["lightning"] + results["raw"]
        if len(r["stats"]["losses"]) == len(reference)
    ]
    lengths_match = len(diffs) == len(results["lightning"]) + len(results["raw"])
    summary: dict[str, Any] = {
        "steps": len(reference),
        "repeats": len(results["raw"]),
        "max_abs_loss_diff": max(diffs) if lengths_match else None,
        "losses_bitwise_equal": lengths_match and max(diffs) == 0.0,
    }
    for name, runs in results.items():
        launched = [r["launch_to_first_step_s"] for r in runs if "launch_to_first_step_s" in r]
        walls = [r["wall_s"] for r in runs if "wall_s" in r]
        steps = [steady_step_s(r["stats"], warmup) for r in runs]
        summary[name] = {
            "steady_step_ms_median": 1000 * statistics.median(steps),
            "steady_step_ms_each": [round(1000 * s, 4) for s in steps],
            "launch_to_first_step_s_median": statistics.median(launched) if launched else None,
            "wall_s_median": statistics.median(walls) if walls else None,
            "peak_rss_mib_max": max(r["stats"]["peak_rss_mib"] for r in runs),
            "peak_gpu_mib_max": runs[0]["stats"]["peak_gpu_mib"],
            "metrics": runs[0]["metrics"],
            "runs": [r["dir"] for r in runs],
        }
    lightning, raw = summary["lightning"], summary["raw"]
    summary["lightning_over_raw_step_time"] = (
        lightning["steady_step_ms_median"] / raw["steady_step_ms_median"]
    )
    summary["lightning_minus_raw_step_us"] = 1000 * (
        lightning["steady_step_ms_median"] - raw["steady_step_ms_median"]
    )
    # Repeat i of each trainer ran back to back: their ratio shows how much one pair can say.
    pairs = zip(lightning["steady_step_ms_each"], raw["steady_step_ms_each"], strict=False)
    summary["lightning_over_raw_each"] = [round(a / b, 4) for a, b in pairs]
    return summary


def table(summary: dict[str, Any]) -> str:
    """The side-by-side Markdown table."""
    L, R = summary["lightning"], summary["raw"]

    def num(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    diff = summary["max_abs_loss_diff"]
    verdict = (
        "bitwise equal" if summary["losses_bitwise_equal"]
        else "step counts differ" if diff is None
        else f"max |diff| {diff:.3g}"
    )  # fmt: skip
    rows = [
        ("per-step losses", verdict, f"{summary['steps']} steps x {summary['repeats']} repeats"),
        ("steady step time (ms, median)", num(L["steady_step_ms_median"], ".3f"),
         num(R["steady_step_ms_median"], ".3f")),
        ("launch to first step (s)", num(L["launch_to_first_step_s_median"], ".2f"),
         num(R["launch_to_first_step_s_median"], ".2f")),
        ("total wall time (s)", num(L["wall_s_median"], ".2f"), num(R["wall_s_median"], ".2f")),
        ("peak RSS, rank 0 (MiB)", num(L["peak_rss_mib_max"], ".0f"),
         num(R["peak_rss_mib_max"], ".0f")),
        ("peak GPU memory (MiB)", num(L["peak_gpu_mib_max"], ".0f"),
         num(R["peak_gpu_mib_max"], ".0f")),
    ]  # fmt: skip
    for key in sorted(set(L["metrics"]) & set(R["metrics"])):
        if key.startswith(("val/", "test/")):
            rows.append((key, f"{L['metrics'][key]:.4f}", f"{R['metrics'][key]:.4f}"))
    lines = ["| | Lightning | raw DDP |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    each = summary["lightning_over_raw_each"]
    spread = f"; repeats {min(each):.3f}x-{max(each):.3f}x" if len(each) > 1 else ""
    lines.append(
        f"\nLightning / raw steady step time: **{summary['lightning_over_raw_step_time']:.3f}x** "
        f"({summary['lightning_minus_raw_step_us']:+.0f} us per step{spread})"
    )
    return "\n".join(lines)


def step_gaps_ms(stats: dict[str, Any], warmup: int) -> list[float]:
    starts = stats["step_starts_s"][warmup:]
    return [1000 * (b - a) for a, b in itertools.pairwise(starts)]


def plot(results: dict[str, list[dict[str, Any]]], warmup: int, path: Path) -> Path | None:
    """compare.png: both trainers' per-step losses overlaid (first repeat) and their step-time
    distributions (every repeat, after the warm-up). None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (losses, times) = plt.subplots(1, 2, figsize=(11, 4))
    styles = {"lightning": {"lw": 2.5, "alpha": 0.6}, "raw": {"lw": 1, "ls": "--"}}
    gaps = {
        n: [g for r in runs for g in step_gaps_ms(r["stats"], warmup)]
        for n, runs in results.items()
    }
    # Steps with an epoch end (validation, checkpoints) are a few slow outliers: cut them off.
    limit = 2 * statistics.median(g for name_gaps in gaps.values() for g in name_gaps)
    for name, runs in results.items():
        losses.plot(runs[0]["stats"]["losses"], label=name, **styles[name])
        median, beyond = statistics.median(gaps[name]), sum(g > limit for g in gaps[name])
        label = f"{name}: all steps' median {median:.2f} ms ({beyond} > {limit:.0f} ms not shown)"
        times.hist(gaps[name], bins=40, range=(0, limit), alpha=0.5, label=label)
    losses.set(xlabel="step", ylabel="training loss (rank 0)", title="Per-step loss")
    times.set(xlabel="step time (ms)", ylabel="steps", title=f"Step times after {warmup} steps")
    losses.legend()
    times.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def with_devices(overrides: list[str], nproc: int) -> list[str]:
    """The overrides with `trainer.devices=nproc` (a plain 1-process run must not spawn)."""
    return [
        *(o for o in overrides if not o.startswith("trainer.devices=")),
        f"trainer.devices={nproc}",
    ]


def scaling(results: dict[int, dict[str, list[dict[str, Any]]]], warmup: int) -> dict[str, Any]:
    """Steady step time and throughput (the task's units: samples, tokens) per trainer and
    process count, and each trainer's scaling efficiency: throughput with N processes over N
    times the 1-process throughput."""
    rows = []
    for nproc, by_trainer in sorted(results.items()):
        for name, runs in by_trainer.items():
            step_s = statistics.median(steady_step_s(r["stats"], warmup) for r in runs)
            stats = runs[0]["stats"]
            rows.append({"trainer": name, "processes": nproc, "step_ms": 1000 * step_s,
                         "unit": stats.get("unit", "samples"),
                         "per_s": stats.get("units_per_step", 0) / step_s})  # fmt: skip
    per_s = {(r["trainer"], r["processes"]): r["per_s"] for r in rows}
    for row in rows:
        base = per_s[row["trainer"], 1]
        row["efficiency"] = row["per_s"] / (row["processes"] * base) if base else None
    return {"rows": rows, "processes": sorted(results)}


def scaling_table(summary: dict[str, Any]) -> str:
    unit = summary["rows"][0]["unit"]
    lines = [f"| trainer | processes | steady step (ms) | {unit}/s | scaling efficiency |",
             "|---|---|---|---|---|"]  # fmt: skip
    for r in summary["rows"]:
        eff = "" if r["processes"] == 1 else f"{r['efficiency']:.2f}"
        lines.append(f"| {r['trainer']} | {r['processes']} | {r['step_ms']:.2f} | "
                     f"{r['per_s']:.0f} | {eff} |")  # fmt: skip
    return "\n".join(lines)


def run_scaling(overrides: list[str], nproc: int, repeats: int, warmup: int, out_dir: Path) -> None:
    """`--scaling`: both trainers with 1 and `nproc` processes, interleaved repeats."""
    results: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for n in (1, nproc):
        results[n] = {"lightning": [], "raw": []}
        for rep in range(repeats):
            for name in ("lightning", "raw") if rep % 2 == 0 else ("raw", "lightning"):
                run_dir = out_dir / f"x{n}" / name / f"r{rep}"
                print(f"[x{n} {rep + 1}/{repeats}] {name}: {run_dir}", flush=True)
                run = run_once(TRAINERS[name], n, with_devices(overrides, n), run_dir)
                results[n][name].append(run)
    summary = scaling(results, warmup) | {"overrides": overrides}
    text = scaling_table(summary)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "scaling.md").write_text(text + "\n")
    (out_dir / "scaling.json").write_text(json.dumps(summary, indent=2))
    print(f"{text}\n\nWritten: {out_dir / 'scaling.md'}, {out_dir / 'scaling.json'}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each trainer (default 5)")
    parser.add_argument("--warmup", type=int, default=20, help="steps left out of step times")
    parser.add_argument("--from-runs", nargs=2, metavar=("LIGHTNING_RUN", "RAW_RUN"),
                        help="compare two finished runs instead of starting new ones")  # fmt: skip
    parser.add_argument("--scaling", action="store_true",
                        help="1 against trainer.devices (at least 2) processes: step time, "
                        "throughput and scaling efficiency of each trainer")  # fmt: skip
    args, overrides = parser.parse_known_args(argv)
    if args.from_runs:
        results = {"lightning": [read_run(Path(args.from_runs[0]))],
                   "raw": [read_run(Path(args.from_runs[1]))]}  # fmt: skip
        out_dir = Path(args.from_runs[0]).parent
    else:
        try:
            cfg = compose(overrides)
            check_schema(cfg)
        except Exception as err:  # config errors (unknown option, misspelt key, type): one line
            fail(typos.misspelt_override(err) or str(err))
        devices = cfg.trainer.devices
        nproc = 1 if devices in ("auto", None) else int(devices)
        if cfg.trainer.num_nodes not in ("auto", None, 1):
            fail(
                "compare runs on one node; for several, run both trainers with "
                "launch/multinode.sh and step_stats=true, then use --from-runs"
            )
        out_dir = Path(cfg.paths.log_dir) / "compare" / "runs" / run_id()
        if args.scaling:
            run_scaling(overrides, max(2, nproc), args.repeats, args.warmup, out_dir)
            return
        results = {"lightning": [], "raw": []}
        for rep in range(args.repeats):
            order = ("lightning", "raw") if rep % 2 == 0 else ("raw", "lightning")
            for name in order:
                run_dir = out_dir / name / f"r{rep}"
                print(f"[{rep + 1}/{args.repeats}] {name}: {run_dir}", flush=True)
                results[name].append(run_once(TRAINERS[name], nproc, overrides, run_dir))
    summary = summarise(results, args.warmup)
    summary["overrides"] = overrides
    text = table(summary)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "compare.md").write_text(text + "\n")
    (out_dir / "compare.json").write_text(json.dumps(summary, indent=2))
    print(text)
    png = plot(results, args.warmup, out_dir / "compare.png")
    picture = png or "no compare.png (it needs matplotlib: pip install -e '.[plot]')"
    print(f"\nWritten: {out_dir / 'compare.md'}, {out_dir / 'compare.json'}, {picture}")
    print(f"Curves of both: tensorboard --logdir {out_dir}")


if __name__ == "__main__":
    main()
