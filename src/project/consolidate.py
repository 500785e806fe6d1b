"""One plain checkpoint file from a sharded one (project.engine.checkpoints.sharded), on one
process without a process group:

    python -m project.consolidate CKPT OUT [--optimizer] [--prefix task.]

CKPT is a save folder (<folder>/last-step40) or the `last` a manifest publishes
(<folder>/last). OUT holds what the template's single-file Lightning checkpoints hold, so that
`torch.load(OUT, weights_only=True)` reads it and eval.py, test or a DDP run's ckpt_path take
it: `state_dict` (the weights, each key under --prefix, the LightningModule's attribute that
holds the task: `task.`), the entries named in CARRIED where the save's `common` holds them
(the network's and the data's config: eval.py needs them), and Lightning's version key; with
--optimizer also `optimizer_states` (the optimizer's state in torch's own layout, numbered by
parameter order) and no `lr_schedulers` (a run started from it begins its schedule afresh).
Bad input is one `error:` line, exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from project.engine.errors import UserError

CARRIED = (
    "hyper_parameters",
    "datamodule_hyper_parameters",
    "project",
)  # `common` entries copied into OUT as they are
PREFIX = "task."  # the LightningModule's attribute that holds the task (engine/lightning/module)


def numbered(optim: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (DCP's get_state_dict) in torch's own layout:
    parameters numbered in the order of the param groups."""
    index: dict[str, int] = {}
    groups = []
    for group in optim["param_groups"]:
        ids = [index.setdefault(name, len(index)) for name in group["params"]]
        # A run started from this file begins its schedule afresh: from the learning rate the
        # schedule started at, not the one it had decayed to (Lightning loads these groups
        # after building the new scheduler, which would scale the decayed rate again).
        lr = {"lr": group["initial_lr"]} if "initial_lr" in group else {}
        groups.append({**group, "params": ids, **lr})
    state = {index[name]: value for name, value in optim["state"].items()}
    return {"state": state, "param_groups": groups}


def lightning_version() -> dict[str, str]:
    """The key Lightning reads first from any checkpoint it loads (its migration step)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return {"pytorch-lightning_version": version("lightning")}
    except PackageNotFoundError:
        return {}


def gathered(
    ckpt: str, what: str = "CKPT", prefix: str = PREFIX, optimizer_via: Path | None = None
) -> dict[str, Any]:
    """What OUT holds (see the module docstring), in memory: the sharded save `ckpt` names,
    gathered on this process without a process group (eval.py reads a sharded save so).
    `what` names `ckpt` in a one-line error; `optimizer_via`: also the optimizer's state,
    read through a temp file at that path."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from project.engine.checkpoints.remote import is_url, join
    from project.engine.checkpoints.sharded import COMMON, gathered_model, read_entries, resolve

    if is_url(ckpt):  # DCP's single-process reader reads local folders only
        raise UserError(f"{what}={ckpt} is a URL: copy the save folder here first (e.g. "
                        "`aws s3 sync`) and give its local path")  # fmt: skip
    folder = resolve(ckpt, what)
    common = read_entries(join(folder, COMMON))
    weights = {k if k.startswith(prefix) else f"{prefix}{k}": v
               for k, v in gathered_model(folder).items()}  # fmt: skip
    result: dict[str, Any] = {"state_dict": weights, **lightning_version()}
    # What a Lightning checkpoint of the template carries beside the weights, where the
    # saving trainer put it in `common`: the network's and data's configs (eval.py builds
    # both from them) and the run's identity (a resume's checks read it).
    result |= {k: common["common"][k] for k in CARRIED if k in common["common"]}
    if optimizer_via is not None:  # DCP's own reader of the whole state (a file it writes)
        try:
            dcp_to_torch_save(folder, optimizer_via)
            full = torch.load(optimizer_via, map_location="cpu", weights_only=True, mmap=True)
        finally:
            optimizer_via.unlink(missing_ok=True)
        if "optim" not in full:
            raise UserError(f"{what}={ckpt} holds no optimizer state: leave out --optimizer")
        result |= {"optimizer_states": [numbered(full["optim"])], "lr_schedulers": []}
    result["consolidated_from"] = {
        "folder": folder, "step": common["step"], "world": common["world"],
        "trainer": common["trainer"],
    }  # fmt: skip
    return result


def consolidate(ckpt: str, out: Path, optimizer: bool, prefix: str) -> dict[str, Any]:
    """Write OUT (see the module docstring); returns where it came from."""
    import torch

    if out.exists():
        raise UserError(f"{out} exists: give a new file name (nothing was overwritten)")
    if not out.parent.is_dir():
        raise UserError(f"{out.parent} is not a folder: create it first")
    via = out.with_name(f".{out.name}.{os.getpid()}.dcp") if optimizer else None
    result = gathered(ckpt, "CKPT", prefix, via)
    done = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        torch.save(result, done)
        os.replace(done, out)
    finally:
        done.unlink(missing_ok=True)
    return result["consolidated_from"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ckpt", help="a save folder (<folder>/last-step40) or <folder>/last")
    parser.add_argument("out", type=Path, help="the file to write (must not exist)")
    parser.add_argument("--optimizer", action="store_true", help="also the optimizer's state")
    parser.add_argument("--prefix", default=PREFIX,
                        help=f"put before each weight's name (default {PREFIX!r}; "
                        "names that start with it are kept)")  # fmt: skip
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        source = consolidate(args.ckpt, args.out, args.optimizer, args.prefix)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    size = args.out.stat().st_size / 1e6
    print(f"{args.out}: step {source['step']} (saved by {source['world']} processes), "
          f"{size:.1f} MB in {time.perf_counter() - start:.2f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
