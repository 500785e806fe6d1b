"""The test harness itself: a hung test fails, and nothing it started outlives it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, child_env, finish, group_alive, process_tree, start

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


# A launcher whose child outlives it in a session of its own, as a torchrun worker does when
# its agent dies: init adopts the child, outside the launcher's process group and tree.
ORPHAN = """
import subprocess, sys
out = None if sys.argv[1] == "holds-output" else subprocess.DEVNULL
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         stdout=out, stderr=out, start_new_session=True)
print(child.pid, flush=True)
"""


def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def ends_soon(pid: int, within_s: float = 5) -> bool:
    deadline = time.monotonic() + within_s
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not running(pid)


@pytest.mark.parametrize("output", ["own-output", "holds-output"])
def test_finish_sees_a_leftover_in_a_session_of_its_own(output: str) -> None:
    """finish() used to look for leftovers only in the launcher's process group, and on a
    timeout killed only the launcher's tree: a process in a session of its own whose parent
    died was in neither, and ran on. Now it is found (by the job's mark), killed, and fails
    the test: as a leftover, or, if it keeps the job's output open, as a timeout."""
    proc = start([sys.executable, "-c", ORPHAN, output])
    orphan = int(proc.stdout.readline())
    proc.wait(timeout=60)
    try:
        # What the old check looked at misses it.
        assert running(orphan)
        assert not group_alive(proc.pid) and orphan not in process_tree(proc.pid)
        expected = "timed out" if output == "holds-output" else f"left behind.*{orphan}"
        with pytest.raises(AssertionError, match=expected):
            finish(proc, timeout=2, settle_s=0.5)
        assert ends_soon(orphan), f"finish() left {orphan} running"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(orphan, signal.SIGKILL)


def test_finish_passes_a_job_that_leaves_nothing() -> None:
    proc = start([sys.executable, "-c", ORPHAN.replace("time.sleep(120)", "pass"), "own-output"])
    began = time.monotonic()
    assert finish(proc, timeout=60)[0] == 0
    assert time.monotonic() - began < 5  # waits only while something of the job runs
