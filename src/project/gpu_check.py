"""What only a GPU can show, in one command (`make gpu-check`, under 5 minutes on one GPU).

    python -m project.gpu_check [--out DIR] [--peak-tflops 989]

Short real trainings through the real entry point (`python -m project.train`, one GPU): bf16- and
16-mixed precision, the one-line refusal of PowerSGD with fp16, `model.compile=true`, pinned
memory, DataLoader workers from the fork server with CUDA, a run stopped by SIGTERM and resumed
that ends bitwise equal to an uninterrupted one (dropout on, so the CUDA RNG state must be
restored), and experiment=bench's throughput with an MFU estimate; and an FSDP2 round trip:
a 2-layer model sharded with `fully_shard`, one step, a sharded DCP checkpoint saved (sync
and async) and loaded into a fresh model (`fsdp_round_trip`, which also runs on the CPU).
One line per check, PASS or FAIL with its figure; exit 1 when any failed. Without CUDA: one
line, exit 0 (CI). Each run's output is kept in --out (default: a fresh temporary folder)
for a FAIL's details.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Dense bf16 peak of an H100 SXM (989.4 TFLOP/s); an H200 is the same chip with more memory.
PEAK_TFLOPS = 989.0
ONE_GPU = ["trainer=gpu", "trainer.devices=1", "trainer.enable_progress_bar=false"]
SHORT = ["trainer.max_epochs=2"]
# Workers started by the fork server while the rank holds a CUDA context, into pinned memory.
WORKERS = ["worker_start_method=forkserver", "data.num_workers=2", "data.pin_memory=true"]
EXIT_BAD_INPUT, EXIT_PREEMPTED = 2, 143  # project.engine.distributed.exits


class Runs:
    """Starts `python -m project.train` runs, each with its own RUN_ID under one log folder."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def folder(self, run_id: str) -> Path:
        return self.out / "train" / "runs" / run_id

    def train(self, run_id: str, *overrides: str, timeout: float = 240) -> tuple[int, str]:
        """Exit code and output (also appended to <out>/<run_id>.log) of one run."""
        cmd = [sys.executable, "-m", "project.train", *ONE_GPU, f"paths.log_dir={self.out}",
               *overrides]  # fmt: skip
        # What deterministic CUDA matmuls need (Lightning sets it too with deterministic=true).
        env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", **os.environ, "RUN_ID": run_id,
               "PYTHONUNBUFFERED": "1"}  # fmt: skip
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            code, out = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as err:
            code, out = -1, f"{err.stdout or ''}{err.stderr or ''}\ntimed out after {timeout} s"
        out = out if isinstance(out, str) else out.decode(errors="replace")
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.out / f"{run_id}.log", "a") as log:
            log.write(f"$ RUN_ID={run_id} {' '.join(cmd)}\n{out}\nexit {code}\n")
        return code, out

    def metrics(self, run_id: str) -> dict[str, float]:
        path = self.folder(run_id) / "metrics.json"
        return json.loads(path.read_text()) if path.is_file() else {}


class Failed(Exception):
    """A check's FAIL line: what went wrong, in one line."""


def trained(runs: Runs, run_id: str, *overrides: str) -> str:
    """Train; the figure: test accuracy and wall time. Failed unless it exits 0."""
    start = time.perf_counter()
    code, out = runs.train(run_id, *SHORT, *overrides)
    if code != 0:
        raise Failed(f"exit {code}, see {runs.out / run_id}.log: {last_line(out)}")
    acc = runs.metrics(run_id).get("test/acc", float("nan"))
    return f"test/acc {acc:.3f} in {time.perf_counter() - start:.0f} s"


def last_line(out: str) -> str:
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "(no output)"


def check_powersgd_refusal(runs: Runs) -> str:
    """fp16 with PowerSGD on CUDA is bad input: exit 2 and one `error:` line naming
    bf16-mixed, before anything trains."""
    code, out = runs.train("powersgd", "strategy=ddp_powersgd", "trainer.precision=16-mixed")
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    if code != EXIT_BAD_INPUT or len(errors) != 1 or "bf16-mixed" not in errors[0]:
        raise Failed(f"exit {code}, want 2 and one error: line naming bf16-mixed: {last_line(out)}")
    return f"refused: {errors[0][:120]}"


def final_weights(run_dir: Path) -> dict[str, Any]:
    """The network's weights in a run's last checkpoint (Lightning's or the raw trainer's)."""
    import torch

    ckpt = run_dir / "checkpoints"
    if (ckpt / "last.pt").is_file():
        return torch.load(ckpt / "last.pt", weights_only=True, map_location="cpu")["model"]
    state = torch.load(ckpt / "last.ckpt", weights_only=True, map_location="cpu")["state_dict"]
    return {k.removeprefix("task."): v for k, v in state.items() if k.startswith("task.")}


def check_resume(runs: Runs) -> str:
    """Stopped by SIGTERM mid-epoch and rerun with the same RUN_ID: the final weights equal an
    uninterrupted run's bit for bit. Dropout draws from the CUDA RNG, which the resume must
    restore; deterministic kernels, so that only the resume can make a difference."""
    args = ["model.net.dropout=0.2", "trainer.deterministic=true", "trainer.max_epochs=3"]
    for run_id, extra, want in (("whole", [], 0),
                                ("resumed", ["fault_injection.at_step=25",
                                             "fault_injection.mode=sigterm"], EXIT_PREEMPTED),
                                ("resumed", [], 0)):  # fmt: skip
        code, out = runs.train(run_id, *args, *extra)
        if code != want:
            raise Failed(f"{run_id}: exit {code}, want {want}: {last_line(out)}")
    if "resuming from" not in out:  # else the equality would prove nothing
        raise Failed("the rerun did not resume from the stopped run's checkpoint")
    whole, resumed = final_weights(runs.folder("whole")), final_weights(runs.folder("resumed"))
    if whole.keys() != resumed.keys():
        raise Failed(f"different tensors: {sorted(whole.keys() ^ resumed.keys())}")
    differ = [k for k in whole if not whole[k].equal(resumed[k])]
    if differ:
        raise Failed(f"final weights differ in {differ}")
    return f"{len(whole)} tensors bitwise equal after a stop at step 25 and a resume"


def check_bench(runs: Runs, peak_tflops: float) -> str:
    """experiment=bench on one GPU: steady samples/s (median step time after the first tenth)
    and MFU = 6 x weights x samples/s over the bf16 peak (forward 2, backward 4 FLOPs per
    weight and sample; biases, activations and the optimizer left out)."""
    code, out = runs.train("bench", "experiment=bench", "step_stats=true")
    if code != 0:
        raise Failed(f"exit {code}: {last_line(out)}")
    stats = json.loads((runs.folder("bench") / "step_stats.json").read_text())
    starts = stats["step_starts_s"][len(stats["step_starts_s"]) // 10 :]
    step_s = statistics.median(b - a for a, b in itertools.pairwise(starts))
    per_s = stats["units_per_step"] / step_s
    weights = sum(t.numel() for t in final_weights(runs.folder("bench")).values() if t.dim() > 1)
    mfu = 6 * weights * per_s / (peak_tflops * 1e12)
    return (
        f"{per_s:,.0f} {stats['unit']}/s ({1000 * step_s:.2f} ms/step), MFU {100 * mfu:.4f}% of "
        f"{peak_tflops:.0f} TFLOP/s bf16 ({weights:,} weights: a tiny net, overhead-bound)"
    )


def fsdp_round_trip(device: str, folder: Path) -> str:
    """One process: a 2-layer model on `device` sharded with `fully_shard` (per layer and at
    the root), one AdamW step, saved as a sharded checkpoint (ShardedLast: sync, then async)
    and loaded into a freshly initialised copy, whose weights and optimizer state must then
    equal the saved ones. Its own process group (a 1-rank one, gloo for the CPU side DCP's
    async save needs), destroyed at the end."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.fsdp import fully_shard

    from project.engine.checkpoints.sharded import ShardedLast

    backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def sharded(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 8)).to(device)  # fmt: skip
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    try:
        model, optimizer = sharded(0)
        model(torch.randn(16, 64, device=device)).square().mean().backward()
        optimizer.step()
        last = ShardedLast(folder, "last", "gpu-check")
        blocked = [last.save(1, model, optimizer, {}, {}),
                   last.save(2, model, optimizer, {}, {}, asynchronous=True)]  # fmt: skip
        last.wait()
        fresh, fresh_optimizer = sharded(1)
        loaded = last.load(fresh, fresh_optimizer)
        last.close()
        want, got = (get_state_dict(m, [o], options=full) for m, o in
                     ((model, optimizer), (fresh, fresh_optimizer)))  # fmt: skip
    finally:
        dist.destroy_process_group()
    if loaded is None or loaded.step != 2:
        raise Failed(f"the async save was not published: loaded {loaded}")
    flat = [(k, a, got[0][k]) for k, a in want[0].items()]
    for name, state in want[1]["state"].items():
        flat += [(f"{name}.{k}", v, got[1]["state"][name][k]) for k, v in state.items()]
    differ = [k for k, a, b in flat if not torch.equal(a, b)]
    if differ:
        raise Failed(f"loaded state differs from the saved one in {differ}")
    return (f"{len(flat)} tensors equal after a sharded save and load on {device} (blocked "
            f"{blocked[0]:.2f} s sync, {blocked[1]:.2f} s async)")  # fmt: skip


def check_fsdp(out: Path) -> str:
    """fsdp_round_trip on the GPU, in a process of its own (its process group and NCCL)."""
    code = ("import sys; from pathlib import Path; from project.gpu_check import "
            "fsdp_round_trip; print(fsdp_round_trip('cuda', Path(sys.argv[1])))")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code, str(out / "fsdp")], capture_output=True,
                          text=True, timeout=240)  # fmt: skip
    if proc.returncode != 0:
        raise Failed(f"exit {proc.returncode}: {last_line(proc.stdout + proc.stderr)}")
    return last_line(proc.stdout)


def checks(runs: Runs, peak_tflops: float) -> list[tuple[str, Callable[[], str]]]:
    return [
        ("bf16-mixed training", lambda: trained(runs, "bf16", "trainer.precision=bf16-mixed")),
        ("16-mixed training", lambda: trained(runs, "fp16", "trainer.precision=16-mixed")),
        ("PowerSGD + 16-mixed refused", lambda: check_powersgd_refusal(runs)),
        ("model.compile=true", lambda: trained(runs, "compile", "model.compile=true")),
        ("pinned memory", lambda: trained(runs, "pinned", "data.pin_memory=true")),
        ("fork-server workers with CUDA", lambda: trained(runs, "workers", *WORKERS)),
        ("resume bitwise equal (dropout, CUDA)", lambda: check_resume(runs)),
        ("bench throughput and MFU", lambda: check_bench(runs, peak_tflops)),
        ("FSDP2 sharded checkpoint round trip", lambda: check_fsdp(runs.out)),
    ]


def cuda_device() -> str | None:
    """The first CUDA device's name, or None where there is none."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="where runs and logs go (default: a temp folder)")
    parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS,
                        help="dense bf16 peak for the MFU (default: H100/H200 SXM)")  # fmt: skip
    args = parser.parse_args(argv)
    device = cuda_device()
    if device is None:
        print("gpu-check: no CUDA device on this machine (torch.cuda.is_available() is False): "
              "nothing checked")  # fmt: skip
        return 0
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    print(f"gpu-check on {device}, runs and logs in {out}", flush=True)
    runs, failed, start = Runs(out), 0, time.perf_counter()
    for name, check in checks(runs, args.peak_tflops):
        try:
            print(f"PASS {name}: {check()}", flush=True)
        except Exception as err:  # one line per check, whatever broke
            failed += 1
            why = str(err) if isinstance(err, Failed) else f"{type(err).__name__}: {err}"
            print(f"FAIL {name}: {why}", flush=True)
    print(f"gpu-check: {failed} failed, {time.perf_counter() - start:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
