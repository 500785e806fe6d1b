"""Each rank's ledger: what it is doing, in the user's terms, kept where a crash cannot erase it.

A mark says "from now on this rank is in `phase` at optimizer step `step`" and records how
many collectives the rank has issued so far (the process group's sequence number). The
collectives themselves (operation, sequence number, sizes, completed or not) are recorded by
torch's Flight Recorder, which the run keeps on with more than one process (`flight_recorder_env`);
the marks say which step and which part of it issued each one. The time between two marks
goes to one bucket of the run's goodput (project.engine.run.goodput): start-up, productive
training, validation, checkpoint saves, and what failures cost.

The latest mark and the buckets live in a small memory-mapped file,
`<run>/ledger/rank-<R>.bin`: the kernel keeps what was written when the process is SIGKILLed
or aborts inside gloo/NCCL, so the hang report names where a dead rank was and the next
attempt knows how far the last one got. A fatal signal also leaves the rank's Python stacks
in `rank-<R>.crash` (faulthandler). A mark costs about a microsecond (docs/performance.md).
"""

from __future__ import annotations

import contextlib
import faulthandler
import mmap
import os
import socket
import struct
import sys
import sysconfig
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from project.engine.launch.warm import STARTED_ENV

# Phases, in the order a step goes through them (ids are stored in the file).
STARTUP, RELOAD, STEP, OPTIMIZER, STOP_CHECK, CHECKPOINT, VALIDATION = range(7)
EPOCH_END, FAULT, TEST, DETECTION, FINISHED = range(7, 12)
DATA, COMPILE, DOWNLOAD = range(12, 15)  # later additions keep the ids above
PHASES = (
    "start-up", "checkpoint reload", "forward/backward (gradient sync)", "optimizer step",
    "stop check", "checkpoint save", "validation (metric sync)", "epoch end (metric sync)",
    "fault injection", "test", "failure detection", "finished", "waiting for data",
    "compiling (torch.compile)", "downloading data",
)  # fmt: skip
TRAINING = (STEP, OPTIMIZER, STOP_CHECK, FAULT, DATA)  # phases inside the training steps

BUCKETS = ("startup", "productive", "validation", "checkpoint", "detection", "restart",
           "reload", "recomputed", "other")  # fmt: skip
_BUCKET_OF = {
    STARTUP: 0,
    RELOAD: 6,
    CHECKPOINT: 3,
    VALIDATION: 2,
    EPOCH_END: 2,
    TEST: 8,
    DETECTION: 4,
    FINISHED: 8,
    COMPILE: 8,
    DOWNLOAD: 8,
}  # fmt: skip; TRAINING: productive or recomputed
PRODUCTIVE, RESTART, RECOMPUTED = 1, 5, 7

FOLDER = "ledger"
FR_BUFFER = 2000  # Flight Recorder entries kept (the last collectives): torch 2.13's default
# How an attempt ended (0: still running, or killed before it could say)
RUNNING, ENDED_OK, ENDED_STOPPED, ENDED_HUNG, ENDED_FAILED = range(5)

_HEAD = struct.Struct("<4sIiid64s64s")  # magic, pid, rank, world, started, host, job
_LIVE = struct.Struct("<qiqd9did")  # step, phase, seq, at, buckets, ended, end time
_LIVE_AT = 256
_MAGIC = b"LDG1"


def job_id(env: dict[str, str] | os._Environ = os.environ) -> str:
    """The scheduler's or launcher's job: restarts and requeues of one job share it ("": none
    known; torchrun's static rendezvous says "none")."""
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    return (run_id if run_id != "none" else "") or env.get("SLURM_JOB_ID") or ""


_first_job = [True]  # a sweep runs several jobs in one process: only the first started with it


def job_start() -> float:
    """When this job started: the process's start for the first job in it (interpreter start
    and imports are start-up), else now (the next job of an in-process sweep)."""
    if not _first_job[0]:
        return time.time()
    _first_job[0] = False
    return min(process_start(), time.time())  # /proc's boot time is whole seconds


def process_start() -> float:
    """When this process started (wall clock), or the warm process it was forked from."""
    if STARTED_ENV in os.environ:
        with contextlib.suppress(ValueError):
            return float(os.environ[STARTED_ENV])
    with contextlib.suppress(OSError, ValueError, IndexError):
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))  # fmt: skip
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    return time.time()


def flight_recorder_env(env: dict[str, str] | os._Environ = os.environ) -> None:
    """Keep torch's Flight Recorder on (before the process group exists) unless the user set
    it: recent torch records gloo and NCCL collectives by default, older releases only when
    asked (TORCH_NCCL_TRACE_BUFFER_SIZE, its older name, is deprecated); on CUDA, NCCL also
    dumps it on a timeout."""
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env:  # the user's, under its older name
        env.setdefault("TORCH_FR_BUFFER_SIZE", str(FR_BUFFER))
    env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")


@dataclass(frozen=True)
class Record:
    """A rank's ledger file, read back (also a dead rank's)."""

    pid: int
    rank: int
    world: int
    started: float
    host: str
    job: str
    step: int
    phase: int
    seq: int
    at: float  # wall time of the latest mark
    buckets: tuple[float, ...]
    ended: int  # RUNNING, ENDED_*
    end: float

    @property
    def phase_name(self) -> str:
        return PHASES[self.phase] if 0 <= self.phase < len(PHASES) else f"phase {self.phase}"

    def alive(self) -> bool | None:
        """Whether its process still runs (None: on another host, cannot tell)."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return Path(f"/proc/{self.pid}").is_dir() and not _zombie(self.pid)


def _zombie(pid: int) -> bool:
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    return False


def read(path: Path) -> Record | None:
    """A ledger file's content (None: missing, or not a ledger)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < _LIVE_AT + _LIVE.size or data[:4] != _MAGIC:
        return None
    _, pid, rank, world, started, host, job = _HEAD.unpack_from(data)
    step, phase, seq, at, *rest = _LIVE.unpack_from(data, _LIVE_AT)
    buckets, ended, end = tuple(rest[:9]), rest[9], rest[10]
    return Record(pid, rank, world, started, _text(host), _text(job), step, phase, seq, at,
                  buckets, ended, end)  # fmt: skip


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode(errors="replace")


class Ledger:
    """This rank's ledger (see the module docstring). `mark` is on the per-step path."""

    def __init__(self, run_dir: Path | None, world: int) -> None:
        self.rank, self.world = 0, world  # the rank is known once the process group is
        self.started = job_start()
        self.created = time.time()  # before any collective of this attempt (the hang report)
        self.step, self.phase, self.at = 0, STARTUP, self.started
        self.progress = time.monotonic()  # the watchdog's clock: the latest mark or touch
        self.buckets = [0.0] * len(BUCKETS)
        self.replay_until = 0  # steps up to this one were trained before: recomputed
        # The longest recent window (decaying): a model whose steps take minutes is not hung
        # after step_timeout_s (project.engine.distributed.hangs).
        self.window_s = 0.0
        self._window_at: float | None = None
        self.resumed_after_failure = False  # start-up is then the restart's cost
        self._seq: Callable[[], int] = lambda: 0
        self._map: mmap.mmap | None = None
        self._crash: Any = None
        self._faulthandler_was_on = False
        self.ended = False  # the attempt's record is closed (goodput)
        self.run_dir = run_dir
        self.folder = None if run_dir is None else run_dir / FOLDER

    def path_of(self, rank: int) -> Path | None:
        return None if self.folder is None else self.folder / f"rank-{rank}.bin"

    @property
    def path(self) -> Path | None:
        return self.path_of(self.rank)

    def open(self, rank: int) -> None:
        """Start this attempt's file for `rank` (the marks so far are kept)."""
        self.rank = rank
        if self.folder is None or self._map is not None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"rank-{rank}.bin", "w+b") as f:  # a new attempt, a new record
            f.truncate(_LIVE_AT + _LIVE.size)
            self._map = mmap.mmap(f.fileno(), 0)
        head = (_MAGIC, os.getpid(), rank, self.world, self.started,
                socket.gethostname().encode()[:64], job_id().encode()[:64])  # fmt: skip
        _HEAD.pack_into(self._map, 0, *head)
        self._write()
        # A fatal signal (an abort inside gloo/NCCL, a segfault) leaves every thread's stack.
        self._crash = open(self.folder / f"rank-{rank}.crash", "w")  # noqa: SIM115
        self._faulthandler_was_on = faulthandler.is_enabled()  # e.g. pytest's
        faulthandler.enable(self._crash, all_threads=True)

    def attach(self, sequence_number: Callable[[], int]) -> None:
        """Count collectives with the process group's sequence number (once it exists)."""
        self._seq = sequence_number

    def mark(self, phase: int, step: int) -> None:
        """From now on this rank is in `phase` at optimizer step `step` (steps done)."""
        now, progress = time.time(), time.monotonic()
        self.buckets[self._bucket()] += now - self.at
        if phase not in TRAINING:
            self._window_at = None  # validation, a save...: the next window is not measured
        elif phase == STEP and self._window_at is None:
            self._window_at = progress  # after a save at the window start: measured from here
        self.phase, self.step, self.at, self.progress = phase, step, now, progress
        self._write()

    def window_start(self) -> None:
        """An accumulation window (optimizer step) starts: how long did the last one take?
        Called before the step deadline is set from `window_s`, so the first window measured
        already stretches the second one's deadline."""
        progress = time.monotonic()
        if self._window_at is not None:
            self.window_s = max(progress - self._window_at, 0.9 * self.window_s)
        self._window_at = progress

    @contextlib.contextmanager
    def during(self, phase: int) -> Iterator[None]:
        """In `phase` for a while (a checkpoint load), then back in the phase it was in."""
        previous = self.phase
        self.mark(phase, self.step)
        try:
            yield
        finally:
            self.mark(previous, self.step)

    def fetching(self, batches: Iterable[Any]) -> Iterator[Any]:
        """`batches`, each fetch between two steps booked to DATA (then back to the phase it
        was in): a stuck loader is reported as waiting for data, not as the step before."""
        batches = iter(batches)
        while True:
            previous = self.phase
            if previous in TRAINING:
                self.mark(DATA, self.step)
            try:
                batch = next(batches)
            except StopIteration:
                return
            finally:
                if previous in TRAINING:
                    self.mark(previous, self.step)
            yield batch

    def stalled(self) -> None:
        """A stall or a failure was noticed: the time since the last mark went to detecting it."""
        self.phase = DETECTION
        self.mark(DETECTION, self.step)

    @property
    def opened(self) -> bool:
        return self._map is not None

    def touch(self) -> None:
        """Progress inside a long phase (a validation batch): the watchdog's clock only."""
        self.progress = time.monotonic()

    def _bucket(self) -> int:
        if self.phase in TRAINING:
            return RECOMPUTED if self.step < self.replay_until else PRODUCTIVE
        if self.phase == STARTUP and self.resumed_after_failure:
            return RESTART
        return _BUCKET_OF[self.phase]

    def _write(self, ended: int = RUNNING, end: float = 0.0) -> None:
        if self._map is not None:
            _LIVE.pack_into(self._map, _LIVE_AT, self.step, self.phase, self._seq(), self.at,
                            *self.buckets, ended, end)  # fmt: skip

    def end(self, how: int) -> float:
        """The attempt ends now (`how`: ENDED_*): the time since the last mark is booked."""
        self.mark(FINISHED if how in (ENDED_OK, ENDED_STOPPED) else DETECTION, self.step)
        self._write(how, self.at)
        return self.at

    def close(self) -> None:
        """At a clean exit: the crash file goes when nothing was written to it."""
        if self._crash is not None:
            faulthandler.disable()
            if self._faulthandler_was_on:
                faulthandler.enable(all_threads=True)  # to stderr, as it was
            self._crash.close()
            path = Path(self._crash.name)
            if path.is_file() and path.stat().st_size == 0:
                path.unlink()
            self._crash = None

    def record(self) -> Record | None:
        return None if self.path is None else read(self.path)

    def seq(self) -> int:
        return self._seq()


# --- what a report shows of a rank ---------------------------------------------------------
_LIBRARY = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})


def is_user_code(filename: str) -> bool:
    """The project's or the user's code: not Python's, not an installed package's."""
    return not filename.startswith(("<", *_LIBRARY)) and "site-packages" not in filename


def where(frames: list[traceback.FrameSummary] | list[dict[str, Any]]) -> str:
    """ "file:line function" of the innermost frame of user code (else the innermost one)."""
    rows = [(f["filename"], f["line"], f["name"]) if isinstance(f, dict)
            else (f.filename, f.lineno, f.name) for f in frames]  # fmt: skip
    for filename, line, name in reversed(rows):
        if is_user_code(filename):
            return f"{_short(filename)}:{line} {name}"
    return f"{_short(rows[-1][0])}:{rows[-1][1]} {rows[-1][2]}" if rows else "?"


def _short(filename: str) -> str:
    with contextlib.suppress(ValueError):
        return os.path.relpath(filename)
    return filename


def thread_stacks() -> tuple[list[traceback.FrameSummary], str]:
    """The main thread's frames, and every thread's stack as text (faulthandler's layout)."""
    import threading

    names = {t.ident: t.name for t in threading.enumerate()}
    main, text = [], []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue  # the reporting thread itself
        stack = traceback.extract_stack(frame)
        if ident == threading.main_thread().ident:
            main = stack
        text.append(f"Thread {names.get(ident, ident)}:\n" + "".join(traceback.format_list(stack)))
    return main, "\n".join(text)
