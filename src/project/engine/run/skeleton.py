"""One run from start to end, the same for both trainers; only "build, fit, test" differs.

    preflight   typed keys, where the run executes, topology, the run folder's last checkpoint
                (resume, or a finished run's results), the `_target_`s: all before anything
                heavy is imported or built, so bad input answers in seconds with one line
    dispatch    a sweep job that is not trained in this process: on SLURM (torchrun on every
                node of the job) or with several processes (its own torchrun job)
    fit + test  the trainer's own `fit_and_test(run)` (train.py, raw_train.py)
    stop        a coordinated stop (Preempted) -> one line, exit 143, rerun to resume
    finish      the process group closed on every rank, metrics.json written by rank 0

The entry points import this module before Hydra composes: only light imports at the top.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from project.engine.config.compose import check_targets, to_plain
from project.engine.config.schema import check_schema
from project.engine.data.worker_start import configure_worker_start
from project.engine.distributed.exits import (
    EXIT_PREEMPTED,
    Preempted,
    close_process_group,
    record_resume,
)
from project.engine.distributed.ledger import Ledger
from project.engine.errors import UserError
from project.engine.launch.env import is_rank_zero, local_rank, resume_command
from project.engine.run.console import warnings_held_back
from project.engine.run.results import METRICS_FILE, read_metrics, write_metrics

if TYPE_CHECKING:
    from project.engine.checkpoints.resume import Resume
    from project.engine.checkpoints.run import RunCheckpoints
    from project.engine.data.elastic import Position
    from project.engine.distributed.ddp import Topology

log = logging.getLogger(__name__)

TREE_ORDER = ("data", "model", "callbacks", "logger", "trainer", "strategy", "paths")


@dataclass(frozen=True)
class EntryPoint:
    """What the skeleton needs to know about a trainer's entry point (train.py, raw_train.py)."""

    name: str  # TRAINER= of the launch scripts: lightning | raw
    module: str  # its entry module: a sweep job with several processes relaunches it
    checkpoint_key: str  # a key every checkpoint of this trainer has (the other's is refused)
    last_name: str | None = None  # its last checkpoint's file name (None: the configured one)
    skip_targets: Collection[str] = field(default_factory=tuple)  # `_target_`s not imported


@dataclass
class Run:
    """What preflight found out, handed to the trainer's fit_and_test."""

    cfg: DictConfig
    output_dir: Path
    topology: Topology
    resume: Resume  # where training continues from (or the finished run it only tests)
    checkpoints: RunCheckpoints  # its checkpoints' paths and state (engine.checkpoints.run)
    # this rank's record: what it is doing, where its time went (none: no file)
    ledger: Ledger = field(default_factory=lambda: Ledger(None, 1))
    position: Position | None = None  # where the resumed epoch stood (engine.data.elastic)

    @property
    def fits(self) -> bool:
        """Whether this attempt trains (train=true and the run has not finished yet)."""
        return bool(self.cfg.train) and not self.resume.finished


def run(
    cfg: DictConfig, entry: EntryPoint, fit_and_test: Callable[[Run], dict[str, float]]
) -> dict:
    """Preflight, dispatch, then `fit_and_test`; returns the run's final metrics."""
    check_schema(cfg)  # types and ranges, before torch is imported: fails in about a second
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from project.engine.distributed import ddp

    hydra_cfg = HydraConfig.get()
    output_dir = Path(hydra_cfg.runtime.output_dir)
    sweep_job = hydra_cfg.mode == RunMode.MULTIRUN
    # feature:slurm
    from project.engine.cluster import slurm_job

    if sweep_job and slurm_job.active():  # hydra/launcher=submitit_slurm
        check_targets(cfg, skip=entry.skip_targets)
        slurm_job.run_on_every_node(
            list(hydra_cfg.overrides.task), str(output_dir), cfg.trainer, entry.name
        )
        return read_metrics(output_dir)
    # /feature:slurm
    topology = ddp.resolve_topology(cfg.trainer)  # before any heavy import: fail in seconds
    relaunched = sweep_job and topology.world_size > 1  # its own torchrun job trains it
    if not relaunched:  # the DataLoader workers' fork server, importing while preflight does
        configure_worker_start(cfg.get("worker_start_method"), cfg.get("data"), entry.module)
    found = preflight(cfg, output_dir, topology, entry)
    if isinstance(found, dict):
        return found  # a finished run's results
    if relaunched:
        relaunch(cfg, entry, output_dir, topology, list(hydra_cfg.overrides.task))
        return read_metrics(output_dir)
    with warnings_held_back() as warn:  # the batch keys fitted first, warnings after the tree
        fit_world(found)
    prepare(found, entry)
    warn()
    metrics = fit_and_test_then_stop(found, fit_and_test)
    if is_rank_zero():
        write_metrics(output_dir, metrics)
    return metrics


def preflight(
    cfg: DictConfig, output_dir: Path, topology: Topology, entry: EntryPoint
) -> Run | dict[str, float]:
    """The run folder's last checkpoint and the targets, before anything is built: a bad
    checkpoint stops with one line, nothing written; a finished run returns its results."""
    from project.engine.checkpoints.remote import STAGING
    from project.engine.checkpoints.resume import find_resume, interpolations, training_identity
    from project.engine.checkpoints.run import RunCheckpoints
    from project.engine.data.elastic import asked
    from project.engine.distributed.ledger import flight_recorder_env

    plain = to_plain(cfg)
    checkpoints = RunCheckpoints(cfg, output_dir, entry.last_name, training_identity(plain),
                                 asked(plain))  # fmt: skip
    resume = find_resume(plain, checkpoints.resume_last, entry.checkpoint_key, interpolations(cfg),
                         staging=output_dir / STAGING, shown=checkpoints.where)  # fmt: skip
    if earlier := finished_results(resume, output_dir):
        return earlier
    check_targets(cfg, skip=entry.skip_targets)
    if topology.world_size > 1:  # before any process group: the hang report reads it
        flight_recorder_env()
    ledger = Ledger(output_dir, topology.world_size)
    return Run(cfg, output_dir, topology, resume, checkpoints, ledger)


def fit_world(run: Run) -> None:
    """A resumed run on another world size keeps its global batch and its place in the epoch
    (project.engine.data.elastic): the batch keys are set here, before anything is built, and
    a stream's lanes checked against the world size. A resume with other callbacks than the
    run's says so."""
    from project.engine.checkpoints.resume import callbacks_changed
    from project.engine.data.elastic import Position, fit_global_batch, fit_layout

    if run.resume.path is None or not run.fits:
        return
    saved = run.resume.callbacks
    if saved is not None and (changed := callbacks_changed(saved, run.checkpoints.callbacks)):
        log.warning(changed)
    run.position = Position.of(run.resume.data_position)
    if run.position is None:
        log.warning(
            f"{run.resume.path} records no data position (written before positions were): "
            "if it was saved in the middle of an epoch, that epoch restarts from its beginning"
        )
    fit_layout(run.cfg, run.position, run.topology.world_size, str(run.resume.path))
    fit_global_batch(run.cfg, run.position, run.topology.world_size, run.checkpoints.command)


def prepare(run: Run, entry: EntryPoint) -> None:
    """Threads per rank, the hardware checks, and (rank 0) the config tree and the topology."""
    from project.engine.distributed import ddp
    from project.engine.run.console import print_config_tree

    threads = ddp.configure_threads(run.topology)
    check_strategy(run, entry.name)
    if is_rank_zero():
        tree_log = run.output_dir / "config_tree.log"  # a resumed run keeps its first record
        if tree_log.exists():  # once per run, not on every restart (the file keeps it)
            log.info(f"Config tree: {tree_log} (each attempt's config: {tree_log.parent}/.hydra)")
        else:
            print_config_tree(run.cfg, TREE_ORDER, save_to=tree_log)
        t = run.topology
        log.info(
            f"{entry.name} trainer: {t.devices} process(es) per node x {t.num_nodes} node(s), "
            f"launcher: {t.launcher.name if t.launcher else 'none'}, {threads} thread(s) per "
            "process"
        )


def check_strategy(run: Run, trainer: str) -> None:
    """The strategy's options against the hardware and the trainer's, before any process group.
    FSDP on several processes writes its `last` sharded (fsdp.options.check_checkpoints), and
    a run folder that holds a sharded `last` keeps it sharded: on any world size, but under
    Lightning's DDP (`trainer`: "lightning" or "raw")."""
    from project.engine.distributed import ddp
    from project.engine.distributed.fsdp import options as fsdp_options

    strategy, world = run.cfg.get("strategy"), run.topology.world_size
    fsdp = fsdp_options.chosen(strategy)
    manifest, remote = run.checkpoints.sharded_manifest, run.checkpoints.remote is not None
    if trainer == "lightning" and run.checkpoints.sharded and world > 1 and not fsdp:
        copy = "copy its folder here first (e.g. `aws s3 sync`) and give ckpt_path=<that folder>"
        raise UserError(
            f"{manifest} publishes a sharded `last`, which Lightning continues in its run "
            "folder under strategy=fsdp or on one process, not under DDP: rerun with "
            "strategy=fsdp, or start a new run (another RUN_ID) from it: "
            + (copy if remote else f"ckpt_path={manifest.removesuffix('.json')}")
        )
    if not fsdp_options.chosen(strategy):
        ddp.check_options(strategy, run.cfg.trainer, world)
        return
    fsdp_options.check(run.cfg, world)
    kept = {k: strategy.get(k) for k in ("process_group_backend", "timeout", "step_timeout_s")}
    ddp.check_options(DictConfig(kept), run.cfg.trainer, world)  # the backend on this hardware
    if world > 1:
        fsdp_options.check_checkpoints(run.cfg, run.resume.path)
        run.checkpoints.sharded = True


def finished_results(resume: Resume, output_dir: Path) -> dict[str, float]:
    """The results a run that already finished kept in its folder, said so in the log; {}
    when there is work left (not finished, or it died before writing its results)."""
    earlier = read_metrics(output_dir) if resume.finished else {}
    if earlier:
        log.info(
            f"This run already finished ({resume.path}); its results are kept in "
            f"{output_dir / METRICS_FILE}. For more training start a new run from its "
            f"weights: ckpt_path={resume.path} trainer.max_epochs=<more>"
        )
    return earlier


def relaunch(
    cfg: DictConfig, entry: EntryPoint, output_dir: Path, topology: Topology, overrides: list[str]
) -> None:
    """A sweep job with several processes runs as its own single-node torchrun job."""
    from project.engine.launch.torchrun import relaunch as torchrun_relaunch

    if topology.launcher is not None or topology.num_nodes > 1:
        raise UserError(
            "a multirun (-m) with several processes starts one torchrun job per sweep job "
            "itself: run it with plain python, single node"
        )
    torchrun_relaunch(entry.module, overrides, str(output_dir), topology.devices)


def fit_and_test_then_stop(
    run: Run, fit_and_test: Callable[[Run], dict[str, float]]
) -> dict[str, float]:
    """`fit_and_test` with a dead peer or unused parameters reported in one line and a
    coordinated stop turned into exit 143; the process group is closed after a finished run
    or a stop; rank 0 adds the attempt to goodput.json however it ended."""
    from project.engine.distributed import ledger as ledgers
    from project.engine.distributed.ddp import errors_reported
    from project.engine.run import goodput, watch

    how = ledgers.ENDED_FAILED
    if local_rank() == 0:  # every node's launcher prints it (a stop, the store's host gone)
        record_resume(resume_command())
    try:
        with errors_reported():
            metrics = fit_and_test(run)
        how = ledgers.ENDED_OK
    except Preempted as stop:
        how = ledgers.ENDED_STOPPED
        if is_rank_zero():
            remote = run.checkpoints.remote is not None  # any machine resumes from its URL
            name = run.checkpoints.where if remote or run.checkpoints.sharded else \
                getattr(stop.checkpoint, "name", "")  # fmt: skip
            saved = f"{name} is saved" if stop.checkpoint else "nothing saved"
            log.info(
                f"Stopped by a signal at step {stop.step}; {saved}. Resume with: "
                f"{resume_command()}   (exit {EXIT_PREEMPTED})"
            )
        close_process_group()  # every rank agreed to stop: the group is healthy
        sys.exit(EXIT_PREEMPTED)
    finally:
        watch.stop_watching()
        if run.ledger.opened:
            goodput.close(run.ledger, how)
            run.ledger.close()
    close_process_group()
    return metrics


def checkpoint_to_test(run: Run, best: Path | str | None) -> Path | None:
    """The weights `test` evaluates (`test_ckpt`), the same rule in both trainers:

    - best / last: that checkpoint of this run when it exists (a best at a URL, as
      callbacks.model_checkpoint.dirpath=s3://... makes it: its downloaded copy);
    - nothing trained in this attempt (train=false, or a finished run only tested): the
      checkpoint it started from;
    - else (current, or no such file): None, the weights in memory.
    """
    from project.engine.checkpoints.remote import is_url

    which = run.cfg.get("test_ckpt") or "current"
    chosen = {"best": best, "last": run.checkpoints.last}.get(which)
    if chosen is not None and (run.cfg.train or run.resume.finished):
        found = fetched_best(run, str(chosen)) if is_url(chosen) else Path(chosen)
        if found is not None and found.is_file():
            return found
    if not run.fits:
        return run.resume.path
    return None


def fetched_best(run: Run, url: str) -> Path | None:
    """The best checkpoint at `url` in this node's staging folder (None: there is none):
    `test` loads a local file on every rank. Read through remote.py, as a `ckpt_path` URL is;
    a store that does not answer is one line, never a test of other weights."""
    from project.engine.checkpoints.remote import STAGING, exists, fetch_checkpoint

    if not exists(url):
        return None
    where = run.output_dir / STAGING / "best"
    path = fetch_checkpoint(url, where, "callbacks.model_checkpoint.dirpath")
    log.info(f"Fetched {url} into {path}")
    return path
