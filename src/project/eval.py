"""Evaluation entry point: test a saved checkpoint on the test split it was trained with."""

from __future__ import annotations

import logging
from typing import Any

import hydra
from omegaconf import DictConfig

from project.config import CONFIG_DIR, register_resolvers
from project.console import report_user_errors, run_cli
from project.errors import UserError

log = logging.getLogger("project.eval")


def load_checkpoint(path: str | None) -> dict[str, Any]:
    """Load `path` with weights_only=True, or raise a one-line UserError saying what is wrong."""
    from project.resume import read_checkpoint

    if path is None:
        raise UserError("ckpt_path is required: python eval.py ckpt_path=/path/to/last.ckpt")
    ckpt = read_checkpoint(path, "ckpt_path")
    if "state_dict" not in ckpt or "hyper_parameters" not in ckpt:
        raise UserError(f"ckpt_path={path} is not a Lightning checkpoint of this project")
    return ckpt


def evaluate(cfg: DictConfig) -> dict[str, float]:
    """Rebuild the model and the data split from the checkpoint, then run trainer.test."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    ckpt_path = OmegaConf.select(cfg, "ckpt_path", throw_on_missing=False)
    ckpt = load_checkpoint(None if ckpt_path == "???" else ckpt_path)

    from project.datamodule import DigitsDataModule
    from project.module import Classifier
    from project.train import instantiate_all

    model = Classifier(**ckpt["hyper_parameters"])
    model.load_state_dict(ckpt["state_dict"])
    # The split (seed, fractions) is the checkpoint's; location and loading come from cfg.data.
    saved = ckpt.get("datamodule_hyper_parameters", {})
    data_kwargs = {k: saved[k] for k in ("seed", "val_fraction", "test_fraction") if k in saved}
    datamodule: DigitsDataModule = instantiate(cfg.data, **data_kwargs)

    from project import ddp

    topology = ddp.resolve_topology(cfg.trainer)
    loggers = instantiate_all(cfg.get("logger"))
    trainer = instantiate(
        cfg.trainer, strategy=ddp.build_strategy(None, topology), logger=loggers or False
    )
    log.info(f"Testing {ckpt_path}")
    trainer.test(model, datamodule=datamodule)
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="eval")
def _hydra_main(cfg: DictConfig) -> None:
    metrics = report_user_errors(lambda: evaluate(cfg))
    log.info("Metrics: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items())))


def main() -> None:
    register_resolvers()
    run_cli(_hydra_main)


if __name__ == "__main__":
    main()
