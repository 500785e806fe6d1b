"""How a worker ends, in one place: the exit codes, the stop, the exit report to the launcher,
and closing the process group.

One exit code means one thing, for both trainers, eval, the doctor and `project.launcher`:
0 finished, 1 anything else, 2 bad input (one line said why), 124 the ranks stopped making
progress (a hang: the report in <run>/hang/ says where; `timeout`'s code), 143 stopped by a
signal after saving the last checkpoint (the stop prints `RUN_ID=<id> <command>`, which resumes
it). 143 is 128 + SIGTERM, what a process killed by SIGTERM reports, so schedulers treat it as
"terminated", not "failed".

Only the standard library is imported at the top: `project.launcher` and every entry point
import this module before anything heavy.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

from project.engine.launch.env import rank

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_TEMPFAIL = 75  # sysexits' EX_TEMPFAIL: a failure the ranks said in one line that may not
# happen again (a save the disk or the object store refused): restarted like a crash
EXIT_HUNG = 124
EXIT_PREEMPTED = 143
NO_RESTART = (EXIT_BAD_INPUT, EXIT_PREEMPTED)  # a restart would repeat the error, or fight the
# scheduler that is taking the machine away

EXIT_DIR_ENV = "PROJECT_EXIT_DIR"  # the folder project.launcher reads the workers' codes from


def one_line(message: str) -> str:
    """Hydra's messages span lines and end with its config search path: keep the useful part."""
    message = str(message).split("Config search path:")[0]
    return " ".join(message.split())


def fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    """Print one line naming the problem (and the fix) and exit with `code`."""
    line = f"error: {one_line(message)}\n"
    if not _said_on_this_node(line):
        # One write (print writes the text and the newline apart): the lines of ranks failing
        # at once reach a shared pipe whole, not run together.
        sys.stderr.write(line)
        sys.stderr.flush()
    sys.exit(code)


def _said_on_this_node(line: str) -> bool:
    """Whether another worker of this node's launcher printed this very line already (bad
    input fails every rank alike: the user reads it once, not once per rank)."""
    folder = os.environ.get(EXIT_DIR_ENV)
    if not folder or not os.path.isdir(folder):
        return False
    said = Path(folder, "said-" + hashlib.sha256(line.encode()).hexdigest()[:16])
    try:
        os.close(os.open(said, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return True
    except OSError:  # the folder went with the process that made it: say it
        return False
    return False


_own_folder: str | None = None  # the EXIT_DIR_ENV folder this process made for its ranks


def say_once_for_my_ranks() -> None:
    """Before this process starts the other ranks of its node itself (Lightning's own
    launcher): they inherit a folder, so that an error line every rank prints is shown once,
    as under project.launcher. Removed when this process exits (`exit_now` too)."""
    global _own_folder
    if os.environ.get(EXIT_DIR_ENV):  # project.launcher's, or the one rank 0 handed down
        return
    _own_folder = tempfile.mkdtemp(prefix="project-exit-")
    os.environ[EXIT_DIR_ENV] = _own_folder
    atexit.register(shutil.rmtree, _own_folder, ignore_errors=True)


def exit_now(code: int) -> NoReturn:
    """End this process with `code` at once, from any thread (the main one may wait inside a
    C call that no exception reaches): no interpreter shutdown, as a kill would."""
    if _own_folder is not None:
        shutil.rmtree(_own_folder, ignore_errors=True)
    os._exit(code)


class TemporaryFailure(Exception):
    """What the run could not do this time, the previous state intact (a save refused: `last`
    is still the one before): one line, exit EXIT_TEMPFAIL, which --max-restarts retries."""


class Preempted(Exception):
    """Every rank agreed to stop on a signal and the last checkpoint is saved
    (project.engine.distributed.signals); the run skeleton exits with EXIT_PREEMPTED."""

    def __init__(self, step: int, checkpoint: Path | str | None) -> None:
        super().__init__(f"stopped by a signal at step {step}")
        self.step, self.checkpoint = step, checkpoint  # None: nothing saved (fast_dev_run)


RESUME_FILE = "resume"  # next to the workers' rank-<R> files


@contextlib.contextmanager
def report_exit() -> Iterator[None]:
    """Around a worker's main(): record its exit code for the launcher (when there is one).

    torchrun does not collect its workers' exit codes when it is the one that was signalled.
    """
    code: int | str | None = EXIT_FAILED
    try:
        yield
        code = EXIT_OK
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
        raise
    finally:
        record_exit(code)


def record_exit(code: int | str | None) -> None:
    """Tell the launcher this worker's exit code (also before an `os._exit`)."""
    folder = os.environ.get(EXIT_DIR_ENV)
    if folder and os.path.isdir(folder):
        # A rank Lightning's launcher started can outlive rank 0, which removes the folder.
        with contextlib.suppress(FileNotFoundError):
            Path(folder, f"rank-{rank()}").write_text(str(code))


def record_resume(command: str) -> None:
    """Tell the launcher the command that resumes this run (its stop line prints it)."""
    folder = os.environ.get(EXIT_DIR_ENV)
    if folder and os.path.isdir(folder):
        Path(folder, RESUME_FILE).write_text(command)


def recorded_resume(folder: str) -> str | None:
    path = Path(folder, RESUME_FILE)
    return path.read_text() if path.is_file() else None


def worker_exits(folder: str) -> dict[int, int]:
    """{global rank: exit code} of the workers on this node that reported one."""
    codes = {}
    for path in Path(folder).glob("rank-*"):
        with contextlib.suppress(ValueError):
            codes[int(path.name.removeprefix("rank-"))] = int(path.read_text())
    return codes


def close_process_group() -> None:
    """Destroy the default process group, if any, before the interpreter shuts down.

    Left to interpreter shutdown, gloo's worker thread can still hold the tensors of the last
    collective and need the GIL to free them while the interpreter is being torn down: the
    process aborts ("terminate called without an active exception", exit -6) after a
    finished run, and torchrun reports the job failed (pytorch/pytorch#179291 explains it).
    Call it after the DDP wrapper is gone (Lightning unwraps it in its teardown; the raw
    trainer drops it first): the Reducer's destructor joins that same thread while holding
    the GIL.
    """
    import time

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        time.sleep(0.1)  # releases the GIL: the worker thread finishes with its tensors
        dist.destroy_process_group()
