"""Shared test helpers: run the real CLIs in subprocesses, compose configs in-process."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "configs"

# Quiet, fast, reproducible children: one thread per rank (2 threads per rank on 2 cores makes
# DDP ~4x slower and changes losses at 1e-7), no progress bar noise.
QUIET = ["trainer.enable_progress_bar=false", "callbacks.progress_bar=null"]
# experiment=charlm, small: 2 epochs of 12 steps of 8 windows of 32 characters, a narrow GPT.
CHARLM = ["experiment=charlm", "trainer.max_epochs=2", "trainer.limit_train_batches=12",
          "trainer.limit_val_batches=4", "trainer.limit_test_batches=2", "model.net.d_model=32",
          "model.net.n_head=2", "data.batch_size=8", "data.dataset.block_size=32"]  # fmt: skip


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RUN_ID", "HYDRA_FULL_ERROR")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
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


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One materialised dataset for the whole session (saves ~1 s of sklearn per run)."""
    from project.data.digits import materialise

    return materialise(tmp_path_factory.mktemp("data") / "digits")


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    return tmp_path / "logs"


@pytest.fixture
def base_args(data_dir: Path, log_dir: Path) -> list[str]:
    """Overrides every CLI test needs: its own log folder, the shared data, quiet output."""
    return [f"paths.data_dir={data_dir}", f"paths.log_dir={log_dir}", *QUIET]


@pytest.fixture
def compose_train(data_dir: Path, tmp_path: Path) -> Iterator:
    """compose(overrides) -> the train config as `python train.py` would see it, in-process."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from project.engine.config import register_resolvers

    register_resolvers()

    def _compose(overrides: Sequence[str] = (), config_name: str = "train"):
        out = tmp_path / "run"
        out.mkdir(exist_ok=True)
        cfg = compose(
            config_name,
            overrides=[f"paths.data_dir={data_dir}", f"paths.output_dir={out}", *overrides],
            return_hydra_config=True,
        )
        cfg.hydra.runtime.output_dir = str(out)
        HydraConfig.instance().set_config(cfg)
        with open_dict(cfg):
            del cfg["hydra"]  # as in a real run: the task never sees the hydra node
        return cfg

    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        yield _compose
    GlobalHydra.instance().clear()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_alive(pgid: int) -> bool:
    """Whether any process of process group `pgid` still exists."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


DISTRIBUTED_TIMEOUT_S = 300  # a 2-process test here takes well under a minute


# Module/session fixtures that train or set up something expensive. `make test` runs tests
# in parallel (pytest-xdist, --dist loadgroup): the tests sharing one of them go to the same
# worker, so it is built once, and the SLURM tests never queue behind each other's jobs.
SHARED_RUNS = ("default_run", "torchrun_runs", "finished_runs", "generated", "slurm")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tighter limits for the distributed tests (unless a test sets its own); one xdist
    worker per shared run."""
    for item in items:
        if item.get_closest_marker("distributed") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(DISTRIBUTED_TIMEOUT_S))
        shared = [name for name in SHARED_RUNS if name in getattr(item, "fixturenames", ())]
        if shared:
            item.add_marker(pytest.mark.xdist_group(shared[0]))


STARTED: list[subprocess.Popen[str]] = []  # this test's process groups (see reap_processes)


def start(cmd: Sequence[str], **env: str) -> subprocess.Popen[str]:
    """Start `cmd` from the repo root in its own process group (so a test can see strays)."""
    proc = subprocess.Popen(
        list(cmd), cwd=ROOT, env=child_env(**env), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    STARTED.append(proc)
    return proc


@pytest.fixture(autouse=True)
def reap_processes() -> Iterator[None]:
    """Whatever ends a test (a failure, pytest-timeout's limit), the process groups it started
    are killed afterwards, and the output of any still running is printed (pytest shows it
    with the failure)."""
    import signal

    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None or group_alive(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(ValueError, subprocess.TimeoutExpired):
                out, _ = proc.communicate(timeout=10)
                print(f"--- killed after the test: {' '.join(proc.args)}\n{(out or '')[-3000:]}")


def finish(proc: subprocess.Popen[str], timeout: float = 180) -> tuple[int, str]:
    """Wait for `proc`; kill its whole group if it overruns. Returns (exit code, output)."""
    import signal
    import time

    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s:\n{out[-3000:]}") from None
    deadline = time.monotonic() + 10
    while group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_alive(proc.pid), f"processes left behind by {proc.args}"
    return proc.returncode, out


def run_launch(script: str, args: Sequence[str], timeout: float = 180, **env: str) -> str:
    """Run a launch script to success; returns its output."""
    code, out = finish(start([str(ROOT / "launch" / script), *args], **env), timeout)
    assert code == 0, out[-4000:]
    return out


# The 2-process runs of torchrun_runs: 2 epochs of 10 steps per rank, every step's loss in
# TensorBoard and in step_stats.json.
TORCHRUN_ARGS = ["trainer.max_epochs=2", "trainer.log_every_n_steps=1", "step_stats=true",
                 *QUIET]  # fmt: skip


@dataclass
class Run:
    dir: Path  # the run folder
    out: str  # what the job printed


@pytest.fixture(scope="session")
def torchrun_runs(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Callable:
    """(*overrides, trainer="lightning", attempt=0) -> the Run of `launch/single_node.sh` with
    2 processes, TORCHRUN_ARGS and the overrides, made once per session: the DDP-option,
    launcher and parity tests share them. Another `attempt` is the same command again, in
    the same log folder. Every worker must have closed its process group."""
    done: dict[tuple, Run] = {}
    log_dirs: dict[tuple, Path] = {}

    def get(*overrides: str, trainer: str = "lightning", attempt: int = 0) -> Run:
        if (overrides, trainer, attempt) not in done:
            if attempt:
                get(*overrides, trainer=trainer, attempt=attempt - 1)
            log_dir = log_dirs.setdefault((overrides, trainer), tmp_path_factory.mktemp("tr"))
            runs = log_dir / "train" / "runs"
            before = set(runs.iterdir()) if runs.exists() else set()
            args = [f"paths.data_dir={data_dir}", f"paths.log_dir={log_dir}", *TORCHRUN_ARGS,
                    *overrides]  # fmt: skip
            out = run_launch("single_node.sh", args, NPROC_PER_NODE="2", TRAINER=trainer,
                             **exit_check_env())  # fmt: skip
            assert_groups_closed(out, 2)
            (run_dir,) = set(runs.iterdir()) - before  # a folder of its own
            done[overrides, trainer, attempt] = Run(run_dir, out)
        return done[overrides, trainer, attempt]

    return get
