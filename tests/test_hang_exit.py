"""A hang report ends the job and leaves nothing behind, with real processes: 2 gloo ranks
under torchrun and Lightning's own launcher. No DataLoader worker or fork server outlives
its rank (also across a torchrun restart); a rank stuck in C code holding Python's lock is
ended anyway; a collective's failure is told from a user's own timeout; a Flight Recorder
whose layout changed still leaves a report."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from torch.utils.data import Dataset

from project.engine.distributed import hangs
from project.engine.distributed import ledger as ledgers
from project.engine.distributed.exits import EXIT_FAILED, EXIT_HUNG
from tests.helpers import ROOT, finish, job_processes, launcher, running, start

ARGS = ["trainer.max_epochs=4", "test=false", "callbacks.early_stopping=null",
        "trainer.accelerator=cpu"]  # fmt: skip
HANG = ["fault_injection.at_step=15", "fault_injection.rank=1", "strategy.step_timeout_s=5",
        "fault_injection.mode=hang"]  # fmt: skip
WORKERS = ["data.num_workers=1"]  # a fork server and a worker per rank


def lightning_launcher(args: list[str]) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), *args, "trainer.devices=2"]


def fork_servers(proc: subprocess.Popen[str]) -> int:
    """How many fork servers of `proc`'s job run now (one per rank while it has workers): a
    worker shows the command line of the server it was forked from, but its parent is one."""
    servers = {pid for pid, cmd in job_processes(proc).items() if "forkserver" in cmd}
    return sum(parent(pid) not in servers for pid in servers)


def parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


@pytest.mark.distributed
@pytest.mark.parametrize("job", ["torchrun", "lightning-launcher"])
def test_a_hang_report_leaves_no_worker_or_fork_server(base_args, job) -> None:
    """The hang drill with a DataLoader worker per rank: the job ends with exit 124 and no
    process of it is left (finish() fails the test on any: the fork server and workers of a
    rank that ended with os._exit used to stay, adopted by init)."""
    args = [*base_args, *ARGS, *HANG, *WORKERS]
    torchrun = launcher(["-m", "project.train", *args])
    cmd = torchrun if job == "torchrun" else lightning_launcher(args)
    code, out = finish(start(cmd, RUN_ID=f"hang-{job}"), 240)
    assert code == EXIT_HUNG, out[-3000:]
    assert "hang report:" in out


@pytest.mark.distributed
def test_no_set_of_workers_accumulates_across_torchrun_restarts(base_args) -> None:
    """The hang drill under launch/single_node.sh with MAX_RESTARTS=1 (the raw trainer):
    the first attempt hangs and is reported, the second trains to the end. At no moment do
    more fork servers run than ranks (each restart used to add a set), and none is left."""
    args = [*base_args, *ARGS, *HANG, *WORKERS]
    proc = start([str(ROOT / "launch/single_node.sh"), *args], NPROC_PER_NODE="2",
                 MAX_RESTARTS="1", TRAINER="raw", RUN_ID="hang-restart")  # fmt: skip
    most, done = [0], threading.Event()

    def count() -> None:
        while not done.wait(0.5):
            most[0] = max(most[0], fork_servers(proc))

    counter = threading.Thread(target=count, daemon=True)
    counter.start()
    try:
        code, out = finish(proc, 280)
    finally:
        done.set()
        counter.join()
    assert code == 0 and "hang report:" in out, out[-3000:]
    assert 1 <= most[0] <= 2, most[0]


ORPHANS = """
import multiprocessing.forkserver, os, sys, time
from pathlib import Path
from torch.utils.data import DataLoader
from project.engine.data.worker_start import configure_worker_start
from tests.helpers import StuckReads
method, folder = sys.argv[1], Path(sys.argv[2])
configure_worker_start(method, {"num_workers": 1}, "project.engine.data.loaders")
batches = iter(DataLoader(StuckReads(str(folder)), num_workers=1))
while not list(folder.glob("worker-*")):
    time.sleep(0.05)
(folder / f"server-{multiprocessing.forkserver._forkserver._forkserver_pid}").touch()
os._exit(0)  # as a hang report ends a rank: no loader shut down
"""


@pytest.mark.parametrize("method", ["forkserver", "fork"])
def test_a_ranks_worker_stuck_in_the_dataset_ends_with_it(tmp_path, method) -> None:
    """A rank that ends with os._exit while its worker is inside the dataset's code: the
    worker (and the fork server) are gone within 3 s. (torch's worker only checks its
    parent between reads; the fork server stayed while any worker held its pipe.)"""
    err = tmp_path / "stderr"  # not a pipe: a process left behind would hold it open
    with err.open("w") as to:
        done = subprocess.run([sys.executable, "-c", ORPHANS, method, str(tmp_path)], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=to, timeout=120)  # fmt: skip
    assert done.returncode == 0, err.read_text()[-3000:]
    pids = [int(p.name.split("-")[1]) for p in tmp_path.iterdir() if p.name[-1].isdigit()]
    assert len(pids) == (2 if method == "forkserver" else 1), pids
    deadline = time.monotonic() + 3
    while (left := [pid for pid in pids if running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:  # not to leave them behind when this fails
        os.kill(pid, signal.SIGKILL)
    assert not left, f"{left} of {pids} outlived their rank"


# --- a rank stuck in C code holding Python's lock (GIL) -----------------------------------
STUCK = ["fault_injection.at_step=15", "strategy.step_timeout_s=5", "fault_injection.mode=gil"]
STUCK_JOBS = {  # (how the job starts, which rank is stuck): both trainers, both launchers
    "lightning-launcher-rank0": (lightning_launcher, 0),
    "lightning-launcher-rank1": (lightning_launcher, 1),
    "torchrun-raw-rank0": (lambda args: launcher(["-m", "project.raw_train", *args]), 0),
    "torchrun-rank1": (lambda args: launcher(["-m", "project.train", *args]), 1),
}


@pytest.mark.distributed
@pytest.mark.parametrize("job", list(STUCK_JOBS))
def test_a_rank_stuck_holding_the_gil_is_ended_and_its_frame_named(base_args, log_dir, job):
    """A rank stuck in C code that holds the GIL (ctypes.PyDLL's sleep, at step 15) cannot
    report, nor run a signal handler: its watchdog thread never runs again. The job still
    ends within the deadline (5 s) + 60 s of its last mark, a peer's screen names the stuck
    rank with the frame it is stuck in (from the stacks its end left), and no process is
    left. (Under Lightning's launcher with rank 0 stuck, the job's process itself, nothing
    used to end it.)"""
    command, rank = STUCK_JOBS[job]
    args = [*base_args, *ARGS, *STUCK, f"fault_injection.rank={rank}"]
    code, out = finish(start(command(args), RUN_ID=job), 240)
    ended = time.time()
    assert code in (EXIT_HUNG, EXIT_FAILED), out[-3000:]
    record = ledgers.read(log_dir / f"train/runs/{job}/ledger/rank-{rank}.bin")
    assert record is not None and record.phase_name == "fault injection", out[-3000:]
    assert ended - record.at < 5 + 60, (ended - record.at, out[-3000:])
    report = re.search(r"hang report:.*?exit \d+; how to read this: \S+", out, re.S)
    assert report, out[-3000:]
    stuck = next(line for line in report[0].splitlines() if line.startswith(f"  rank {rank} "))
    assert "faults.py" in stuck and "maybe_fail" in stuck, report[0]
    assert f"rank {rank} never issued collective" in report[0], report[0]


# --- what counts as a dead peer -------------------------------------------------------------
class Slow(Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> int:
        time.sleep(1)
        return i


def gloo_error(timeout_s: float, peer_leaves: bool) -> RuntimeError:
    """The RuntimeError gloo raises on rank 0 of a real 2-rank group (two threads of this
    process) whose rank 1 never joins an all-reduce (a timeout) or goes away (closed)."""
    import datetime
    import gc

    import torch
    import torch.distributed as dist

    store, groups = dist.HashStore(), [None, None]

    def make(r: int) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        groups[r] = dist.ProcessGroupGloo(dist.PrefixStore("t", store), r, 2, timeout)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    [t.start() for t in threads], [t.join() for t in threads]
    work = groups[0].allreduce([torch.ones(3)])
    if peer_leaves:
        groups[1] = None
        gc.collect()
    with pytest.raises(RuntimeError) as caught:
        work.wait()
    return caught.value


@pytest.mark.quick
def test_only_a_collectives_failure_is_taken_for_a_dead_peer() -> None:
    """gloo's collective timeout and a closed connection are a peer's failure; a user's own
    DataLoader(timeout=...) is not (it used to be: any "timed out" was)."""
    from torch.utils.data import DataLoader

    with pytest.raises(RuntimeError) as user:  # fork: no gloo thread runs in this process yet
        next(iter(DataLoader(Slow(), num_workers=1, timeout=0.2, multiprocessing_context="fork")))
    assert "timed out" in str(user.value)
    assert not hangs.is_peer_failure(user.value)
    assert not hangs.is_peer_failure(RuntimeError("the shard download timed out"))
    timed_out, closed = gloo_error(0.3, peer_leaves=False), gloo_error(30, peer_leaves=True)
    # the peer's socket reads "closed by peer" or "Connection reset by peer", as the race goes
    assert "Timed out waiting" in str(timed_out) and "by peer" in str(closed), str(closed)
    assert hangs.is_peer_failure(timed_out) and hangs.is_peer_failure(closed)
    import torch.distributed as dist  # the store's and the network's own error types

    assert hangs.is_peer_failure(dist.DistNetworkError("connect() to rank 0's store failed"))
    assert hangs.is_peer_failure(dist.DistStoreError("wait timeout after 300000ms"))


# --- a Flight Recorder whose layout changed -----------------------------------------------
CHANGED_LAYOUT = """
import sys, time
from pathlib import Path
import torch, torch.distributed as dist
from project.engine.distributed import hangs, ledger as ledgers
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
dist.all_reduce(torch.ones(1))
renamed = [{"seq": 1, "name": "gloo:all_reduce", "sizes": [[1]], "completed": True,
            "pg": ["0", "default_pg"]}]  # the fields, under other names
hangs.flight_recorder = lambda: renamed
ledger = ledgers.Ledger(Path(sys.argv[1]), 1)
ledger.open(0)
ledger.mark(ledgers.STEP, 7)
hangs.Watchdog(ledger, lambda: 0.5, Path(sys.argv[1])).start()
time.sleep(30)  # the watchdog thread reports and ends the process
"""


def test_a_changed_flight_recorder_layout_leaves_a_report_from_the_ledger(tmp_path) -> None:
    """Flight Recorder entries whose fields were renamed (torch is rewriting it for gloo):
    the watchdog thread still writes the report (it used to die on a KeyError, and the rank
    with it never reported), from the ledger alone: step, phase, collectives issued."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", CHANGED_LAYOUT, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == EXIT_HUNG, done.stderr[-3000:]
    report = (tmp_path / "hang/report.txt").read_text()
    assert "rank 0  step 7" in report and "issued #1" in report, report
    assert "collectives unknown" in report, report
    own = json.loads((tmp_path / "hang/rank-0.json").read_text())
    assert own["collectives"] is None and own["seq"] == 1
