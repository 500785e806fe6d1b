"""Typed configs: the types and ranges of the main groups' keys, in one place.

Both trainers and the compare command check the composed config against these dataclasses
before anything heavy starts, so `trainer.max_epochs=abc`, `data.batch_size=0` or
`trainer.precision=15` stop in about a second with one line naming the key and what it takes
(Lightning or the DataLoader would say it seconds later, deep in a traceback). The same
dataclasses give the JSON schemas editors read (`make schema` writes schema/<group>.json; the
config files name theirs in a `yaml-language-server` comment).

Only the keys listed are typed; any other key is left to its consumer. A value may always be
a Hydra interpolation (`${...}`): it is checked after it resolves.
"""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from omegaconf import DictConfig, ListConfig, OmegaConf

from project.engine.config.typos import check_added_keys
from project.engine.errors import UserError

# What Lightning accepts for `precision` (its lightning.fabric.connector._PRECISION_INPUT).
PRECISIONS = Literal["transformer-engine", "transformer-engine-float16", "16-true", "16-mixed",
                     "bf16-true", "bf16-mixed", "32-true", "64-true", 64, 32, 16, "64", "32",
                     "16", "bf16"]  # fmt: skip


def bounds(ge: float | None = None, gt: float | None = None, le: float | None = None) -> Any:
    """A field with a numeric range (checked for numbers only; null passes where allowed)."""
    return field(default=None, metadata={"ge": ge, "gt": gt, "le": le})


@dataclass
class TrainerSchema:
    """configs/trainer/*.yaml: lightning.pytorch.Trainer's arguments (the raw trainer reads the
    same keys)."""

    accelerator: str | None = None
    devices: int | str | list[int] | None = None
    num_nodes: int | Literal["auto"] | None = bounds(ge=1)
    precision: PRECISIONS | None = None
    min_epochs: int | None = bounds(ge=0)
    max_epochs: int | None = bounds(ge=-1)
    max_steps: int | None = bounds(ge=-1)
    accumulate_grad_batches: int | None = bounds(ge=1)
    gradient_clip_val: float | None = bounds(ge=0)
    gradient_clip_algorithm: Literal["norm", "value"] | None = None
    check_val_every_n_epoch: int | None = bounds(ge=1)
    log_every_n_steps: int | None = bounds(ge=0)
    limit_train_batches: int | float | None = bounds(ge=0)
    limit_val_batches: int | float | None = bounds(ge=0)
    limit_test_batches: int | float | None = bounds(ge=0)
    num_sanity_val_steps: int | None = bounds(ge=-1)
    fast_dev_run: bool | int | None = bounds(ge=0)
    overfit_batches: int | float | None = bounds(ge=0)
    deterministic: bool | Literal["warn"] | None = None
    sync_batchnorm: bool | None = None
    use_distributed_sampler: bool | None = None
    enable_progress_bar: bool | None = None
    enable_model_summary: bool | None = None


@dataclass
class DataSchema:
    """configs/data/*.yaml: the loading keys every DataModule takes (`dataset` is the source's
    own: its constructor checks it)."""

    batch_size: int | None = bounds(ge=1)
    num_workers: int | None = bounds(ge=0)
    pin_memory: bool | None = None
    persistent_workers: bool | None = None
    shuffle: bool | None = None
    lanes: int | None = bounds(ge=1)
    shuffle_block: int | None = bounds(ge=1)


@dataclass
class OptimizerSchema:
    """configs/model/optimizer/*.yaml: the arguments most torch optimizers share."""

    lr: float | None = bounds(gt=0)
    weight_decay: float | None = bounds(ge=0)
    momentum: float | None = bounds(ge=0)


@dataclass
class RunSchema:
    """configs/train.yaml: the run's own keys."""

    task_name: str | None = None
    seed: int | None = None
    train: bool | None = None
    test: bool | None = None
    test_ckpt: Literal["best", "last", "current"] | None = None
    ckpt_path: str | None = None
    auto_resume: bool | None = None
    keep_global_batch: bool | None = None
    optimized_metric: str | None = None
    optimized_mode: Literal["min", "max"] | None = None
    step_stats: bool | None = None
    worker_start_method: Literal["forkserver", "fork", "spawn"] | None = None


# Config key (dotted; "" is the root) -> its schema, and the file name of its JSON schema.
SCHEMAS: dict[str, tuple[type, str]] = {
    "": (RunSchema, "train"),
    "trainer": (TrainerSchema, "trainer"),
    "data": (DataSchema, "data"),
    "model.optimizer": (OptimizerSchema, "optimizer"),
}


def matches(value: Any, kind: Any) -> bool:
    """Whether a resolved config value is of type `kind` (bool is not a number here)."""
    origin = get_origin(kind)
    if origin in (Union, types.UnionType):
        return any(matches(value, k) for k in get_args(kind))
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in get_args(kind))
    if origin is list:
        (item,) = get_args(kind)
        return isinstance(value, (list, ListConfig)) and all(matches(v, item) for v in value)
    if kind is type(None):
        return value is None
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def describe(kind: Any) -> str:
    """'an integer', "one of 'norm', 'value'", 'an integer or null', ..."""
    origin = get_origin(kind)
    if origin in (Union, types.UnionType):
        return " or ".join(describe(k) for k in get_args(kind))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(kind))
    if origin is list:
        return f"a list of {describe(get_args(kind)[0]).removeprefix('an ').removeprefix('a ')}s"
    names = {int: "an integer", float: "a number", bool: "true/false", str: "a string"}
    return names.get(kind, "null" if kind is type(None) else kind.__name__)


SYMBOLS = (("ge", ">="), ("gt", ">"), ("le", "<="))


def out_of_range(value: Any, meta: Any) -> bool:
    """Whether a number breaks one of the field's bounds (non-numbers never do)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    tests = {"ge": value.__ge__, "gt": value.__gt__, "le": value.__le__}
    return any(meta.get(op) is not None and not tests[op](meta[op]) for op, _ in SYMBOLS)


def check_schema(cfg: DictConfig) -> None:
    """Every typed key of the composed config has a value of its type and range, and no key
    added to `trainer` or `callbacks` goes unread: else one line naming the key and the fix."""
    for key, (schema, _) in SCHEMAS.items():
        node = OmegaConf.select(cfg, key) if key else cfg
        if not isinstance(node, DictConfig):
            continue
        hints = get_type_hints(schema)
        for f in fields(schema):
            if f.name not in node:
                continue
            value, dotted = node[f.name], f"{key}.{f.name}" if key else f.name
            if not matches(value, hints[f.name]) or out_of_range(value, f.metadata):
                limits = [
                    f"{s} {f.metadata[op]}" for op, s in SYMBOLS if f.metadata.get(op) is not None
                ]
                expected = describe(hints[f.name]) + (f" ({', '.join(limits)})" if limits else "")
                raise UserError(f"{dotted}={value!r}: expected {expected}")
    check_added_keys(cfg)


def json_type(kind: Any, meta: dict[str, Any]) -> dict[str, Any]:
    """JSON schema of one field's type."""
    origin = get_origin(kind)
    if origin in (Union, types.UnionType):
        return {"anyOf": [json_type(k, meta) for k in get_args(kind)]}
    if origin is Literal:
        return {"enum": list(get_args(kind))}
    if origin is list:
        return {"type": "array", "items": json_type(get_args(kind)[0], {})}
    names = {int: "integer", float: "number", bool: "boolean", str: "string", type(None): "null"}
    out: dict[str, Any] = {"type": names[kind]}
    if kind in (int, float):
        keys = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum"}
        out.update({keys[k]: v for k, v in meta.items() if v is not None})
    return out


def json_schema(schema: type, title: str) -> dict[str, Any]:
    """The JSON schema of one config group's files (other keys allowed, interpolations too)."""
    interpolation = {"type": "string", "pattern": r"^\$\{.*\}$"}
    hints = get_type_hints(schema)
    props = {}
    for f in fields(schema):
        kind = json_type(hints[f.name], dict(f.metadata))
        props[f.name] = {"anyOf": [*kind.get("anyOf", [kind]), interpolation]}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": title,
        "description": " ".join((schema.__doc__ or "").split()),
        "type": "object",
        "properties": props,
        "additionalProperties": True,
    }


def write_schemas(out_dir: Path) -> list[Path]:
    """schema/<group>.json for every typed group; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for schema, name in SCHEMAS.values():
        path = out_dir / f"{name}.json"
        path.write_text(json.dumps(json_schema(schema, name), indent=2) + "\n")
        written.append(path)
    return written


if __name__ == "__main__":  # make schema
    for path in write_schemas(Path(sys.argv[1] if len(sys.argv) > 1 else "schema")):
        print(path)
