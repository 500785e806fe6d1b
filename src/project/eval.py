"""Evaluation entry point: test a saved checkpoint on the test split it was trained with.

The module (task + network) and the data split are rebuilt from the checkpoint's own
hyperparameters, whatever task it trained; the config only says where the data lives and how
to load it (`paths.data_dir`, or a `data=` option of the same dataset for loader settings).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from project.engine.config.compose import CONFIG_DIR, to_plain
from project.engine.data.worker_start import configure_worker_start
from project.engine.errors import UserError
from project.engine.run import cli

log = logging.getLogger("project.eval")  # not __name__: run as a script it is "__main__"

LOADING_KEYS = ("batch_size", "num_workers", "pin_memory", "persistent_workers")


def load_checkpoint(path: str | None, staging: Path | None = None) -> dict[str, Any]:
    """Load `path` with weights_only=True, or raise a one-line UserError saying what is wrong.
    A URL (s3://...) is downloaded into `staging` first. A sharded save (strategy=fsdp's
    `last`: its folder, or the `last` its manifest publishes) is gathered whole on each
    process, as `python -m project.consolidate` writes it."""
    from project.engine.checkpoints.remote import STAGING, answers, fetch_checkpoint, is_url
    from project.engine.checkpoints.sharded import names_save
    from project.engine.checkpoints.state import read_checkpoint
    from project.engine.checkpoints.whole import consolidated

    if path is None:
        raise UserError("ckpt_path is required: python eval.py ckpt_path=/path/to/last.ckpt")
    if is_url(path):
        answers(path, "ckpt_path")  # a silent store: one line, not names_save's wait
    if names_save(path):
        ckpt = consolidated(path, "ckpt_path")
    else:
        local = (
            fetch_checkpoint(path, staging or Path(STAGING), "ckpt_path") if is_url(path) else path
        )
        ckpt = read_checkpoint(local, "ckpt_path")
    hparams = ckpt.get("hyper_parameters") or {}
    if "state_dict" not in ckpt or "task" not in hparams or "net" not in hparams:
        hint = "give a .ckpt written by train.py"
        raw = "python -m project.raw_train train=false ckpt_path=... tests it"  # feature:raw
        hint = f"{hint} (a raw trainer's .pt: {raw})" if "config" in ckpt else hint  # feature:raw
        raise UserError(
            f"ckpt_path={path} is not a Lightning checkpoint of this project's TaskModule "
            f"(no task/net hyperparameters): {hint}"
        )
    if "dataset" not in (ckpt.get("datamodule_hyper_parameters") or {}):
        raise UserError(
            f"ckpt_path={path} does not record its dataset (trained with a datamodule of your "
            "own?): evaluate it with train.py train=false ckpt_path=... and its data config"
        )
    return ckpt


def data_config(ckpt: dict[str, Any], cfg: DictConfig) -> dict[str, Any]:
    """The checkpoint's datamodule arguments; loader settings and the data location from cfg.

    A `data=` option must read the same dataset the checkpoint's task was trained on.
    """
    saved = dict(ckpt["datamodule_hyper_parameters"])
    dataset = dict(saved["dataset"])
    given = to_plain(cfg.get("data")) or {}
    if given:
        wanted = (given.get("dataset") or {}).get("_target_", given.get("_target_"))
        if wanted != dataset["_target_"]:
            task = ckpt["hyper_parameters"]["task"]["_target_"]
            raise UserError(
                f"the data override reads {wanted} but the checkpoint's task ({task}) was trained "
                f"on {dataset['_target_']}: drop the data= override (the checkpoint's own data "
                "is used) or pick a checkpoint of that task"
            )
        saved.update({k: given[k] for k in LOADING_KEYS if k in given})
        dataset.update({k: v for k, v in given["dataset"].items() if k == "data_dir"})
    elif "data_dir" in dataset:
        dataset["data_dir"] = cfg.paths.data_dir  # where this machine keeps its data
    if "cache_dir" in dataset:  # a remote stream's shards: cached in this run's folder
        dataset["cache_dir"] = f"{cfg.paths.output_dir}/shard_cache"
    return {**saved, "dataset": dataset}


def evaluate(cfg: DictConfig) -> dict[str, float]:
    """Rebuild the module and the data split from the checkpoint, then run trainer.test."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    ckpt_path = OmegaConf.select(cfg, "ckpt_path", throw_on_missing=False)
    staging = Path(cfg.paths.output_dir) / "checkpoint_staging"  # a URL's local copy
    ckpt = load_checkpoint(None if ckpt_path == "???" else ckpt_path, staging)
    data = data_config(ckpt, cfg)
    # the workers' fork server: started before Lightning loads, it imports meanwhile
    configure_worker_start(cfg.get("worker_start_method"), data, "project.eval")

    from project.engine.distributed import ddp
    from project.engine.distributed.exits import close_process_group
    from project.engine.lightning.build import instantiate_all
    from project.engine.lightning.datamodule import DataModule, shard_datamodule
    from project.engine.lightning.module import TaskModule
    from project.engine.run.console import quiet_lightning
    from project.engine.run.results import as_floats

    quiet_lightning()  # after Lightning's import: each of its lines once, rank 0 only
    datamodule = DataModule(**data)
    shard_datamodule(datamodule, cfg.seed)
    model = TaskModule(**ckpt["hyper_parameters"])
    model.load_state_dict(ckpt["state_dict"])
    topology = ddp.resolve_topology(cfg.trainer)
    loggers = instantiate_all(cfg.get("logger"))
    trainer = instantiate(
        cfg.trainer, strategy=ddp.build_strategy(None, topology), logger=loggers or False
    )
    log.info(f"Testing {ckpt_path}")
    trainer.test(model, datamodule=datamodule)
    close_process_group()
    return as_floats(trainer.callback_metrics)


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="eval")
def _hydra_main(cfg: DictConfig) -> None:
    from project.engine.run.results import log_metrics

    log_metrics(cli.report_user_errors(lambda: evaluate(cfg)))


def main() -> None:
    cli.main(_hydra_main)


if __name__ == "__main__":
    main()
