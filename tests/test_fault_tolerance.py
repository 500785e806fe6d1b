"""Fault tolerance with real processes and real signals: exact resume after a preemption or a
killed rank, torchrun restarts, no hangs, atomic checkpoints. CPU, gloo."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from project.engine.distributed.exits import EXIT_PREEMPTED
from project.engine.distributed.signals import STOP_SIGNALS
from project.engine.launch.torchrun import TRAINERS
from tests.helpers import (
    CHARLM,
    ROOT,
    assert_groups_closed,
    assert_same_weights,
    child_env,
    exit_check_env,
    finish,
    start,
)

# The CNN has dropout, so exact resume also needs the RNG states back.
ARGS = ["model=cnn", "trainer.max_epochs=4", "test=false", "callbacks.early_stopping=null"]


def python_run(module: str, args: list[str], run_id: str, timeout: float = 180) -> tuple[int, str]:
    return finish(start([sys.executable, "-m", module, *args], RUN_ID=run_id), timeout)


def python_runs(*runs: tuple[str, list[str], str], timeout: float = 240) -> list[tuple[int, str]]:
    """Several 1-process runs (module, args, run id) at once: each uses one core of two, so the
    uninterrupted reference costs no extra wall time beside the run it is compared with."""
    procs = [start([sys.executable, "-m", m, *args], RUN_ID=run_id) for m, args, run_id in runs]
    return [finish(proc, timeout) for proc in procs]


def torchrun(args: list[str], run_id: str | None = None, **env: str) -> tuple[int, str]:
    env = {"NPROC_PER_NODE": "2", **env, **({"RUN_ID": run_id} if run_id else {})}
    return finish(start([str(ROOT / "launch" / "single_node.sh"), *args], **env), 240)


# The signal tests signal after the first epoch's checkpoint: 16 epochs of 10 steps leave
# ~1 s of training after it on a fast day (8 epochs did not always outlast the polling).
LONG = ["trainer.max_epochs=16", "test=false", "callbacks.early_stopping=null"]

# How long a signalled torchrun job may take to end: torchrun gives each worker 30 s after its
# SIGTERM, then 30 s after a SIGKILL, before it gives up on it (a worker stalled on a slow
# disk once took all 60 s), plus the stop itself.
STOP_TIMEOUT_S = 150

# The language model, cut to 20 steps per epoch like digits (the step numbers below hold).
CHARLM = [*CHARLM[:1], "trainer.max_epochs=4", "trainer.limit_train_batches=20", *CHARLM[3:],
          "test=false", "callbacks.early_stopping=null"]  # fmt: skip


BOTH = tuple(TRAINERS.values())  # every trainer's module


@pytest.mark.parametrize(
    "modules, accumulate, task",
    [
        pytest.param(("project.train",), 1, "digits", marks=pytest.mark.quick, id="train-digits"),
        pytest.param(("project.raw_train",), 1, "digits", id="raw-digits"),  # feature:raw
        pytest.param(BOTH, 1, "charlm", id="both-charlm"),
        pytest.param(BOTH, 1, "digits-2-workers", id="both-digits-2-workers"),
        pytest.param(BOTH, 1, "digits-no-fault-tolerance", id="both-digits-no-fault-tolerance"),
        pytest.param(BOTH, 4, "digits", marks=pytest.mark.slow, id="both-digits-accumulate4"),
    ],
)
def test_preempted_mid_epoch_then_rerun_matches_uninterrupted(
    base_args, log_dir, modules, accumulate, task
) -> None:
    """Each trainer is stopped mid-epoch and rerun; its final weights must be those of one
    uninterrupted run (one reference serves both trainers: their weights are bitwise equal).
    Without callbacks.fault_tolerance a stop still saves what the rerun resumes from (it once
    said "run the same command again to resume" and the rerun started from scratch)."""
    args = [*base_args, *(CHARLM if task == "charlm" else ARGS),
            f"trainer.accumulate_grad_batches={accumulate}"]  # fmt: skip
    if task == "digits-2-workers":  # the workers copy the order when the first iterator starts
        args.append("data.num_workers=2")
    reruns = [*args, "callbacks.fault_tolerance=null"] if "no-fault" in task else args
    if accumulate > 1:  # checks every 2 windows = 8 batches: a stop never splits a window
        args.append("callbacks.fault_tolerance.check_every_n_steps=2")
    # SIGTERM at step 25 (accumulate 4: step 7, batch 8 of epoch 1): every rank stops at the
    # next check (mid-epoch, at a window start), saves last.ckpt and exits with the code.
    at_step, stop_step, skipped = (25, 29, 9) if accumulate == 1 else (7, 7, 8)
    cut = [*reruns, f"fault_injection.at_step={at_step}", "fault_injection.mode=sigterm"]
    whole, *cuts = python_runs((modules[0], args, "whole"), *((m, cut, m) for m in modules))
    assert whole[0] == 0, whole[1][-3000:]
    for code, out in cuts:
        assert code == EXIT_PREEMPTED, out[-3000:]
        assert f"Stopped by a signal at step {stop_step}" in out
    # The same command again (same run folder) resumes mid-epoch and ends identical.
    for code, out in python_runs(*((m, reruns, m) for m in modules)):
        assert code == 0, out[-3000:]
        assert "skipping" in out and f"{skipped} batches" in out
    for module in modules:
        assert_same_weights(log_dir / "train/runs/whole", log_dir / "train/runs" / module)
    if reruns is not args:  # its last checkpoint says it finished: a third run trains nothing
        for code, out in python_runs(*((m, reruns, m) for m in modules)):
            assert code == 0 and "This run already finished" in out, out[-3000:]


def test_step_cadence_checkpoint_then_sigkill_resumes_exactly(base_args, log_dir) -> None:
    args = [*base_args, *ARGS, "callbacks.fault_tolerance.every_n_train_steps=7"]
    killed = [*args, "fault_injection.at_step=17"]
    (code, out), (killed_code, killed_out) = python_runs(
        ("project.train", args, "whole"), ("project.train", killed, "killed")
    )
    assert code == 0, out[-3000:]
    code, out = killed_code, killed_out
    assert code == -signal.SIGKILL, out[-3000:]  # no chance to save: last.ckpt is from step 14
    state = torch.load(log_dir / "train/runs/killed/checkpoints/last.ckpt", weights_only=True)
    assert state["global_step"] == 14
    code, out = python_run("project.train", args, "killed")
    assert code == 0 and "resuming from" in out, out[-3000:]
    assert_same_weights(log_dir / "train/runs/whole", log_dir / "train/runs/killed")


# strategy=fsdp's drill: 2 batches a step (5 steps an epoch on 2 processes) and its sharded
# `last` every 3 steps, so a kill at step 13 resumes mid-epoch from step 12.
FSDP_DRILL = ["strategy=fsdp", "callbacks.model_checkpoint=null",
              "trainer.accumulate_grad_batches=2",
              "callbacks.fault_tolerance.every_n_train_steps=3"]  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize(("drill", "at_step"), [([], 25), (FSDP_DRILL, 13)], ids=["ddp", "fsdp"])
def test_torchrun_restart_after_sigkill_matches_uninterrupted(
    base_args, log_dir, drill, at_step
) -> None:
    """Both trainers: a killed rank, torchrun restarts the group, it resumes, and the final
    weights are those of one uninterrupted run (the trainers' weights are bitwise equal).
    Under strategy=fsdp from the sharded `last`, mid-epoch, accumulating."""
    args, runs = [*base_args, *ARGS, *drill], log_dir / "train/runs"
    code, out = torchrun(args, run_id="whole")
    assert code == 0, out[-3000:]
    for trainer in TRAINERS:
        before = set(runs.iterdir())
        kill = [f"fault_injection.at_step={at_step}", "fault_injection.rank=1"]
        code, out = torchrun([*args, *kill], MAX_RESTARTS="1", TRAINER=trainer)
        assert code == 0, out[-4000:]
        assert f"fault injection: sigkill on rank 1 at step {at_step}" in out
        assert "esum" in out  # "resuming from" / "Resumed from"
        if drill:  # the sharded save of step 12, not a fresh start (which would end alike too)
            assert re.search(r"esum\w* from \S+-step12\b", out), out[-4000:]
        (restarted,) = set(runs.iterdir()) - before  # the restarted group used the same folder
        assert restarted.name.startswith("torchrun-")
        assert_same_weights(runs / "whole", restarted)


@pytest.mark.distributed
def test_sigterm_to_torchrun_agent_stops_saves_and_rerun_resumes(base_args, log_dir) -> None:
    args = [*base_args, *LONG]
    code, out = torchrun(args, run_id="whole")
    assert code == 0, out[-3000:]
    # No RUN_ID: the run is named by torchrun; the stop prints the command that resumes it.
    proc = start([str(ROOT / "launch" / "single_node.sh"), *args], NPROC_PER_NODE="2")
    deadline = time.monotonic() + 120
    while not (saved := list((log_dir / "train/runs").glob("torchrun-*/checkpoints/last.ckpt"))):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    time.sleep(0.15)  # into the next epoch
    proc.send_signal(signal.SIGTERM)  # the launch script passes it to torchrun's agent
    code, out = finish(proc, STOP_TIMEOUT_S)
    assert code == EXIT_PREEMPTED, out[-3000:]
    assert out.count("SIGTERM received") == 2  # both ranks agreed to stop...
    assert out.count("Stopped by a signal") == 1 and "Saved" in out  # ...and rank 0 saved
    stopped_at = torch.load(saved[0], weights_only=True)["global_step"]
    assert 10 <= stopped_at < 160
    # The worker's stop line and the launcher's give the same command, which resumes the run.
    said = re.findall(r"(?i)resume with: (RUN_ID=\S+ .*?)   \(exit 143\)", out)
    assert len(said) == 2 and said[0] == said[1], out[-3000:]
    assert said[0].startswith(f"RUN_ID={saved[0].parents[1].name} NPROC_PER_NODE=2 ")
    rerun = subprocess.run(
        ["bash", "-c", said[0]], cwd=ROOT, env=child_env(), text=True, timeout=240,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    assert rerun.returncode == 0 and "resuming from" in rerun.stdout, rerun.stdout[-3000:]
    assert_same_weights(log_dir / "train/runs/whole", saved[0].parents[1])


@pytest.mark.distributed
@pytest.mark.parametrize("launcher", ["torchrun", "lightning"])
def test_killed_rank_without_restarts_ends_the_job(base_args, launcher) -> None:
    args = [*base_args, *ARGS, "fault_injection.at_step=15", "fault_injection.rank=1"]
    began = time.monotonic()
    if launcher == "torchrun":
        code, out = torchrun(args)  # finish() also asserts that no process is left
    else:  # Lightning's own launcher: rank 0 is this process, rank 1 its child
        cmd = [sys.executable, str(ROOT / "train.py"), *args, "trainer.accelerator=cpu",
               "trainer.devices=2"]  # fmt: skip
        code, out = finish(start(cmd), 120)
    assert code != 0
    assert time.monotonic() - began < 90  # well inside strategy.timeout (600 s): no hang
    if launcher == "lightning":  # rank 0 survives its peer: the report names the dead rank
        assert "hang report: rank 1 died: the job failed" in out and "died (pid" in out, out[-3000:]


def test_killed_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path) -> None:
    """A real SIGKILL in the middle of writing last.ckpt through AtomicCheckpointIO."""
    path = tmp_path / "last.ckpt"
    script = textwrap.dedent(f"""
        import os, signal, torch
        from project.engine.lightning.callbacks import AtomicCheckpointIO
        io = AtomicCheckpointIO()
        io.save_checkpoint({{"step": 1, "w": torch.ones(1000)}}, {str(path)!r})
        real_save = torch.save
        def dying_save(obj, f, *a, **k):
            f.write(b"PK\\x03\\x04 half a checkpoint")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        torch.save = dying_save
        io.save_checkpoint({{"step": 2, "w": torch.zeros(1000)}}, {str(path)!r})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["step"] == 1 and torch.equal(ckpt["w"], torch.ones(1000))


def test_fault_injection_exception_mode(base_args) -> None:
    cmd = [sys.executable, str(ROOT / "train.py"), *base_args, "trainer.max_epochs=1",
           "fault_injection.at_step=3", "fault_injection.mode=exception"]  # fmt: skip
    code, out = finish(start(cmd), 120)
    assert code != 0 and "InjectedFault: fault injection: exception on rank 0 at step 3" in out


def sigterm_mid_run(
    proc_env: dict[str, str], args: list[str], target: str, signum: int, log_dir: Path
) -> tuple[int, str]:
    """Start the 2-process launch script, wait for its first checkpoint, then signal: the whole
    process group (a terminal's Ctrl-C), the script, or the launcher (torchrun) process."""
    proc = start([str(ROOT / "launch" / "single_node.sh"), *args], **proc_env)
    first = log_dir / "train/runs" / proc_env["RUN_ID"] / "checkpoints/last.ckpt"
    deadline = time.monotonic() + 120
    while not first.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(0.15)  # into the next epoch
    if target == "group":
        os.killpg(proc.pid, signum)
    elif target == "script":
        proc.send_signal(signum)
    else:
        launcher = subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "project.launcher"],
                                  capture_output=True, text=True).stdout.split()  # fmt: skip
        os.kill(int(launcher[0]), signum)
    return finish(proc, STOP_TIMEOUT_S)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("target", "signum"),
    [("group", signal.SIGINT), pytest.param("launcher", signal.SIGUSR1, marks=pytest.mark.slow)],
    ids=["ctrl-c", "usr1-to-torchrun"],
)
def test_signals_stop_save_and_exit_143(base_args, log_dir, target, signum) -> None:
    """Ctrl-C (SIGINT to every process, torchrun forwarding it again) used to kill the workers
    with KeyboardInterrupt and save nothing; SIGUSR1 to torchrun killed torchrun alone and left
    the workers training. (Every stop signal through the launcher, with workers that only
    stop: test_launch.py; every stop signal in a worker: the test below; SIGTERM through the
    launch script: the test above.)"""
    args = [*base_args, *LONG]
    env = {"NPROC_PER_NODE": "2", "RUN_ID": "sig", **exit_check_env()}
    code, out = sigterm_mid_run(env, args, target, signum, log_dir)
    assert code == EXIT_PREEMPTED, out[-3000:]
    assert_groups_closed(out, 2)
    name = signal.Signals(signum).name
    assert out.count(f"{name} received") == 2, out[-3000:]  # both ranks agreed to stop
    stopped = int(out.split("Stopped by a signal at step ")[1].split(";")[0])
    saved = torch.load(log_dir / "train/runs/sig/checkpoints/last.ckpt", weights_only=True)
    assert saved["global_step"] == stopped and not saved["project"]["finished"]
    assert "the workers saved last.ckpt" in out and "Traceback" not in out


def test_every_stop_signal_stops_a_worker_at_the_next_check() -> None:
    """Each stop signal, really sent, sets the flag the ranks agree on at the next check."""
    script = textwrap.dedent("""
        import os, torch
        from project.engine.distributed.signals import STOP_SIGNALS, StopSignal
        for signum in STOP_SIGNALS:
            stop = StopSignal(every_n_steps=1, budget_s=None, save_every_n_train_steps=None,
                              save_every_n_seconds=None)
            stop.install()
            assert stop.check(torch.device("cpu"))[0] is False
            os.kill(os.getpid(), signum)
            print(signum, stop.check(torch.device("cpu"))[0], flush=True)
            stop.restore()
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [x for s in STOP_SIGNALS for x in (str(int(s)), "True")]
    for s in STOP_SIGNALS:
        assert f"{s.name} received" in proc.stderr


@pytest.mark.slow
def test_stop_check_adapts_to_the_stop_budget(base_args, log_dir) -> None:
    """With slow steps (here: a budget far below one step) the ranks check every window, so a
    stop fits the scheduler's grace time, and they say that even one step does not fit."""
    args = [*base_args, *ARGS, "callbacks.fault_tolerance.stop_budget_s=0.001",
            "fault_injection.at_step=25", "fault_injection.mode=sigterm"]  # fmt: skip
    code, out = python_run("project.train", args, "budget")
    assert code == EXIT_PREEMPTED, out[-3000:]
    assert "Stopped by a signal at step 25" in out  # not 29: the default every-10 check
    assert out.count("more than the stop budget") == 1


@pytest.mark.quick
def test_the_step_timeout_starts_at_the_second_window_after_anything_long(monkeypatch) -> None:
    """The short timeout never covers an attempt's first step, an epoch's first window (its
    workers starting), or the window after validation or a save: by the second window every
    rank has passed a collective since. (A rank hung inside the steps is reported after the
    step timeout: tests/test_hangs.py; the collective itself fails REPORT_S later.)"""
    import datetime

    from project.engine.distributed import ddp

    set_to: list[float] = []
    monkeypatch.setattr(ddp, "set_collective_timeout", lambda t: set_to.append(t.seconds))
    timeouts = ddp.CollectiveTimeout(5, datetime.timedelta(seconds=600), world_size=2)
    timeouts.in_steps()  # the attempt's first window (a resumed one too)
    assert set_to == []
    timeouts.start()  # the collectives wait 30 s longer than the report
    assert set_to == [630] and timeouts.deadline() == 600
    timeouts.in_steps()
    timeouts.in_steps()
    assert set_to == [630, 35] and timeouts.deadline() == 5
    timeouts.outside_steps()  # a save, validation, the epoch's end
    timeouts.in_steps()
    assert set_to == [630, 35, 630]
    timeouts.in_steps()
    assert set_to == [630, 35, 630, 35]
    alone = ddp.CollectiveTimeout(5, None, world_size=1)  # one process waits for no one
    alone.start(), alone.in_steps(), alone.in_steps()
    assert set_to == [630, 35, 630, 35]
    shorter = ddp.CollectiveTimeout(120, datetime.timedelta(seconds=10), world_size=2)
    shorter.in_steps(), shorter.in_steps()  # strategy.timeout below the step timeout: it wins
    assert set_to == [630, 35, 630, 35, 40] and shorter.deadline() == 10
