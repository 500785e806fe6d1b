"""How DataLoader worker processes start: from a fork server, not forked from the rank.

A rank runs threads: gloo's (or NCCL's), the logger's writer, earlier loaders' queue feeders.
Forking a process that runs threads copies into the child every lock another thread held at
that instant, and nothing in the child will ever release it. One such lock hangs real DDP
jobs: when a collective ends, gloo's thread drops the last reference to its tensors, and to
do that makes a Python thread state under the interpreter's HEAD_LOCK without holding the
GIL; CPython before 3.11.10 (gh-112275) takes that lock again in the child of `os.fork()`, so
a DataLoader worker forked at that instant hangs inside `os.fork()` forever and its rank
waits for a batch that never comes (docs/data.md has the measured story).

So the template starts workers the way Python 3.14 does by default: from a fork server, a
single-threaded process started before training; each worker is forked from it, never from a
rank. The server imports torch, what the entry point imports and the dataset's module once
(its preload), so a worker starts in about the time a fork takes. The price: a worker
receives the dataset pickled, so a dataset must pickle (an open file handle or a lambda in
it fails at the first epoch, in the rank, with Python's pickling error).
`worker_start_method=fork` is PyTorch's default on Linux, for datasets that cannot pickle,
at the risk above on older CPython. Either way the workers end with their rank, however it
ends (project.engine.data.die_with_rank).
"""

from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.forkserver
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from project.engine.data.die_with_rank import children_die_with_me

# Every worker of the template's loaders; die_with_rank: the workers end with their rank;
# worker_stacks: a hang report can read any worker's stacks; long_work: a worker's shard
# download is noted for its rank (named, not imported: those modules sit above this one).
ENGINE = ("torch", "project.engine.data.loaders", "project.engine.data.die_with_rank",
          "project.engine.distributed.worker_stacks", "project.engine.run.long_work")  # fmt: skip


def configure_worker_start(
    method: str | None, data: Mapping[str, Any] | None, entry_module: str
) -> None:
    """Make `method` (`worker_start_method`; None: forkserver) every DataLoader's default; a
    loader given its own `multiprocessing_context` keeps it. With `data.num_workers` > 0 the
    fork server starts now, to import while the rank sets up; else the first loader that has
    workers starts it (a run without workers pays nothing). `data`: the `data` config."""
    method = method or "forkserver"
    multiprocessing.set_start_method(method, force=True)
    if method == "fork":  # forkserver: the server arms itself when it imports die_with_rank
        children_die_with_me()
    if method == "forkserver":
        data = data or {}
        multiprocessing.set_forkserver_preload(preload(data, entry_module))
        if data.get("num_workers"):
            multiprocessing.forkserver.ensure_running()


def preload(data: Mapping[str, Any], entry_module: str) -> list[str]:
    """What the fork server imports once for all workers: torch, the template's loaders
    (their worker seeding) and the workers' stack dumps for a hang report, what the entry
    module imports (a worker runs the entry again as __mp_main__: cheap once that is loaded),
    and the module of the data a worker unpickles: the dataset's (`data.dataset._target_`),
    else the user's datamodule's (`data._target_`; one that imports Lightning would
    otherwise cost every worker seconds)."""
    dataset = data.get("dataset")
    target = dataset.get("_target_") if isinstance(dataset, Mapping) else None
    target = target or data.get("_target_")
    data_module = [target.rpartition(".")[0]] if target else []
    return list(dict.fromkeys([*ENGINE, *imports_of(entry_module), *data_module]))


def imports_of(module_name: str) -> list[str]:
    """The modules `module_name` imports at its top, itself excluded: run by `python -m` it
    is __main__, and runpy warns when a worker runs it again while it is loaded."""
    main = sys.modules["__main__"]
    is_main = getattr(main.__spec__, "name", None) == module_name
    module = main if is_main else importlib.import_module(module_name)
    names = {v.__name__ if isinstance(v, ModuleType) else getattr(v, "__module__", None)
             for name, v in vars(module).items() if not name.startswith("__")}  # fmt: skip
    own = {module_name, "__main__", "builtins"}
    return sorted(n for n in names if isinstance(n, str) and n not in own)
