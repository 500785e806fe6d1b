"""Training entry point (Lightning): `python train.py [overrides]`, see configs/train.yaml.

What happens around fit and test (checks, resume, sweep jobs, the stop, metrics.json) is the
run skeleton both trainers share (project.engine.run.skeleton); this file builds the run.
Lightning and torch are imported only inside `fit_and_test`, after Hydra has composed and
checked the config, so `--help`, `--cfg job` and config typos answer in well under a second.
"""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig

from project.engine.config.compose import CONFIG_DIR, register_resolvers, to_plain
from project.engine.run import cli, skeleton
from project.engine.run.console import quiet_hydra

log = logging.getLogger("project.train")  # not __name__: run as a script it is "__main__"
# Also here, not only in main(): a SLURM job that submitit starts imports this module to run
# the task function and never calls main().
register_resolvers()
quiet_hydra()

# What project.launcher's warm start imports once per node, before it forks the workers
# (project.engine.launch.warm): what fit_and_test imports, and the heaviest of what it builds.
WARM_IMPORTS = ("lightning.pytorch", "torchmetrics", "torch.utils.tensorboard",
                "project.engine.lightning.build", "project.engine.lightning.callbacks",
                "project.engine.lightning.datamodule")  # fmt: skip
LIGHTNING = skeleton.EntryPoint("lightning", "project.train", checkpoint_key="state_dict")


def train(cfg: DictConfig) -> dict[str, float]:
    """Fit, then test; returns the final metrics (rank 0 also writes metrics.json)."""
    return skeleton.run(cfg, LIGHTNING, fit_and_test)


def fit_and_test(run: skeleton.Run) -> dict[str, float]:
    """Instantiate data, model, loggers, callbacks and trainer from the config; fit; test."""
    import lightning.pytorch as pl
    from hydra.utils import instantiate

    from project.engine.checkpoints.remote import STAGING
    from project.engine.lightning import build
    from project.engine.lightning.callbacks import AtomicCheckpointIO
    from project.engine.lightning.datamodule import shard_datamodule
    from project.engine.run.results import as_floats

    cfg, resume = run.cfg, run.resume
    strategy = build.strategy(run)
    c = run.checkpoints
    if c.sharded and hasattr(strategy, "sharded_at"):  # FSDPStrategy: `last` sharded
        strategy.sharded_at = (c.sharded_dir, c.sharded_name, c.last)
    pl.seed_everything(cfg.seed, workers=True)
    datamodule: pl.LightningDataModule = instantiate(cfg.data)
    # Any datamodule's loaders: sharded, resumable, started where a resumed epoch stood.
    shard_datamodule(datamodule, cfg.seed, run.position, cfg.get("keep_global_batch", True),
                     cfg, run.checkpoints.command)  # fmt: skip
    model: pl.LightningModule = instantiate(cfg.model)
    loggers = build.instantiate_all(cfg.get("logger"))
    callbacks = build.callbacks(run, loggers)
    best_k = any(isinstance(cb, pl.callbacks.ModelCheckpoint) for cb in callbacks)
    trainer: pl.Trainer = instantiate(
        cfg.trainer,
        strategy=strategy,
        callbacks=callbacks,
        logger=loggers or False,
        plugins=[AtomicCheckpointIO(run.ledger, run.output_dir / STAGING)],
        profiler=build.profiler(cfg),
        # Lightning adds a ModelCheckpoint of its own where none is configured: not in a run
        # whose `last` is sharded (strategy=fsdp on several processes)
        **({"enable_checkpointing": False} if c.sharded and not best_k else {}),
    )
    for lg in loggers:
        lg.log_hyperparams(to_plain(cfg))

    metrics: dict[str, float] = {}
    with build.stops_as_preempted(trainer, run):
        if run.fits:
            log.info(f"Training{f', resuming from {resume.path}' if resume.path else ''}")
            path = str(resume.path) if resume.path else None
            # weights_only: our checkpoints hold tensors and plain values only.
            trainer.fit(model, datamodule=datamodule, ckpt_path=path, weights_only=True)
            metrics.update(as_floats(trainer.callback_metrics))
        elif resume.finished:  # training finished, its testing did not: test only
            metrics.update(resume.metrics)
        if cfg.test:
            ckpt = skeleton.checkpoint_to_test(run, build.best_checkpoint(trainer, run))
            log.info(f"Testing {ckpt or 'the current weights'}")
            path = str(ckpt) if ckpt else None
            trainer.test(model, datamodule=datamodule, ckpt_path=path, weights_only=True)
            metrics.update(as_floats(trainer.callback_metrics))
    return metrics


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def _hydra_main(cfg: DictConfig) -> float | None:
    return cli.optimized_value(cfg, cli.run_task(lambda: train(cfg)))


def main() -> None:
    cli.main(_hydra_main)


if __name__ == "__main__":
    main()
