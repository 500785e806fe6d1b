"""A warm start for the launcher's workers: torch, Lightning and the entry point imported once
per node, each worker forked from that process instead of starting Python anew.

A worker of a 2-process job spent most of its start importing (torch, Lightning, torchmetrics:
docs/performance.md has the figures), once per process and again at every restart. Here
`project.launcher` starts one process per node (the "zygote", this module run as a script)
as soon as it has read its arguments, so its imports overlap the rendezvous. It imports the
entry point (`-m project.train`) and what the entry point lists in `WARM_IMPORTS`, and then
only waits. torchrun's agent asks it for each worker (project.engine.private_api.warm_workers
replaces the agent's `Popen`); it forks one that, like torchrun's own:

- runs in a session of its own (the agent signals its process group) with the agent's
  environment for that rank, unbuffered stdout/stderr (`python -u`), default signal handlers;
- runs the module as `__main__` (`runpy`, as `python -m` does), then the interpreter's own
  shutdown steps (non-daemon threads joined, atexit handlers, streams flushed);
- ends with the code `python` would: 0, the SystemExit code, 1 for an exception, or the
  signal that killed it (the zygote, its parent, reports it to the agent).

What the zygote refuses to do, so that a fork is as good as a fresh process: it forks only
while it is the one thread of its process, and never after CUDA was initialised. A module
that starts a thread or touches CUDA at import time turns the warm start off for the job (one
`launcher:` line, workers start cold). An entry point that cannot be imported is one `error:`
line naming the module, exit 2 (project.launcher). `PROJECT_WARM_START=0` starts every worker
cold. Values a library reads from the environment at import time are read again in each
worker where the template knows them (Lightning's and torchmetrics' rank).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

WARM_ENV = "PROJECT_WARM_START"  # "0": every worker starts as a new Python process
# When a worker of the job's first attempt started, as goodput counts it (distributed.ledger):
# when the warm process that imported everything for it started; a restart's, its fork.
STARTED_ENV = "PROJECT_WORKER_STARTED"
# Signals the zygote ignores (it ends when the agent closes its socket, after its workers:
# their exit codes go through it); each worker gets the defaults back.
HELD = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
        signal.SIGUSR2)  # fmt: skip
_HEADER = struct.Struct("!I")
BLAS_ENV = "OPENBLAS_NUM_THREADS"


class WarmStartError(Exception):
    """The entry point could not be imported: the job cannot start (one line, exit 2)."""


def _send(sock: socket.socket, message: tuple) -> None:
    data = pickle.dumps(message)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _receive(sock: socket.socket) -> tuple | None:
    """One message, or None once the other end has closed."""
    head = _read_exactly(sock, _HEADER.size)
    body = None if head is None else _read_exactly(sock, _HEADER.unpack(head)[0])
    return None if body is None else pickle.loads(body)


def _read_exactly(sock: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


# --- the agent's side -------------------------------------------------------------------------
def worker_argv(args: Sequence[str]) -> list[str] | None:
    """What a worker runs after `python -u` (["-m", module, ...] or [script, ...]) when torchrun
    starts it as this Python would; None for anything else (another binary, a NUMA wrapper)."""
    if len(args) < 3 or args[0] != sys.executable or args[1] != "-u":
        return None
    return list(args[2:]) if args[2] != "-m" or len(args) > 3 else None


# torchrun's options that take no value (torch.distributed.run's parser): early_plan's reading
FLAGS = frozenset({"-h", "--help", "-m", "--module", "--no-python", "--no_python", "--run-path",
                   "--run_path", "--standalone", "--virtual-local-rank",
                   "--virtual_local_rank"})  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """What the warm process depends on: the entry point, and whether the node runs several
    processes (torchrun then sets OMP_NUM_THREADS=1, which libgomp reads as torch loads)."""

    target: tuple[str, ...]  # ("-m", module) or (script,)
    several: bool


def plan_of(args: Any) -> Plan | None:
    """The plan for torchrun's parsed `args`; None when workers start cold
    (PROJECT_WARM_START=0, --no-python, --run-path)."""
    if os.environ.get(WARM_ENV) == "0" or args.no_python or args.run_path:
        return None
    from torch.distributed.run import determine_local_world_size

    target = ("-m", args.training_script) if args.module else (args.training_script,)
    return Plan(target, determine_local_world_size(args.nproc_per_node) > 1)


def early_plan(argv: Sequence[str]) -> Plan | None:
    """The plan read from torchrun's command line without torch's parser (importing it costs
    the launcher a second before the warm process could start); None where unsure. The
    launcher checks it against plan_of once torch has parsed the same arguments."""
    flags, nproc, i = set(), "1", 0
    while i < len(argv) and argv[i].startswith("-"):
        name, eq, value = argv[i].partition("=")
        if name in FLAGS:
            flags.add(name.replace("_", "-"))
            i += 1
            continue
        value, i = (value, i + 1) if eq else (argv[i + 1] if i + 1 < len(argv) else "", i + 2)
        if name in ("--nproc-per-node", "--nproc_per_node"):
            nproc = value
    cold = {"--no-python", "--run-path"} & flags or os.environ.get(WARM_ENV) == "0"
    if i >= len(argv) or cold or not nproc.isdigit() or "PET_NPROC_PER_NODE" in os.environ:
        return None
    module = {"-m", "--module"} & flags
    return Plan(("-m", argv[i]) if module else (argv[i],), int(nproc) > 1)


def start(plan: Plan | None) -> Zygote | None:
    """The node's warm process for `plan`, started now so that its imports overlap the
    rendezvous (and every restart forks its workers); None: workers start cold."""
    if plan is None:
        return None
    env = dict(os.environ)
    if plan.several:  # torchrun's own rule for its workers, before libgomp reads it
        env.setdefault("OMP_NUM_THREADS", "1")
    # numpy's BLAS (torch imports numpy) starts its threads as it loads, unless told to use
    # one: here one, and each worker gets its own count back after the fork (blas_threads,
    # through threadpoolctl; without it the threads make the workers start cold).
    if importlib.util.find_spec("threadpoolctl") is not None:
        env.setdefault(BLAS_ENV, "1")
    return Zygote(plan, env)


def confirm(early: Zygote | None, plan: Plan | None) -> Zygote | None:
    """The warm process for torchrun's parsed arguments: the one started early when it was
    started for the same plan, else (it is discarded) a new one."""
    if early is not None and early.plan == plan:
        return early
    if early is not None:
        early.discard()
    return start(plan)


class Zygote:
    """The agent's handle on its node's warm process: start it, fork workers, learn their ends."""

    def __init__(self, plan: Plan, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair()
        self.plan, self.started = plan, time.time()
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-m", __name__, str(theirs.fileno()), *plan.target],
            env=env, pass_fds=(theirs.fileno(),),
        )  # fmt: skip
        theirs.close()
        self.sock, self.lock = ours, threading.Lock()
        self.state: tuple | None = None  # ("ready",) | ("cold", why) | ("failed", line)
        self.exits: dict[int, int] = {}
        self.replies: list[tuple] = []
        self.gone = self.told = False

    def spawn(self, args: Sequence[str], env: dict[str, str]) -> WarmProcess | None:
        """A worker forked from the warm process, or None to start it cold."""
        argv = worker_argv(args)
        if argv is None:
            return None
        with self.lock:
            while self.state is None and not self.gone:
                self._pump(None)
            if self.state is not None and self.state[0] == "failed":
                raise WarmStartError(self.state[1])
            if self.state is None or self.state[0] == "cold" or self.gone:
                if not self.told:
                    cold = self.state is not None and self.state[0] == "cold"
                    why = self.state[1] if cold else "the warm process ended"
                    print(f"launcher: workers start cold: {why} (docs/launching.md: the warm "
                          "start)", file=sys.stderr, flush=True)  # fmt: skip
                    self.told = True
                return None
            if env.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                env = {**env, STARTED_ENV: repr(self.started)}
            with _signals_held():  # torchrun's handler raises: never between fork and reply
                _send(self.sock, ("spawn", argv, env))
                while not self.replies and not self.gone:
                    self._pump(None)
            if not self.replies:
                return None
            kind, value = self.replies.pop(0)
        if kind != "pid":
            raise OSError(f"the warm start could not fork a worker: {value}")
        return WarmProcess(self, int(value), list(args))

    def returncode(self, pid: int, timeout: float | None) -> int | None:
        """The exit code of worker `pid` once known (waiting up to `timeout` seconds)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            self._pump(0)
            while pid not in self.exits and not self.gone:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._pump(0.1 if left is None else min(left, 0.1))
            # delivered once (a reused pid starts afresh); the warm process dead: a failure
            code = self.exits.pop(pid, 1 if self.gone else None)
            if code is not None and not self.gone:
                with contextlib.suppress(OSError):  # seen: the zombie may go, as Popen's
                    _send(self.sock, ("reap", pid))  # poll() reaps its child
            return code

    def _pump(self, timeout: float | None) -> None:
        """Read the messages that arrive within `timeout` (None: wait for one)."""
        while not self.gone and select.select([self.sock], [], [], timeout)[0]:
            try:
                with _signals_held():  # a signal's exception mid-message would desync it
                    message = _receive(self.sock)
            except (OSError, EOFError, pickle.UnpicklingError, struct.error):
                message = None  # unreadable from here on: as if the warm process had ended
            if message is None:
                self.gone = True
            elif message[0] == "exit":
                self.exits[message[1]] = message[2]
            elif message[0] in ("pid", "error"):
                self.replies.append(message)
            else:
                self.state = message
            timeout = 0

    def discard(self) -> None:
        """End a warm process that forked nothing (it may still be importing)."""
        self.sock.close()
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        """End the warm process (workers it forked and that still run are left to the agent)."""
        self.sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Signals arrive after the block (torchrun's handlers raise wherever they land)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class WarmProcess:
    """The parts of `subprocess.Popen` torchrun's agent uses, for a worker the zygote forked."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self.zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.returncode(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.zygote.returncode(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# --- the zygote -------------------------------------------------------------------------------
def _threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1


def preload(target: Sequence[str]) -> tuple:
    """Import the entry point, torch and the entry point's WARM_IMPORTS, in that order (the
    entry point may set what torch reads as it loads): ("ready",), ("cold", why) or
    ("failed", line). `target`: ["-m", module] or [script] (a script is not imported: its
    top level would run). A module that cannot be found, or imports one that cannot, is the
    job's one line; any other error at import (it may need the rank's environment, which
    this process lacks) starts the workers cold."""
    entry = target[1] if target[0] == "-m" else None
    names = [entry, "torch"] if entry else ["torch"]
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError as err:
            if name != entry:
                return ("cold", f"importing {name} failed ({type(err).__name__})")
            return ("failed", f"error: the entry point's module {name} cannot be imported "
                              f"({type(err).__name__}: {err}); run `python -m {name}` to see "
                              "the traceback")  # fmt: skip
        except BaseException as err:
            return ("cold", f"importing {name} raised {type(err).__name__}")
        if name == entry and not hasattr(module, "__path__"):
            forget(name)  # runpy runs it anew as __main__: no second copy
        names += [n for n in getattr(module, "WARM_IMPORTS", ()) if n not in names]
        if threading.active_count() > 1 or _threads() > 1:
            return ("cold", f"importing {name} started a thread")
    if sys.modules["torch"].cuda.is_initialized() or _cuda_driver_loaded():
        return ("cold", "an import initialised CUDA")
    return ("ready",)


def _cuda_driver_loaded() -> bool:
    """CUDA's driver library is loaded (torch.cuda.is_available() loads it without torch's
    own CUDA state): a fork would share its state."""
    try:
        with open("/proc/self/maps") as maps:
            return "libcuda.so" in maps.read()
    except OSError:
        return False


def forget(name: str) -> None:
    """Take module `name` out of sys.modules and its package (what it imported stays)."""
    del sys.modules[name]
    parent, _, child = name.rpartition(".")
    if parent and hasattr(sys.modules.get(parent), child):
        delattr(sys.modules[parent], child)


def serve(fd: int, target: Sequence[str]) -> None:
    """The zygote's loop: preload, then fork a worker per request and report how each ended.
    A forked worker leaves this function only as the interpreter ends (SystemExit)."""
    for sig in HELD:
        signal.signal(sig, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    before = dict(os.environ)
    state = preload(target)
    # What the imports set in the environment, a cold worker's imports set too (where the
    # worker's environment does not say otherwise).
    set_by_imports = {k: v for k, v in os.environ.items() if before.get(k) != v}
    running: set[int] = set()  # workers not yet reported as ended
    reported: set[int] = set()  # ended, reported, not yet reaped
    with contextlib.suppress(OSError):  # the agent gone: nothing to report to
        _send(sock, state)
        while state[0] == "ready":
            readable = select.select([sock], [], [], 0.05)[0]
            for pid in list(running):
                code = ended(pid)
                if code is not None:
                    running.discard(pid)
                    reported.add(pid)
                    _send(sock, ("exit", pid, code))
            if not readable:
                continue
            message = _receive(sock)
            if message is None:
                break  # the agent is gone or done
            if message[0] == "reap" and message[1] in reported:
                reported.discard(message[1])
                end_leftovers(message[1])
                os.waitpid(message[1], os.WNOHANG)
            elif message[0] == "spawn":
                try:
                    env = {**set_by_imports, **message[2]}
                    pid = fork_worker(sock, message[1], env)
                except OSError as err:
                    _send(sock, ("error", str(err)))
                    continue
                running.add(pid)
                _send(sock, ("pid", pid))
    os._exit(0)  # nothing of the zygote's own exit (its atexit handlers) is the job's


def ended(pid: int) -> int | None:
    """How worker `pid` ended (its code, or minus the signal that killed it), or None while it
    runs. It stays a zombie until the agent has seen the code ("reap"), as a Popen child does
    until its poll(): the agent may still signal its process group meanwhile."""
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if info is None or info.si_pid == 0:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def end_leftovers(pid: int) -> None:
    """A worker that failed: SIGKILL what it left in its process group (its DataLoader fork
    server and workers, a stuck subprocess) before a restart forks the next set. A cold
    worker's leftovers end on their own within seconds; a warm restart is quicker than that.
    Not after a stop (143: every rank saved and left in order) or a finish. Safe from a
    reused pid: the worker is still this process's zombie, its number held."""
    if ended(pid) not in (None, 0, 143):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def fork_worker(sock: socket.socket, argv: list[str], env: dict[str, str]) -> int:
    """Fork one worker; returns its pid once it leads a session of its own with the default
    signal handlers (from then on the agent may signal it). The worker itself never returns:
    it ends as `python -u <argv>` would (run_worker)."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ready_r)
            sock.close()
            os.setsid()
            for sig in HELD:  # as exec gives a cold worker: the agent handles every one of them
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os.close(ready_w)
        except BaseException:
            os._exit(1)
        run_worker(argv, env)
    os.close(ready_w)
    os.read(ready_r, 1)  # EOF once the child is ready (or has died)
    os.close(ready_r)
    return pid


def run_worker(argv: list[str], env: dict[str, str]) -> None:
    """In the forked child: become the worker torchrun asked for and run it. It ends by
    SystemExit (its own, or 0, or 1 after printing an uncaught exception as the interpreter
    does) or KeyboardInterrupt, which leave through serve(): the interpreter's normal exit
    (threads joined, atexit, finalizers, flushed files) gives the exit code."""
    import runpy

    from project.engine.private_api import reread_import_time_env

    blas_forced = BLAS_ENV not in env and os.environ.get(BLAS_ENV) == "1"
    os.environ.clear()
    os.environ.update(env)
    reread_import_time_env()
    if blas_forced:
        blas_threads(env)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # drawn anew, as a fresh process's global state is
    sys.orig_argv = [sys.executable, "-u", *argv]
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException:
        sys.excepthook(*sys.exc_info())
        raise SystemExit(1) from None
    raise SystemExit(0)


def blas_threads(env: dict[str, str]) -> None:
    """numpy's OpenBLAS, loaded in the zygote on one thread: the count a cold worker's would
    start with (the first of GOTO_NUM_THREADS and OMP_NUM_THREADS the worker's environment
    sets, as OpenBLAS reads them, else the CPUs it may run on). torch's own threads are not
    BLAS's: libgomp read the worker's OMP_NUM_THREADS as it loaded, and starts them lazily."""
    if "numpy" not in sys.modules:
        return
    counts = [env.get(k, "") for k in ("GOTO_NUM_THREADS", "OMP_NUM_THREADS")]
    wanted = next((int(c) for c in counts if c.isdigit() and int(c) > 0), None)
    wanted = wanted or len(os.sched_getaffinity(0))
    if wanted > 1:
        from threadpoolctl import ThreadpoolController  # found by start()

        # OpenBLAS only: OPENBLAS_NUM_THREADS=1 held back no other library's threads
        ThreadpoolController().select(internal_api="openblas").limit(limits=wanted)


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2:])
