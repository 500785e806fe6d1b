"""Where a run continues from, for both trainers: where its last checkpoint lives, and the
checks that a checkpoint may be resumed by this config.

Every checkpoint of either trainer carries a `project` entry (project.engine.checkpoints.state):
the config keys that define what is trained (`training_identity`), whether the run finished,
and its final fit metrics. A run folder is only continued by the same training
(`check_resumable`); a finished run is reported, never trained again.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from project.engine.checkpoints.remote import STAGING, answers, fetch_checkpoint, is_url, join
from project.engine.checkpoints.state import read_checkpoint
from project.engine.config.compose import to_plain
from project.engine.errors import UserError

# What a run trains: a checkpoint is only resumed by a config that agrees on these (dotted
# prefixes). Where the data lives and how it is loaded may change between attempts.
IDENTITY = ("seed", "model", "data")
NOT_IDENTITY = ("model.compile", "data.dataset.data_dir", "data.dataset.cache_dir",
                "data.dataset.cache_limit_mb", "data.dataset.prefetch",
                "data.num_workers", "data.pin_memory", "data.persistent_workers")  # fmt: skip
ARCHITECTURE = ("model.net", "model.task")  # what must match for the weights to load at all


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1} (lists stay values)."""
    if not isinstance(tree, Mapping):
        return {prefix[:-1]: tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}{key}."))
    return flat


def training_identity(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The flattened config keys that define what this run trains (see IDENTITY)."""
    flat = flatten({k: cfg.get(k) for k in IDENTITY})
    return {
        k: v for k, v in flat.items()
        if not any(k == n or k.startswith(n + ".") for n in NOT_IDENTITY)
    }  # fmt: skip


def interpolations(cfg: Any) -> dict[str, str]:
    """{key: source} for each leaf of the unresolved `cfg` that is exactly `${source}`."""
    from omegaconf import DictConfig, OmegaConf

    if not isinstance(cfg, DictConfig):
        return {}
    raw = flatten(OmegaConf.to_container(cfg, resolve=False))
    return {
        k: v[2:-1] for k, v in raw.items()
        if isinstance(v, str) and re.fullmatch(r"\$\{[\w.]+\}", v)
    }  # fmt: skip


def saved_identity(ckpt: dict[str, Any]) -> tuple[dict[str, Any] | None, bool]:
    """(identity, complete): what the checkpoint says it trained. Checkpoints written before
    the `project` entry existed still name their network (Lightning's hyper_parameters, the
    raw trainer's config): then only the architecture can be compared."""
    if isinstance(ckpt.get("project"), dict) and "identity" in ckpt["project"]:
        return ckpt["project"]["identity"], True
    net = (ckpt.get("hyper_parameters") or {}).get("net")
    net = net or ((ckpt.get("config") or {}).get("model") or {}).get("net")
    return (flatten({"model": {"net": net}}), False) if net else (None, False)


def check_resumable(
    path: str | Path,
    ckpt: dict[str, Any],
    cfg: Mapping[str, Any],
    explicit: bool,
    follows: Mapping[str, str] | None = None,
) -> None:
    """Refuse (one line, naming the keys) a checkpoint trained with another config.

    Auto-resume (`explicit=False`) continues a run folder only with the same training
    (IDENTITY); an explicit ckpt_path may change anything but the network architecture.
    `follows`: {key: the key it is interpolated from} (`interpolations`), to name the key the
    user changed rather than one that followed it.
    """
    saved, complete = saved_identity(ckpt)
    if saved is None:
        return
    now = training_identity(cfg)
    keys = sorted(set(saved) | set(now))
    if explicit or not complete:
        keys = [k for k in keys if k.startswith(tuple(a + "." for a in ARCHITECTURE))]
    diff = [k for k in keys if saved.get(k) != now.get(k)]
    if not diff:
        return
    follows = follows or {}
    shown = "; ".join(
        f"{k}{f' (it follows {follows[k]})' if k in follows else ''}: {saved.get(k)!r} there, "
        f"{now.get(k)!r} now" for k in diff[:4]
    )  # fmt: skip
    more = f" (+{len(diff) - 4} more)" if len(diff) > 4 else ""
    if not explicit and all(k in follows for k in diff):
        # A key the user changed (trainer.max_epochs) moved a key they never set (T_max):
        # name theirs, and the way to keep the run's own value.
        keep = " ".join(f"{k}={saved.get(k)!r}" for k in diff)
        raise UserError(
            f"the command changed {', '.join(sorted({follows[k] for k in diff}))}, and with "
            f"it the run's {shown}{more}: add {keep} to continue this run as it was trained, "
            f"or use another RUN_ID for a new run (with ckpt_path={path} it starts from these "
            "weights: fine-tuning; the folder is left as it is)"
        )
    if explicit:
        raise UserError(
            f"ckpt_path={path} holds another network ({shown}{more}): pass the model "
            "overrides it was trained with"
        )
    raise UserError(
        f"{path} was trained with another config ({shown}{more}), so this run folder belongs "
        f"to another run: use another RUN_ID for a new run (with ckpt_path={path} it starts "
        "from these weights: fine-tuning; the folder is left as it is)"
    )


def checkpoint_dir(cfg: Mapping[str, Any], output_dir: Path) -> Path:
    """The run's checkpoint folder: callbacks.model_checkpoint.dirpath, else <run>/checkpoints."""
    ckpt = (cfg.get("callbacks") or {}).get("model_checkpoint") or {}
    return Path(ckpt.get("dirpath") or output_dir / "checkpoints")


# Callbacks that only show things: a resume may change them without a word.
PRESENTATION = ("progress_bar", "model_summary", "lr_monitor")


def callbacks_record(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The callbacks config a checkpoint records: {name: its settings, or None when off}."""
    callbacks = to_plain(cfg.get("callbacks")) or {}
    # Where a callback writes follows the machine (paths.*): a resume elsewhere is the same run.
    return {
        name: {k: v for k, v in cb.items() if k != "dirpath"} if isinstance(cb, dict) else cb
        for name, cb in callbacks.items() if name not in PRESENTATION
    }  # fmt: skip


def callbacks_changed(saved: Mapping[str, Any], now: Mapping[str, Any]) -> str | None:
    """One line naming the callbacks this attempt runs otherwise than the run did (early
    stopping dropped or added, its patience changed ...), None when they agree."""
    said = []
    for name in sorted(set(saved) | set(now)):
        before, after = saved.get(name), now.get(name)
        if before == after:
            continue
        if before is None or after is None:
            said.append(f"callbacks.{name}: {'off' if before is None else 'on'} then, "
                        f"{'off' if after is None else 'on'} now")  # fmt: skip
            continue
        old, new = flatten(before), flatten(after)
        keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
        said += [f"callbacks.{name}.{k}: {old.get(k)!r} then, {new.get(k)!r} now" for k in keys]
    if not said:
        return None
    more = f" (+{len(said) - 4} more)" if len(said) > 4 else ""
    return (
        f"this attempt's callbacks differ from the run's so far: {'; '.join(said[:4])}{more} "
        "(the command's own settings apply from here on)"
    )


@dataclass
class Resume:
    """Where a run continues from: `path` (None: from scratch), and what the checkpoint says."""

    path: Path | str | None = None  # str: a sharded `last`'s folder by URL
    finished: bool = False  # auto-resume found a run that finished training
    metrics: dict[str, float] = field(default_factory=dict)  # its final fit metrics
    data_position: dict[str, Any] | None = None  # where its epoch stood (engine.data.elastic)
    callbacks: dict[str, Any] | None = None  # the callbacks it ran with (None: not recorded)


def find_resume(
    cfg: Mapping[str, Any],
    last: Path | str | None,
    kind: str,
    follows: Mapping[str, str] | None = None,
    staging: Path | None = None,
    shown: str | None = None,
) -> Resume:
    """An explicit ckpt_path, else (auto_resume) the run folder's `last` checkpoint, checked.

    `kind` is the key every checkpoint of the trainer has ("state_dict": Lightning, "model":
    the raw trainer): the other trainer's checkpoint is refused with one line. A ckpt_path
    that is a URL (s3://...) is downloaded into `staging` first; `shown` names `last` in
    messages (its URL, where it is a local copy of one). `last` may be the folder of a
    sharded `last` by URL (DCP reads it there; Lightning on one process copies it first).
    """
    explicit = cfg.get("ckpt_path")
    if explicit and is_url(explicit):
        from project.engine.checkpoints.sharded import names_save  # torch: when needed

        answers(str(explicit), "ckpt_path")  # a silent store: one line, not names_save's wait
        if names_save(str(explicit)):  # a folder of shards: nothing to download
            raise UserError(
                f"ckpt_path={explicit} is a sharded save (strategy=fsdp's, a folder of shards): "
                "copy the save folder here first (e.g. `aws s3 sync`) and give its local path"
            )
        where = (staging or Path(STAGING)) / "ckpt_path"
        path, what = fetch_checkpoint(str(explicit), where, "ckpt_path"), "ckpt_path"
    elif explicit:
        path, what = Path(explicit), "ckpt_path"
    elif cfg.get("auto_resume") and last is not None and (is_url(last) or Path(last).exists()):
        path, what = last, "the run's last checkpoint"
    else:
        return Resume()
    if folder := sharded_folder(path, what):  # the save itself, as both trainers load it
        path, ckpt = folder, sharded_entries(folder, kind)
    else:
        ckpt = read_checkpoint(path, what)
    if kind not in ckpt:
        own = "a .ckpt of train.py" if kind == "state_dict" else "a .pt of the raw trainer"
        raise UserError(
            f"{what} {path} is not a checkpoint of this trainer (it has no {kind!r}): give "
            f"{own}; each trainer resumes from its own"
        )
    named = explicit if explicit else (shown or path)
    check_resumable(named, ckpt, cfg, explicit=bool(explicit), follows=follows)
    state = ckpt.get("project") or {}
    finished = bool(state.get("finished")) and not explicit  # explicit: Lightning decides
    return Resume(path, finished, state.get("metrics") or {}, ckpt.get("data_position"),
                  state.get("callbacks"))  # fmt: skip


def check_same_on_every_rank(resume: Resume, sharded: bool) -> None:
    """Each rank chose what it continues from by itself, before any process group
    (find_resume, RunCheckpoints): a run folder that not every node sees (a node-local disk),
    or one changed meanwhile, would have the ranks continue from different states, some from
    scratch, or make the sharded `last`'s group on some ranks only. Compared once the process
    group is up, before anything else is made or loaded: the checkpoint, its position in the
    epoch (two copies at one path may differ), whether `last` is sharded. Refused in one line,
    on every rank alike."""
    import json
    import socket

    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    path = None if resume.path is None else str(resume.path)
    position = json.dumps(resume.data_position, sort_keys=True, default=str)
    mine = (socket.gethostname(), path, position, resume.finished, sharded)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    other = next((r for r, pick in enumerate(every) if pick[1:] != every[0][1:]), None)
    if other is None:  # every rank sees the same list: all go on or all stop
        return
    same_path = every[0][1] == every[other][1]  # then the copies' positions tell them apart
    said = [f"rank {r} on {every[r][0]} from {every[r][1] or 'scratch (none found)'}"
            f"{f' (at {every[r][2]})' if same_path else ''}" for r in (0, other)]  # fmt: skip
    raise UserError(
        f"the ranks would continue from different checkpoints: {said[0]}, {said[1]}: the run "
        "folder must be one every node sees (shared storage), or its checkpoints in an object "
        "store (callbacks.fault_tolerance.dirpath=s3://...)"
    )


def sharded_folder(path: Path | str, what: str) -> Path | str | None:
    """The save folder a sharded `path` names (project.engine.checkpoints.sharded: the
    folder, its manifest or the `last` it publishes); None: `path` is one file. A URL here
    is a sharded `last`'s folder (RunCheckpoints resolved it; any other is downloaded)."""
    from project.engine.checkpoints.sharded import names_save, resolve  # torch: when needed

    if is_url(path):
        return str(path)
    return Path(resolve(str(path), what)) if names_save(str(path)) else None


def sharded_entries(folder: Path | str, kind: str) -> dict[str, Any]:
    """A sharded save's entries besides model and optimizer (project.engine.checkpoints
    .sharded), with `kind` set when the trainer that wrote it is the one reading it."""
    from project.engine.checkpoints.sharded import COMMON, read_entries  # torch: when needed

    saved = read_entries(join(str(folder), COMMON))
    trainer = {"model": "raw", "state_dict": "lightning"}.get(kind)
    return dict(saved["common"]) | ({kind: None} if saved["trainer"] == trainer else {})
