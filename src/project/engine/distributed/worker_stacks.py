"""The Python stacks of a rank's DataLoader workers, for the hang report.

A worker stuck in the user's dataset leaves its rank waiting for data, and the rank's own
stack shows only torch's queue. So every process forked after this module is imported (a
worker forked from the rank, or from the fork server, which imports it first:
project.engine.data.worker_start) registers faulthandler on SIGNAL, writing into an
anonymous in-memory file of its own (a memfd: nothing on disk, nothing to clean up). The
report sends SIGNAL to the rank's descendants that catch it (a process that does not, a
spawned worker, is never sent it: its default action would end it) and reads each one's dump
through /proc/<pid>/fd. Linux only; elsewhere nothing is registered and nothing collected.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import signal
import time
from pathlib import Path
from typing import IO, Any

from project.engine.distributed.ledger import is_user_code, where

SIGNAL = signal.SIGRTMIN + 4 if hasattr(signal, "SIGRTMIN") else None  # used by nothing else
NAME = "project-worker-stacks"
LOADER = f"torch{os.sep}utils{os.sep}data{os.sep}dataloader.py"  # a rank waiting for a batch
# A DataLoader worker's main loop: the thread that runs the dataset (others may run user code).
WORKER_LOOP = f"torch{os.sep}utils{os.sep}data{os.sep}_utils{os.sep}worker.py"

_dump: IO[str] | None = None  # this process's memfd, kept open while it lives


def _register() -> None:
    """In a freshly forked child: dump every thread's stack into a memfd on SIGNAL."""
    global _dump
    with contextlib.suppress(OSError, ValueError, RuntimeError, AttributeError):
        _dump = os.fdopen(os.memfd_create(NAME, os.MFD_CLOEXEC), "w")
        faulthandler.register(SIGNAL, file=_dump, all_threads=True, chain=False)


if SIGNAL is not None and hasattr(os, "memfd_create"):  # at import, in the rank and fork server
    os.register_at_fork(after_in_child=_register)


def waits_for_loader(frames: list[Any]) -> bool:
    """The main thread is inside a DataLoader's iterator (its workers have the batch)."""
    return any(LOADER in getattr(f, "filename", "") for f in frames)


def collect(seconds: float = 3.0, settle_s: float = 0.5) -> dict[int, str]:
    """{pid: its stacks} of this process's descendants that registered (workers).

    faulthandler writes a dump in many small writes, the worker's other threads (its queue
    feeder, the resource sharer, a prefetch thread) before the one in the dataset: a dump
    read mid-write lacks the dataset's frame. A dump counts once it is unchanged since the
    last read and holds the worker's main loop, or has not changed for `settle_s` (another
    process: a fork server); at `seconds`, what was read."""
    if SIGNAL is None:
        return {}
    dumps = {pid: fd for pid in _descendants(os.getpid()) if (fd := _memfd(pid)) is not None}
    before: dict[int, int] = {}  # where this dump begins (an earlier request's is before it)
    for pid, fd in list(dumps.items()):
        try:
            before[pid] = os.stat(fd).st_size
            os.kill(pid, SIGNAL)
        except OSError:
            del dumps[pid]
    read: dict[int, tuple[str, float]] = {}  # pid: (its dump so far, when that was first read)
    complete: set[int] = set()
    end = time.monotonic() + seconds
    while len(complete) < len(dumps) and time.monotonic() < end:
        time.sleep(0.05)
        for pid, fd in dumps.items():
            with contextlib.suppress(OSError):
                text = Path(fd).read_bytes()[before[pid] :].decode(errors="replace")
                now = time.monotonic()
                if pid in complete or "File" not in text:
                    continue
                if text != read.get(pid, ("", now))[0]:
                    read[pid] = (text, now)
                elif WORKER_LOOP in text or now - read[pid][1] >= settle_s:
                    complete.add(pid)
    return {pid: text for pid, (text, _) in read.items()}


def innermost(text: str) -> str | None:
    """The innermost frame of project or user code in a faulthandler dump: in the thread
    running a DataLoader worker's loop (the dataset's), else in any thread."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text)
    for block in sorted(blocks, key=lambda b: WORKER_LOOP not in b):  # stable: loop first
        found = re.findall(r'\s*File "(.+)", line (\d+) in (.+)', block)
        frames = [{"filename": f, "line": n, "name": name} for f, n, name in reversed(found)]
        if any(is_user_code(f["filename"]) for f in frames):
            return where(frames)
    return None


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            if entry.name.isdigit():
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _memfd(pid: int) -> str | None:
    """/proc/<pid>/fd/<n> of its dump, if it catches SIGNAL (else None)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        caught = int(re.search(r"SigCgt:\s*([0-9a-f]+)", status)[1], 16)  # type: ignore[index]
    except (OSError, TypeError, ValueError):
        return None
    return memfd(pid, NAME) if caught >> (SIGNAL - 1) & 1 else None


def memfd(pid: int, name: str) -> str | None:
    """/proc/<pid>/fd/<n> of the process's memfd called `name` (None: it has none)."""
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd).startswith(f"/memfd:{name}"):
                    return str(fd)
    return None


def in_descendants(name: str) -> list[str]:
    """The memfds called `name` of this process's descendants (its workers' notes)."""
    return [fd for pid in _descendants(os.getpid()) if (fd := memfd(pid, name)) is not None]
