"""Training entry point: compose the config with Hydra, then fit and test.

Lightning, torch and the project modules are imported only inside `train()`, after Hydra has
composed and validated the config, so `--help`, `--cfg job` and config typos answer in well
under a second.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from omegaconf import DictConfig

from project.engine import slurm_job
from project.engine.config import CONFIG_DIR, check_targets, register_resolvers, to_plain
from project.engine.console import (
    print_config_tree,
    quiet_hydra,
    quiet_lightning,
    read_metrics,
    report_metrics,
    report_user_errors,
    run_cli,
)
from project.engine.env import is_rank_zero
from project.engine.errors import UserError
from project.engine.schema import check_schema
from project.launcher import report_exit

if TYPE_CHECKING:
    from project.engine.resume import Resume

log = logging.getLogger("project.train")
# Also here, not only in main(): a SLURM job that submitit starts imports this module to run
# the task function and never calls main().
register_resolvers()
quiet_hydra()

TREE_ORDER = ("data", "model", "callbacks", "logger", "trainer", "strategy", "paths")


def instantiate_all(group: DictConfig | None) -> list[Any]:
    """Instantiate every non-null `{name: {_target_: ...}}` entry of a callbacks/logger group."""
    from hydra.utils import instantiate

    return [instantiate(c) for c in (group or {}).values() if c is not None]


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit, then test; returns the metrics Lightning collected (floats)."""
    check_schema(cfg)  # types and ranges, before torch is imported: fails in about a second
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from project.engine import ddp
    from project.engine.resume import find_resume, finished_results, last_checkpoint

    hydra_cfg = HydraConfig.get()
    output_dir = Path(hydra_cfg.runtime.output_dir)
    if hydra_cfg.mode == RunMode.MULTIRUN and slurm_job.active():  # hydra/launcher=submitit_slurm
        check_targets(cfg)
        slurm_job.run_on_every_node(list(hydra_cfg.overrides.task), str(output_dir), cfg.trainer)
        return read_metrics(output_dir)
    topology = ddp.resolve_topology(cfg.trainer)  # before any heavy import: fail in seconds
    # Before Lightning is imported (checking the targets imports it) and anything is built:
    # a bad checkpoint stops here with one line, nothing written; a finished run (a sweep
    # job's too) answers in seconds.
    last = last_checkpoint(cfg, output_dir)  # where callbacks.fault_tolerance keeps last.ckpt
    resume = find_resume(to_plain(cfg), last, kind="state_dict")
    if earlier := finished_results(resume, output_dir):
        return earlier
    check_targets(cfg)
    if hydra_cfg.mode == RunMode.MULTIRUN and topology.world_size > 1:
        if topology.launcher is not None or topology.num_nodes > 1:
            raise UserError(
                "a multirun (-m) with several processes starts one torchrun job per sweep job "
                "itself: run it with plain python, single node"
            )
        ddp.relaunch_with_torchrun(
            "project.train", list(hydra_cfg.overrides.task), str(output_dir), topology.devices
        )
        return read_metrics(output_dir)

    import lightning.pytorch as pl
    from hydra.utils import instantiate

    from project.engine.callbacks import (
        AtomicCheckpointIO,
        FaultInjection,
        FaultTolerance,
        StepStatsCallback,
    )
    from project.engine.datamodule import shard_datamodule
    from project.engine.resume import training_identity

    quiet_lightning()
    threads = ddp.configure_threads(topology)
    ddp.check_hardware(cfg.get("strategy"), cfg.trainer)
    strategy = ddp.build_strategy(cfg.get("strategy"), topology)
    if is_rank_zero():
        tree_log = output_dir / "config_tree.log"  # a resumed run keeps its first record
        print_config_tree(cfg, TREE_ORDER, save_to=None if tree_log.exists() else tree_log)
        log.info(
            f"{topology.devices} process(es) per node x {topology.num_nodes} node(s), "
            f"launcher: {topology.launcher.name if topology.launcher else 'none'}, "
            f"{threads} thread(s) per process"
        )

    pl.seed_everything(cfg.seed, workers=True)
    datamodule: pl.LightningDataModule = instantiate(cfg.data)
    shard_datamodule(datamodule, cfg.seed)  # any datamodule's loaders: sharded, resumable
    model: pl.LightningModule = instantiate(cfg.model)
    loggers = instantiate_all(cfg.get("logger"))
    callbacks = instantiate_all(cfg.get("callbacks"))
    if not loggers:  # `logger=none` must just work: an LR monitor without a logger is an error
        callbacks = [c for c in callbacks if not isinstance(c, pl.callbacks.LearningRateMonitor)]
    fault_tolerance = next((c for c in callbacks if isinstance(c, FaultTolerance)), None)
    check_one_last_checkpoint(callbacks, fault_tolerance)
    if fault_tolerance is not None:
        fault_tolerance.identity = training_identity(to_plain(cfg))
    if cfg.get("step_stats"):
        callbacks.append(StepStatsCallback(str(output_dir)))
    if (cfg.get("fault_injection") or {}).get("at_step") is not None:
        callbacks.append(FaultInjection(to_plain(cfg.fault_injection)))
    trainer: pl.Trainer = instantiate(
        cfg.trainer,
        strategy=strategy,
        callbacks=callbacks,
        logger=loggers or False,
        plugins=[AtomicCheckpointIO()],
    )
    for lg in loggers:
        lg.log_hyperparams(to_plain(cfg))

    metrics: dict[str, float] = {}
    with stop_cleanly(trainer):
        if cfg.train and not resume.finished:
            log.info(f"Training{f', resuming from {resume.path}' if resume.path else ''}")
            # weights_only: our checkpoints hold tensors and plain values only.
            path = str(resume.path) if resume.path else None
            trainer.fit(model, datamodule=datamodule, ckpt_path=path, weights_only=True)
            metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})
        elif resume.finished:  # training finished, its testing did not: test only
            metrics.update(resume.metrics)
        if cfg.test:
            ckpt = test_checkpoint(trainer, cfg, last, resume)
            log.info(f"Testing {ckpt or 'the current weights'}")
            trainer.test(model, datamodule=datamodule, ckpt_path=ckpt, weights_only=True)
            metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})
    if trainer.is_global_zero:
        report_metrics(output_dir, metrics)
    return metrics


def check_one_last_checkpoint(callbacks: list[Any], fault_tolerance: Any) -> None:
    """A ModelCheckpoint with save_last next to FaultTolerance would write a second last.ckpt
    into the same folder (Lightning then versions it: last-v1.ckpt, and auto-resume would
    read a stale one)."""
    import lightning.pytorch as pl

    for cb in callbacks:
        if isinstance(cb, pl.callbacks.ModelCheckpoint) and cb.save_last and fault_tolerance:
            raise UserError(
                "callbacks.model_checkpoint.save_last=true writes a second last.ckpt beside "
                "the one callbacks.fault_tolerance writes every epoch: leave it false"
            )


@contextlib.contextmanager
def stop_cleanly(trainer: Any) -> Iterator[None]:
    """A signal stop -> exit EXIT_PREEMPTED; a dead peer -> one line instead of a hang/wall;
    after a finished run or a stop the process group is closed (`ddp.close_process_group`).

    Lightning's own launcher starts ranks > 0 as children of rank 0 and kills them only on
    KeyboardInterrupt: on any other failure of rank 0 they are killed here, so no rank is
    left behind (e.g. one hung while rank 0 timed out waiting for it).
    """
    from lightning.pytorch.strategies.launchers.subprocess_script import (
        _SubprocessScriptLauncher,
    )
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from project.engine import ddp
    from project.launcher import EXIT_PREEMPTED

    try:
        with ddp.peer_failures_reported():
            yield
    except SIGTERMException:
        if trainer.is_global_zero:
            log.info(
                f"Stopped by a signal at step {trainer.global_step}; last.ckpt is saved. Run "
                f"the same command again (same run folder) to resume. Exit {EXIT_PREEMPTED}."
            )
        ddp.close_process_group()  # every rank agreed to stop: the group is healthy
        sys.exit(EXIT_PREEMPTED)
    except BaseException:
        launcher = trainer.strategy.launcher
        if isinstance(launcher, _SubprocessScriptLauncher):
            launcher.kill(signal.SIGKILL)
        raise
    ddp.close_process_group()


def test_checkpoint(trainer: Any, cfg: DictConfig, last: Path | None, resume: Resume) -> str | None:
    """The checkpoint `trainer.test` loads (test_ckpt): best, last, or None (current weights).

    After fit the trainer knows its best checkpoint; a finished run that is only tested
    takes both from its last checkpoint.
    """
    which = cfg.get("test_ckpt") or "current"
    if not cfg.train:
        return cfg.get("ckpt_path")
    if resume.finished:  # no fit ran here: the weights come from the run's checkpoints
        from project.engine.resume import read_checkpoint

        states = read_checkpoint(resume.path).get("callbacks", {}).values()
        best = next((s["best_model_path"] for s in states if s.get("best_model_path")), None)
        return best if which == "best" and best else str(resume.path)
    if which == "best":
        return getattr(trainer.checkpoint_callback, "best_model_path", None) or None
    if which == "last" and last is not None and last.is_file():
        return str(last)
    return None


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def _hydra_main(cfg: DictConfig) -> float | None:
    # In a submitit job errors travel back to the sweep as exceptions: no SystemExit there.
    metrics = train(cfg) if slurm_job.active() else report_user_errors(lambda: train(cfg))
    # Sweepers (e.g. Optuna) optimise the returned value.
    return metrics.get(cfg.get("optimized_metric"))


def main() -> None:
    register_resolvers()
    with report_exit():  # tells project.launcher (when it started us) how we ended
        run_cli(_hydra_main)


if __name__ == "__main__":
    main()
