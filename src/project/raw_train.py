"""The raw PyTorch DDP trainer's entry point: the same training as `project.train`, no Lightning.

    python -m project.raw_train [overrides]                                  # one process
    torchrun --standalone --nproc-per-node=2 -m project.raw_train [overrides] # DDP
    TRAINER=raw launch/single_node.sh [overrides]                            # the same, scripted

What happens around fit and test (checks, resume, sweep jobs, the stop, metrics.json) is the
run skeleton both trainers share (project.engine.run.skeleton). The trainer itself is
project.engine.raw.trainer (a table there maps each Lightning feature to where it happens);
the config keys it reads are listed in project.engine.raw.keys. Torch is imported only after
Hydra composed the config, so `--help` and config errors answer fast.
"""

from __future__ import annotations

import math

import hydra
from omegaconf import DictConfig

from project.engine.checkpoints import LAST_PT
from project.engine.config.compose import CONFIG_DIR
from project.engine.raw.keys import ADAPTERS, check_config
from project.engine.run import cli, skeleton

# What project.launcher's warm start imports once per node, before it forks the workers
# (project.engine.launch.warm); never Lightning, which this trainer does not run.
WARM_IMPORTS = ("project.engine.raw.trainer", "torchmetrics", "torch.utils.tensorboard")
# Not the Lightning adapters' own targets: importing them imports Lightning, which this trainer
# never runs (raw.keys.check_config says in one line when they are not the adapters).
RAW = skeleton.EntryPoint(
    "raw",
    "project.raw_train",
    checkpoint_key="model",
    last_name=LAST_PT,
    skip_targets=tuple(f"{group}._target_" for group in ADAPTERS),
)


def run(cfg: DictConfig) -> dict[str, float]:
    """Fit, then test; returns the final metrics (rank 0 also writes metrics.json)."""
    check_config(cfg)  # what it cannot run the same way: one line before anything starts
    return skeleton.run(cfg, RAW, fit_and_test)


def fit_and_test(run: skeleton.Run) -> dict[str, float]:
    """Build the trainer, continue from the run's checkpoint, fit, test."""
    from project.engine.raw.trainer import RawTrainer

    cfg, resume = run.cfg, run.resume
    trainer = RawTrainer(run)
    metrics: dict[str, float] = {}
    try:
        if resume.path:
            trainer.load(resume.path)
        if run.fits:
            metrics.update(trainer.fit())
        elif resume.finished:  # training finished, its testing did not: test only
            metrics.update(resume.metrics)
        if cfg.test:
            ckpt = skeleton.checkpoint_to_test(run, run.checkpoints.best)
            if ckpt is not None:
                trainer.load(ckpt, weights_only=True)
            metrics.update(trainer.test())
    finally:
        trainer.close()  # drops DDP, then closes the process group, on every exit path
    if not math.isfinite(metrics.get("train/loss", 0.0)):
        raise RuntimeError("training diverged: the train loss is not finite")
    return metrics


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def _hydra_main(cfg: DictConfig) -> float | None:
    return cli.optimized_value(cfg, cli.run_task(lambda: run(cfg)))


def main() -> None:
    cli.main(_hydra_main)


if __name__ == "__main__":
    main()
