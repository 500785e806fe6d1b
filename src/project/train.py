"""Training entry point: compose the config with Hydra, then fit and test.

Lightning, torch and the project modules are imported only inside `train()`, after Hydra has
composed and validated the config, so `--help`, `--cfg job` and config typos answer in well
under a second.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from project.config import CONFIG_DIR, is_rank_zero, register_resolvers, to_plain
from project.console import (
    print_config_tree,
    quiet_lightning,
    read_metrics,
    report_metrics,
    report_user_errors,
    run_cli,
)
from project.errors import UserError

log = logging.getLogger("project.train")

TREE_ORDER = ("data", "model", "callbacks", "logger", "trainer", "strategy", "paths")


def instantiate_all(group: DictConfig | None) -> list[Any]:
    """Instantiate every non-null `{name: {_target_: ...}}` entry of a callbacks/logger group."""
    from hydra.utils import instantiate

    return [instantiate(c) for c in (group or {}).values() if c is not None]


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit, then test; returns the metrics Lightning collected (floats)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from project import ddp

    hydra_cfg = HydraConfig.get()
    output_dir = Path(hydra_cfg.runtime.output_dir)
    topology = ddp.resolve_topology(cfg.trainer)  # before any heavy import: fail in seconds
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

    from project.callbacks import AtomicCheckpointIO, FaultInjection, StepStatsCallback

    quiet_lightning()
    threads = ddp.configure_threads(topology)
    ddp.check_hardware(cfg.get("strategy"), cfg.trainer)
    strategy = ddp.build_strategy(cfg.get("strategy"), topology)
    if is_rank_zero():
        print_config_tree(cfg, TREE_ORDER, save_to=output_dir / "config_tree.log")
        log.info(
            f"{topology.devices} process(es) per node x {topology.num_nodes} node(s), "
            f"launcher: {topology.launcher.name if topology.launcher else 'none'}, "
            f"{threads} thread(s) per process"
        )

    pl.seed_everything(cfg.seed, workers=True)
    datamodule: pl.LightningDataModule = instantiate(cfg.data)
    model: pl.LightningModule = instantiate(cfg.model)
    loggers = instantiate_all(cfg.get("logger"))
    callbacks = instantiate_all(cfg.get("callbacks"))
    if not loggers:  # `logger=none` must just work: an LR monitor without a logger is an error
        callbacks = [c for c in callbacks if not isinstance(c, pl.callbacks.LearningRateMonitor)]
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
    if cfg.train:
        ckpt_path = resume_checkpoint(cfg, callbacks)
        log.info(f"Training{f', resuming from {ckpt_path}' if ckpt_path else ''}")
        with stop_cleanly(trainer):
            # weights_only: our checkpoints hold tensors and plain values only.
            trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
        metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})
    if cfg.test:
        ckpt = test_checkpoint(trainer, cfg.get("test_ckpt")) if cfg.train else cfg.get("ckpt_path")
        log.info(f"Testing {ckpt or 'the current weights'}")
        trainer.test(model, datamodule=datamodule, ckpt_path=ckpt)
        metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})
    if trainer.is_global_zero:
        report_metrics(output_dir, metrics)
    return metrics


def resume_checkpoint(cfg: DictConfig, callbacks: list[Any]) -> str | None:
    """An explicit ckpt_path, else (auto_resume) the last.ckpt a previous attempt left."""
    if cfg.get("ckpt_path"):
        return cfg.ckpt_path
    if not cfg.get("auto_resume"):
        return None
    from project.callbacks import FaultTolerance
    from project.resume import last_checkpoint

    for cb in callbacks:
        if isinstance(cb, FaultTolerance) and (
            found := last_checkpoint(cb.path.parent, cb.path.name)
        ):
            return str(found)
    return None


@contextlib.contextmanager
def stop_cleanly(trainer: Any) -> Iterator[None]:
    """A signal stop -> exit EXIT_PREEMPTED; a dead peer -> one line instead of a hang/wall."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from project import ddp
    from project.resume import EXIT_PREEMPTED

    try:
        with ddp.peer_failures_reported():
            yield
    except SIGTERMException:
        if trainer.is_global_zero:
            log.info(
                f"Stopped by a signal at step {trainer.global_step}; last.ckpt is saved. Run "
                f"the same command again (same run folder) to resume. Exit {EXIT_PREEMPTED}."
            )
        sys.exit(EXIT_PREEMPTED)


def test_checkpoint(trainer: Any, which: str | None) -> str | None:
    """The checkpoint `trainer.test` should load after fit: best, last, or None (current)."""
    ckpt_cb = trainer.checkpoint_callback
    if which in (None, "current") or ckpt_cb is None:
        return None
    if which == "best":
        return ckpt_cb.best_model_path or None
    if which == "last":
        return ckpt_cb.last_model_path or None
    raise UserError(f"test_ckpt={which!r} is not one of best, last, current")


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def _hydra_main(cfg: DictConfig) -> float | None:
    metrics = report_user_errors(lambda: train(cfg))
    # Sweepers (e.g. Optuna) optimise the returned value.
    return metrics.get(cfg.get("optimized_metric"))


def main() -> None:
    register_resolvers()
    run_cli(_hydra_main)


if __name__ == "__main__":
    main()
