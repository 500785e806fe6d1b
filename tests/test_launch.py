"""Real distributed runs through the launch scripts: torchrun, two "nodes", network namespaces,
mismatches, multirun. CPU, gloo, one thread per rank."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from project.engine.distributed import exits
from project.engine.distributed.signals import STOP_SIGNALS
from project.engine.launch.torchrun import TRAINERS
from tests.helpers import (
    ROOT,
    SHORT_LOGGED,
    assert_same_training,  # feature:raw
    assert_same_weights,
    child_env,
    finish,
    free_port,
    launcher,
    read_scalars,
    start,
    step_losses,
    torchrun,
)

pytestmark = pytest.mark.distributed


def runs(log_dir: Path) -> list[Path]:
    return sorted((log_dir / "train" / "runs").iterdir())


def world_size_reported(out: str) -> int:
    line = next(ln for ln in out.splitlines() if "All distributed processes registered" in ln)
    return int(line.split("Starting with")[1].split()[0])


def test_torchrun_standalone_two_processes(torchrun_runs) -> None:
    runs = [torchrun_runs(), torchrun_runs(attempt=1)]  # the same command twice
    assert runs[0].dir.parent == runs[1].dir.parent and runs[0].dir != runs[1].dir
    for run in runs:
        assert world_size_reported(run.out) == 2
        assert "launcher: torchrun" in run.out
        assert run.out.count("Metrics:") == 1  # rank 0 only
        assert run.dir.name.startswith("torchrun-")  # named by torchrun's job id
    run = runs[0].dir
    assert (run / ".hydra" / "config.yaml").is_file() and (run / "config_tree.log").is_file()
    assert sorted(p.name for p in run.glob("*.log")) == ["config_tree.log", "train.log"]


def test_both_trainers_log_their_throughput(torchrun_runs) -> None:
    """train/samples_per_s (the task's unit: tokens for the language model) on every logged
    step, over both ranks, in TensorBoard."""
    for trainer in TRAINERS:
        scalars = read_scalars(torchrun_runs(trainer=trainer).dir / "tensorboard")
        rates = [v for _, v in scalars["train/samples_per_s"]]
        steps = [s for s, _ in scalars["train/loss_step"]]
        assert len(rates) == len(steps) and min(rates) > 0, (trainer, rates)


def test_torchrun_losses_identical_on_rerun(torchrun_runs) -> None:
    """The same command twice: the workers forked from the launcher's warm process (attempt
    0) and started as new processes (attempt 1) train bitwise alike."""
    first, second = (torchrun_runs(attempt=i) for i in (0, 1))
    for run, how in ((first, "forked warm"), (second, "started cold")):  # the exit check's
        starts = sorted(ln for ln in run.out.splitlines() if ln.startswith("start check:"))
        assert starts == [f"start check: rank {r} {how}" for r in (0, 1)], run.out[-2000:]
    assert len(step_losses(first.dir)) >= 20 and step_losses(first.dir) == step_losses(second.dir)
    assert_same_weights(first.dir, second.dir)


@pytest.mark.parametrize(
    "options",
    [
        ["strategy=ddp_static"],  # static_graph + gradient_as_bucket_view
        ["strategy.gradient_as_bucket_view=true"],
        ["strategy=ddp_unused"],
        ["strategy.bucket_cap_mb=1"],
    ],
)
def test_ddp_presets_match_plain_ddp(torchrun_runs, options) -> None:
    run = torchrun_runs(*options)
    assert world_size_reported(run.out) == 2
    assert step_losses(run.dir) == step_losses(torchrun_runs().dir)  # bitwise


def two_nodes(env0: dict, env1: dict, args: list[str], wrap0=(), wrap1=()) -> tuple[str, str]:
    """Start node 0 and node 1 (launch/multinode.sh, 1 process each); both must succeed."""
    script = str(ROOT / "launch" / "multinode.sh")
    common = {"NNODES": "2", "NPROC_PER_NODE": "1"}
    procs = [start([*wrap, script, *args], **common, **env)
             for wrap, env in ((wrap0, env0), (wrap1, env1))]  # fmt: skip
    results = [finish(p, timeout=180) for p in procs]
    for code, out in results:
        assert code == 0, out[-4000:]
    return results[0][1], results[1][1]


def test_two_nodes_static_rendezvous(base_args, log_dir, tmp_path) -> None:
    """Both trainers on two "nodes" of one process each: one run folder, bitwise the same
    losses."""
    args = [*base_args, "trainer.max_epochs=2", "step_stats=true"]
    for trainer in TRAINERS:
        extra = [f"hydra.run.dir={tmp_path / trainer}"] if trainer != "lightning" else []
        port = str(free_port())
        out0, out1 = two_nodes(
            {"NODE_RANK": "0", "MASTER_PORT": port, "TRAINER": trainer},
            {"NODE_RANK": "1", "MASTER_PORT": port, "TRAINER": trainer},
            [*args, *extra],
        )  # fmt: skip
        assert "1 process(es) per node x 2 node(s)" in out0 + out1
        if trainer == "lightning":
            assert world_size_reported(out0 + out1) == 2 and "launcher: torchrun" in out0 + out1
    (lightning,) = runs(log_dir)  # both nodes agreed on one run folder
    assert (lightning / "step_stats.json").is_file()
    # feature:raw
    assert_same_training(lightning, tmp_path / "raw")
    # /feature:raw


def test_two_nodes_c10d_rendezvous(base_args, log_dir) -> None:
    env = {"RDZV_ENDPOINT": f"127.0.0.1:{free_port()}", "RDZV_ID": "c10d-test"}
    out0, out1 = two_nodes(env, env, [*base_args, *SHORT_LOGGED])
    assert world_size_reported(out0 + out1) == 2
    assert [r.name for r in runs(log_dir)] == ["torchrun-c10d-test"]
    assert "failed to shutdown the rendezvous" not in out0 + out1, out0[-2000:] + out1[-2000:]


def test_two_hosts_in_network_namespaces(netns_pair, base_args, log_dir) -> None:
    ns, dev, addrs = netns_pair
    common = {"MASTER_ADDR": addrs[0], "MASTER_PORT": "29555"}
    out0, out1 = two_nodes(
        {"NODE_RANK": "0", "GLOO_SOCKET_IFNAME": dev[0], **common},
        {"NODE_RANK": "1", "GLOO_SOCKET_IFNAME": dev[1], **common},
        [*base_args, *SHORT_LOGGED],
        wrap0=("ip", "netns", "exec", ns[0]),
        wrap1=("ip", "netns", "exec", ns[1]),
    )
    assert f"# GLOO_SOCKET_IFNAME={dev[0]}" in out0  # the script shows the interface it passes on
    assert world_size_reported(out0 + out1) == 2
    assert len(runs(log_dir)) == 1


@pytest.mark.parametrize("no_python", [["--no-python"], []], ids=["no-python", "as-written"])
def test_torchrun_runs_the_multinode_script(base_args, log_dir, no_python) -> None:
    """`torchrun ... launch/multinode.sh` as the docs write it (torchrun then runs the script
    with Python: its last line hands it to bash) trains exactly as with --no-python: one run
    folder, the script's own command line, exit 0; and bad input is exit 2 either way."""
    script = str(ROOT / "launch" / "multinode.sh")
    cmd = [*torchrun([*no_python, script]), *base_args, *SHORT_LOGGED]
    code, out = finish(start(cmd))
    assert code == 0, out[-4000:]
    assert world_size_reported(out) == 2 and len(runs(log_dir)) == 1
    assert "SyntaxError" not in out and "-m project.train" in out  # the script's own "+ ..." line
    code, out = finish(start([*cmd, "trainer.max_epochs=abc"]))
    assert code != 0 and "error: trainer.max_epochs='abc'" in out, out[-3000:]


def test_importing_the_bash_handoff_returns() -> None:
    """The module whose `exec_bash` hands `python launch/multinode.sh` to bash used to exec
    at import: any process importing it became bash. Now only the script's call execs (the
    test above runs that path through torchrun)."""
    code = "import project.engine.launch.bash_script; print('still Python')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout == "still Python\n", proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.devices=1", "error: trainer.devices=1 but torchrun started 2 processes per node"),
        ("trainer.num_nodes=2", "error: trainer.num_nodes=2 but torchrun started 1 node(s)"),
    ],
)
def test_topology_mismatch_stops_every_rank(base_args, override: str, message: str) -> None:
    began = time.monotonic()
    proc = start([str(ROOT / "launch" / "single_node.sh"), *base_args, override],
                 NPROC_PER_NODE="2")  # fmt: skip
    code, out = finish(proc, timeout=60)  # also asserts no process is left behind
    # Every rank checks; the line is printed once (the other rank sees it said), exit 2.
    assert code == 2
    assert out.count(message) == 1, out[-3000:]
    assert time.monotonic() - began < 30


def test_multirun_two_jobs_two_devices(base_args, log_dir) -> None:
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", "model=mlp,cnn",
           "trainer.accelerator=cpu", "trainer.devices=2", *base_args, *SHORT_LOGGED]  # fmt: skip
    code, out = finish(start(cmd), timeout=240)  # also asserts no stray processes
    assert code == 0, out[-4000:]
    sweeps = list((log_dir / "train" / "multiruns").iterdir())
    assert len(sweeps) == 1
    jobs = sorted(p.name for p in sweeps[0].iterdir() if p.is_dir())
    assert jobs == ["0", "1"]
    assert out.count("Starting with 2 processes") == 2
    for job in jobs:
        assert (sweeps[0] / job / "metrics.json").is_file()
    assert not (log_dir / "train" / "runs").exists()  # no job escaped into a run folder


def test_scripts_parse_and_pass_shellcheck() -> None:
    scripts = [
        *(ROOT / "launch").glob("*.sh"),
        ROOT / ".ci" / "run",
        ROOT / "launch" / "slurm.sbatch",  # feature:slurm
        ROOT / "tests" / "slurm_cluster.sh",  # feature:slurm
    ]
    for script in scripts:
        subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (apt-get install shellcheck); bash -n passed")
    proc = subprocess.run(["shellcheck", "-x", *map(str, scripts)], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stdout


def dry_run(script: str, *args: str, **env: str) -> str:
    code, out = finish(start([str(ROOT / "launch" / script), *args], DRY_RUN="1", **env), 30)
    assert code == 0, out
    return out


# The rendezvous settings multinode.sh passes (docs/elastic.md), for a given RDZV_TIMEOUT.
RDZV_CONF = ("join_timeout={0}\\,timeout={0}\\,last_call_timeout=3\\,keep_alive_interval=1"
             "\\,keep_alive_max_attempt=3")  # fmt: skip


def test_printed_torchrun_commands() -> None:
    py = os.environ.get("PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    out = dry_run("single_node.sh", "model=cnn", NPROC_PER_NODE="4", PYTHON=py)
    assert out.strip() == (
        f"+ {py} -m project.launcher --standalone --nproc-per-node=4 --max-restarts=0 "
        "-m project.train model=cnn"
    )
    out = dry_run("multinode.sh", "x=1", NNODES="2", NPROC_PER_NODE="8", NODE_RANK="1",
                  MASTER_ADDR="10.0.0.1", MASTER_PORT="1234", MAX_RESTARTS="3",
                  NCCL_SOCKET_IFNAME="ib0", PYTHON=py)  # fmt: skip
    assert "# NCCL_SOCKET_IFNAME=ib0" in out
    assert out.splitlines()[-1] == (
        f"+ {py} -m project.launcher --nnodes=2 --nproc-per-node=8 --max-restarts=3 "
        f"--monitor-interval=0.1 --rdzv-conf={RDZV_CONF.format(300)} "
        "--node-rank=1 --master-addr=10.0.0.1 --master-port=1234 -m project.train x=1"
    )
    out = dry_run("multinode.sh", NNODES="1:4", NPROC_PER_NODE="2", RDZV_ENDPOINT="localhost:29400",
                  RDZV_ID="job7", LOCAL_ADDR="10.0.0.5", RDZV_TIMEOUT="60", RDZV_LAST_CALL="9",
                  MONITOR_INTERVAL="0.5", PYTHON=py)  # fmt: skip
    conf = RDZV_CONF.format(60).replace("last_call_timeout=3", "last_call_timeout=9")
    assert out.splitlines()[-1] == (
        f"+ {py} -m project.launcher --nnodes=1:4 --nproc-per-node=2 --max-restarts=0 "
        f"--monitor-interval=0.5 --rdzv-conf={conf} "
        "--rdzv-backend=c10d "
        "--rdzv-endpoint=localhost:29400 --rdzv-id=job7 --local-addr=10.0.0.5 -m project.train"
    )
    # feature:raw
    out = dry_run("multinode.sh", TRAINER="raw", PYTHON=py)
    assert out.splitlines()[-1].endswith(" -m project.raw_train")
    # /feature:raw


def test_master_port_follows_the_job() -> None:
    """Two jobs on one node used to share port 29500/29400 and so one rendezvous store."""

    def port(**env: str) -> str:
        return dry_run("multinode.sh", NNODES="2", **env).split("--master-port=")[1].split()[0]

    assert port(RUN_ID="a") == port(RUN_ID="a") != port(RUN_ID="b")
    assert port(SLURM_JOB_ID="17") != port(SLURM_JOB_ID="18")
    assert port() == "29500" and port(RUN_ID="a", MASTER_PORT="4000") == "4000"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"NNODES": "2", "NODE_RANK": "5"}, "NODE_RANK=5 must be one of 0..1 (NNODES=2)"),
        ({"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE=0 must be a whole number >= 1"),
        ({"NNODES": "two"}, "NNODES=two must be N or MIN:MAX"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
        (
            {"MASTER_ADDR": "no-such-host.invalid"},
            "MASTER_ADDR=no-such-host.invalid does not resolve",
        ),
        ({"RDZV_ENDPOINT": "localhost"}, "RDZV_ENDPOINT=localhost must be host:port"),
        ({"RDZV_LAST_CALL": "5s"}, "RDZV_LAST_CALL=5s must be a whole number >= 1"),
        ({"RDZV_KEEP_ALIVE": "0"}, "RDZV_KEEP_ALIVE=0 must be a whole number >= 1"),
        ({"MONITOR_INTERVAL": "fast"}, "MONITOR_INTERVAL=fast must be a number of seconds > 0"),
    ],
)
def test_launch_input_is_checked_before_torchrun(env: dict, message: str) -> None:
    began = time.monotonic()
    code, out = finish(start([str(ROOT / "launch" / "multinode.sh")], **env), 30)
    assert (code == 2 and out.strip() == f"error: {message}") or message in out, out
    assert out.strip().startswith("error: ") and len(out.strip().splitlines()) == 1, out
    assert time.monotonic() - began < 10


@pytest.mark.quick
def test_launcher_arguments_torch_asserts_on_are_one_line() -> None:
    """`python -m project.launcher` run by hand: torch refused these with a bare
    AssertionError (or a ValueError's traceback) once it ran; what torch accepts still passes."""
    from torch.distributed.run import parse_args

    from project.launcher import argument_error

    def error(*args: str) -> str | None:
        return argument_error(parse_args([*args, "train.py"]))

    for nproc in ("0", "-2"):
        assert error(f"--nproc-per-node={nproc}") == (
            f"--nproc-per-node={nproc} must be a whole number >= 1 (or auto)"
        )
    within = "must be N or MIN:MAX, whole numbers with 1 <= MIN <= MAX"
    for nnodes in ("2:1", "0", "0:2", "two", "1:2:3"):
        assert error(f"--nnodes={nnodes}") == f"--nnodes={nnodes} {within}"
    assert error("--max-restarts=-1") == "--max-restarts=-1 must be a whole number >= 0"
    assert error("--monitor-interval=0") == "--monitor-interval=0.0 must be a number of seconds > 0"
    for nproc in ("two", "2.5"):  # torch's ValueError, as a traceback, once it ran
        assert error(f"--nproc-per-node={nproc}") == (
            f"--nproc-per-node={nproc} must be a whole number >= 1, or auto, cpu or gpu "
            f"(Unsupported nproc_per_node value: {nproc})"
        )
    gpu = ["--standalone", "--nproc-per-node=gpu", "--max-restarts=0"]
    if not torch.cuda.is_available():  # gpu counts this machine's GPUs
        assert "(Cuda is not available.)" in (error(*gpu) or ""), error(*gpu)
    for fine in (["--nnodes=2", "--nproc-per-node=8"], ["--nnodes=1:4", "--nproc-per-node=auto"],
                 *([gpu] if torch.cuda.is_available() else [])):  # fmt: skip
        assert error(*fine) is None, fine


@pytest.mark.quick
def test_a_launcher_argument_torch_asserts_on_stops_before_torchrun() -> None:
    code, out = finish(start(launcher(["-m", "project.train"], nproc=0)), 60)
    assert code == 2 and out.strip() == (
        "error: --nproc-per-node=0 must be a whole number >= 1 (or auto)"
    ), out


@pytest.mark.quick
def test_the_resume_command_says_every_node_for_a_job_of_several(monkeypatch) -> None:
    """A c10d job (no NODE_RANK in its command) of two nodes: the line says to run it on
    every node; on one node nothing is added."""
    from project.engine.launch import env

    monkeypatch.setattr(env, "_run_id", "torchrun-job")  # not agreed through a store
    typed = "NNODES=1:2 RDZV_ENDPOINT=10.0.0.1:29400 RDZV_ID=job launch/multinode.sh trainer=gpu"
    monkeypatch.setenv(env.COMMAND_ENV, typed)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    for nodes, said in (("1", ""), ("2", " (on every node)")):
        monkeypatch.setenv("GROUP_WORLD_SIZE", nodes)
        assert env.resume_command() == f"RUN_ID=torchrun-job {typed}{said}"
    monkeypatch.setenv(env.COMMAND_ENV, "NNODES=2 NODE_RANK=0 launch/multinode.sh")
    assert env.resume_command().endswith(" (on every node, each with its NODE_RANK)")


@pytest.mark.quick
def test_the_survivor_of_the_store_host_is_told_the_command_that_resumes(
    tmp_path, monkeypatch
) -> None:
    """The node hosting the c10d store died: the survivor's one line ends with the command its
    worker recorded (what to run, when none did), as the stop line does."""
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError
    from torch.distributed.run import parse_args

    from project.launcher import _rendezvous_line, _resume

    args = parse_args(["--nnodes=1:2", "--rdzv-backend=c10d",
                       "--rdzv-endpoint=10.0.0.1:29400", "train.py"])  # fmt: skip
    gone = RendezvousConnectionError("the store is gone")
    line = _rendezvous_line(gone, args, True, _resume(str(tmp_path), args))
    assert line.endswith("): the same command, with the run's RUN_ID (on every node)"), line
    monkeypatch.setenv(exits.EXIT_DIR_ENV, str(tmp_path))
    exits.record_resume("RUN_ID=torchrun-job NNODES=1:2 launch/multinode.sh (on every node)")
    line = _rendezvous_line(gone, args, True, _resume(str(tmp_path), args))
    assert line.startswith("error: the rendezvous store at 10.0.0.1:29400 is gone"), line
    assert line.endswith(
        "docs/elastic.md): RUN_ID=torchrun-job NNODES=1:2 launch/multinode.sh (on every node)"
    ), line


@pytest.mark.quick
def test_the_rendezvous_shutdown_warning_is_shown_only_after_a_failure() -> None:
    """A node that closes the c10d rendezvous after the store's host exited: torch warns it
    "failed to shutdown the rendezvous", noise after a run that finished."""
    import inspect
    import logging

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from project.launcher import _QuietCleanShutdown

    state = {"finished": False}
    quiet = _QuietCleanShutdown(state)
    assert dynamic_rendezvous.logger.name == quiet.LOGGER  # where torch logs it, and what
    assert "failed to shutdown the rendezvous" in inspect.getsource(dynamic_rendezvous)

    def shown(message: str) -> bool:
        return quiet.filter(logging.LogRecord(quiet.LOGGER, logging.WARNING, "", 0, message,
                                              None, None))  # fmt: skip

    warning = ("The node 'a_1_0' has failed to shutdown the rendezvous 'job' due to an error "
               "of type RendezvousConnectionError.")  # fmt: skip
    assert shown(warning)  # the run failed: kept
    state["finished"] = True
    assert not shown(warning) and shown("another warning")


def test_missing_node_is_reported_not_waited_on(base_args) -> None:
    """Node 1 is never started: node 0 stops after RDZV_TIMEOUT with a diagnosis (it used to
    wait 15 minutes, then print a C++ stack trace)."""
    began = time.monotonic()
    proc = start([str(ROOT / "launch" / "multinode.sh"), *base_args], NNODES="2",
                 NPROC_PER_NODE="1", NODE_RANK="0", MASTER_PORT=str(free_port()),
                 RDZV_TIMEOUT="8")  # fmt: skip
    code, out = finish(proc, 90)
    assert code == 1, out[-3000:]
    assert "did not complete" in out and "a node was not started" in out
    assert "Traceback" not in out
    assert time.monotonic() - began < 60


def read_until(proc: subprocess.Popen[str], word: str, times: int) -> str:
    """`proc`'s output up to the line where `word` has appeared `times` times (or its end)."""
    out = ""
    while out.count(word) < times and proc.poll() is None:
        out += proc.stdout.readline()
    return out


def test_launcher_exit_codes_follow_the_workers(tmp_path) -> None:
    """A signal that arrives after the workers finished is exit 0 (SLURM would requeue a
    finished job on 143); a crash is exit 1 with one line naming the rank."""
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import os, sys, time\n"
        f"from {exits.__name__} import report_exit\n"
        "with report_exit():\n"
        "    if sys.argv[1] == 'crash' and os.environ['RANK'] == '1':\n"
        "        sys.exit(3)\n"
        "print('finished', flush=True)\n"
        "time.sleep(60 if sys.argv[1] == 'linger' else 0)  # e.g. a slow interpreter exit\n"
    )
    cmd = launcher([str(worker)])
    proc = start([*cmd, "linger"])
    out = read_until(proc, "finished", 2)
    proc.send_signal(signal.SIGTERM)
    code, rest = finish(proc, 60)
    assert code == 0 and "arrived after training had finished" in rest, out + rest
    code, out = finish(start([*cmd, "crash"]), 60)
    assert code == 1 and "error: rank 1" in out and "exited with code 3" in out, out
    assert "Traceback" not in out and "ChildFailedError" not in out


def test_bad_input_that_fails_every_rank_is_one_line(tmp_path) -> None:
    """Both ranks refuse the same input at once: the user reads the line once, exit 2 (it
    used to print once per rank: 8 lines on 8 GPUs)."""
    worker = tmp_path / "worker.py"
    worker.write_text(
        f"from {exits.__name__} import fail, report_exit\n"
        "with report_exit():\n"
        "    fail('the same input, refused by every rank')\n"
    )
    code, out = finish(start(launcher([str(worker)])), 60)
    assert code == 2 and out.count("error: the same input, refused") == 1, out


WORKER_THAT_STOPS = f"""
import signal, sys, time
from {exits.__name__} import report_exit

def stop(signum, frame):
    sys.stdout.write(signal.Signals(signum).name + " received\\n")  # one write: a shared pipe
    sys.stdout.flush()
    sys.exit({exits.EXIT_PREEMPTED})  # as a training worker after saving last.ckpt

with report_exit():
    for signum in {[int(s) for s in STOP_SIGNALS]}:  # project.engine.distributed.signals' own list
        signal.signal(signum, stop)
    print("ready", flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("signum", STOP_SIGNALS, ids=lambda s: s.name)
def test_launcher_forwards_every_stop_signal(tmp_path, signum) -> None:
    """A stop signal to the launcher reaches every worker, and the job ends 143 once they
    stopped. SIGUSR1/SIGUSR2 (SLURM's and submitit's warnings) used to kill torchrun alone and
    leave the workers training; SIGTERM stopped them but the job exited 1."""
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER_THAT_STOPS)
    proc = start(launcher([str(worker)]))
    out = read_until(proc, "ready", 2)
    proc.send_signal(signum)
    code, rest = finish(proc, 90)
    out += rest
    assert code == exits.EXIT_PREEMPTED, out
    assert out.count(f"{signum.name} received") == 2, out  # every worker got it
    assert "the workers saved last.ckpt" in out and "Traceback" not in out, out


def test_unknown_trainer_switch() -> None:
    code, out = finish(start([str(ROOT / "launch" / "single_node.sh")], TRAINER="jax"), 30)
    assert code == 2 and "error: TRAINER=jax is not one of the trainers" in out


# A worker the launcher starts: what it sees of how it was started. It exits with argv[1] on
# rank 1. `python -m warm_probe` (tmp_path on PYTHONPATH).
WARM_PROBE = """
import os, sys
PRELOADED = "torch" in sys.modules  # imported before this module: a warm start
# Lightning sets its rank_zero_only.rank from RANK as it loads: the warm process has none
WARM_IMPORTS = ("lightning.fabric.utilities.rank_zero",)
if __name__ == "__main__":
    from lightning.fabric.utilities.rank_zero import rank_zero_only
    parent = open(f"/proc/{os.getppid()}/cmdline").read().replace("\\0", " ")
    own = os.getsid(0) == os.getpid()
    import torch
    from threadpoolctl import threadpool_info
    blas = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
    print(f"rank {os.environ['RANK']}: preloaded={PRELOADED} own_session={own} "
          f"zero_only_rank={rank_zero_only.rank} argv={sys.argv[1:]} "
          f"threads={torch.get_num_threads()},{blas} parent={parent}", flush=True)
    if os.environ["RANK"] == "1" and sys.argv[1] == "raise":  # what the interpreter's exit does
        import atexit, threading, time
        atexit.register(print, "atexit ran", flush=True)
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread joined"))).start()
        open(sys.argv[2], "w").write("flushed at exit")  # never closed: flushed as it goes
        raise ValueError("boom")
    if os.environ["RANK"] == "1" and sys.argv[1] == "3":  # left in its group as it fails
        import subprocess
        subprocess.Popen(["sleep", "300"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sys.exit(int(sys.argv[1]) if os.environ["RANK"] == "1" else 0)
"""


def probe_job(
    tmp_path: Path, module: str, *args: str, nproc: int = 2, **env: str
) -> tuple[int, str]:
    """`python -m project.launcher --nproc-per-node=N -m <module> args` with tmp_path on the
    path; (exit code, output)."""
    path = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    return finish(start(launcher(["-m", module, *args], nproc), **path, **env), 120)


def test_warm_workers_are_forked_and_end_as_cold_ones_do(tmp_path) -> None:
    """Each worker is forked from the launcher's warm process (torch imported before its
    module) into a session of its own, with its rank read again; it ends as a cold worker does
    (2: bad input; 3: one line naming the rank, exit 1; an uncaught exception: its traceback,
    non-daemon threads joined, atexit handlers run, unclosed files flushed, exit 1). What a
    failed warm worker leaves in its process group is ended with it (finish() fails the test
    on the `sleep` case 3 starts): a warm restart comes sooner than leftovers end by themselves."""
    (tmp_path / "warm_probe.py").write_text(WARM_PROBE)
    left = str(tmp_path / "left.txt")
    cases = [("1", ["2"], 2), ("0", ["2"], 2), ("1", ["3"], 1), ("1", ["raise", left], 1),
             ("0", ["raise", left], 1)]  # fmt: skip
    for warm, args, job_code in cases:
        ended, out = probe_job(tmp_path, "warm_probe", *args, PROJECT_WARM_START=warm)
        assert ended == job_code, out
        lines = sorted(ln for ln in out.splitlines() if ln.startswith("rank "))
        assert len(lines) == 2, out
        for rank, line in enumerate(lines):
            assert f"own_session=True zero_only_rank={rank} argv={args}" in line, line
            assert f"preloaded={warm == '1'}" in line, line
            parent = "project.engine.launch.warm" if warm == "1" else "project.launcher"
            assert parent in line.split("parent=")[1], line
        if args[0] == "3":
            assert "error: rank 1" in out and "exited with code 3" in out, out
        if args[0] == "raise":  # the traceback, threads joined, atexit run, files flushed
            assert "exited with code 1" in out and "ValueError: boom" in out, out
            assert "thread joined" in out and "atexit ran" in out, out
            assert Path(left).read_text() == "flushed at exit"
            Path(left).unlink()


def test_a_one_process_node_forks_its_worker_with_a_cold_ones_threads(tmp_path) -> None:
    """One process per node (the elastic drill's nodes) is forked warm too, so a restart
    skips the imports. The warm process loads numpy's BLAS on one thread (its threads would
    forbid the fork); the worker gets a cold one's count back, and torch's threads are a
    cold one's (OMP_NUM_THREADS=2 here: torchrun sets it to 1 only for several processes)."""
    (tmp_path / "warm_probe.py").write_text(WARM_PROBE)
    lines = {}
    for warm in ("1", "0"):
        code, out = probe_job(tmp_path, "warm_probe", "0", nproc=1, PROJECT_WARM_START=warm,
                              OMP_NUM_THREADS="2")  # fmt: skip
        assert code == 0, out
        (lines[warm],) = [ln for ln in out.splitlines() if ln.startswith("rank ")]
        assert f"preloaded={warm == '1'}" in lines[warm], lines[warm]
    threads = {warm: line.split("threads=")[1].split(" parent")[0] for warm, line in lines.items()}
    assert threads["0"].startswith("2,[2") and threads["1"] == threads["0"], threads


@pytest.mark.quick
@pytest.mark.parametrize(
    "argv",
    [
        ["--standalone", "--nproc-per-node=2", "-m", "project.train", "trainer.max_epochs=1"],
        ["--nproc_per_node", "1", "--nnodes", "1:2", "--module", "project.raw_train", "-x"],
        ["--rdzv-conf", "timeout=5", "--standalone", "train.py", "--nproc-per-node=4"],
        ["--no-python", "--nproc-per-node=2", "launch/multinode.sh"],
        ["--nproc-per-node=auto", "-m", "project.train"],
        ["--max-restarts", "3", "--run_path", "train.py"],
    ],
)
def test_the_warm_process_read_early_is_the_one_torchrun_parses(argv, monkeypatch) -> None:
    """The launcher starts the warm process before torch's parser has read its arguments
    (from early_plan) and keeps it only if torch's reading (plan_of) agrees; where the early
    reading is unsure it starts none, and never a different one."""
    from torch.distributed.run import parse_args

    from project.engine.launch import warm

    monkeypatch.delenv(warm.WARM_ENV, raising=False)
    early = warm.early_plan(argv)
    assert early is None or early == warm.plan_of(parse_args(argv)), (early, argv)
    unsure = argv[0] == "--no-python" or "auto" in argv[0] or "--run_path" in argv
    assert (early is None) == unsure, (early, argv)


def test_an_entry_point_that_cannot_be_imported_is_one_line(tmp_path) -> None:
    (tmp_path / "broken_probe.py").write_text("import not_a_module_anywhere\n")
    code, out = probe_job(tmp_path, "broken_probe")
    assert code == 2 and "Traceback" not in out, out
    error = [ln for ln in out.splitlines() if ln.startswith("error: ")]
    assert error == [
        "error: the entry point's module broken_probe cannot be imported (ModuleNotFoundError: "
        "No module named 'not_a_module_anywhere'); run `python -m broken_probe` to see the "
        "traceback"
    ], out


def test_a_module_that_starts_a_thread_at_import_starts_its_workers_cold(tmp_path) -> None:
    """A fork beside a running thread can inherit a lock held for good: the warm process
    never forks then; the workers start as new processes, with one line saying why."""
    (tmp_path / "thread_probe.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n" + WARM_PROBE
    )
    code, out = probe_job(tmp_path, "thread_probe", "0")
    assert code == 0, out
    assert "launcher: workers start cold: importing thread_probe started a thread" in out, out
    assert out.count("preloaded=False") == 2, out
