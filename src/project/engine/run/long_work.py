"""Work that may take long inside the training steps, booked outside the step deadline.

Inside the steps a rank that makes no progress for `strategy.step_timeout_s` is reported as
hung (project.engine.distributed.ddp.CollectiveTimeout). Some work there is legitimately
longer, and no trainer hook announces it:

- a checkpoint save Lightning does not tell the callbacks about (`save_weights_only=True`:
  it skips their `on_save_checkpoint`); the strategy announces every save
  (project.engine.lightning.strategy);
- a torch.compile (re)compilation inside a step (a new shape, a guard that failed):
  torch.compile's compile callbacks announce it (`follow_compiles`);
- a remote shard a reader waits for (project.data.remote.cache: `ShardCache.downloading` is pointed
  here when this module is imported: every training rank imports it, and the fork server
  preloads it for its workers, project.engine.data.worker_start).

Each calls `during(phase)`: the rank switches to the long deadline (`strategy.timeout`, the
collectives too) and the ledger says what it does; afterwards it is back in the phase it
was in, and the short deadline returns at the second window after, as after validation.
In a DataLoader worker `during` leaves a note instead (an in-memory file); the rank's
watchdog reads its workers' notes when the rank has waited for data over a second
(`excuse_workers`). Elsewhere (no watched training, tests) nothing happens.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from project.data.shards import ShardCache
from project.engine.distributed import worker_stacks
from project.engine.distributed.ledger import COMPILE, DATA, DOWNLOAD
from project.engine.private_api import on_compile

if TYPE_CHECKING:
    from project.engine.distributed.ddp import CollectiveTimeout
    from project.engine.distributed.ledger import Ledger
    from project.engine.distributed.signals import StopSignal

_watched: tuple[int, Ledger, CollectiveTimeout, StopSignal] | None = None


def watch(ledger: Ledger, timeouts: CollectiveTimeout, stop: StopSignal) -> None:
    """Training starts in this process (project.engine.run.watch): announcements count."""
    global _watched
    _watched = (os.getpid(), ledger, timeouts, stop)
    follow_compiles()


def unwatch() -> None:
    global _watched
    _watched = None


@contextlib.contextmanager
def during(phase: int) -> Iterator[None]:
    """Long work in `phase` (a ledger phase) while the block runs, on the long deadline."""
    if not _here():
        with _noted(phase):  # a DataLoader worker: a note its rank's watchdog reads
            yield
        return
    ledger = _watched[1]  # type: ignore[index]
    previous = ledger.phase
    outside_steps(phase)
    try:
        yield
    finally:
        ledger.mark(previous, ledger.step)


def outside_steps(phase: int) -> None:
    """Long work begins (its end is the next mark): the long deadline, the ledger, no step
    timing (what the trainers' own `outside_steps` do)."""
    if not _here():
        return
    _, ledger, timeouts, stop = _watched  # type: ignore[misc]
    timeouts.outside_steps()
    ledger.mark(phase, ledger.step)
    if stop.stragglers is not None:
        stop.stragglers.pause()


def downloading(url: str) -> contextlib.AbstractContextManager[None]:
    """Around a remote shard's download, or a wait for one, that a reader cannot go on
    without (project.data.remote.cache.ShardCache; background prefetches are not booked)."""
    return during(DOWNLOAD)


ShardCache.downloading = staticmethod(downloading)  # type: ignore[method-assign]


NOTE = "project-long-work"
_note: IO[str] | None = None  # this worker's note: the phase of its long work, or empty


@contextlib.contextmanager
def _noted(phase: int) -> Iterator[None]:
    """In a DataLoader worker (elsewhere: nothing), the note says `phase` while the block
    runs: an anonymous in-memory file its rank reads through /proc (in_workers)."""
    global _note
    data = sys.modules.get("torch.utils.data")
    if data is None or data.get_worker_info() is None or not hasattr(os, "memfd_create"):
        yield
        return
    if _note is None:
        _note = os.fdopen(os.memfd_create(NOTE, os.MFD_CLOEXEC), "w")
    _write(_note, str(phase))
    try:
        yield
    finally:
        _write(_note, "")


def _write(note: IO[str], text: str) -> None:
    note.seek(0)
    note.truncate()
    note.write(text)
    note.flush()


def in_workers() -> int | None:
    """The phase of long work one of this process's DataLoader workers does now (a shard
    download), if any: its rank, waiting for the batch, is then on the long deadline too."""
    for fd in worker_stacks.in_descendants(NOTE):
        with contextlib.suppress(OSError, ValueError):
            if text := Path(fd).read_text():
                return int(text)
    return None


def excuse_workers(ledger: Ledger) -> None:
    """The watchdog, while its rank waits for data over a second: a worker's long work moves
    the rank to the long deadline (the rank's next mark ends it)."""
    waiting = ledger.phase == DATA and time.monotonic() - ledger.progress > 1.0
    if waiting and (phase := in_workers()) is not None:
        outside_steps(phase)


def _here() -> bool:
    """Training is watched in this process (a forked DataLoader worker inherits the module's
    state: only the training process acts on it)."""
    return _watched is not None and _watched[0] == os.getpid()


_compiling: list[contextlib.AbstractContextManager[None]] = []


def _compile_start(args: Any = None) -> None:
    work = during(COMPILE)
    work.__enter__()
    _compiling.append(work)


def _compile_end(args: Any = None) -> None:
    if _compiling:
        _compiling.pop().__exit__(None, None, None)


def follow_compiles() -> None:
    """Book torch.compile's compilations (once its compiler is loaded: Lightning loads it,
    the raw trainer when `model.compile` is set); at every training start, as
    `torch.compiler.reset()` drops the callbacks."""
    on_compile(_compile_start, _compile_end)
