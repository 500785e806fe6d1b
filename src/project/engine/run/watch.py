"""What both trainers switch on when training starts and off when it ends: this rank's ledger
file (project.engine.distributed.ledger), the hang watchdog (hangs.py), straggler detection
(stragglers.py, riding on the stop check) and the goodput's attempt (goodput.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from project.engine.distributed import hangs
from project.engine.distributed import ledger as ledgers
from project.engine.distributed.exits import EXIT_HUNG
from project.engine.distributed.fsdp import options as fsdp_options
from project.engine.distributed.hangs import Watchdog
from project.engine.distributed.stragglers import Stragglers
from project.engine.run import goodput, long_work

if TYPE_CHECKING:
    from project.engine.distributed.ddp import CollectiveTimeout
    from project.engine.distributed.signals import StopSignal

LogMetrics = Callable[[dict[str, float], int], None]


@dataclass
class Watch:
    ledger: ledgers.Ledger
    watchdog: Watchdog | None
    stragglers: Stragglers | None


def start(
    run: Any, rank: int, world: int, step: int, timeouts: CollectiveTimeout, stop: StopSignal,
    log_metrics: LogMetrics | None, kill_children: Callable[[], None] | None = None,
    close_loggers: Callable[[], None] | None = None,
) -> Watch:  # fmt: skip
    """At train start (after a resume's load: `step` is where it continues); `run`: the
    skeleton's Run (not imported: the skeleton imports this module). `close_loggers`: rank
    0's, when a hang report ends the process (their last scalars would be lost)."""
    ledger = run.ledger
    if rank == 0:
        goodput.begin(ledger, resumed_from=step)
    ledger.open(rank)
    ledger.mark(ledgers.STARTUP, step)
    stop.ledger = ledger
    timeouts.start()
    long_work.watch(ledger, timeouts, stop)  # a weights-only save, a recompile, a download
    sharded = fsdp_options.chosen(run.cfg.get("strategy"))  # its collectives: every step
    stop.stragglers = Stragglers.of(run.cfg.get("stragglers"), rank, world, log_metrics, sharded)
    watchdog = None
    if world > 1:

        def on_end(code: int) -> None:
            how = ledgers.ENDED_HUNG if code == EXIT_HUNG else ledgers.ENDED_FAILED
            summary = goodput.close(ledger, how)
            if summary is not None and log_metrics is not None:
                log_metrics(goodput.scalars(summary), ledger.step)
            if close_loggers is not None:  # a logger server that does not answer: 5 s at most
                closing = threading.Thread(target=close_loggers, daemon=True)
                closing.start()
                closing.join(5)

        def deadline() -> float:
            if threading.current_thread().name == hangs.THREAD:  # not the training thread's
                long_work.excuse_workers(ledger)  # a worker downloading a shard: the long one
            return timeouts.deadline()

        watchdog = Watchdog(ledger, deadline, run.output_dir, kill_children, on_end)
        watchdog.start()
    return Watch(ledger, watchdog, stop.stragglers)


def end(watch: Watch | None, step: int, log_metrics: LogMetrics | None) -> None:
    """At train end: no more watching; rank 0 logs the goodput so far."""
    long_work.unwatch()
    if watch is None:
        return
    if watch.watchdog is not None:
        watch.watchdog.stop()
    watch.ledger.mark(ledgers.TEST, step)
    logged = goodput.so_far(watch.ledger) if watch.ledger.rank == 0 and log_metrics else {}
    if logged and log_metrics is not None:
        log_metrics(logged, step)


def stop_watching() -> None:
    """However training ended (an error too): the watchdog must not outlive it."""
    long_work.unwatch()
    if (watchdog := hangs.active()) is not None:
        watchdog.stop()
