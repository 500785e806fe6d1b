"""The raw PyTorch DDP trainer's entry point: the same training as `project.train`, no Lightning.

    python -m project.raw_train [overrides]                                  # one process
    torchrun --standalone --nproc-per-node=2 -m project.raw_train [overrides] # DDP
    TRAINER=raw launch/single_node.sh [overrides]                            # the same, scripted

The trainer itself is project.engine.raw_trainer (a table there maps each Lightning feature to
where it happens); the config keys it reads are listed in project.engine.raw_keys. Torch is
imported only after Hydra composed the config, so `--help` and config errors answer fast.
"""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from project.engine.config import CONFIG_DIR, check_targets, register_resolvers, to_plain
from project.engine.console import (
    report_metrics,
    report_user_errors,
    run_cli,
)
from project.engine.schema import check_schema
from project.launcher import EXIT_PREEMPTED, report_exit

log = logging.getLogger("project.raw_train")


def run(cfg: DictConfig) -> dict[str, float]:
    """Fit, then test the last weights; returns the final metrics (rank 0 writes metrics.json)."""
    check_schema(cfg)  # types and ranges, before torch is imported: fails in about a second
    from hydra.core.hydra_config import HydraConfig

    from project.engine.raw_keys import ADAPTERS
    from project.engine.resume import LAST_PT, find_resume, finished_results, last_checkpoint

    output_dir = Path(HydraConfig.get().runtime.output_dir)
    # An explicit ckpt_path wins; else (auto_resume) the last.pt a previous attempt of this
    # run left: a torchrun restart, a requeued job, the same RUN_ID again. Checked before the
    # targets are imported and anything is built: a bad checkpoint or a finished run answers
    # in seconds.
    resume = find_resume(to_plain(cfg), last_checkpoint(cfg, output_dir, LAST_PT), kind="model")
    if earlier := finished_results(resume, output_dir):
        return earlier
    # Not the Lightning adapters' own targets (importing them imports Lightning, which this
    # trainer never runs): check_config says in one line when they are not the adapters.
    check_targets(cfg, skip={f"{group}._target_" for group in ADAPTERS})
    from project.engine import ddp
    from project.engine.raw_trainer import Preempted, RawTrainer

    trainer = RawTrainer(cfg, output_dir)
    metrics: dict[str, float] = {}
    try:
        if resume.path:
            trainer.load(resume.path)
        if cfg.train and not resume.finished:
            try:
                with ddp.peer_failures_reported():
                    metrics.update(trainer.fit())
            except Preempted:
                log.info(
                    f"Stopped by a signal at step {trainer.global_step}; {LAST_PT} is saved. Run "
                    f"the same command again to resume. Exit {EXIT_PREEMPTED}."
                )
                sys.exit(EXIT_PREEMPTED)  # the finally below still closes the process group
        elif resume.finished:  # training finished, its testing did not: test only
            metrics.update(resume.metrics)
        if cfg.test:
            best = trainer.checkpoint_dir() / "best.pt"
            if cfg.train and cfg.get("test_ckpt") == "best" and best.is_file():
                trainer.load(str(best), weights_only=True)  # like Lightning's ckpt_path="best"
            test = trainer.evaluate("test", trainer.n_batches("test"))
            for name, value in test.items():
                trainer.log_scalar(name, value, trainer.global_step)
            metrics.update(test)
        if trainer.is_zero:
            report_metrics(output_dir, metrics)
    finally:
        trainer.close()  # destroy_process_group on every exit path
    if not math.isfinite(metrics.get("train/loss", 0.0)):
        raise RuntimeError("training diverged: the train loss is not finite")
    return metrics


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def _hydra_main(cfg: DictConfig) -> float | None:
    metrics = report_user_errors(lambda: run(cfg))
    return metrics.get(cfg.get("optimized_metric"))


def main() -> None:
    register_resolvers()
    with report_exit():  # tells project.launcher (when it started us) how we ended
        run_cli(_hydra_main)


if __name__ == "__main__":
    main()
