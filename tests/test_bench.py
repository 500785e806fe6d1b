"""The benchmark commands of project.bench (the compare command's tests are in
test_raw_parity.py)."""

from __future__ import annotations

import cProfile
import json
import re

import pytest

from project.bench.calls import calls_by_function, per_step
from project.bench.recovery import PHASES
from tests.helpers import run_script


def called(n: int) -> None:
    for _ in range(n):
        len([])


@pytest.mark.quick
def test_calls_per_step_come_from_real_profiles_and_their_difference(tmp_path) -> None:
    dumps = []
    for n in (3, 10):
        profile = cProfile.Profile()
        profile.runcall(called, n)
        profile.dump_stats(tmp_path / f"{n}.pstats")
        dumps.append(calls_by_function(tmp_path / f"{n}.pstats"))
    short, long = dumps
    assert short["~:0(<built-in method builtins.len>)"] == 3
    steps = per_step(short, long, steps=7)
    assert steps["~:0(<built-in method builtins.len>)"] == 1.0
    assert not any(re.search(r" at 0x[0-9a-f]+", k) for k in long)  # same names every process
    with pytest.raises(SystemExit, match="differ by 0 steps"):
        per_step(short, long, steps=0)


@pytest.mark.slow
def test_calls_command_prints_both_trainers_and_lightning_without_its_profiler() -> None:
    proc = run_script("-m project.bench.calls", ["--nproc", "1", "--epochs", "2", "--batches",
                      "1", "3", "trainer.accelerator=cpu"], timeout=400)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = dict(re.findall(r"^\| (lightning|raw) \| 1 \| (\d+) \|$", proc.stdout, re.M))
    assert int(rows["raw"]) > 500, proc.stdout  # forward, backward, optimizer: hundreds
    assert int(rows["lightning"]) > int(rows["raw"]), proc.stdout
    listing = proc.stdout.split("Calls per step Lightning adds most")[1]
    # The template's NoProfiler replaced Lightning's default profiler on every hook call.
    assert "project/engine/lightning/build.py" in listing, listing
    assert "lightning/pytorch/profilers/profiler.py" not in listing, listing


@pytest.mark.quick
def test_draws_command_prints_one_ranks_cost() -> None:
    proc = run_script("-m project.bench.draws", ["--draws", "100000", "--sampler", "random"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = re.search(r"random sampler, 100000 draws, rank 1 of 4: start-up ([\d.]+) s, first "
                     r"10 batches ([\d.]+) s, peak RSS (\d+) MB", proc.stdout)  # fmt: skip
    assert line and int(line[3]) > 0, proc.stdout


def test_lanes_command_prints_mixing_locality_and_the_block_trade_off() -> None:
    """project.bench.lanes on a small synthetic set: the shard-major order against the lanes
    (classes per batch, shards per rank), the layout at W = 64 and 1,000, and the blocks."""
    proc = run_script("-m project.bench.lanes", ["--shards", "2000"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "| 2.06 -> 9.98 (8 lanes)" in out and "| 64 -> 16" in out, out
    assert "W=64: 64 lanes; shards a rank reads 32 " in out, out
    assert "W=1000: 1000 lanes; shards a rank reads 2 " in out, out
    assert "        2000 | 16384 |" in out, out


def test_memory_bench_counts_each_ranks_state_and_fsdp_shards_it() -> None:
    small = ["model.net.n_layer=2", "model.net.d_model=128", "trainer.accelerator=cpu"]
    proc = run_script("-m project.bench.memory", ["--nproc", "1", "2", "--steps", "4", *small],
                      timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 10 and cells[1].isdigit():
            rows[(cells[0], int(cells[1]))] = cells
    assert set(rows) == {("ddp", 1), ("fsdp", 1), ("ddp", 2), ("fsdp", 2)}, proc.stdout
    ddp, fsdp = rows[("ddp", 2)], rows[("fsdp", 2)]
    # DDP keeps the whole state on every rank (the same as one process); FSDP keeps half of the
    # parameters, gradients and AdamW state (padding rounds a shard up by a row at most).
    assert ddp[2:6] == rows[("ddp", 1)][2:6]
    for column in (2, 3, 4):
        assert float(fsdp[column]) == pytest.approx(float(ddp[column]) / 2, rel=0.03), proc.stdout
    assert fsdp[8] == "yes", proc.stdout
    # One unit is one of the two blocks: under half of the network, over a quarter.
    assert float(ddp[2]) / 4 < float(fsdp[7]) < float(ddp[2]) / 2, proc.stdout
    assert float(ddp[9]) > 0 and float(fsdp[9]) > 0


@pytest.mark.slow
@pytest.mark.distributed
def test_recovery_bench_kills_a_node_and_times_the_survivors_return(data_dir, tmp_path) -> None:
    """One drill under DDP: two nodes train, the second is killed, the survivor trains again
    alone to the end; the table has every phase, and the total covers the phases in it."""
    args = ["--repeats", "1", "--strategies", "ddp", "--keep", str(tmp_path),
            f"paths.data_dir={data_dir}"]  # fmt: skip
    proc = run_script("-m project.bench.recovery", args, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {k: float(v) for k, v in re.findall(r"^\| ([a-z ]+) \| ([\d.]+)", proc.stdout, re.M)}
    assert list(rows) == list(PHASES), proc.stdout
    parts = ("failure seen", "rendezvous", "worker start", "checkpoint reload", "first step")
    assert rows["total"] >= sum(rows[p] for p in parts) - 0.05 > 0, rows
    run = tmp_path / "ddp-0" / "logs" / "train" / "runs" / "torchrun-recovery"
    goodput = json.loads((run / "goodput.json").read_text())
    assert [a["how"] for a in goodput["attempts"]] == ["failed", "finished"], goodput
    assert rows["steps again"] == goodput["recomputed_steps"]
