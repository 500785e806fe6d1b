"""Misspelt and unread keys: one line that names the key and its close matches.

Hydra answers a misspelt override (`trainer.max_epoch=3`) with "To append to your config use
+trainer.max_epoch=3", and that `+` form composes fine: Lightning's Trainer then fails on the
unknown argument seconds later, and `+callbacks.early_stoping=null` adds a null entry nobody
reads, so early stopping stays on with exit 0. Here a misspelt key gets "did you mean ...?" from
the keys next to it, and a key added to `trainer` or `callbacks` that nothing reads is refused
before anything starts.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from omegaconf import DictConfig

from project.engine.config.compose import CONFIG_DIR
from project.engine.errors import UserError

# lightning.pytorch.Trainer's arguments (tests/test_configs.py checks them against its
# signature): a `trainer` key outside them fails inside Trainer, seconds after the start.
TRAINER_ARGS = frozenset((
    "accelerator", "strategy", "devices", "num_nodes", "precision", "logger", "callbacks",
    "fast_dev_run", "max_epochs", "min_epochs", "max_steps", "min_steps", "max_time",
    "limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches",
    "overfit_batches", "val_check_interval", "check_val_every_n_epoch", "num_sanity_val_steps",
    "log_every_n_steps", "enable_checkpointing", "enable_progress_bar", "enable_model_summary",
    "accumulate_grad_batches", "gradient_clip_val", "gradient_clip_algorithm", "deterministic",
    "benchmark", "inference_mode", "use_distributed_sampler", "profiler", "detect_anomaly",
    "barebones", "plugins", "sync_batchnorm", "reload_dataloaders_every_n_epochs",
    "default_root_dir", "enable_autolog_hparams", "model_registry",
))  # fmt: skip
LIGHTNING_TRAINERS = ("lightning.pytorch.Trainer", "lightning.Trainer", "pytorch_lightning.Trainer")


def did_you_mean(key: str, candidates: Iterable[str], prefix: str = "") -> str:
    """': did you mean `prefix.max_epochs`?' for the closest match of `key`, else ''."""
    close = difflib.get_close_matches(key, sorted(set(candidates)), n=1, cutoff=0.6)
    return f": did you mean `{prefix}{close[0]}`?" if close else ""


def misspelt_override(err: BaseException) -> str | None:
    """The one line for Hydra's "Could not override 'a.b'" of a key its node lacks, else None."""
    cause = err.__cause__
    parent, key = getattr(cause, "parent_node", None), getattr(cause, "key", None)
    if "Could not override" not in str(err) or not isinstance(parent, DictConfig) or not key:
        return None
    full = getattr(cause, "full_key", None) or str(key)
    where = full.rsplit(".", 1)[0] + "." if "." in full else ""
    hint = did_you_mean(str(key), [str(k) for k in parent], where)
    if not hint:
        hint = f" (its keys: {', '.join(sorted(str(k) for k in parent))[:300]})"
    return f"`{full}` is not a key of the config{hint}"


def check_added_keys(cfg: DictConfig) -> None:
    """Keys added with `+` that nothing reads: a `trainer` key Lightning's Trainer does not take,
    a `callbacks` entry that names no callback. One line with the close matches."""
    trainer = cfg.get("trainer")
    if isinstance(trainer, DictConfig) and trainer.get("_target_") in LIGHTNING_TRAINERS:
        for key in trainer:
            if key != "_target_" and key not in TRAINER_ARGS:
                hint = did_you_mean(str(key), TRAINER_ARGS, "trainer.") or (
                    ": drop it (a Trainer class of your own: set `trainer._target_`)"
                )
                raise UserError(f"`trainer.{key}` is not an argument of Lightning's Trainer{hint}")
    callbacks = cfg.get("callbacks")
    if isinstance(callbacks, DictConfig):
        _check_callbacks(callbacks)


def _check_callbacks(callbacks: DictConfig) -> None:
    shipped = {p.stem for p in (CONFIG_DIR / "callbacks").glob("*.yaml")} - {"default", "none"}
    known = shipped | {str(k) for k, v in callbacks.items() if _builds(v)}
    for key, value in callbacks.items():
        if key in shipped or key == "fault_tolerance" or _builds(value):
            continue
        hint = did_you_mean(str(key), known, "callbacks.") or (
            f": set `callbacks.{key}._target_` to a callback class, or drop it"
        )
        raise UserError(f"`callbacks.{key}={_show(value)}` names no callback{hint}")


def _builds(value: Any) -> bool:
    return isinstance(value, DictConfig) and "_target_" in value


def _show(value: Any) -> str:
    return "null" if value is None else str(value)[:60]
