"""Training entry point: compose the config with Hydra, then fit and test.

Lightning, torch and the project modules are imported only inside `train()`, after Hydra has
composed and validated the config, so `--help`, `--cfg job` and config typos answer in well
under a second.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from project.config import CONFIG_DIR, is_rank_zero, register_resolvers, to_plain
from project.console import (
    print_config_tree,
    quiet_lightning,
    report_user_errors,
    run_cli,
)

log = logging.getLogger("project.train")

TREE_ORDER = ("data", "model", "callbacks", "logger", "trainer", "paths", "extras")


def instantiate_all(group: DictConfig | None) -> list[Any]:
    """Instantiate every non-null `{name: {_target_: ...}}` entry of a callbacks/logger group."""
    from hydra.utils import instantiate

    return [instantiate(c) for c in (group or {}).values() if c is not None]


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit, then test; returns the metrics Lightning collected (floats)."""
    import lightning.pytorch as pl
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import instantiate

    quiet_lightning()
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    if is_rank_zero():
        print_config_tree(cfg, TREE_ORDER, save_to=output_dir / "config_tree.log")

    pl.seed_everything(cfg.seed, workers=True)
    datamodule: pl.LightningDataModule = instantiate(cfg.data)
    model: pl.LightningModule = instantiate(cfg.model)
    loggers = instantiate_all(cfg.get("logger"))
    callbacks = instantiate_all(cfg.get("callbacks"))
    if not loggers:  # `logger=none` must just work: an LR monitor without a logger is an error
        callbacks = [c for c in callbacks if not isinstance(c, pl.callbacks.LearningRateMonitor)]
    trainer: pl.Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    for lg in loggers:
        lg.log_hyperparams(to_plain(cfg))

    metrics: dict[str, float] = {}
    if cfg.train:
        log.info("Training")
        trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
        metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})
    if cfg.test:
        ckpt = test_checkpoint(trainer, cfg.get("test_ckpt")) if cfg.train else cfg.get("ckpt_path")
        log.info(f"Testing {ckpt or 'the current weights'}")
        trainer.test(model, datamodule=datamodule, ckpt_path=ckpt)
        metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})
    if is_rank_zero():
        log.info("Metrics: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items())))
        log.info(f"Run folder: {output_dir}")
    return metrics


def test_checkpoint(trainer: Any, which: str | None) -> str | None:
    """The checkpoint `trainer.test` should load after fit: best, last, or None (current)."""
    ckpt_cb = trainer.checkpoint_callback
    if which in (None, "current") or ckpt_cb is None:
        return None
    if which == "best":
        return ckpt_cb.best_model_path or None
    if which == "last":
        return ckpt_cb.last_model_path or None
    from project.errors import UserError

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
