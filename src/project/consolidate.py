"""One plain checkpoint file from a sharded one (project.engine.checkpoints.sharded), on one
process without a process group:

    python -m project.consolidate CKPT OUT [--optimizer] [--prefix task.]

CKPT is the `last` a manifest publishes (<run>/checkpoints/last-ckpt: Lightning's, published
by last-ckpt.json; the raw trainer's is last-pt) or a save folder (last-ckpt-step40). OUT
holds what the template's single-file Lightning checkpoints hold, so that `torch.load(OUT,
weights_only=True)` reads it and eval.py, test or a DDP run's ckpt_path take it: `state_dict`
(the weights, each key under --prefix, the LightningModule's attribute that holds the task:
`task.`), the entries whole.CARRIED names where the save's `common` holds them
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


def consolidate(ckpt: str, out: Path, optimizer: bool, prefix: str | None) -> dict[str, Any]:
    """Write OUT (see the module docstring); returns where it came from. `prefix` None: the
    LightningModule's `task.`."""
    import torch

    from project.engine.checkpoints.whole import PREFIX, consolidated

    if out.exists():
        raise UserError(f"{out} exists: give a new file name (nothing was overwritten)")
    if not out.parent.is_dir():
        raise UserError(f"{out.parent} is not a folder: create it first")
    result = consolidated(ckpt, "CKPT", PREFIX if prefix is None else prefix, optimizer)
    done = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        torch.save(result, done)
        os.replace(done, out)
    finally:
        done.unlink(missing_ok=True)
    return result["consolidated_from"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ckpt", help="<run>/checkpoints/last-ckpt (the raw trainer's: last-pt) "
                        "or a save folder (<run>/checkpoints/last-ckpt-step40)")  # fmt: skip
    parser.add_argument("out", type=Path, help="the file to write (must not exist)")
    parser.add_argument("--optimizer", action="store_true", help="also the optimizer's state")
    parser.add_argument("--prefix", help="put before each weight's name (default: 'task.', "
                        "the LightningModule's; names that start with it are kept)")  # fmt: skip
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
