"""What the tests share (the fixtures are in conftest.py): presets, running the real CLIs in
subprocesses, reading what a run left behind, and the assertions several test files make.
Test files import from here, never from each other.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
import uuid
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "configs"

# Quiet, fast, reproducible children: one thread per rank (2 threads per rank on 2 cores makes
# DDP ~4x slower and changes losses at 1e-7), no progress bar noise.
QUIET = ["trainer.enable_progress_bar=false"]
# experiment=charlm, small: 2 epochs of 12 steps of 8 windows of 32 characters, a narrow GPT.
CHARLM = ["experiment=charlm", "trainer.max_epochs=2", "trainer.limit_train_batches=12",
          "trainer.limit_val_batches=4", "trainer.limit_test_batches=2", "model.net.d_model=32",
          "model.net.n_head=2", "data.batch_size=8", "data.dataset.block_size=32"]  # fmt: skip


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RUN_ID", "HYDRA_FULL_ERROR")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra})  # a test may set its own
    return env


def exit_check_env() -> dict[str, str]:
    """Environment for a distributed run whose workers report at exit whether they closed
    their process group (tests/exit_check/sitecustomize.py); see assert_groups_closed."""
    paths = [str(ROOT / "tests" / "exit_check"), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def assert_groups_closed(out: str, nproc: int) -> None:
    """Every one of `nproc` workers closed its process group before the interpreter exit."""
    closed = [ln for ln in out.splitlines() if ln.startswith("exit check:")]
    assert len(closed) == nproc and all(ln.endswith("closed") for ln in closed), closed


def run_script(
    script: str, args: Sequence[str], timeout: float = 240, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run `python <script> args...` (or `python -m module` for script="-m module") from the
    repo root; returns the completed process."""
    target = script.split() if script.startswith("-m ") else [str(ROOT / script)]
    return subprocess.run(
        [sys.executable, *target, *args],
        cwd=ROOT,
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """All scalar series from the TensorBoard event files under `tb_dir`: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


# The straggler drill: rank 1's steps 30 ms slower from step 10 (fault_injection.mode=slow).
SLOW_RANK_1 = ["fault_injection.at_step=10", "fault_injection.rank=1",
               "fault_injection.mode=slow", "fault_injection.slow_ms=30"]  # fmt: skip


def assert_rank_1_named_slow(out: str, run_dir: Path) -> None:
    """A SLOW_RANK_1 run: the straggler line names rank 1 within 50 steps, and rank 1's own
    time (30 ms more a step) reached TensorBoard."""
    import statistics

    found = re.search(r"straggler: rank 1 works .* up to step (\d+)", out)
    assert found and int(found[1]) <= 10 + 50, out[-3000:]
    scalars = read_scalars(run_dir / "tensorboard")
    after = {r: statistics.median(v for s, v in scalars[f"ranks/busy_ms/rank{r}"] if s > 10)
             for r in (0, 1)}  # fmt: skip
    assert after[1] > 25 + after[0], after  # the 30 ms, in rank 1's own time


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


S3_KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip


@contextlib.contextmanager
def s3_server(log: Path | None = None, auth: bool = False) -> Iterator[dict[str, str]]:
    """A real S3 server (moto's, `moto[server]` in the dev extras) on 127.0.0.1 at a free port,
    for as long as the block runs; yields the standard AWS environment that points boto3, s3fs
    and every child process at it (AWS_ENDPOINT_URL, test keys, a region). `log`: a file that
    receives its request log (one line per request: s3_gets counts them); `auth`: it checks
    credentials (it knows no key, so every request is refused as a bad key would be)."""
    import urllib.request

    port = free_port()
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"} if auth else None
    with open(log or os.devnull, "a") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out, stderr=out, start_new_session=True, env=env,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):  # it answers in ~1.5 s here
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{url}/moto-api/", timeout=1).close()
                break
            if proc.poll() is not None:
                raise RuntimeError(f"moto's S3 server exited with {proc.returncode}")
            time.sleep(0.1)
        else:
            raise RuntimeError(f"moto's S3 server did not answer at {url} within 30 s")
        yield {"AWS_ENDPOINT_URL": url, **S3_KEYS}
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if proc.poll() is None:
            proc.kill()


def s3_gets(log: Path, folder: str, suffix: str = ".npy") -> int:
    """How many GET requests of objects under `folder` (`s3://bucket/prefix`) ending in
    `suffix` the server's request log (s3_server(log=...)) holds."""
    path = "/" + folder.removeprefix("s3://").rstrip("/") + "/"
    pattern = re.compile(rf'"GET {re.escape(path)}\S*{re.escape(suffix)}[ ?]')
    return sum(1 for line in log.read_text().splitlines() if pattern.search(line))


def group_alive(pgid: int) -> bool:
    """Whether any process of process group `pgid` still exists."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it, whatever session the launcher put them in."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def python_stacks(pids: list[int]) -> str:
    """Where each process is stuck, Python and native frames (py-spy, a dev dependency), for
    the report of a job that did not end."""
    spy = Path(sys.executable).with_name("py-spy")
    if not spy.exists():
        return ""
    dump = [str(spy), "dump", "--native", "--pid"]
    dumps = [subprocess.run([*dump, str(pid)], capture_output=True, text=True, timeout=60).stdout
             for pid in pids]  # fmt: skip
    return "\n".join(dumps)


STARTED: list[subprocess.Popen[str]] = []  # this test's process groups (see reap_processes)

# start() gives each job a mark of its own in this environment variable: every process of the
# job inherits it, and keeps it in a session of its own (torchrun's workers) and after its
# parent died and init adopted it, where neither the process group nor the tree finds it.
JOB_VAR = "PROJECT_TEST_JOB"
JOB_MARKS: weakref.WeakKeyDictionary[subprocess.Popen[str], str] = weakref.WeakKeyDictionary()


def start(cmd: Sequence[str], **env: str) -> subprocess.Popen[str]:
    """Start `cmd` from the repo root in its own process group, its processes marked as one
    job (JOB_VAR), so that finish() sees every process the job leaves behind."""
    mark = uuid.uuid4().hex
    proc = subprocess.Popen(
        list(cmd), cwd=ROOT, env=child_env(**env, **{JOB_VAR: mark}), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    JOB_MARKS[proc] = mark
    STARTED.append(proc)
    return proc


def job_processes(proc: subprocess.Popen[str]) -> dict[int, str]:
    """The live processes of `proc`'s job, pid -> command line: those in its process group,
    those below it, and those carrying its JOB_VAR mark (if start() started it). One pass
    over /proc (~1 ms): finish() polls it after every distributed test. Zombies count as
    ended (nothing left to kill; init may never reap them in a container)."""
    mark = JOB_MARKS.get(proc)
    needle = f"{JOB_VAR}={mark}\0".encode() if mark else None
    # Its pid names its group and its children only while `proc` runs: once it is reaped
    # (and its group empty) the number may be another job's, so then only the mark counts.
    running = proc.poll() is None
    below = set(process_tree(proc.pid)) if running else set()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            state, _ppid, pgid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:3]
            ours = running and (int(pgid) == proc.pid or pid in below)
            if not ours and needle is not None:
                ours = needle in (entry / "environ").read_bytes()
            if ours and state != "Z":
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
                found[pid] = cmdline.decode(errors="replace").strip()
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile, or not ours to read
    return found


def kill_job(proc: subprocess.Popen[str]) -> dict[int, str]:
    """SIGKILL every process of `proc`'s job (job_processes); returns what was running."""
    import signal

    # The group at once first (a process it forks meanwhile is in the group too), while its
    # leader is unreaped: after that the number may name another job's group.
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    left = job_processes(proc)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


def finish(
    proc: subprocess.Popen[str], timeout: float = 180, settle_s: float = 10
) -> tuple[int, str]:
    """Wait for `proc`; kill its whole job if it overruns. Then every process of the job must
    end within `settle_s` (a worker's interpreter exit can take a moment): one that does not
    is killed and fails the test. Returns (exit code, output)."""
    import time

    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stacks = python_stacks(sorted(job_processes(proc)))
        kill_job(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s:\n{out[-3000:]}\n{stacks}") from None
    deadline = time.monotonic() + settle_s
    while job_processes(proc) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = kill_job(proc)
    assert not left, f"processes left behind by {proc.args}: {left}"
    return proc.returncode, out


def run_launch(script: str, args: Sequence[str], timeout: float = 180, **env: str) -> str:
    """Run a launch script to success; returns its output."""
    code, out = finish(start([str(ROOT / "launch" / script), *args], **env), timeout)
    assert code == 0, out[-4000:]
    return out


# The 2-process runs of torchrun_runs: 2 epochs of 10 steps per rank, every step's loss in
# TensorBoard and in step_stats.json.
# Short runs (each test adds what it checks): 3 epochs, no test; 2 epochs with every step's
# loss logged, no test; 3 epochs with per-step statistics (step_stats.json).
SHORT_NO_TEST = ["trainer.max_epochs=3", "test=false"]
SHORT_LOGGED = ["trainer.max_epochs=2", "trainer.log_every_n_steps=1", "test=false"]
SHORT_STATS = ["trainer.max_epochs=3", "step_stats=true"]
TORCHRUN_ARGS = ["trainer.max_epochs=2", "trainer.log_every_n_steps=1", "step_stats=true",
                 *QUIET]  # fmt: skip


# strategy=fsdp on several processes refuses best-k checkpoints; no periodic `last` either
FSDP = ["callbacks.model_checkpoint=null", "callbacks.fault_tolerance=null"]


def max_loss_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """The largest per-step loss difference of two runs of the same length."""
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@dataclass
class Run:
    dir: Path  # the run folder
    out: str  # what the job printed


# PowerSGD on a 1.2 MB model (odd layer sizes: a layout's offsets are not all multiples of 16
# bytes), 4 epochs: the resume tests' run (tests/conftest.py: powersgd_whole is its reference).
POWERSGD = ["strategy=ddp_powersgd", "model.net.hidden=511", "trainer.max_epochs=4", "test=false",
            "callbacks.early_stopping=null"]  # fmt: skip


def torchrun(target: Sequence[str], nproc: int = 2) -> list[str]:
    """`python -m project.launcher --standalone --nproc-per-node=N <target>`: the command
    project.compare and sweep jobs build (project.engine.launch.torchrun)."""
    from project.engine.launch.torchrun import command

    return command(list(target), nproc)


def launcher(target: Sequence[str], nproc: int = 2) -> list[str]:
    """The same single-node job under `python -m project.launcher` (the launch scripts'
    torchrun: exit codes, no restarts of bad input, forwarded signals)."""
    return [sys.executable, "-m", "project.launcher", "--standalone", f"--nproc-per-node={nproc}",
            *target]  # fmt: skip


def user_data(tmp_path: Path, target: str, **params: object) -> list[str]:
    """Overrides that train on the datamodule tests.user_data.<target>, which records what it
    reads in `tmp_path` (a data config written there, found through hydra.searchpath)."""
    configs = tmp_path / "configs" / "data"
    configs.mkdir(parents=True, exist_ok=True)
    lines = [f"_target_: tests.user_data.{target}", f"record_dir: {tmp_path}"]
    lines += [f"{key}: {value}" for key, value in params.items()]
    (configs / "user.yaml").write_text("\n".join(lines))
    return ["data=user", f"hydra.searchpath=[file://{tmp_path}/configs]", *QUIET]


def recorded_data(
    tmp_path: Path, rows: int, source: str = "RecordedSource", **params: object
) -> list[str]:
    """Overrides that train on `rows` rows of tests.user_data.RecordedSource (a DataSource, so
    both trainers read it; every read recorded in `tmp_path`), through a data config written
    there: the template's datamodule settings, another dataset. `source`, `params`: another
    source of tests.user_data and its arguments."""
    configs = tmp_path / "configs" / "data"
    configs.mkdir(parents=True, exist_ok=True)
    digits = (CONFIG_DIR / "data" / "digits.yaml").read_text().split("dataset:")[0]
    (configs / "recorded.yaml").write_text(
        f"{digits}dataset:\n  _target_: tests.user_data.{source}\n"
        f"  record_dir: {tmp_path}\n  n_train: {rows}\n"
        + "".join(f"  {key}: {value}\n" for key, value in params.items())
    )
    return [f"hydra.searchpath=[file://{tmp_path}/configs]", "data=recorded"]


def recorded_reads(record_dir: Path, tag: str, split: str = "train") -> list[list[int]]:
    """What each rank (by rank) of one attempt read of `split`, in order."""
    files = sorted(record_dir.glob(f"reads-{tag}-rank*.txt"))
    return [[int(line.split()[1]) for line in f.read_text().splitlines()
             if line.startswith(split)] for f in files]  # fmt: skip


def options(group: str) -> list[str]:
    """The option names of a config group (its YAML files)."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def one_error_line(out: str) -> str:
    """The output must hold exactly one `error: ...` line and no traceback; returns it."""
    errors = [ln for ln in out.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in out, out[-3000:]
    return errors[0]


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit 2 and stderr is exactly one `error:` line that names every needle."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr[-3000:]
    line = one_error_line(proc.stderr)
    for needle in needles:
        assert needle in line, line


METRIC = re.compile(r"([a-z]+/[a-z_]+)=([-0-9.e]+)")


def logged_metrics(stdout: str, prefix: str = "test/") -> dict[str, float]:
    """The `Metrics: ...` line a run logs last, as {name: value} (names starting with prefix)."""
    line = [ln for ln in stdout.splitlines() if "Metrics:" in ln][-1]
    return {k: float(v) for k, v in METRIC.findall(line) if k.startswith(prefix)}


def step_losses(run_dir: Path) -> list[float]:
    """Every logged `train/loss_step` of a run, read back from its TensorBoard event files."""
    return [v for _, v in read_scalars(run_dir / "tensorboard")["train/loss_step"]]


def final_weights(run_dir: Path) -> dict[str, Any]:
    """The network's weights in a run's last checkpoint, keyed alike for both trainers (a
    sharded one gathered whole)."""
    import torch

    ckpt_dir = run_dir / "checkpoints"
    for manifest in (SHARDED_RAW, "last-ckpt.json"):  # sharded (strategy=fsdp)
        if (ckpt_dir / manifest).is_file():
            return sharded_state(ckpt_dir / manifest)["model"]
    if (ckpt_dir / "last.pt").is_file():  # the raw trainer
        return torch.load(ckpt_dir / "last.pt", weights_only=True)["model"]
    state = torch.load(ckpt_dir / "last.ckpt", weights_only=True)["state_dict"]
    return {k.removeprefix("task."): v for k, v in state.items() if k.startswith("task.")}


# The raw trainer's sharded `last` (strategy=fsdp on several processes): its manifest.
SHARDED_RAW = "last-pt.json"


def sharded_manifest(module: str) -> str:
    """The manifest of a trainer's sharded `last` (last.pt -> last-pt.json, last.ckpt ->
    last-ckpt.json)."""
    return SHARDED_RAW if module == "project.raw_train" else "last-ckpt.json"


def sharded_state(manifest: Path) -> dict[str, Any]:
    """The whole state (model, optim) of the sharded save `manifest` publishes, gathered on
    this process by DCP's own reader."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from project.engine.checkpoints.sharded import resolve

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(resolve(manifest, "test"), Path(tmp) / "whole.pt")
        return torch.load(Path(tmp) / "whole.pt", weights_only=True)


def sharded_entries(manifest: Path) -> dict[str, Any]:
    """What the sharded save `manifest` publishes holds beside model and optimizer."""
    from project.engine.checkpoints.sharded import COMMON, read_entries, resolve

    return read_entries(str(Path(resolve(manifest, "test")) / COMMON))


def assert_same_weights(a: Path, b: Path) -> None:
    """Bitwise the same final weights in two run folders."""
    import torch

    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), f"{key} differs"


def assert_same_training(lightning: Path, raw: Path) -> None:
    """Two run folders of one config, one per trainer: the same loss at every step (bitwise),
    the same final weights and metrics (to float noise)."""
    import torch

    losses = [
        json.loads((run / "step_stats.json").read_text())["losses"] for run in (lightning, raw)
    ]
    assert len(losses[1]) >= 20
    assert losses[0] == losses[1]  # bitwise, every step
    a, b = final_weights(lightning), final_weights(raw)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=0)
    metrics = [json.loads((run / "metrics.json").read_text()) for run in (lightning, raw)]
    shared = [k for k in metrics[1] if k in metrics[0]]  # Lightning also logs lr, loss_step
    assert {"val/loss", "test/loss"} <= set(shared)
    for key in shared:
        assert metrics[0][key] == pytest.approx(metrics[1][key], abs=1e-6), key


def run_trainer(module: str, args: list[str], run_dir: Path, nproc: int = 1) -> dict:
    """Train `module` with `args` into `run_dir` (under torchrun with `nproc` processes);
    returns its step_stats.json."""
    cmd = torchrun(["-m", module, *args, f"hydra.run.dir={run_dir}"], nproc)
    code, out = finish(start(cmd, **(exit_check_env() if nproc > 1 else {})), timeout=240)
    assert code == 0, out[-4000:]
    if nproc > 1:
        assert_groups_closed(out, nproc)
    return json.loads((run_dir / "step_stats.json").read_text())


def assert_parity(tmp: Path, args: list[str], nproc: int = 1) -> None:
    """Both trainers on `args` (into tmp/lightning and tmp/raw) train identically."""
    for module, trainer in (("project.train", "lightning"), ("project.raw_train", "raw")):
        run_trainer(module, args, tmp / trainer, nproc)
    assert_same_training(tmp / "lightning", tmp / "raw")


def block_forever() -> None:
    """A process stuck in user code (what a hang report must find in a DataLoader worker)."""
    import time

    while True:
        time.sleep(3600)


class StuckReads:
    """A dataset whose first read records its worker's pid (`<folder>/worker-<pid>`) and
    never returns: a DataLoader worker stuck in a user's dataset code."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        import time

        Path(self.folder, f"worker-{os.getpid()}").touch()
        while True:
            time.sleep(3600)


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# The sharded-checkpoint tests' FSDP2 training (tests/fsdp_mlp.py): 8 steps, `last` every 2.
FSDP_MLP = ROOT / "tests" / "fsdp_mlp.py"


def fsdp_mlp(folder: Path | str, *args: str, nproc: int = 2, ok: bool = True) -> tuple[int, str]:
    """Run tests/fsdp_mlp.py under torchrun with `nproc` processes (1 too: it needs a process
    group) saving into `folder` (a path, or a URL as a string); (exit code, output). `ok`: it
    must exit 0 with every worker's process groups closed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(FSDP_MLP), "--folder", str(folder), *args]  # fmt: skip
    code, out = finish(start(cmd, **(exit_check_env() if ok else {})), timeout=180)
    if ok:
        assert code == 0, out[-4000:]
        assert_groups_closed(out, nproc)
    return code, out


def assert_same_tensors(a: dict[str, Any], b: dict[str, Any], atol: float = 0.0) -> float:
    """The same keys and tensors (bitwise with atol=0); returns the largest difference."""
    import torch

    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    worst = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    if atol == 0.0:
        assert all(torch.equal(a[k], b[k]) for k in a), f"differ by up to {worst}"
    assert worst <= atol, worst
    return worst


def assert_same_tree(a: Any, b: Any, where: str = "") -> None:
    """Nested dicts and lists with bitwise equal tensors and equal plain values."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: {a.keys() ^ set(b)}"
        for key in a:
            assert_same_tree(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: lengths"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
