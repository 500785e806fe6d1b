"""Which modules of the task's network get their own `fully_shard` (FSDP2), for both trainers.

Each sharded module is one unit of communication: its parameters are gathered (all-gather)
just before its forward and backward and freed after, its gradients reduce-scattered once its
backward ends. Units of a few blocks each keep the gathered weights small (the memory FSDP
saves) while each collective stays large enough to be efficient.

`strategy.blocks: null` picks each module of an nn.ModuleList / nn.Sequential whose class
repeats there and holds parameters (a transformer's blocks, an MLP's Linear layers), looking
no deeper inside a module it picked; a list of class names picks every module of those
classes instead. The network itself is always sharded last (the root unit: what is left,
e.g. embeddings and the head, which keeps tied weights together).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from project.engine.errors import UserError

log = logging.getLogger(__name__)

CONTAINERS = (nn.ModuleList, nn.Sequential)


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def repeated_blocks(net: nn.Module) -> list[nn.Module]:
    """The default plan's units, outermost first (see the module docstring)."""
    chosen: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        children = [c for c in module.children() if _has_parameters(c)]
        kinds = Counter(type(c) for c in children) if isinstance(module, CONTAINERS) else {}
        for child in children:
            if kinds.get(type(child), 0) > 1:
                chosen.append(child)
            else:
                visit(child)

    visit(net)
    return chosen


def named_blocks(net: nn.Module, names: Sequence[str]) -> list[nn.Module]:
    """Every module of `net` (not `net` itself) whose class is named in `names`, outermost
    first; a name no module of `net` has is refused (a typo would shard nothing)."""
    names = [names] if isinstance(names, str) else list(names)  # strategy.blocks=Block
    present = {type(m).__name__ for m in net.modules()}
    if missing := [n for n in names if n not in present]:
        raise UserError(
            f"strategy.blocks names {missing[0]}, which model.net ({type(net).__name__}) does "
            f"not contain: name classes it has ({', '.join(sorted(present))}), or leave "
            "strategy.blocks null to shard its repeated blocks"
        )
    chosen = [m for m in net.modules() if m is not net and type(m).__name__ in names]
    if not chosen:  # only the root's own class: one unit, the whole model gathered at once
        raise UserError(
            f"strategy.blocks names only {type(net).__name__}, the network itself (always "
            "sharded as the root): name the classes of its blocks, or leave strategy.blocks null"
        )
    return chosen


def check_running_statistics(net: nn.Module) -> None:
    """FSDP2 shards parameters only: buffers such as BatchNorm's running statistics would
    drift apart per rank (DDP broadcasts rank 0's), and evaluation would differ by rank."""
    if with_stats := [n for n, m in net.named_modules()
                      if getattr(m, "running_mean", None) is not None]:  # fmt: skip
        raise UserError(
            f"strategy=fsdp does not synchronise running statistics, and model.net has "
            f"them ({with_stats[0] or type(net).__name__}: BatchNorm with "
            "track_running_stats): use strategy=ddp, or norms without running statistics"
        )


def check_parameters_in_net(task: nn.Module) -> None:
    """Only `task.net` is sharded: a parameter the task holds beside it would train on each
    rank alone, never synchronised."""
    inside = {id(p) for p in task.net.parameters()}
    outside = [name for name, p in task.named_parameters() if id(p) not in inside]
    if outside:
        raise UserError(
            f"strategy=fsdp shards model.net only, and the task holds parameters outside it "
            f"({', '.join(outside[:3])}): move them into the network, or use strategy=ddp"
        )


def shard(task: nn.Module, mesh: Any, blocks: Sequence[str] | None, **kwargs: Any) -> None:
    """`fully_shard` the task's network: its blocks (innermost first, as FSDP2 requires), then
    the network. `kwargs`: fully_shard's options (options.ShardOptions.kwargs). Idempotent:
    Lightning calls configure_model again for test."""
    net = task.net
    if isinstance(net, FSDPModule):
        return
    check_parameters_in_net(task)
    check_running_statistics(net)
    units = named_blocks(net, blocks) if blocks else repeated_blocks(net)
    kinds = ", ".join(sorted(Counter(type(u).__name__ for u in units)))  # before the renaming
    for unit in reversed(units):
        fully_shard(unit, mesh=mesh, **kwargs)
    fully_shard(net, mesh=mesh, **kwargs)
    log.info(f"strategy=fsdp: {len(units)} blocks ({kinds or 'none'}) and the network sharded "
             f"over {mesh.size()} ranks")  # fmt: skip


@contextlib.contextmanager
def gradients_held(net: nn.Module) -> Iterator[None]:
    """Inside an accumulation window: gradients add up unsharded on each rank and are
    reduce-scattered once, at the window's last backward (DDP's no_sync)."""
    if not isinstance(net, FSDPModule):
        yield
        return
    net.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        net.set_requires_gradient_sync(True)
