"""The test harness itself: a hung test fails, and nothing it started outlives it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import ROOT, child_env

pytestmark = pytest.mark.quick  # the fast tier: `make test`


def run_pytest(test_file: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A pytest session of its own on `test_file`, with this suite's conftest and settings."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", str(test_file), "-p", "tests.conftest", "-p",
         "no:cacheprovider", "-q", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT),
         *args],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_hung_test_fails_and_its_processes_are_killed(tmp_path) -> None:
    pid_file = tmp_path / "child.pid"
    hung = tmp_path / "test_hung.py"
    hung.write_text(
        textwrap.dedent(f"""
        import sys
        import pytest
        from tests.helpers import start

        @pytest.mark.timeout(3)
        def test_hangs():
            code = ("import os, time; print('child says hi', flush=True); "
                    "open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)")
            start([sys.executable, "-c", code]).wait()
    """)
    )
    proc = run_pytest(hung)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "Timeout" in proc.stdout and "child says hi" in proc.stdout, proc.stdout[-3000:]
    pid = int(pid_file.read_text())
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return
    raise AssertionError(f"the hung test's child {pid} is still running")


def test_tests_sharing_a_run_stay_on_one_worker(tmp_path) -> None:
    """`make test` runs tests in parallel: the ones sharing an expensive fixture (conftest's
    SHARED_RUNS) must run on one worker, or it is built once per worker and the SLURM tests
    queue behind each other. pytest 9.2 broke this silently (pytest-xdist#1386)."""
    builds = tmp_path / "builds"
    probe = tmp_path / "test_groups.py"
    probe.write_text(
        textwrap.dedent(f"""
        import os
        import pytest

        @pytest.fixture(scope="module")
        def torchrun_runs():  # a name from SHARED_RUNS
            with open({str(builds)!r}, "a") as f:
                f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")

        @pytest.mark.parametrize("i", range(8))
        def test_shared(torchrun_runs, i):
            pass

        @pytest.mark.parametrize("i", range(8))
        def test_alone(i):
            pass
    """)
    )
    proc = run_pytest(probe, "-n", "2", "--dist", "loadgroup")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert len(builds.read_text().split()) == 1, "the shared fixture was built on every worker"
