"""The tests' fixtures and hooks (plain helpers live in tests/helpers.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from tests.helpers import (
    CONFIG_DIR,
    POWERSGD,
    QUIET,
    STARTED,
    TORCHRUN_ARGS,
    Run,
    assert_groups_closed,
    exit_check_env,
    finish,
    job_processes,
    kill_job,
    launcher,
    run_launch,
    s3_server,
    start,
)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One materialised dataset for the whole session (saves ~1 s of sklearn per run)."""
    from project.data.digits import materialise

    return materialise(tmp_path_factory.mktemp("data") / "digits")


@pytest.fixture(scope="session")
def s3_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The request log of the session's S3 server (tests/helpers.py: s3_gets counts in it)."""
    return tmp_path_factory.mktemp("s3") / "requests.log"


@pytest.fixture(scope="session")
def s3_server_env(s3_log: Path) -> Iterator[dict[str, str]]:
    """One real S3 server (moto) for the session; its AWS environment (tests/helpers.py)."""
    with s3_server(log=s3_log) as env:
        yield env


@pytest.fixture
def s3(s3_server_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An empty bucket of its own on the session's S3 server: yields its URL (`s3://<name>`).
    The AWS environment is set in this process (s3fs, boto3) and so in every child the test
    starts (tests/helpers.py's child_env copies os.environ)."""
    import uuid

    import fsspec

    for key, value in s3_server_env.items():
        monkeypatch.setenv(key, value)
    fsspec.filesystem("s3").clear_instance_cache()  # no client of another test's environment
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir(bucket)
    yield f"s3://{bucket}"
    with contextlib.suppress(OSError):
        fs.rm(bucket, recursive=True)


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

    from project.engine.config.compose import register_resolvers

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


DISTRIBUTED_TIMEOUT_S = 300  # a 2-process test here takes well under a minute


# Module/session fixtures that train or set up something expensive. `make test` runs tests
# in parallel (pytest-xdist, --dist loadgroup): the tests sharing one of them go to the same
# worker, so it is built once, and the SLURM tests never queue behind each other's jobs.
SHARED_RUNS = (
    "default_run",
    "torchrun_runs",
    "finished_runs",
    "generated",
    "slurm",
    "fsdp_whole",
    "fsdp_stopped",
    "stream_runs",
    "powersgd_whole",
)


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


@pytest.fixture(autouse=True)
def reap_processes() -> Iterator[None]:
    """Whatever ends a test (a failure, pytest-timeout's limit), the jobs it started are
    killed afterwards (every process of each, also those in sessions of their own: torchrun's
    workers), and the output of any still running is printed (pytest shows it with the
    failure)."""
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None or job_processes(proc):
            kill_job(proc)
            with contextlib.suppress(ValueError, subprocess.TimeoutExpired):
                out, _ = proc.communicate(timeout=10)
                print(f"--- killed after the test: {' '.join(proc.args)}\n{(out or '')[-3000:]}")


@pytest.fixture(scope="session")
def powersgd_whole(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    """The run folder of POWERSGD trained to its end by Lightning on 2 processes, once per
    session: where the PowerSGD resumes end, locally and through S3, in both trainers (they
    train bitwise alike)."""
    log_dir = tmp_path_factory.mktemp("powersgd") / "logs"
    args = [f"paths.data_dir={data_dir}", f"paths.log_dir={log_dir}", *QUIET, *POWERSGD]
    code, out = finish(start(launcher(["-m", "project.train", *args]), RUN_ID="whole"), 240)
    assert code == 0, out[-3000:]
    return log_dir / "train" / "runs" / "whole"


@pytest.fixture(scope="session")
def torchrun_runs(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Callable:
    """(*overrides, trainer="lightning", attempt=0) -> the Run of `launch/single_node.sh` with
    2 processes, TORCHRUN_ARGS and the overrides, made once per session: the DDP-option,
    launcher and parity tests share them. Another `attempt` is the same command again, in
    the same log folder; attempt 1 starts its workers cold (PROJECT_WARM_START=0, the others
    fork them from the launcher's warm process): the rerun test then also checks that both
    compute the same. Every worker must have closed its process group."""
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
            cold = {"PROJECT_WARM_START": "0"} if attempt == 1 else {}
            out = run_launch("single_node.sh", args, NPROC_PER_NODE="2", TRAINER=trainer,
                             **exit_check_env(), **cold)  # fmt: skip
            assert_groups_closed(out, 2)
            (run_dir,) = set(runs.iterdir()) - before  # a folder of its own
            done[overrides, trainer, attempt] = Run(run_dir, out)
        return done[overrides, trainer, attempt]

    return get


@pytest.fixture
def netns_pair():
    """Two network namespaces joined by a veth pair: two hosts with a real interface between."""
    import shutil
    import uuid

    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (`ip`) to create network namespaces")
    tag = uuid.uuid4().hex[:6]
    ns, dev = (f"pj{tag}a", f"pj{tag}b"), (f"vj{tag}a", f"vj{tag}b")
    addrs = ("198.18.0.1", "198.18.0.2")  # benchmark-test range: never a real host

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    try:
        ip("netns", "add", ns[0])
        ip("netns", "add", ns[1])
        ip("link", "add", dev[0], "type", "veth", "peer", "name", dev[1])
        for i in range(2):
            ip("link", "set", dev[i], "netns", ns[i])
            ip("-n", ns[i], "addr", "add", f"{addrs[i]}/24", "dev", dev[i])
            ip("-n", ns[i], "link", "set", dev[i], "up")
            ip("-n", ns[i], "link", "set", "lo", "up")
    except subprocess.CalledProcessError as err:
        for name in ns:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        pytest.skip(f"cannot create network namespaces here: {err.stderr.decode().strip()}")
    yield ns, dev, addrs
    for name in ns:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
