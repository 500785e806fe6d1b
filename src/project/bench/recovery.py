"""How long a lost node costs: the two-agent drill of docs/elastic.md, timed phase by phase.

    python -m project.bench.recovery [--repeats 3] [--strategies ddp,fsdp] [--seed 0]
                                     [hydra overrides...]

Each repetition starts two "nodes" on this host (`launch/multinode.sh` with NNODES=1:2, c10d,
one process each, the launch script's rendezvous defaults), waits until they train, SIGKILLs
the second node (its agent, warm process and worker) at a random moment, and lets the
survivor finish alone. It then reads the survivor's run folder (goodput.json, step_stats.json)
and prints, per strategy, the median of:

- failure seen: the kill -> the survivor's worker ends (its collective failed, the hang
  report named the dead rank);
- rendezvous: -> the new worker's process starts (the agent stops its workers, the dead node's
  heartbeats expire, the last call for late nodes, the fork or spawn);
- worker start: -> its first step, less the reload (Python and imports unless forked warm,
  the config, the process group, the data, the model);
- checkpoint reload: reading `last` (goodput's reload bucket);
- first step: the first optimizer step of the new attempt;
- total: the kill -> that step done (training again);
- steps again: optimizer steps trained a second time (goodput's recomputed steps).

Figures and the date they were measured go in docs/performance.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]  # the launch scripts' folder is beside src/
# digits in batches of 8 on each of 2 processes: 79 steps an epoch (~0.6 s here), a save
# every 50 steps
DRILL = ["data.batch_size=8", "trainer.max_epochs=10", "test=false", "step_stats=true",
         "callbacks.early_stopping=null", "trainer.enable_progress_bar=false",
         "callbacks.fault_tolerance.every_n_train_steps=50"]  # fmt: skip
STRATEGY = {"ddp": [], "fsdp": ["strategy=fsdp", "callbacks.model_checkpoint=null"]}
PHASES = ("failure seen", "rendezvous", "worker start", "checkpoint reload", "first step",
          "total", "steps again")  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree(pid: int) -> list[int]:
    """`pid` and every process below it (torchrun puts its workers in sessions of their own,
    so a process group would miss them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(
                int(stat.parent.name)
            )
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def start_node(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([str(ROOT / "launch" / "multinode.sh"), *args], cwd=ROOT,
                                env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip


def wait(condition: Any, timeout: float, what: str, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            tail = "\n".join(p.read_text(errors="replace")[-2000:] for p in logs if p.exists())
            raise SystemExit(f"error: {what} did not happen within {timeout:.0f} s:\n{tail}")
        time.sleep(0.05)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def drill(strategy: str, overrides: list[str], work: Path, rng: random.Random) -> dict[str, float]:
    """One drill: two nodes, the second killed at a random moment; the survivor's phases."""
    port, logs = free_port(), [work / "node0.log", work / "node1.log"]
    env = {**os.environ, "NNODES": "1:2", "NPROC_PER_NODE": "1", "MAX_RESTARTS": "3",
           "RDZV_ENDPOINT": f"127.0.0.1:{port}", "RDZV_ID": "recovery",
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    env.pop("RUN_ID", None)
    args = [f"paths.log_dir={work / 'logs'}", *DRILL, *STRATEGY[strategy], *overrides]
    run_dir = work / "logs" / "train" / "runs" / "torchrun-recovery"
    host = start_node(args, env, logs[0])
    nodes = [host]
    try:
        wait(lambda: listening(port), 120, "the rendezvous store", logs)
        nodes.append(start_node(args, env, logs[1]))
        train_log = run_dir / "train.log"
        wait(lambda: train_log.exists() and "at step 50" in train_log.read_text(), 300,
             "the first save at step 50", logs)  # fmt: skip
        time.sleep(rng.uniform(0.0, 1.5))  # a random step past the save
        for pid in tree(nodes[1].pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed = time.time()
        code = host.wait(timeout=600)
        if code != 0:
            raise SystemExit(f"error: the survivor ended with {code}:\n"
                             + logs[0].read_text(errors="replace")[-3000:])  # fmt: skip
    finally:
        for node in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
    return phases(run_dir, killed)


def phases(run_dir: Path, killed: float) -> dict[str, float]:
    """The survivor's phases (PHASES) from its run folder, `killed`: when the node died."""
    goodput = json.loads((run_dir / "goodput.json").read_text())
    failed, again = goodput["attempts"][-2:]
    stats = json.loads((run_dir / "step_stats.json").read_text())  # the last attempt's
    first_step = stats["first_step_unix"]
    step_done = first_step + (stats["step_starts_s"][1] if len(stats["step_starts_s"]) > 1 else 0)
    reload = again["buckets"]["reload"]
    return {
        "failure seen": failed["ended"] - killed,
        "rendezvous": again["started"] - failed["ended"],
        "worker start": first_step - again["started"] - reload,
        "checkpoint reload": reload,
        "first step": step_done - first_step,
        "total": step_done - killed,
        "steps again": float(goodput["recomputed_steps"]),
    }


def table(results: dict[str, list[dict[str, float]]]) -> str:
    """Markdown: one row per phase, one column per strategy, medians (seconds; steps)."""
    names = list(results)
    lines = ["| phase (median) | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for phase in PHASES:
        cells = [statistics.median(r[phase] for r in results[n]) for n in names]
        unit = "" if phase == "steps again" else " s"
        lines.append(f"| {phase} | " + " | ".join(f"{c:.2f}{unit}" for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="drills per strategy (default 3)")
    parser.add_argument("--strategies", default="ddp,fsdp", help="comma-separated: ddp, fsdp")
    parser.add_argument("--seed", type=int, default=0, help="seeds the moments of the kills")
    parser.add_argument("--keep", metavar="DIR", help="keep each drill's logs and run in DIR")
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    strategies = args.strategies.split(",")
    if unknown := [s for s in strategies if s not in STRATEGY]:
        parser.error(f"--strategies: {','.join(unknown)} is not one of {', '.join(STRATEGY)}")
    rng, results = random.Random(args.seed), {}
    with contextlib.ExitStack() as stack:
        tmp = args.keep or stack.enter_context(tempfile.TemporaryDirectory())
        for rep in range(args.repeats):  # interleaved: a slow phase of the machine hits all
            for strategy in strategies:
                print(f"[{rep + 1}/{args.repeats}] {strategy}", flush=True)
                work = Path(tmp, f"{strategy}-{rep}")
                work.mkdir(parents=True)
                result = drill(strategy, overrides, work, rng)
                print("  " + ", ".join(f"{k} {v:.2f}" for k, v in result.items()), flush=True)
                results.setdefault(strategy, []).append(result)
    print(table(results))


if __name__ == "__main__":
    main()
