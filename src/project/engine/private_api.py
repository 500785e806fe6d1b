"""Every place the template reaches into a private Lightning, torch or Hydra API, in one module.

Each override says in one line what it buys. `USED` names every private attribute relied on
here or elsewhere in the template; tests/test_private_api.py checks that each one still exists
in the installed versions, so an upgrade that renames one fails a quick test instead of a run.
What each override saves per step is measured in docs/performance.md.

Only the standard library is imported at the top: project.launcher imports this module.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

POWERSGD = "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook"
# The PowerSGDState slots the template reads or sets by name (it saves all of them).
POWERSGD_SLOTS = (
    "process_group", "iter", "start_powerSGD_iter", "matrix_approximation_rank",
    "min_compression_rate", "rng", "error_dict", "p_memory_dict", "q_memory_dict",
)  # fmt: skip
# The fields of a Flight Recorder entry (`_dump_fr_trace_json`'s "entries") the hang report
# reads (engine/distributed/hangs.py). torch is rewriting the recorder for gloo: a dump whose
# entries lack one leaves the report to the ledger alone. An entry's "frames" (where it was
# issued) are read when present: torch 2.13's JSON dump has none.
FR_DUMP = "_dump_fr_trace_json"
FR_ENTRY = ("collective_seq_id", "profiling_name", "retired", "input_sizes", "process_group",
            "is_p2p")  # fmt: skip
HANDLER = "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler"
# (module, dotted attribute) of every private name the template uses; `FR_DUMP.entries.<f>`:
# a field of that dump's entries (tests/test_private_api.py reads a real one).
USED = (
    ("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop._broadcast_sigterm_tensor"),
    ("lightning.pytorch.core.module", "LightningModule._current_fx_name"),
    ("lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher.kill"),
    ("lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher.procs"),
    ("lightning.pytorch.trainer.trainer", "Trainer._run_sanity_check"),  # feature:raw
    # feature:tracking
    ("lightning.fabric.utilities.logger", "_convert_params"),
    ("lightning.fabric.utilities.logger", "_flatten_dict"),
    ("lightning.pytorch.loggers.mlflow", "MLFlowLogger._run_id"),
    ("lightning.pytorch.loggers.mlflow", "MLFlowLogger._initialized"),
    ("lightning.pytorch.loggers.mlflow", "MLFlowLogger._mlflow_client"),
    # /feature:tracking
    (
        "torch.distributed.elastic.agent.server.local_elastic_agent",
        "LocalElasticAgent._monitor_workers",
    ),
    ("torch.distributed.elastic.multiprocessing.api", "_terminate_process_handler"),
    ("torch.distributed.distributed_c10d", "_set_pg_timeout"),
    # The hang report (engine/distributed/ledger.py, hangs.py): collectives issued so far,
    # torch's Flight Recorder, and Lightning's watcher of the ranks its launcher started.
    ("torch.distributed.distributed_c10d", "_get_default_group"),
    ("torch.distributed", "ProcessGroup._get_sequence_number_for_group"),
    ("torch._C._distributed_c10d", FR_DUMP),
    *(("torch._C._distributed_c10d", f"{FR_DUMP}.entries.{field}") for field in FR_ENTRY),
    ("lightning.fabric.strategies.launchers.subprocess_script", "_ChildProcessObserver._finished"),
    (
        "lightning.fabric.strategies.launchers.subprocess_script",
        "_ChildProcessObserver._terminate_all",
    ),
    (
        "lightning.fabric.strategies.launchers.subprocess_script",
        "_ChildProcessObserver._child_processes",
    ),
    ("torch.distributed.elastic.agent.server.api", "SimpleElasticAgent._exit_barrier"),
    # The launcher's warm start (engine/launch/warm.py): the agent's Popen, and the rank a
    # forked worker reads again.
    (HANDLER, "SubprocessHandler._popen"),
    (HANDLER, "SubprocessHandler._stdout"),
    (HANDLER, "SubprocessHandler._stderr"),
    ("lightning.fabric.utilities.rank_zero", "_get_rank"),
    ("torch.distributed.elastic.agent.server.api", "SimpleElasticAgent._rendezvous"),
    ("torch.distributed.elastic.agent.server.api", "SimpleElasticAgent._restart_workers"),
    ("torch.distributed.elastic.agent.server.api", "SimpleElasticAgent._exit_barrier_timeout"),
    ("torch.distributed.elastic.agent.server.api", "SimpleElasticAgent._store"),
    ("torch.distributed.elastic.agent.server.api", "SimpleElasticAgent._worker_group"),
    (
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
        "DynamicRendezvousHandler._state_holder",
    ),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState.participants"),
    (
        "hydra._internal.config_loader_impl",
        "ConfigLoaderImpl._parse_overrides_and_create_caching_repo",
    ),
    # Lightning's fit-loop progress counters: where a resumed epoch starts and what a
    # checkpoint records of it (engine/lightning/datamodule.py, engine/lightning/callbacks.py).
    ("lightning.pytorch.loops.fit_loop", "_FitLoop.epoch_loop"),
    ("lightning.pytorch.loops.fit_loop", "_FitLoop.epoch_progress"),
    ("lightning.pytorch.loops.loop", "_Loop.restarting"),
    ("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop.batch_progress"),
    ("lightning.pytorch.loops.progress", "_Progress.current"),
    ("lightning.pytorch.loops.progress", "_Progress.total"),
    ("lightning.pytorch.loops.progress", "_ProcessedTracker.ready"),
    ("lightning.pytorch.loops.progress", "_ProcessedTracker.started"),
    ("lightning.pytorch.loops.progress", "_ProcessedTracker.processed"),
    ("lightning.pytorch.loops.progress", "_ProcessedTracker.completed"),
    # Several train loaders cycled in an epoch, each resumed by its own count
    # (engine/lightning/combined.py): the mode, and the iterator's loaders it reads again.
    ("lightning.pytorch.utilities.combined_loader", "CombinedLoader._mode"),
    ("lightning.pytorch.utilities.combined_loader", "CombinedLoader._iterator"),
    ("lightning.pytorch.utilities.combined_loader", "_ModeIterator.iterables"),
    # PowerSGD as the template's comm hook drives it (engine/distributed/comm_hooks/): which
    # tensors it compresses, and the state it keys by bucket, which the hook moves when DDP
    # regroups and saves per rank. How powerSGD_hook groups P and Q by shape has no name to
    # list: a test checks BucketLayouts.slices against a real call (tests/test_comm_hooks.py).
    (POWERSGD, "_should_compress"),
    (POWERSGD, "PowerSGDState.__slots__"),
    *((POWERSGD, f"PowerSGDState.__slots__.{slot}") for slot in POWERSGD_SLOTS),
    # torch.compile's compilations, booked outside the step deadline
    # (engine/run/long_work.py).
    ("torch", "_dynamo.callback_handler"),
    ("torch", "_dynamo.callback.CompilationCallbackHandler.start_callbacks"),
    ("torch", "_dynamo.callback.CompilationCallbackHandler.register_start_callback"),
    ("torch", "_dynamo.callback.CompilationCallbackHandler.register_end_callback"),
)


class DirectHookName:
    """Mixin for a LightningModule: Lightning sets `_current_fx_name` before and after every
    hook it calls, dozens of times a step; nn.Module's __setattr__ first looks for a
    parameter, buffer or submodule of that name, which a hook's name never is."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_current_fx_name":
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)


def skip_sigterm_broadcast(trainer: Any) -> bool:
    """Drop the blocking broadcast Lightning runs before every training step when world size
    > 1 (Lightning issue #21487); RunState's check every few steps does its
    job. False when this Lightning has no such broadcast."""
    epoch_loop = trainer.fit_loop.epoch_loop
    if not hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
        return False
    epoch_loop._broadcast_sigterm_tensor = lambda: None
    return True


def kill_launched_ranks(trainer: Any, signum: int) -> None:
    """Lightning's own launcher starts ranks > 0 as children of rank 0 and kills them only on
    KeyboardInterrupt: on any other failure of rank 0 they would be left behind."""
    from lightning.pytorch.strategies.launchers.subprocess_script import (
        _SubprocessScriptLauncher,
    )

    launcher = trainer.strategy.launcher
    if isinstance(launcher, _SubprocessScriptLauncher):
        launcher.kill(signum)


def launched_ranks(trainer: Any) -> list[Any]:
    """The processes (Popen) Lightning's own launcher started for the ranks > 0 of this node;
    [] under an external launcher or on one process."""
    from lightning.pytorch.strategies.launchers.subprocess_script import (
        _SubprocessScriptLauncher,
    )

    launcher = trainer.strategy.launcher
    return list(launcher.procs) if isinstance(launcher, _SubprocessScriptLauncher) else []


def on_launched_rank_exit(ended: Callable[[list[Any], int], None]) -> None:
    """Lightning's launcher watches the ranks it started and, when one ends with an error,
    SIGKILLs the others and rank 0 "to avoid zombies": a rank's bad-input exit 2 became the
    job's 137, which schedulers read as an out-of-memory kill. Call `ended(ranks, code)`
    instead (it ends the process) when the rank exited with a code; a rank killed by a signal
    is left to Lightning. A paused watcher (pause_child_observer) stays paused."""
    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

    terminate = _ChildProcessObserver._terminate_all
    terminate = getattr(terminate, "lightnings", terminate)  # installed once: its own

    def _terminate_all(self: Any) -> None:
        codes = [p.returncode for p in self._child_processes if p.returncode]
        if codes and codes[0] > 0:  # the rank Lightning's watcher reports first
            ended(self._child_processes, codes[0])
        terminate(self)

    _terminate_all.lightnings = terminate  # type: ignore[attr-defined]
    _ChildProcessObserver._terminate_all = _terminate_all


def combined_mode(combined: Any) -> str:
    """A Lightning CombinedLoader's mode (it has no public getter)."""
    return combined._mode


def reread_through(combined: Any, wrap: Callable[[Any], Any]) -> None:
    """After `iter(combined)`: its iterator reads a loader again (`max_size_cycle`) through
    `wrap(loader)`, so the loader can be told that a later pass begins."""
    combined._iterator.iterables = [wrap(loader) for loader in combined.flattened]


# feature:tracking
def flat_params(params: Any) -> dict[str, Any]:
    """Hyperparameters as the flat {dotted key: value} dict Lightning's loggers log."""
    from lightning.fabric.utilities.logger import _convert_params, _flatten_dict

    return _flatten_dict(_convert_params(params))


# /feature:tracking
def restart_only_crashes(agent_cls: Any, no_restart: Collection[int]) -> None:
    """Make torchrun's agent give up instead of restarting a group whose failure was one of
    `no_restart` (bad input, a coordinated stop): `--max-restarts` is for crashes. The agent
    restarts while `_remaining_restarts > 0`."""
    monitor = agent_cls._monitor_workers

    def _monitor_workers(self: Any, worker_group: Any) -> Any:
        result = monitor(self, worker_group)
        codes = {f.exitcode for f in (getattr(result, "failures", None) or {}).values()}
        if codes & set(no_restart):
            self._remaining_restarts = 0
        return result

    agent_cls._monitor_workers = _monitor_workers


def announce_restarts(agent_cls: Any, say: Callable[[str], None]) -> None:
    """Before torchrun's agent restarts its workers, `say` what happens next: which restart
    (a failure's; a node joining is not counted), and how long the rendezvous waits for the
    nodes (the c10d rendezvous's heartbeat and last-call settings), instead of silence."""
    restart = agent_cls._restart_workers

    def _restart_workers(self: Any, worker_group: Any) -> Any:
        spec = worker_group.spec
        failed = worker_group.state.name in ("FAILED", "UNHEALTHY")
        why = (
            f"the workers failed: restart {spec.max_restarts - self._remaining_restarts} of "
            f"{spec.max_restarts}" if failed else "a node is waiting to join: restart (not counted)"
        )  # fmt: skip
        settings = getattr(spec.rdzv_handler, "_settings", None)
        if settings is not None:  # the c10d (dynamic) rendezvous
            lost = settings.keep_alive_interval.total_seconds() * settings.keep_alive_max_attempt
            why += (f", waiting for the nodes: a node whose heartbeats stopped is left out after "
                    f"<= {lost:.0f} s, then {settings.timeout.last_call.total_seconds():.0f} s "
                    "for late nodes")  # fmt: skip
        say(f"launcher: {why}")
        return restart(self, worker_group)

    agent_cls._restart_workers = _restart_workers


def after_rendezvous(agent_cls: Any, met: Callable[[], None]) -> None:
    """Call `met` each time torchrun's agent has completed a rendezvous (the nodes met). A
    store that fails after that is gone with its node; one that fails before was never
    reached. The agent's monitor asks the store for waiting nodes while the workers are
    healthy, so a dead store can surface before any restart is announced."""
    rendezvous = agent_cls._rendezvous

    def _rendezvous(self: Any, worker_group: Any) -> Any:
        result = rendezvous(self, worker_group)
        met()
        return result

    agent_cls._rendezvous = _rendezvous


def signals_once(mp_api: Any, state: dict[str, Any]) -> None:
    """torchrun's handler raises on every signal: a second one (Ctrl-C and the scheduler's
    TERM, or the launch script forwarding what torchrun also got) would interrupt the
    workers' graceful shutdown, and one after the job ended would be a traceback. Only the
    first one during the job counts (`state`: {"signal": None, "done": False})."""
    raise_signal = mp_api._terminate_process_handler

    def handler(signum: int, frame: Any) -> None:
        if state["signal"] is not None or state["done"]:
            return
        state["signal"] = signum
        raise_signal(signum, frame)

    mp_api._terminate_process_handler = handler


def warm_workers(handler_cls: Any, spawn: Callable[[tuple, dict], Any]) -> None:
    """torchrun's agent starts each worker with Popen: ask `spawn` first (a worker forked from
    the node's warm process, project.engine.launch.warm; None: start it as before). Workers
    whose output goes to files (`--redirects`, `--tee`) always start as before."""
    popen = handler_cls._popen

    def _popen(self: Any, args: tuple, env: dict[str, str]) -> Any:
        if self._stdout is None and self._stderr is None:
            proc = spawn(args, env)
            if proc is not None:
                return proc
        return popen(self, args, env)

    handler_cls._popen = _popen


def exit_barrier_on_live_peers(
    agent_cls: Any, finished: Callable[[], None] = lambda: None, poll_s: float = 0.5
) -> None:
    """torchrun's agent waits at the end for every agent of its group (up to
    `exit_barrier_timeout`, 300 s): the one hosting the rendezvous store must not take it away
    from the others while they still use it. An agent that died never arrives; wait only for
    those whose rendezvous heartbeats still come (the rendezvous drops a node silent for
    keep_alive_interval x keep_alive_max_attempt). `finished` is called first: the agent
    reaches the barrier only once this node's workers have all exited 0."""

    def _exit_barrier(self: Any) -> None:
        import time

        finished()
        store, group = self._store, self._worker_group
        key = f"project.exit_barrier.{group.group_world_size}"
        deadline = time.monotonic() + self._exit_barrier_timeout
        try:
            arrived = store.add(key, 1)
            while arrived < min(group.group_world_size, _live_agents(group.spec.rdzv_handler)):
                if time.monotonic() > deadline:
                    return
                time.sleep(poll_s)
                arrived = store.add(key, 0)
        except Exception:  # the store's host has gone: nobody is left to wait for
            return

    agent_cls._exit_barrier = _exit_barrier


def _live_agents(rdzv_handler: Any) -> int:
    """The agents in this rendezvous round whose heartbeats are current (a c10d rendezvous
    drops the others when it syncs; a static one has no heartbeats: all of them)."""
    holder = getattr(rdzv_handler, "_state_holder", None)
    if holder is None:
        return 1 << 30
    rdzv_handler.num_nodes_waiting()  # syncs the state (under the handler's own lock)
    return len(holder.state.participants)


def one_repository_help() -> bool:
    """Hydra's `--help` and `--hydra-help` list every config group with its options through a
    fresh config repository per group and kind (about 120, each a deep copy of the repository
    and Hydra's whole ConfigStore): more than half a second. List them all from one repository
    instead: the same calls on the same kind of repository, so the same page. `--help` lists
    only the groups the entry point's defaults list has (eval.py's has no `strategy` or
    `model`: Hydra refuses `eval.py strategy=fsdp`, so its help does not offer it). False (and
    Hydra's own slow listing) when this Hydra lacks what the override needs."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.hydra import Hydra
    from hydra.core.object_type import ObjectType

    original = getattr(Hydra, "format_config_groups", None)
    make_repo = "_parse_overrides_and_create_caching_repo"
    if original is None or not hasattr(ConfigLoaderImpl, make_repo):
        return False
    if getattr(original, "one_repository", False):  # already installed
        return True

    def format_config_groups(self: Any, predicate: Any, *args: Any, **kwargs: Any) -> str:
        from hydra.core.hydra_config import HydraConfig

        loader = self.config_loader
        # `--help` composed the primary config first: its choices name every group it has.
        chosen = HydraConfig.get().runtime.choices if HydraConfig.initialized() else None

        def listed(group: str) -> bool:
            return predicate(group) and (
                chosen is None or group.startswith("hydra") or group in chosen
            )

        # What loader.get_group_options(group) builds per call (no primary config, no overrides).
        _, repo = loader._parse_overrides_and_create_caching_repo(None, [])

        def options(group_name: str, results_filter: Any = ObjectType.CONFIG) -> list[str]:
            return repo.get_group_options(group_name, results_filter)

        loader.get_group_options = options  # shadows the method for this listing only
        try:
            return original(self, listed, *args, **kwargs)
        finally:
            del loader.get_group_options

    format_config_groups.one_repository = True  # type: ignore[attr-defined]
    Hydra.format_config_groups = format_config_groups
    return True


def powersgd_compresses(rows: int, cols: int, rank: int, min_compression_rate: float) -> bool:
    """Whether torch's powerSGD_hook compresses a `rows` x `cols` gradient at this rank (else
    it all-reduces it as it is): the template lays out the P and Q of a bucket as it does."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    return bool(_should_compress(rows, cols, rank, min_compression_rate)[0])


def powersgd_slots(state: Any) -> tuple[str, ...]:
    """Every attribute of a PowerSGDState (it has no state_dict of its own: a checkpoint
    carries these)."""
    return tuple(type(state).__slots__)


def set_collective_timeout(timeout: Any) -> None:
    """The default process group's timeout (a timedelta) for the collectives issued from now
    on: torch has no public call for it after init_process_group (project.engine.distributed.ddp
    switches between a long and a short one)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout)


def collective_counter() -> Callable[[], int]:
    """A function giving the number of collectives the default process group has issued (its
    sequence number, which every rank's n-th collective shares); the last one seen once the
    group is destroyed. It holds the group weakly: a group kept alive past
    destroy_process_group is freed at interpreter shutdown, where gloo's threads abort the
    process ("terminate called without an active exception", see exits.close_process_group)."""
    import weakref

    from torch.distributed.distributed_c10d import _get_default_group

    group, last = weakref.ref(_get_default_group()), 0

    def sequence_number() -> int:
        nonlocal last
        if (pg := group()) is not None:
            last = pg._get_sequence_number_for_group()
        return last

    return sequence_number


def flight_recorder() -> list[dict[str, Any]] | None:
    """torch's Flight Recorder entries (the last collectives of every process group), oldest
    first, each a dict with at least the FR_ENTRY fields; None when it is off, unavailable, or
    its entries are laid out otherwise (the caller then knows the collectives' count only)."""
    import json
    import os

    sizes = (os.environ.get("TORCH_FR_BUFFER_SIZE"), os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE"))
    if "0" in sizes:
        return None  # turned off by the user: no entry does not mean no collective
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json

        entries = json.loads(_dump_fr_trace_json(includeCollectives=True, onlyActive=False))
        entries = entries["entries"]
    except Exception:  # a report must not fail because the recorder did
        return None
    if not isinstance(entries, list):
        return None
    fields = set(FR_ENTRY)
    if all(isinstance(e, dict) and fields <= e.keys() for e in entries):
        return entries
    return None


def pause_child_observer() -> None:
    """Lightning's launcher watches the ranks it started and SIGKILLs rank 0 within 5 s of one
    failing; while rank 0 writes a hang report it must not (the report kills them after)."""
    import threading

    for thread in threading.enumerate():
        if thread.name == "child-process-observer":
            thread._finished = True  # type: ignore[attr-defined]
            thread._terminate_all = lambda: None  # type: ignore[attr-defined]  # mid-sleep


def on_compile(start: Callable[[Any], None], end: Callable[[Any], None]) -> None:
    """Call `start`/`end` around every torch.compile compilation (its outermost one), once
    torch._dynamo is loaded; registered once (`torch._dynamo.reset()` drops them: call again)."""
    import sys

    handler = getattr(sys.modules.get("torch._dynamo"), "callback_handler", None)
    if handler is not None and start not in handler.start_callbacks:
        handler.register_start_callback(start)
        handler.register_end_callback(end)


def reread_import_time_env() -> None:
    """Values Lightning and torchmetrics read from the environment as they load (the rank of
    rank_zero_only), read again in a warm worker, which inherited them from a process with
    no RANK."""
    import os
    import sys

    fabric = sys.modules.get("lightning.fabric.utilities.rank_zero")
    if fabric is not None:
        fabric.rank_zero_only.rank = fabric._get_rank() or 0
    metrics = sys.modules.get("torchmetrics.utilities.prints")
    if metrics is not None and (
        fabric is None or metrics.rank_zero_only is not fabric.rank_zero_only
    ):
        metrics.rank_zero_only.rank = int(os.environ.get("LOCAL_RANK", 0))
