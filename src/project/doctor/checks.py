"""The checks: every collective for its exact result, sub-groups, bandwidth, NCCL transports."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def timed(fn: Callable[[], Any]) -> tuple[str, float, str]:
    """(status, milliseconds, detail): ok | wrong | unsupported | failed."""
    began = time.perf_counter()
    try:
        good = fn()
    except Exception as err:  # a failing collective is the finding
        text = " ".join(str(err).split())[:200]
        unsupported = "not supported" in text.lower() or "unsupported" in text.lower()
        return ("unsupported" if unsupported else "failed", 0.0, f"{type(err).__name__}: {text}")
    ms = (time.perf_counter() - began) * 1e3
    return ("ok", ms, "") if good else ("wrong", ms, "unexpected result")


def collectives(rank: int, world: int, device: Any) -> dict[str, tuple[str, float, str]]:
    """Each collective with inputs whose exact result is known (small integers in float32)."""
    import torch
    import torch.distributed as dist

    def t(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    def same(a: torch.Tensor, values: list[float]) -> bool:
        return torch.equal(a.cpu(), torch.tensor(values, dtype=torch.float32))

    tri = world * (world + 1) / 2

    def barrier() -> bool:
        dist.barrier()
        return True

    def broadcast() -> bool:
        x = t([42.0, 7.0] if rank == 0 else [0.0, 0.0])
        dist.broadcast(x, src=0)
        return same(x, [42.0, 7.0])

    def all_reduce(op: Any, expected: float) -> Callable[[], bool]:
        def run() -> bool:
            x = t([rank + 1.0])
            dist.all_reduce(x, op=op)
            return same(x, [expected])

        return run

    def reduce() -> bool:
        x = t([rank + 1.0])
        dist.reduce(x, dst=0)
        return rank != 0 or same(x, [tri])

    def all_gather() -> bool:
        out = [t([0.0]) for _ in range(world)]
        dist.all_gather(out, t([float(rank)]))
        return same(torch.cat(out), [float(r) for r in range(world)])

    def gather() -> bool:
        out = [t([0.0]) for _ in range(world)] if rank == 0 else None
        dist.gather(t([float(rank)]), out, dst=0)
        return rank != 0 or same(torch.cat(out), [float(r) for r in range(world)])

    def scatter() -> bool:
        x = t([0.0])
        dist.scatter(x, [t([10.0 * r]) for r in range(world)] if rank == 0 else None, src=0)
        return same(x, [10.0 * rank])

    def reduce_scatter() -> bool:
        x = t([0.0])
        dist.reduce_scatter(x, [t([float(rank + r)]) for r in range(world)])
        return same(x, [float(sum(s + rank for s in range(world)))])  # sum_s (s + r)

    def all_to_all() -> bool:
        out = [t([0.0]) for _ in range(world)]
        dist.all_to_all(out, [t([100.0 * rank + r]) for r in range(world)])
        return same(torch.cat(out), [100.0 * s + rank for s in range(world)])

    def ring() -> bool:
        if world == 1:
            return True
        got = t([-1.0])
        ops = [
            dist.P2POp(dist.isend, t([float(rank)]), (rank + 1) % world),
            dist.P2POp(dist.irecv, got, (rank - 1) % world),
        ]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        return same(got, [float((rank - 1) % world)])

    checks = {
        "barrier": barrier,
        "broadcast": broadcast,
        "all_reduce(sum)": all_reduce(dist.ReduceOp.SUM, tri),
        "all_reduce(max)": all_reduce(dist.ReduceOp.MAX, float(world)),
        "reduce": reduce,
        "all_gather": all_gather,
        "gather": gather,
        "scatter": scatter,
        "reduce_scatter": reduce_scatter,
        "all_to_all": all_to_all,
        "send/recv ring": ring,
    }
    return {name: timed(fn) for name, fn in checks.items()}


def grid_groups(world: int, tp: int) -> tuple[list[list[int]], list[list[int]]]:
    """TP x DP: TP groups are consecutive ranks, DP groups take one rank of each TP group."""
    tp_groups = [list(range(i, i + tp)) for i in range(0, world, tp)]
    dp_groups = [list(range(j, world, tp)) for j in range(tp)]
    return tp_groups, dp_groups


def subgroups(rank: int, world: int, tp: int, device: Any) -> dict[str, tuple[str, float, str]]:
    """Every rank creates every group (new_group is collective); an all_reduce in each of its
    own groups must sum exactly its members' values."""
    import torch
    import torch.distributed as dist

    results = {}
    tp_groups, dp_groups = grid_groups(world, tp)
    for kind, groups in (("tp", tp_groups), ("dp", dp_groups)):
        handles = [dist.new_group(g) for g in groups]
        mine = next(i for i, g in enumerate(groups) if rank in g)

        def run(members: list[int] = groups[mine], group: Any = handles[mine]) -> bool:
            x = torch.tensor([rank + 1.0], device=device)
            dist.all_reduce(x, group=group)
            return x.item() == sum(m + 1 for m in members)

        results[f"{kind} group {groups[mine]}"] = timed(run)
    return results


def bandwidth(world: int, max_mb: float, device: Any) -> list[dict[str, float]]:
    """all_reduce of float32 messages from 4 KiB up to max_mb, x4 each step; busbw as defined
    by nccl-tests: algbw x 2(n-1)/n. Plus a 4-byte latency row."""
    import torch
    import torch.distributed as dist

    rows = []
    sizes, size = [4], 4096
    while size <= max_mb * 2**20:
        sizes.append(size)
        size *= 4
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        iters = 50 if nbytes <= 65536 else max(3, min(20, int(2**26 / nbytes)))
        for _ in range(2):
            dist.all_reduce(x)
        times = []
        for _ in range(iters):
            dist.barrier()
            began = time.perf_counter()
            dist.all_reduce(x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - began)
        seconds = statistics.median(times)
        algbw = nbytes / seconds / 1e9
        rows.append(
            {
                "bytes": nbytes,
                "time_us": seconds * 1e6,
                "algbw_GBps": algbw,
                "busbw_GBps": algbw * 2 * (world - 1) / world,
            }
        )
    return rows


def nccl_transports(debug_file: Path) -> list[str]:
    """The transports NCCL reported choosing (NCCL_DEBUG=INFO lines "... via P2P/IPC")."""
    found = set()
    for path in debug_file.parent.glob(debug_file.name.replace("%h.%p", "*")):
        for line in path.read_text(errors="replace").splitlines():
            if " via " in line:
                found.add(line.split(" via ", 1)[1].split()[0])
    return sorted(found)
