"""A rank's DataLoader workers and fork server end with the rank, however it ends.

A rank can end without shutting its loaders down: a hang report's `os._exit`, a SIGKILL, an
abort inside gloo/NCCL. Its workers then wait forever: torch's worker notices its loader is
gone only when its parent changes, and a worker's parent is the fork server
(project.engine.data.worker_start), which stays because every worker holds the pipe whose
closing tells it that its rank has gone. Each torchrun restart would add such a set.

So every process the fork server starts closes that pipe (the rank's end of it is then the
only one: the server stops when the rank ends) and has the kernel SIGKILL it when the fork
server ends (PR_SET_PDEATHSIG: a worker stuck inside a dataset's code goes too). The fork
server imports this module (its preload); `children_die_with_me` does the same for workers
forked from the rank itself (`worker_start_method=fork`). Spawned workers are left to
torch's own check of their parent (every 5 s).
"""

from __future__ import annotations

import ctypes
import multiprocessing.util
import os
import signal
import sys
import threading

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class _Armed:
    """What multiprocessing's after-fork registry holds (weakly) for this process."""

    def __init__(self, parent: int, thread: int | None, close_pipe: bool) -> None:
        self.parent, self.thread, self.close_pipe = parent, thread, close_pipe


_armed: _Armed | None = None


def children_die_with_me(close_pipe: bool = False) -> None:
    """Every process multiprocessing starts from this one from now on is SIGKILLed when this
    one ends. `close_pipe`: in the fork server, the child also drops its copy of the pipe
    that keeps the server alive. From a rank (fork), only for workers its main thread
    starts: the kernel sends the signal when the forking *thread* ends."""
    global _armed
    if _armed is not None or not sys.platform.startswith("linux"):
        return
    thread = None if close_pipe else threading.main_thread().ident  # the server: one thread
    _armed = _Armed(os.getpid(), thread, close_pipe)
    multiprocessing.util.register_after_fork(_armed, _in_child)


def _in_child(armed: _Armed) -> None:
    """In a new child, before it runs anything (its after-fork hook)."""
    global _armed
    _armed = None  # the child's own children are not armed by its parent's setting
    if armed.close_pipe:
        from multiprocessing import forkserver

        server = forkserver._forkserver
        if server._forkserver_alive_fd is not None:
            os.close(server._forkserver_alive_fd)
            server._forkserver_alive_fd = None  # a server it needs later is its own
    if armed.thread is not None and threading.get_ident() != armed.thread:
        return  # forked from another of the rank's threads: its end would kill the worker
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != armed.parent:  # the parent ended before the line above
        os._exit(1)


def _in_fork_server() -> bool:
    """Whether the fork server is importing this module (its preload)."""
    from multiprocessing import forkserver

    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


if _in_fork_server():
    children_die_with_me(close_pipe=True)
