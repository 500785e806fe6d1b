"""Hangs, desyncs and stragglers named on one screen, and what a failure cost (goodput), with
real processes: 2 gloo ranks under torchrun and Lightning's own launcher, both trainers.
The screen's logic and the ledger file are also checked alone (quick tier)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from project.engine.distributed import hangs, worker_stacks
from project.engine.distributed import ledger as ledgers
from project.engine.distributed.exits import EXIT_FAILED, EXIT_HUNG
from project.engine.distributed.stragglers import Stragglers
from project.engine.launch.torchrun import TRAINERS
from project.engine.run import goodput
from tests.helpers import (
    ROOT,
    SLOW_RANK_1,
    assert_rank_1_named_slow,
    finish,
    kill_job,
    launcher,
    read_scalars,
    recorded_data,
    start,
)

ARGS = ["trainer.max_epochs=4", "test=false", "callbacks.early_stopping=null",
        "trainer.accelerator=cpu"]  # fmt: skip
HANG = ["fault_injection.at_step=15", "fault_injection.rank=1", "strategy.step_timeout_s=5"]
JOBS = {  # how a 2-process job is started: torchrun (both trainers), Lightning's own launcher
    **{f"torchrun-{name}": lambda args, m=module: launcher(["-m", m, *args])
       for name, module in TRAINERS.items()},
    "lightning-launcher": lambda args: [sys.executable, str(ROOT / "train.py"), *args,
                                        "trainer.devices=2"],
}  # fmt: skip


def run_job(job: str, args: list[str], run_id: str, timeout: float = 240) -> tuple[int, str, float]:
    began = time.monotonic()
    code, out = finish(start(JOBS[job](args), RUN_ID=run_id), timeout)
    return code, out, time.monotonic() - began


def ended(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str]:
    """(exit code, output) of a job once its launcher exits; the processes it leaves are
    killed, not counted (DataLoader workers: what a report leaves is another test's)."""
    end = time.monotonic() + timeout
    while True:
        try:
            out, _ = proc.communicate(timeout=1)
            return proc.returncode, out
        except subprocess.TimeoutExpired:  # leftover workers keep the output pipe open
            if proc.poll() is not None or time.monotonic() > end:
                kill_job(proc)


def screen(out: str) -> str:
    """The hang report as printed (from its first line to its exit line)."""
    until = r"exit \d+; how to read this: \S+(\n  next: [^\n]*)?"  # its last line, if any
    found = re.search(r"hang report:.*?" + until, out, re.S)
    assert found, out[-3000:]
    return found[0]


@pytest.mark.distributed
@pytest.mark.parametrize("job", list(JOBS))
def test_a_hung_rank_is_named_with_its_frame_and_the_job_ends(base_args, log_dir, job) -> None:
    """Rank 1 stops responding at step 15: within the step timeout (5 s) plus 30 s the job
    ends with exit 124, one screen names rank 1, the collective the others wait in and the
    project frame rank 1 is stuck in; every rank's stacks are in the run folder; no process
    is left (finish() checks)."""
    code, out, _ = run_job(job, [*base_args, *ARGS, *HANG, "fault_injection.mode=hang"], "hang")
    assert code == EXIT_HUNG, out[-3000:]
    report = screen(out)
    assert len(report.splitlines()) <= 30
    # It ends with what to do next: the command that resumes this run, or a longer timeout.
    nxt = re.search(r"next: resume with RUN_ID=hang (.*); steps that are legitimately", out)
    assert nxt and ("project.launcher" in nxt[1] or "train.py" in nxt[1]), out[-3000:]
    rank1 = next(line for line in report.splitlines() if line.strip().startswith("rank 1 "))
    assert "step 15" in rank1 and "faults.py" in rank1 and "maybe_fail" in rank1, report
    waited = re.search(r"rank 1 never issued collective #(\d+) \(all_reduce \[\d+\]\)", report)
    assert waited, report
    run = log_dir / "train/runs/hang"
    assert (run / "hang/report.txt").read_text().strip() == report.strip()
    stacks = (run / "hang/rank-1.txt").read_text()
    assert "maybe_fail" in stacks and f"#{int(waited[1]) - 1}" in stacks
    cost = json.loads((run / "goodput.json").read_text())
    assert cost["attempts"][-1]["how"] == "hung"
    assert 5 <= cost["buckets"]["detection"] < 5 + 30  # the stall until the report, and it
    logged = read_scalars(run / "tensorboard")  # flushed before the process ended
    assert "ranks/busy_ms/rank1" in logged and logged["goodput/detection_s"][-1][1] >= 5


@pytest.mark.distributed
@pytest.mark.parametrize("job", ["torchrun-raw", "lightning-launcher"])
def test_a_desync_names_the_rank_with_the_extra_collective(base_args, log_dir, job) -> None:
    """Rank 1 issues one all-reduce the other rank does not: gloo aborts one side; the screen
    names the collective's sequence number, what each rank issued there and rank 1."""
    args = [*base_args, *ARGS, *HANG, "fault_injection.mode=desync"]
    code, out, _ = run_job(job, args, "desync")
    assert code == EXIT_FAILED, out[-3000:]
    report = screen(out)
    found = re.search(r"collective #(\d+) does not match across ranks", report)
    assert found, report
    assert f"rank 1 issued a collective the others did not (#{found[1]})" in report
    assert "all_reduce" in report and "fault injection" in report


@pytest.mark.distributed
def test_a_slow_rank_is_named_and_a_balanced_run_names_none(base_args, log_dir) -> None:
    """Rank 1's steps take 30 ms longer from step 10: a straggler line names it within 50
    steps and every rank's times reach TensorBoard; the same run without the fault names no
    one. (torchrun, the raw trainer; both trainers share the detection.)"""
    args = [*base_args, *ARGS, "trainer.max_epochs=7"]
    code, out, _ = run_job("torchrun-raw", [*args, *SLOW_RANK_1], "slow")
    assert code == 0, out[-3000:]
    assert_rank_1_named_slow(out, log_dir / "train/runs/slow")
    code, out, _ = run_job("torchrun-raw", args, "balanced")
    assert code == 0, out[-3000:]
    assert "straggler:" not in out
    assert "ranks/busy_ms/rank1" in read_scalars(log_dir / "train/runs/balanced/tensorboard")


@pytest.mark.distributed
@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_goodput_after_a_sigkill_and_one_torchrun_restart(base_args, log_dir, trainer) -> None:
    """A rank SIGKILLed at step 25, checkpoints every 10 steps, torchrun restarts once: the
    resumed attempt trains steps 21-25 again (recomputed_steps 5), the buckets sum to wall_s,
    and wall_s is the job's own duration (less the launcher's start and exit)."""
    args = [*base_args, *ARGS, "fault_injection.at_step=25", "fault_injection.rank=1",
            "callbacks.fault_tolerance.every_n_train_steps=10"]  # fmt: skip
    began = time.monotonic()
    proc = start([str(ROOT / "launch/single_node.sh"), *args], NPROC_PER_NODE="2",
                 MAX_RESTARTS="1", TRAINER=trainer, RUN_ID="restarted")  # fmt: skip
    code, out = finish(proc, 240)
    elapsed = time.monotonic() - began
    assert code == 0 and "esum" in out, out[-3000:]  # "Resumed from" / "resuming from"
    run = log_dir / "train/runs/restarted"  # the restarted group used the same folder
    cost = json.loads((run / "goodput.json").read_text())
    assert cost["recomputed_steps"] == 5, cost
    assert [a["how"] for a in cost["attempts"]] == ["failed", "finished"]
    assert cost["buckets"]["restart"] > 1 and cost["buckets"]["reload"] > 0  # the 2nd start-up
    assert abs(sum(cost["buckets"].values()) - cost["wall_s"]) <= 0.05 * cost["wall_s"]
    assert 0.6 * elapsed < cost["wall_s"] <= elapsed, (cost, elapsed)
    assert cost["buckets"]["recomputed"] > 0 and cost["buckets"]["productive"] > 0
    assert "Goodput:" in out
    logged = read_scalars(run / "tensorboard")
    assert logged["goodput/recomputed_steps"][-1][1] == 5


SHORT = ["trainer.max_epochs=1", "trainer.limit_val_batches=0", "trainer.num_sanity_val_steps=0",
         "test=false", "callbacks.early_stopping=null", "trainer.accelerator=cpu",
         "strategy.step_timeout_s=3"]  # fmt: skip
SLOW_STEPS = {  # every rank's optimizer step takes ~5 s, 3 steps; the step deadline is 3 s
    "lightning-5s-step": ("lightning", ["+callbacks.sleepy._target_=tests.user_model.Sleepy",
                                        "+callbacks.sleepy.seconds=5",
                                        "trainer.limit_train_batches=3"]),
    "lightning-10x0.5s-accumulated": ("lightning", [
        "+callbacks.sleepy._target_=tests.user_model.Sleepy", "+callbacks.sleepy.seconds=0.5",
        "trainer.accumulate_grad_batches=10", "trainer.limit_train_batches=30",
        "data.batch_size=8"]),
    "raw-5s-getitem": ("raw", ["data.batch_size=10", "trainer.limit_train_batches=3"]),
}  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(SLOW_STEPS))
def test_healthy_slow_steps_are_not_reported_as_a_hang(base_args, tmp_path, case) -> None:
    """Steps slower than strategy.step_timeout_s from the first one on: the deadline of the
    second window is already three of the first's (it was the bare 3 s, and every attempt
    died at step 1 with exit 124)."""
    trainer, slow = SLOW_STEPS[case]
    data = recorded_data(tmp_path, 400, "SlowSource", read_s=0.5) if trainer == "raw" else []
    code, out, _ = run_job(f"torchrun-{trainer}", [*base_args, *SHORT, *data, *slow], case)
    assert code == 0, out[-3000:]
    assert "hang report" not in out and "at step 3" in out  # its 3 steps trained


STALL = ["fault_injection.at_step=null", "data.batch_size=10", "trainer.limit_train_batches=30"]


@pytest.mark.distributed
@pytest.mark.parametrize(("job", "workers"), [("torchrun-raw", 0), ("torchrun-lightning", 1)])
def test_a_stuck_loader_is_named_with_the_datasets_frame(base_args, tmp_path, job, workers):
    """Rank 1's dataset never returns its 81st read (step 8): the screen says rank 1 waits
    for data, at the dataset's own frame (in its worker process when it has one), and that
    the others wait for rank 1."""
    data = recorded_data(tmp_path, 400, "SlowSource", stall_at=81, stall_rank=1)
    args = [*base_args, *SHORT, *data, *STALL, f"data.num_workers={workers}"]
    code, out = ended(start(JOBS[job](args), RUN_ID="stuck-loader"), 240)
    assert code == EXIT_HUNG, out[-3000:]
    report = screen(out)
    rank1 = next(line for line in report.splitlines() if line.strip().startswith("rank 1 "))
    assert "waiting for data" in rank1 and "user_data.py" in rank1, report
    assert "__getitem__" in rank1 and ("(worker pid" in rank1) == (workers > 0), report
    assert re.search(r"rank 1 never issued collective #\d+", report), report


@pytest.mark.distributed
def test_a_weights_only_save_is_outside_the_step_deadline(base_args, tmp_path) -> None:
    """ModelCheckpoint(save_weights_only=True) every 4 steps, each save taking rank 0 5 s
    while rank 1 waits in its barrier, step deadline 3 s: Lightning does not tell callbacks
    about such saves, the strategy books them; the run finishes."""
    args = [*base_args, *SHORT, "trainer.limit_train_batches=10",
            "model.net._target_=tests.user_model.SlowToSave", "+model.net.save_s=5",
            "+callbacks.model_checkpoint.save_weights_only=true",
            "+callbacks.model_checkpoint.every_n_train_steps=4",
            "callbacks.model_checkpoint.every_n_epochs=null",
            "callbacks.model_checkpoint.monitor=null"]  # fmt: skip
    code, out, _ = run_job("torchrun-lightning", args, "weights-only")
    assert code == 0, out[-3000:]
    assert "hang report" not in out
    saved = list((tmp_path / "logs/train/runs/weights-only/checkpoints").glob("*.ckpt"))
    assert saved, out[-3000:]


# --- the screen's logic and the ledger, without processes ---------------------------------
def row(rank: int, seq: int, phase: int, step: int, pending: tuple | None, where: str) -> dict:
    collectives = [{"seq": seq - 1, "op": "all_reduce", "sizes": [[8]], "done": True}]
    if pending:
        collectives.append({"seq": seq, "op": pending[0], "sizes": [pending[1]], "done": False})
    return {"rank": rank, "seq": seq, "phase": phase, "step": step, "where": where,
            "collectives": collectives}  # fmt: skip


@pytest.mark.quick
def test_the_screen_names_the_rank_behind_and_a_mismatch(tmp_path: Path) -> None:
    folder = tmp_path / "hang"
    folder.mkdir()
    reports = {
        0: row(0, 75, ledgers.STEP, 15, ("all_reduce", [850]), "trainer.py:298 backward"),
        1: row(1, 74, ledgers.FAULT, 15, None, "faults.py:56 maybe_fail"),
        2: row(2, 75, ledgers.STEP, 15, ("all_reduce", [850]), "trainer.py:298 backward"),
    }
    for r, report in reports.items():  # fmt: skip
        (folder / f"rank-{r}.json").write_text(json.dumps(report))
    lines = hangs.screen(folder, 3, "no progress", EXIT_HUNG)
    text = "\n".join(lines)
    assert "rank 0,2 " in text  # ranks in the same place share a line
    assert "rank 1 never issued collective #75 (all_reduce [850]) that rank 0,2 issued" in text
    reports[1] = row(1, 75, ledgers.FAULT, 15, ("all_reduce", [1]), "faults.py:71 extra")
    (folder / "rank-1.json").write_text(json.dumps(reports[1]))
    text = "\n".join(hangs.screen(folder, 3, "a collective failed", EXIT_FAILED))
    assert "collective #75 does not match across ranks" in text
    assert "rank 1 issued a collective the others did not (#75)" in text  # the minority


@pytest.mark.quick
def test_a_dead_rank_is_read_from_its_ledger_file(tmp_path: Path, monkeypatch) -> None:
    """The ledger file outlives its process: the screen says where a rank that left no
    report was (its step, phase, collectives issued) and that its process is gone."""
    import subprocess

    code = ("from pathlib import Path; from project.engine.distributed import ledger as l; "
            f"g = l.Ledger(Path({str(tmp_path)!r}), 2); g.open(1); g.attach(lambda: 41); "
            "g.mark(l.FAULT, 20); import os; os.kill(os.getpid(), 9)")  # fmt: skip
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == -9
    record = ledgers.read(tmp_path / "ledger/rank-1.bin")
    assert record is not None and record.alive() is False
    assert (record.step, record.phase_name, record.seq) == (20, "fault injection", 41)
    folder = tmp_path / "hang"
    folder.mkdir()
    (folder / "rank-0.json").write_text(
        json.dumps(row(0, 41, ledgers.STEP, 20, ("all_reduce", [850]), "trainer.py:298 backward"))
    )
    text = "\n".join(hangs.screen(folder, 2, "a collective failed", EXIT_FAILED))  # fmt: skip
    assert f"died (pid {record.pid} gone), issued #41" in text, text
    # Titled as what it is, and what comes next: torchrun's restart while it has one.
    assert text.startswith("hang report: rank 1 died: the job failed"), text
    assert text.splitlines()[-1].startswith("  next: resume with RUN_ID="), text
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    text = "\n".join(hangs.screen(folder, 2, "a collective failed", EXIT_FAILED))  # fmt: skip
    assert "next: torchrun restarts the job (restart 2 of 3)" in text.splitlines()[-1], text


@pytest.mark.quick
def test_stragglers_need_patience_and_a_margin() -> None:
    logged: list[dict] = []
    s = Stragglers(0, 3, share=0.2, min_ms=5, patience=3, warn_every_n_steps=100,
                   log_metrics=lambda m, step: logged.append(m))  # fmt: skip
    balanced = [10.0, 5.0, 11.0, 5.0, 10.5, 5.0]  # busy, sync per rank: within the margin
    for step in (10, 20, 30, 40):
        s.judge(balanced, step)
    assert s.named == [] and logged[-1]["ranks/busy_ms/rank2"] == 10.5
    slow = [10.0, 30.0, 40.0, 1.0, 10.5, 30.0]
    s.judge(slow, 50), s.judge(slow, 60)
    assert s.named == []  # two checks in a row: not yet
    s.judge(slow, 70)
    assert s.named == [1] and s.warned_at == 70
    s.judge(slow, 80)
    assert s.warned_at == 70  # at most one line per warn_every_n_steps


@pytest.mark.quick
def test_goodput_counts_gaps_only_between_attempts_of_one_job() -> None:
    def attempt(started: float, ended: float, job: str, reached: int, resumed: int) -> dict:
        buckets = dict.fromkeys(ledgers.BUCKETS, 0.0) | {"productive": ended - started}
        return {"started": started, "ended": ended, "job": job, "how": "failed",
                "buckets": buckets, "reached": reached, "resumed_from": resumed,
                "replay_until": 25 if resumed else 0}  # fmt: skip

    restarted = goodput.summarise([attempt(0, 10, "j", 25, 0), attempt(12, 20, "j", 40, 20)])
    assert restarted["wall_s"] == 20 and restarted["buckets"]["restart"] == 2
    assert restarted["recomputed_steps"] == 5
    rerun = goodput.summarise([attempt(0, 10, "j", 25, 0), attempt(1000, 1008, "k", 40, 20)])
    assert rerun["wall_s"] == 18  # a rerun days later: the gap is not the job's


@pytest.mark.quick
def test_the_step_deadline_waits_for_three_of_the_slowest_recent_steps(monkeypatch) -> None:
    """A model whose steps take longer than strategy.step_timeout_s is not reported as hung:
    the ledger measures its windows (validation between two is not one), and the deadline,
    with the collective timeout 30 s behind it, grows to three of the slowest."""
    from project.engine.distributed import ddp

    ledger = ledgers.Ledger(None, 2)
    for step in range(3):
        ledger.window_start()
        ledger.mark(ledgers.STEP, step)
        time.sleep(0.04)
        ledger.mark(ledgers.OPTIMIZER, step)
    ledger.window_start()
    assert 0.04 <= ledger.window_s < 1.0  # bounds a loaded 2-core machine keeps
    ledger.mark(ledgers.VALIDATION, 3)
    time.sleep(1.0)
    ledger.window_start()
    assert ledger.window_s < 1.0  # the validation was not counted as a step
    set_to: list[float] = []
    monkeypatch.setattr(ddp, "set_collective_timeout", lambda t: set_to.append(t.seconds))
    timeouts = ddp.CollectiveTimeout(5, None, world_size=2)
    timeouts.in_steps(3 * ledger.window_s), timeouts.in_steps(3 * ledger.window_s)
    assert timeouts.deadline() == 5 and set_to == [35]
    timeouts.in_steps(3 * 20.0)  # steps of 20 s
    assert timeouts.deadline() == 60 and set_to == [35, 90]
    timeouts.in_steps(3 * 20.5)  # within 10 %: not set again
    assert set_to == [35, 90]


@pytest.mark.quick
def test_an_attempt_killed_before_it_could_close_is_added_by_the_next(tmp_path: Path) -> None:
    """Rank 0 SIGKILLed at step 25 leaves only its ledger file: the next attempt adds that
    attempt (up to its last mark), books its own start-up as the restart's and the steps
    up to 25 it trains again as recomputed."""
    import subprocess

    code = (
        "from pathlib import Path; from project.engine.distributed import ledger as l; "
        f"g = l.Ledger(Path({str(tmp_path)!r}), 2); g.open(0); "
        "g.mark(l.STEP, 24); g.mark(l.FAULT, 25); import os; os.kill(os.getpid(), 9)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == -9  # fmt: skip
    ledger = ledgers.Ledger(tmp_path, 2)
    ledger.mark(ledgers.RELOAD, 0)
    goodput.begin(ledger, resumed_from=20)
    assert (ledger.replay_until, ledger.resumed_after_failure) == (25, True)
    assert ledger.buckets[ledgers.BUCKETS.index("startup")] == 0  # rebooked as the restart's
    ledger.open(0)
    for step in range(20, 30):
        ledger.mark(ledgers.STEP, step)
        time.sleep(0.01)
    summary = goodput.close(ledger, ledgers.ENDED_OK)
    assert summary is not None and summary["attempts"] == 2
    assert summary["recomputed_steps"] == 5 and summary["buckets"]["recomputed"] > 0
    kept = json.loads((tmp_path / goodput.FILE).read_text())
    assert [a["how"] for a in kept["attempts"]] == ["killed", "finished"]
    assert goodput.close(ledger, ledgers.ENDED_OK) is None  # once


@pytest.mark.quick
def test_the_ledger_does_not_keep_the_process_group_alive() -> None:
    """The ledger counts collectives with the group's sequence number but holds the group
    weakly: a group outliving destroy_process_group is freed at interpreter shutdown, where
    gloo's threads abort the process (a finished or stopped run then exits -6, not 0 or 143)."""
    import gc
    import weakref

    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_group

    from project.engine.private_api import collective_counter

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ledger = ledgers.Ledger(None, 1)
        ledger.attach(collective_counter())
        dist.all_reduce(torch.ones(1)), dist.all_reduce(torch.ones(1))
        assert ledger.seq() == 2
        group = weakref.ref(_get_default_group())
    finally:
        dist.destroy_process_group()
    gc.collect()
    assert group() is None, "something still holds the destroyed process group"
    assert ledger.seq() == 2  # the last count, kept for a report after the group is gone


@pytest.mark.quick
def test_flight_recorder_is_on_unless_the_user_set_it() -> None:
    env: dict[str, str] = {}
    ledgers.flight_recorder_env(env)
    assert env == {
        "TORCH_FR_BUFFER_SIZE": str(ledgers.FR_BUFFER),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }
    for own in ({"TORCH_FR_BUFFER_SIZE": "0"}, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}):
        env = dict(own)
        ledgers.flight_recorder_env(env)
        assert env == {**own, "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}  # theirs, under either name


@pytest.mark.quick
def test_ranks_in_no_collective_are_busy_in_their_code_not_a_stalled_transport(tmp_path) -> None:
    """Every rank passed the same collectives and waits in none (slow steps, a stuck loader on
    every rank): the screen says so and points at their frames, not at the network."""
    folder = tmp_path / "hang"
    folder.mkdir()
    reports = {0: row(0, 30, ledgers.STEP, 4, None, "model.py:12 forward"),
               1: row(1, 30, ledgers.DATA, 4, None, "data.py:40 __getitem__")}  # fmt: skip
    for r, report in reports.items():
        (folder / f"rank-{r}.json").write_text(json.dumps(report))
    text = "\n".join(hangs.screen(folder, 2, "no progress", EXIT_HUNG))
    assert "no rank is in a collective: the ranks are busy in their own code" in text, text
    assert "rank 1 waits for its data loader" in text and "waiting for data" in text
    assert "the transport stalled" not in text and "does not match" not in text


@pytest.mark.quick
def test_the_dataset_frame_is_taken_from_the_workers_loop_thread() -> None:
    """faulthandler dumps a worker's other threads first; one may run project code too (a
    prefetch thread): the frame named is the one under the DataLoader worker's loop."""
    loop = "/venv/lib/python3.11/site-packages/torch/utils/data/_utils/worker.py"
    dump = (
        "Thread 0x01 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 327 in wait\n'
        f'  File "{ROOT}/src/project/data/remote/prefetch.py", line 40 in run\n\n'
        "Current thread 0x02 (most recent call first):\n"
        f'  File "{ROOT}/tests/user_data.py", line 81 in __getitem__\n'
        f'  File "{loop}", line 349 in _worker_loop\n'
    )
    assert worker_stacks.innermost(dump) == "tests/user_data.py:81 __getitem__"
    head = dump[: dump.index("Current thread")]  # read before the loop's thread was written
    assert "user_data.py" not in (worker_stacks.innermost(head) or "")  # the wrong thread
    assert worker_stacks.WORKER_LOOP not in head  # so collect() waits for the rest


# Run in a process of its own: a fork server already started by this pytest process (another
# test's DataLoader workers) would ignore the preload, and the worker could not dump.
WORKER_STACKS = """
import multiprocessing
from project.engine.distributed import worker_stacks
from tests.helpers import block_forever
context = multiprocessing.get_context("forkserver")
context.set_forkserver_preload(["project.engine.distributed.worker_stacks", "tests.helpers"])
worker = context.Process(target=block_forever)
worker.start()
try:
    for _ in range(100):  # until it runs the target (it imports first)
        dumps = worker_stacks.collect(seconds=0.5)
        if any("block_forever" in text for text in dumps.values()):
            break
    print(worker_stacks.innermost(dumps[worker.pid]) if worker.pid in dumps else dumps)
finally:
    worker.kill()
    worker.join()
"""


def test_a_workers_stack_is_read_from_outside() -> None:
    """A process forked from a fork server that loaded worker_stacks (as every DataLoader
    worker of the template is) dumps its stacks on request: the innermost user frame."""
    proc = subprocess.run([sys.executable, "-c", WORKER_STACKS], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    innermost = proc.stdout.strip().splitlines()[-1]
    assert innermost.startswith("tests/helpers.py:") and innermost.endswith(" block_forever")


def watched(monkeypatch) -> tuple[ledgers.Ledger, object]:
    """A ledger and timeouts of 2 ranks inside the training steps (the short 3 s deadline),
    watched by long_work as a trainer's would be."""
    import types

    from project.engine.distributed import ddp
    from project.engine.run import long_work

    monkeypatch.setattr(ddp, "set_collective_timeout", lambda timeout: None)
    monkeypatch.setattr(long_work, "_watched", None)  # unwatched again after the test
    ledger, timeouts = ledgers.Ledger(None, 2), ddp.CollectiveTimeout(3, None, world_size=2)
    timeouts.in_steps(), timeouts.in_steps()
    ledger.mark(ledgers.STEP, 5)
    long_work.watch(ledger, timeouts, types.SimpleNamespace(stragglers=None))
    assert timeouts.deadline() == 3
    return ledger, timeouts


def test_a_recompile_inside_the_steps_is_outside_the_step_deadline(monkeypatch) -> None:
    """torch.compile compiling in a step (the first call, then a new shape) runs on the long
    deadline, booked as compiling; the short one returns at the second window after."""
    import torch
    import torch._dynamo

    ledger, timeouts = watched(monkeypatch)
    from project.engine.run import long_work

    long_work.follow_compiles()
    seen = []

    def backend(graph, inputs):  # runs while dynamo compiles
        seen.append((ledger.phase, timeouts.deadline()))
        return graph.forward

    double = torch.compile(lambda x: x * 2 + 1, backend=backend, dynamic=False)
    assert double(torch.ones(3)).tolist() == [3.0] * 3
    assert ledger.phase == ledgers.STEP and timeouts.deadline() == 600
    timeouts.in_steps(), timeouts.in_steps()
    assert timeouts.deadline() == 3
    double(torch.ones(4))  # another shape: a recompile
    assert seen == [(ledgers.COMPILE, 600)] * 2
    assert ledger.buckets[ledgers.BUCKETS.index("other")] > 0


class Downloading:
    """A dataset whose reads each download for 3 s first (a lazy shard copy in a worker)."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> int:
        from project.engine.run import long_work

        with long_work.during(ledgers.DOWNLOAD):
            time.sleep(3)
        return i


def test_a_download_in_a_worker_puts_its_rank_on_the_long_deadline(monkeypatch) -> None:
    """A DataLoader worker downloading while its rank waits for the batch: after a second of
    waiting the rank's watchdog reads the worker's note and moves the rank to the long
    deadline, booked as downloading; the note is gone once the download ended."""
    from torch.utils.data import DataLoader

    from project.engine.run import long_work

    ledger, timeouts = watched(monkeypatch)
    loader = DataLoader(Downloading(), batch_size=None, num_workers=1,
                        multiprocessing_context="fork")  # fmt: skip
    batches = iter(loader)
    ledger.mark(ledgers.DATA, 5)

    def excused() -> bool:
        long_work.excuse_workers(ledger)
        return timeouts.deadline() == 600

    assert hangs.wait_for(excused, 10) and ledger.phase == ledgers.DOWNLOAD
    assert next(batches) == 0 and next(batches) == 1
    assert long_work.in_workers() is None  # both downloads are over


@pytest.mark.quick
def test_a_lazy_shard_download_is_outside_the_step_deadline(tmp_path, monkeypatch) -> None:
    """A remote shard copied into the rank's cache while it trains: on the long deadline,
    booked as downloading; then back in the step it was in."""
    import numpy as np

    import project.engine.data.loaders  # noqa: F401  (what every rank imports: it books downloads)
    from project.data.shards import ShardCache, load_shard, read_index, write_shards

    ledger, timeouts = watched(monkeypatch)
    write_shards(tmp_path / "remote", [np.arange(10)], [10])
    seen = []

    class Watching(ShardCache):
        def fetch(self, url: str, local: str) -> None:
            seen.append((ledger.phase, timeouts.deadline()))
            super().fetch(url, local)

    url = f"file://{tmp_path}/remote"
    shard = load_shard(url, read_index(url)["shards"][0], Watching(tmp_path / "cache"))
    assert shard.tolist() == list(range(10)) and seen == [(ledgers.DOWNLOAD, 600)]
    assert ledger.phase == ledgers.STEP
