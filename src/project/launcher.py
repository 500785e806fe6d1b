"""torchrun as the launch scripts run it: `python -m project.launcher <torchrun arguments>`.

It is torch's own launcher (`torch.distributed.run`, the same arguments and behaviour) with
the failure handling a training job needs, which torchrun lacks:

- A worker that exits 2 (bad input: it printed one line) or 143 (stopped on a signal after
  saving last.ckpt) is never restarted: `--max-restarts` is for crashes, and a restart would
  only repeat the error, or train on while the scheduler is taking the machine away.
- One exit code that means one thing: 0 finished (also when a signal came after training had
  finished), 143 stopped by a signal (rerun to resume; SLURM requeues on it), 2 bad input,
  124 the ranks stopped making progress (rank 0 printed the hang report), 75 a save the disk
  or store refused (said in one line; restarted like a crash), 1 anything else,
  with one line naming the failed rank and how it ended instead of torchrun's 25-40 line
  error report.
- SIGUSR1 and SIGUSR2 (SLURM's early warning: the sbatch recipe's and submitit's) are
  forwarded to the workers like SIGTERM and SIGINT, not fatal to the launcher alone; a
  repeated signal while the workers are saving does not cut their shutdown short.
- At the end an agent waits only for the peers still alive (torchrun waits up to 300 s for
  every agent, also for one whose node died after the others had finished).
- A rendezvous that does not complete (a node never started, a wrong address) is one line
  naming the likely causes; the scripts bound its wait with `--rdzv-conf`.

Workers tell the launcher how they ended through `project.engine.distributed.exits.report_exit`
(one file per rank in a folder the launcher names in the environment): torchrun itself does
not collect their exit codes when it is the one that was signalled. The exit codes and the
private torch APIs patched here are defined in project.engine.distributed.exits and
project.engine.private_api. Only the standard library is imported at the top.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import socket
import sys
import tempfile
from typing import Any

from project.engine.distributed.exits import (
    EXIT_BAD_INPUT,
    EXIT_DIR_ENV,
    EXIT_FAILED,
    EXIT_HUNG,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_TEMPFAIL,
    NO_RESTART,
    recorded_resume,
    worker_exits,
)
from project.engine.launch import warm
from project.engine.launch.env import COMMAND_ENV
from project.engine.private_api import (
    after_rendezvous,
    announce_restarts,
    exit_barrier_on_live_peers,
    restart_only_crashes,
    signals_once,
    warm_workers,
)

EXTRA_SIGNALS = ("SIGUSR1", "SIGUSR2")

log = logging.getLogger("project.launcher")  # not __name__: run as a script it is "__main__"


class _QuietExpectedExits(logging.Filter):
    """torchrun logs an error line for every failed worker; for exit 2 (the worker printed
    its one-line error), 75 (a save refused, said in one line), 124 (a hang report) and 143
    (a coordinated stop) it only adds noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        said = (*NO_RESTART, EXIT_HUNG, EXIT_TEMPFAIL)
        return not any(f"(exitcode: {code})" in message for code in said)


class _QuietCleanShutdown(logging.Filter):
    """After a run that finished, the agent hosting the c10d store may exit (the store goes
    with it) while another agent is still closing the rendezvous: torch's warning that it
    "failed to shutdown the rendezvous" is then noise. After a failure it is kept."""

    LOGGER = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"  # by name: no import

    def __init__(self, state: dict[str, Any]) -> None:
        super().__init__()
        self.state = state  # "finished": this node's workers all exited 0

    def filter(self, record: logging.LogRecord) -> bool:
        noise = "failed to shutdown the rendezvous" in record.getMessage()
        return not (noise and self.state["finished"])


def _resume(folder: str, args: Any) -> str:
    """The command that resumes the run, as this node's first worker recorded it."""
    several = str(args.nnodes).rpartition(":")[2] != "1"  # N, or MIN:MAX's MAX
    default = "the same command, with the run's RUN_ID" + (" (on every node)" if several else "")
    return recorded_resume(folder) or default


def _failure_line(failures: dict[int, Any]) -> str:
    rank, failure = min(failures.items(), key=lambda item: item[1].timestamp)
    how = (
        f"was killed by {failure.signal_name()}"
        if failure.exitcode < 0
        else f"exited with code {failure.exitcode}"
    )
    return (
        f"error: rank {rank} on {socket.gethostname()} {how}: its output above says why "
        f"({len(failures)} rank(s) of this node failed)"
    )


def _signalled(signum: int, folder: str, args: Any) -> int:
    import signal

    name, codes = signal.Signals(signum).name, worker_exits(folder)
    if codes and all(c == 0 for c in codes.values()):
        print(f"launcher: {name} arrived after training had finished: exit 0", file=sys.stderr)
        return 0
    resume = _resume(folder, args)
    saved = (
        "the workers saved last.ckpt"
        if any(c == EXIT_PREEMPTED for c in codes.values())
        else "before the workers saved a checkpoint (it resumes from the last one written)"
    )
    print(f"launcher: stopped by {name}, {saved}; resume with: {resume}   "
          f"(exit {EXIT_PREEMPTED})", file=sys.stderr)  # fmt: skip
    return EXIT_PREEMPTED


def _rendezvous_line(err: BaseException, args: Any, ran: bool, resume: str) -> str:
    where = args.rdzv_endpoint or f"{args.master_addr}:{args.master_port}"
    # The nodes had met and the store stopped answering (not: a node did not come back in
    # time): what is gone is the store, with the node that hosted it.
    if ran and "Timeout" not in type(err).__name__:
        return (
            f"error: the rendezvous store at {where} is gone ({type(err).__name__}): the node "
            f"that hosted it (the agent at {where}) left, and the others cannot meet again "
            "without it. Resume the run from its last checkpoint on the nodes left, with "
            f"RDZV_ENDPOINT on one of them (the most reliable: docs/elastic.md): {resume}"
        )
    return (
        f"error: the rendezvous at {where} did not complete ({type(err).__name__}): not every "
        f"node joined (nnodes={args.nnodes}, this node: node rank {args.node_rank}). Likely "
        "causes, in order: a node was not started; a wrong MASTER_ADDR / RDZV_ENDPOINT or port; "
        "a firewall between the nodes; the wrong network interface (GLOO_SOCKET_IFNAME / "
        "NCCL_SOCKET_IFNAME)"
    )


def elastic_world_sizes(args: Any) -> None:
    """A range of nodes (NNODES=MIN:MAX): tell the workers every world size the job may take
    (a stream's default lanes are a multiple of each: project.data.lanes)."""
    low, _, high = str(args.nnodes).partition(":")
    nproc = str(args.nproc_per_node)
    if high and low.isdigit() and high.isdigit() and nproc.isdigit():
        sizes = [n * int(nproc) for n in range(int(low), int(high) + 1)]
        os.environ["PROJECT_WORLD_SIZES"] = ",".join(map(str, sizes))


def argument_error(args: Any) -> str | None:
    """The one-line error for torchrun arguments torch refuses only with a bare
    AssertionError (or a ValueError's traceback) once it runs; None: they are fine. What
    torch accepts is left as it is (the same int() parsing)."""
    try:
        counts = [int(n) for n in str(args.nnodes).split(":")]
        nodes_ok = len(counts) in (1, 2) and 1 <= counts[0] <= counts[-1]
    except ValueError:
        nodes_ok = False
    if not nodes_ok:
        return f"--nnodes={args.nnodes} must be N or MIN:MAX, whole numbers with 1 <= MIN <= MAX"
    from torch.distributed.run import determine_local_world_size

    try:  # what torchrun makes of it (auto, cpu, gpu: counted on this machine)
        nproc_ok = determine_local_world_size(args.nproc_per_node) >= 1
    except ValueError as err:  # two, 2.5, gpu without CUDA
        return (f"--nproc-per-node={args.nproc_per_node} must be a whole number >= 1, or auto, "
                f"cpu or gpu ({err})")  # fmt: skip
    if not nproc_ok:
        return f"--nproc-per-node={args.nproc_per_node} must be a whole number >= 1 (or auto)"
    if args.max_restarts < 0:
        return f"--max-restarts={args.max_restarts} must be a whole number >= 0"
    if not args.monitor_interval > 0:
        return f"--monitor-interval={args.monitor_interval} must be a number of seconds > 0"
    return None


def launch(argv: list[str]) -> int:
    """Run torchrun with `argv`; returns the job's exit code (see the module docstring)."""
    # The store's C++ client prints its socket errors with 30-frame C++ stacks when a node
    # leaves; the launcher says what happened in one line. Read once, as torch loads: the
    # workers get the user's own setting back.
    # The warm process starts first: its imports overlap the launcher's own (torch's parser).
    early = warm.start(warm.early_plan(argv))
    try:
        return _launch(argv, early)
    finally:
        if early is not None and early.proc.poll() is None:
            early.discard()  # not taken: refused before any worker was asked for


def _launch(argv: list[str], early: warm.Zygote | None) -> int:
    cpp_level = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = cpp_level or "ERROR"
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import api as mp_api
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    if cpp_level is None:
        del os.environ["TORCH_CPP_LOG_LEVEL"]
    args = torchrun.parse_args(argv)
    if problem := argument_error(args):  # before anything starts: one line, exit 2
        print(f"error: {problem}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    elastic_world_sizes(args)
    for name in EXTRA_SIGNALS:
        if name not in args.signals_to_handle:
            args.signals_to_handle += f",{name}"
    state: dict[str, Any] = {"signal": None, "done": False, "ran": False, "finished": False}
    restart_only_crashes(LocalElasticAgent, NO_RESTART)

    # The nodes had met once: a store failing from then on is gone with the node hosting it.
    after_rendezvous(LocalElasticAgent, lambda: state.update(ran=True))
    announce_restarts(LocalElasticAgent, lambda line: print(line, file=sys.stderr, flush=True))
    exit_barrier_on_live_peers(LocalElasticAgent, lambda: state.update(finished=True))
    signals_once(mp_api, state)
    logging.getLogger(mp_api.__name__).addFilter(_QuietExpectedExits())
    logging.getLogger(_QuietCleanShutdown.LOGGER).addFilter(_QuietCleanShutdown(state))
    folder = tempfile.mkdtemp(prefix="project-exit-")
    os.environ[EXIT_DIR_ENV] = folder  # the workers inherit it
    # What the stop line and the hang report print after `RUN_ID=<id>` (the launch scripts
    # set the command as typed; a worker cannot see torchrun's arguments itself).
    os.environ.setdefault(COMMAND_ENV, shlex.join(["python", *sys.orig_argv[1:]]))
    zygote = warm.confirm(early, warm.plan_of(args))  # workers forked from one process
    if zygote is not None:
        warm_workers(SubprocessHandler, zygote.spawn)
    try:
        torchrun.run(args)
        return EXIT_OK
    except ChildFailedError as err:
        if state["signal"] is not None:
            return _signalled(state["signal"], folder, args)
        # The first failure is the cause; the agent then stops the other workers (SIGTERM).
        first = min(err.failures.values(), key=lambda f: f.timestamp)
        if first.exitcode in (*NO_RESTART, EXIT_HUNG, EXIT_TEMPFAIL):  # the workers said why
            return first.exitcode
        print(_failure_line(err.failures), file=sys.stderr, flush=True)
        return EXIT_FAILED
    except mp_api.SignalException as err:
        return _signalled(int(err.sigval), folder, args)
    except warm.WarmStartError as err:
        print(err, file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except Exception as err:
        if "Rendezvous" in type(err).__name__ or "Store" in type(err).__name__:
            line = _rendezvous_line(err, args, state["ran"], _resume(folder, args))
            print(line, file=sys.stderr, flush=True)
            return EXIT_FAILED
        raise
    finally:
        state["done"] = True
        if zygote is not None:
            zygote.close()
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    sys.exit(launch(sys.argv[1:]))


if __name__ == "__main__":
    main()
