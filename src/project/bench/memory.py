"""Per-rank memory of the training state under each strategy, and its step time.

    python -m project.bench.memory [--nproc 1 2 4] [--strategies ddp fsdp] [--steps 12]
                                   [--trainer raw|lightning] [overrides...]

Each (strategy, processes) pair trains `--steps` optimizer steps of the bench model (the shipped
language model made wider and deeper, `MODEL`; overrides change it). At the first optimizer
step every rank counts the bytes it holds of the parameters, their gradients and the optimizer
state: a DTensor counts its local shard, so FSDP's figures are what a rank really keeps between
steps. FSDP also all-gathers one unit's parameters at a time in forward and backward: the
largest unit's full size is printed as "one unit" and the bound FSDP must meet is
DDP's state / W x 1.1 + one unit (docs/launching.md). DDP's gradient buckets (a second copy of the
gradients unless `strategy.gradient_as_bucket_view=true`) are not counted: they are DDP's
communication buffers, like FSDP's all-gather buffers. The step time is rank 0's median
time between optimizer steps after the first two.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from project.engine.launch import torchrun
from project.engine.launch.torchrun import TRAINERS

# Wider and deeper than experiment=charlm (0.4 M parameters): 8 blocks of width 256, 6.4 M.
MODEL = ["experiment=charlm", "model.net.n_layer=8", "model.net.d_model=256"]
# Nothing but training steps: no checkpoint, no early stopping, no test.
FIXED_WORK = [
    "callbacks.model_checkpoint=null", "callbacks.early_stopping=null",
    "callbacks.fault_tolerance=null", "test=false", "logger=none",
]  # fmt: skip
RESULT = "memory-rank{rank}.json"


def local_bytes(tensor: Any) -> int:
    """Bytes this rank holds of `tensor`: a DTensor's local shard, else the tensor."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def state_bytes(optimizer: Any) -> dict[str, int]:
    """This rank's bytes of the optimizer's parameters, their gradients and its state."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = [v for s in optimizer.state.values() for v in s.values() if hasattr(v, "numel")]
    return {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(local_bytes(t) for t in state),
    }


def largest_unit(modules: list[Any]) -> int:
    """Bytes of the largest FSDP unit's full parameters (what one all-gather materialises):
    the parameters a fully_shard-ed module manages itself, not those of units inside it."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in modules if isinstance(m, FSDPModule)]

    def own_bytes(unit: Any) -> int:
        inner = {id(p) for c in unit.modules() if c is not unit and c in units
                 for p in c.parameters()}  # fmt: skip
        return sum(p.numel() * p.element_size() for p in unit.parameters() if id(p) not in inner)

    sizes = [own_bytes(u) for u in units]
    return max(sizes, default=0)


def child(module: str, out_dir: str, overrides: list[str]) -> None:
    """Run one trainer in this process; count the state at its first optimizer step and time
    every step (public hooks only: every optimizer's step, every module's forward)."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    seen: list[Any] = []
    forward = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda m, args: seen.append(m) if m not in seen else None
    )
    steps: list[float] = []
    counted: dict[str, int] = {}

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        steps.append(time.perf_counter())
        if not counted:
            counted.update(state_bytes(optimizer), unit=largest_unit(seen))
            forward.remove()

    register_optimizer_step_post_hook(after_step)
    entry = __import__(module, fromlist=["main"])
    sys.argv = [module, *overrides]
    try:
        entry.main()
    finally:
        gaps = [b - a for a, b in itertools.pairwise(steps[2:])]
        result = {**counted, "step_ms": 1e3 * statistics.median(gaps) if gaps else None}
        rank = os.environ.get("RANK", "0")
        Path(out_dir, RESULT.format(rank=rank)).write_text(json.dumps(result))


def run_once(module: str, strategy: str, nproc: int, overrides: list[str], out: Path) -> dict:
    """One run; every rank's counts (rank 0's step time)."""
    out.mkdir(parents=True)
    args = [*overrides, *FIXED_WORK, f"strategy={strategy}", f"trainer.devices={nproc}",
            f"hydra.run.dir={out / 'run'}"]  # fmt: skip
    target = ["-m", "project.bench.memory", "--child", module, str(out), *args]
    torchrun.run_to_end(target, nproc, f"{module} strategy={strategy} x{nproc}")
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob(RESULT.format(rank="*")))]
    worst = max(ranks, key=lambda r: r["params"] + r["grads"] + r["optimizer"])
    return {**worst, "step_ms": ranks[0]["step_ms"]}


def table(results: dict[tuple[str, int], dict]) -> str:
    """Markdown: MB per rank of each part, FSDP's bound against DDP's, step times."""
    mb = 2.0**20
    lines = [
        "| strategy | processes | params MB | grads MB | optimizer MB | state MB | "
        "DDP's / W | one unit MB | within DDP/W x 1.1 + one unit | ms/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (strategy, nproc), r in results.items():
        total = r["params"] + r["grads"] + r["optimizer"]
        ddp = results.get(("ddp", nproc))
        per_w = ddp and (ddp["params"] + ddp["grads"] + ddp["optimizer"]) / nproc
        bound = per_w and per_w * 1.1 + r["unit"]
        verdict = "-" if not bound or strategy == "ddp" else ("yes" if total <= bound else "NO")
        ms = f"{r['step_ms']:.1f}" if r["step_ms"] else "-"
        lines.append(
            f"| {strategy} | {nproc} | {r['params'] / mb:.2f} | {r['grads'] / mb:.2f} | "
            f"{r['optimizer'] / mb:.2f} | {total / mb:.2f} | "
            f"{per_w / mb if per_w else 0:.2f} | {r['unit'] / mb:.2f} | {verdict} | {ms} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(argv[1], argv[2], argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--strategies", nargs="+", default=["ddp", "fsdp"])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps of each run")
    parser.add_argument("--trainer", choices=sorted(TRAINERS), default=next(iter(TRAINERS)))
    args, overrides = parser.parse_known_args(argv)
    if min(args.nproc) < 1 or args.steps < 4:
        parser.error("--nproc must be at least 1 and --steps at least 4")
    overrides = [*MODEL, *overrides, f"+trainer.max_steps={args.steps}"]
    results: dict[tuple[str, int], dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in args.nproc:
            for strategy in args.strategies:
                print(f"{args.trainer} strategy={strategy} x{nproc}", flush=True)
                out = Path(tmp, f"{strategy}{nproc}")
                results[(strategy, nproc)] = run_once(
                    TRAINERS[args.trainer], strategy, nproc, overrides, out
                )
    print(table(results))


if __name__ == "__main__":
    main()
