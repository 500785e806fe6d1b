"""Which config keys the raw trainer reads: the guard that keeps it in step with Lightning.

Every leaf of a composed training config must be classified here (tests/test_raw_parity.py
composes every option of every group, and checks the adapters' constructor arguments), so a
key that changes Lightning's training cannot be silently ignored by the raw trainer:

- CONSUMED: read by the raw trainer. A subtree ("model.net.*") is consumed when the raw
  trainer hands it whole to the same builder Lightning uses (build_task, build_source,
  build_optimizer, DistributedDataParallel), so every key in it acts the same in both.
- PRESENTATION: changes what is shown or named, not what is trained.
- REFUSED: Lightning features the raw trainer does not have; a non-default value stops it.
A new key (a Lightning option, an adapter argument, a callback setting) is unclassified until
someone decides which it is, and implements it in the raw trainer if it is CONSUMED. Where a
run sets one anyway (`+trainer.val_check_interval=100`), under a group Lightning hands to its
objects (GUARDED), the raw trainer stops with one line naming it (check_config).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from project.engine.errors import UserError

CONSUMED = {
    "seed", "train", "test", "test_ckpt", "ckpt_path", "optimized_metric", "optimized_mode",
    "step_stats", "auto_resume", "worker_start_method", "keep_global_batch",
    # model: the Lightning adapter's arguments, each handed to the shared builders
    "model._target_", "model._recursive_", "model.compile",
    "model.task.*", "model.net.*", "model.optimizer.*", "model.scheduler.*",
    # data: the datamodule adapter's arguments
    "data._target_", "data._recursive_", "data.batch_size", "data.num_workers", "data.pin_memory",
    "data.persistent_workers", "data.shuffle", "data.lanes", "data.shuffle_block", "data.dataset.*",
    # strategy: DistributedDataParallel or FSDP and process-group options (checked by
    # ddp.check_options, distributed/fsdp/options.check)
    "strategy.*",
    "trainer.accelerator", "trainer.devices", "trainer.num_nodes", "trainer.sync_batchnorm",
    "trainer.min_epochs", "trainer.max_epochs", "trainer.max_steps", "trainer.precision",
    "trainer.accumulate_grad_batches", "trainer.gradient_clip_val",
    "trainer.gradient_clip_algorithm", "trainer.check_val_every_n_epoch",
    "trainer.log_every_n_steps", "trainer.deterministic", "trainer.benchmark",
    "trainer.limit_train_batches", "trainer.limit_val_batches", "trainer.limit_test_batches",
    "trainer.num_sanity_val_steps", "trainer.fast_dev_run", "trainer.use_distributed_sampler",
    "callbacks.model_checkpoint", "callbacks.model_checkpoint.dirpath",
    "callbacks.model_checkpoint.monitor", "callbacks.model_checkpoint.mode",
    "callbacks.early_stopping", "callbacks.early_stopping.monitor",
    "callbacks.early_stopping.mode", "callbacks.early_stopping.patience",
    "callbacks.early_stopping.min_delta",
    "callbacks.fault_tolerance", "callbacks.fault_tolerance.dirpath",
    "callbacks.fault_tolerance.check_every_n_steps", "callbacks.fault_tolerance.stop_budget_s",
    "callbacks.fault_tolerance.every_n_train_steps",
    "callbacks.fault_tolerance.every_n_seconds",
    "fault_injection.at_step", "fault_injection.rank", "fault_injection.mode",
    "fault_injection.slow_ms", "stragglers", "stragglers.*",
}  # fmt: skip
PRESENTATION = {
    "task_name", "tags", "paths.*", "trainer._target_",
    "trainer.default_root_dir", "trainer.enable_progress_bar", "trainer.enable_model_summary",
    "trainer.profiler.*", "callbacks.early_stopping._target_",
    "callbacks.fault_tolerance._target_",
    "callbacks.fault_tolerance.filename",  # the raw trainer's own format is always last.pt
    "callbacks.model_checkpoint._target_",
    "callbacks.model_checkpoint.filename", "callbacks.model_checkpoint.save_top_k",
    "callbacks.model_checkpoint.auto_insert_metric_name",
    "callbacks.model_checkpoint.every_n_epochs",
    "callbacks.model_checkpoint.save_last",  # must stay false: fault_tolerance owns last.*
}  # fmt: skip
# Loggers and callbacks watch or show a run; adding one does not trip the guard. The raw
# trainer implements the three callbacks that change what is trained or kept (checkpoints,
# early stopping, fault tolerance), key by key above; a callback added by a user that changes
# training (e.g. weight averaging) has no raw counterpart, and the parity test shows it.
IMPLEMENTED_CALLBACKS = ("model_checkpoint", "early_stopping", "fault_tolerance")
# Lightning features this trainer does not implement: refused when set to anything but this
# value or null (see check_config). The raw trainer checks early stopping after each
# validation: Lightning's rule with check_on_train_epoch_end=false. With true Lightning also
# checks at epoch ends without a validation (null: the same in the usual set-up, where only an
# epoch that max_steps cuts short has none, and Lightning then fails on the missing metric).
REFUSED = {"trainer.overfit_batches": 0.0, "trainer.detect_anomaly": False,
           "callbacks.early_stopping.check_on_train_epoch_end": False}  # fmt: skip
# The groups whose keys Lightning hands to its objects (Trainer, the adapters, the callbacks):
# an unclassified key there would change Lightning's run and not the raw trainer's.
GUARDED = ("trainer", "model", "data", "callbacks")
# What the raw trainer builds in place of the Lightning adapters; another _target_ there is
# code it cannot run (a user's own LightningModule/DataModule).
ADAPTERS = {
    "model": "project.engine.lightning.module.TaskModule",
    "data": "project.engine.lightning.datamodule.DataModule",
}
SUPPORTED_PRECISION = ("32-true", "32", 32, "bf16-mixed", "16-mixed")


def classify(key: str) -> str | None:
    """ "consumed", "presentation", "refused" or None (unknown: a test fails on it)."""
    parts = key.split(".")
    if parts[0] == "logger" or (parts[0] == "callbacks" and len(parts) > 1
                                and parts[1] not in IMPLEMENTED_CALLBACKS):  # fmt: skip
        return "presentation"
    for kind, keys in (
        ("consumed", CONSUMED),
        ("presentation", PRESENTATION),
        ("refused", REFUSED),
    ):
        subtrees = [k[:-2] for k in keys if k.endswith(".*")]
        if key in keys or any(key == t or key.startswith(t + ".") for t in subtrees):
            return kind
    return None


def leaf_keys(node: Any, prefix: str = "") -> list[str]:
    """The dotted keys of a config's leaves (a list is one leaf; interpolations unresolved)."""
    if OmegaConf.is_config(node):
        node = OmegaConf.to_container(node, resolve=False)
    if not isinstance(node, dict):
        return [prefix[:-1]]
    keys = []
    for key, value in node.items():
        keys += leaf_keys(value, f"{prefix}{key}.")
    return keys  # an empty group (callbacks=none) configures nothing


def check_config(cfg: DictConfig) -> None:
    """Stop with one line on what the raw trainer cannot do the same way."""
    for group, target in ADAPTERS.items():
        if cfg[group].get("_target_") != target:
            raise UserError(
                f"{group}._target_={cfg[group].get('_target_')} is a Lightning class the raw "
                f"trainer cannot run: it runs {target}'s plain-PyTorch parts (project.tasks, "
                "project.data); train this config with train.py"
            )
    for group in (g for g in GUARDED if cfg.get(g) is not None):
        for key in leaf_keys(cfg[group], f"{group}."):
            if classify(key) is None:
                value = OmegaConf.select(cfg, key, throw_on_resolution_failure=False)
                raise UserError(
                    f"{key}={value} is not implemented by the raw trainer: remove it, or train "
                    "with train.py (project/engine/raw/keys.py lists the keys it reads)"
                )
    for key, default in REFUSED.items():
        value = OmegaConf.select(cfg, key, default=default)
        if value not in (default, None, 0, False):
            raise UserError(
                f"{key}={value} is a Lightning feature the raw trainer does not have: leave it "
                f"at {default}, or train with train.py"
            )
    if cfg.trainer.precision not in SUPPORTED_PRECISION:
        raise UserError(
            f"trainer.precision={cfg.trainer.precision} is not supported by the raw trainer: "
            f"use one of {', '.join(map(str, SUPPORTED_PRECISION[2:]))} or 32-true"
        )
