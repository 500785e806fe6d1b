"""What the fixed-layout copies around PowerSGD cost per training step (2 processes, gloo, CPU).

    python -m project.bench.powersgd_copies [--repeats 5] [--steps 30] [--hidden 1024] [--layers 3]

The template's PowerSGD hook (BucketLayouts in project.engine.distributed.comm_hooks.
powersgd_layout) hands torch's powerSGD_hook a copy of each DDP bucket in a fixed layout and
copies the result back, so a resumed run is bitwise the uninterrupted one. This times a small
DDP job (an MLP with `--layers` hidden layers of `--hidden` units, 64 inputs, batch 64 per
rank, SGD) for five variants, run one after the other in the same two processes, `--repeats`
rounds (each starting with another variant):

    compressing, fixed layout      the template's hook while PowerSGD compresses
    compressing, DDP's own bucket  torch's hook on DDP's buffer as it is (no copies; the same
                                   one-bucket-at-a-time wait on gloo)
    plain, DDP's own bucket        the template's hook before start_powerSGD_iter (no copies)
    plain, fixed layout            the plain all-reduce on fixed-layout copies
    plain, fixed layout + wait     what the hook did there before 2026-12-03: the copies and
                                   gloo's one-bucket-at-a-time wait on every step

Prints, per variant, the median over rounds of each round's median step time (forward,
backward with the hook, optimizer step; rank 0, after 5 warm-up steps) and of the time spent
in the copies themselves (timed around the copy in and the copy back).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

VARIANTS = (
    "compressing, fixed layout", "compressing, DDP's own bucket",
    "plain, DDP's own bucket", "plain, fixed layout", "plain, fixed layout + wait",
)  # fmt: skip
WARMUP = 5  # DDP's first step and its regrouping, PowerSGD's first compressed step


def timed_copies(clock: list[float]) -> None:
    """Add the time FixedBucket spends copying (in and back) to clock[0]."""
    from project.engine.distributed.comm_hooks.powersgd_layout import FixedBucket

    for name in ("__init__", "copy_back"):
        original = getattr(FixedBucket, name)

        def timed(*args: Any, _original: Any = original) -> Any:
            began = time.perf_counter()
            try:
                return _original(*args)
            finally:
                clock[0] += time.perf_counter() - began

        setattr(FixedBucket, name, timed)


def register(model: Any, variant: str) -> None:
    """The variant's comm hook on a DDP model (PowerSGD of rank 1, from step 2 or never)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    from project.engine.distributed.comm_hooks import CommHook
    from project.engine.distributed.comm_hooks.powersgd_layout import BucketLayouts, FixedBucket

    start = 2 if variant.startswith("compressing") else 10**9
    if variant in ("compressing, fixed layout", "plain, DDP's own bucket"):
        CommHook("powersgd", matrix_approximation_rank=1, start_powerSGD_iter=start).register(model)
        return
    state = powerSGD_hook.PowerSGDState(
        None, matrix_approximation_rank=1, start_powerSGD_iter=start
    )
    layouts = BucketLayouts(state, model.module.named_parameters())
    wait = variant != "plain, fixed layout"  # gloo: one bucket at a time while compressing

    def copies_always(state, bucket):  # the hook as it was: the fixed layout on every step
        layout = layouts.layout_of(bucket)
        fixed = FixedBucket(bucket, layout, layouts.key(layout.names))
        done = powerSGD_hook.powerSGD_hook(state, fixed)
        if wait:
            done.wait()
        return done.then(fixed.copy_back)

    def own_bucket(state, bucket):
        done = powerSGD_hook.powerSGD_hook(state, bucket)
        done.wait()
        return done

    hook = own_bucket if variant == "compressing, DDP's own bucket" else copies_always
    model.register_comm_hook(state, hook)


def train(variant: str, args: argparse.Namespace, clock: list[float]) -> tuple[float, float]:
    """One run of `variant`: its median step time and median copy time per step (s)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    sizes = [64, *[args.hidden] * args.layers, 10]
    layers: list[torch.nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(sizes):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]
    model = DistributedDataParallel(torch.nn.Sequential(*layers[:-1]))
    register(model, variant)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    steps, copies = [], []
    for step in range(WARMUP + args.steps):
        clock[0], began = 0.0, time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        if step >= WARMUP:
            steps.append(time.perf_counter() - began)
            copies.append(clock[0])
    return statistics.median(steps), statistics.median(copies)


def child(args: argparse.Namespace) -> None:
    """One rank: every variant once per round; rank 0 writes what it measured."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    clock = [0.0]
    timed_copies(clock)
    results: dict[str, list[list[float]]] = {v: [] for v in VARIANTS}
    for round_ in range(args.repeats):
        shift = round_ % len(VARIANTS)  # each variant in each place of a round as often
        for variant in VARIANTS[shift:] + VARIANTS[:shift]:
            results[variant].append(list(train(variant, args, clock)))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))
    # Both ranks past their last collective before either tears its group down: a rank that
    # destroyed it while its peer's gloo threads still worked once aborted ("terminate called
    # without an active exception", in CI).
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(argv: list[str], out: Path) -> None:
    """This command as two gloo ranks on this machine (one thread each)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = os.environ | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2",
                        "OMP_NUM_THREADS": "1"}  # fmt: skip
    cmd = [sys.executable, "-m", "project.bench.powersgd_copies", *argv, "--child", str(out)]
    procs = [subprocess.Popen(cmd, env=env | {"RANK": str(r)}) for r in range(2)]
    if any(proc.wait() for proc in procs):
        raise SystemExit("a rank failed: see its output above")


def table(results: dict[str, list[list[float]]]) -> str:
    """Markdown: each variant's median step time and copy time, in ms."""
    lines = ["| variant | ms per step | of which copies |", "|---|---|---|"]
    for variant, rounds in results.items():
        step, copies = (statistics.median(r[i] for r in rounds) * 1000 for i in (0, 1))
        lines.append(f"| {variant} | {step:.2f} | {copies:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds of all variants")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--hidden", type=int, default=1024, help="units per hidden layer")
    parser.add_argument("--layers", type=int, default=3, help="hidden layers")
    parser.add_argument("--child", dest="out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.out:
        return child(args)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        run_ranks(argv, out)
        results = json.loads(out.read_text())
    params = 64 * args.hidden + (args.layers - 1) * args.hidden**2 + 10 * args.hidden
    print(f"python -m project.bench.powersgd_copies {' '.join(argv)}".rstrip())
    print(f"MLP of ~{params / 1e6:.1f} M weights, 2 ranks (gloo, 1 thread each), median of "
          f"{args.repeats} rounds of {args.steps} steps")  # fmt: skip
    print(table(results))


if __name__ == "__main__":
    main()
