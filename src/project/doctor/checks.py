"""The checks: every collective for its exact result, sub-groups, bandwidth, NCCL transports."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where used: `--help` and bad input stay fast
    import torch


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


@dataclass(frozen=True)
class Member:
    """One rank of the group under check: what every collective check needs to build its
    input and to know the exact result."""

    rank: int
    world: int
    device: Any

    def tensor(self, values: list[float]) -> torch.Tensor:
        import torch

        return torch.tensor(values, dtype=torch.float32, device=self.device)

    @property
    def rank_sum(self) -> float:
        """1 + 2 + ... + world: the sum when every rank contributes its rank + 1."""
        return self.world * (self.world + 1) / 2


def equals(x: torch.Tensor, values: list[float]) -> bool:
    """Exactly `values` (small integers: float32 sums of them have no rounding)."""
    import torch

    return torch.equal(x.cpu(), torch.tensor(values, dtype=torch.float32))


def check_barrier(m: Member) -> bool:
    import torch.distributed as dist

    dist.barrier()
    return True


def check_broadcast(m: Member) -> bool:
    import torch.distributed as dist

    x = m.tensor([42.0, 7.0] if m.rank == 0 else [0.0, 0.0])
    dist.broadcast(x, src=0)
    return equals(x, [42.0, 7.0])


def check_all_reduce_sum(m: Member) -> bool:
    import torch.distributed as dist

    x = m.tensor([m.rank + 1.0])
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return equals(x, [m.rank_sum])


def check_all_reduce_max(m: Member) -> bool:
    import torch.distributed as dist

    x = m.tensor([m.rank + 1.0])
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return equals(x, [float(m.world)])


def check_reduce(m: Member) -> bool:
    """Only the destination (rank 0) holds the result."""
    import torch.distributed as dist

    x = m.tensor([m.rank + 1.0])
    dist.reduce(x, dst=0)
    return m.rank != 0 or equals(x, [m.rank_sum])


def check_all_gather(m: Member) -> bool:
    import torch
    import torch.distributed as dist

    out = [m.tensor([0.0]) for _ in range(m.world)]
    dist.all_gather(out, m.tensor([float(m.rank)]))
    return equals(torch.cat(out), [float(r) for r in range(m.world)])


def check_gather(m: Member) -> bool:
    """Only the destination (rank 0) holds the result."""
    import torch
    import torch.distributed as dist

    out = [m.tensor([0.0]) for _ in range(m.world)] if m.rank == 0 else None
    dist.gather(m.tensor([float(m.rank)]), out, dst=0)
    return m.rank != 0 or equals(torch.cat(out), [float(r) for r in range(m.world)])


def check_scatter(m: Member) -> bool:
    import torch.distributed as dist

    x = m.tensor([0.0])
    pieces = [m.tensor([10.0 * r]) for r in range(m.world)] if m.rank == 0 else None
    dist.scatter(x, pieces, src=0)
    return equals(x, [10.0 * m.rank])


def check_reduce_scatter(m: Member) -> bool:
    import torch.distributed as dist

    x = m.tensor([0.0])
    dist.reduce_scatter(x, [m.tensor([float(m.rank + r)]) for r in range(m.world)])
    return equals(x, [float(sum(s + m.rank for s in range(m.world)))])  # sum_s (s + r)


def check_all_to_all(m: Member) -> bool:
    import torch
    import torch.distributed as dist

    out = [m.tensor([0.0]) for _ in range(m.world)]
    dist.all_to_all(out, [m.tensor([100.0 * m.rank + r]) for r in range(m.world)])
    return equals(torch.cat(out), [100.0 * s + m.rank for s in range(m.world)])


def check_send_recv_ring(m: Member) -> bool:
    """Each rank sends to the next and receives from the previous, in one batch."""
    import torch.distributed as dist

    if m.world == 1:
        return True
    got = m.tensor([-1.0])
    ops = [
        dist.P2POp(dist.isend, m.tensor([float(m.rank)]), (m.rank + 1) % m.world),
        dist.P2POp(dist.irecv, got, (m.rank - 1) % m.world),
    ]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return equals(got, [float((m.rank - 1) % m.world)])


# The report's collective names, in the order they run (every rank runs them in this order).
COLLECTIVES: dict[str, Callable[[Member], bool]] = {
    "barrier": check_barrier,
    "broadcast": check_broadcast,
    "all_reduce(sum)": check_all_reduce_sum,
    "all_reduce(max)": check_all_reduce_max,
    "reduce": check_reduce,
    "all_gather": check_all_gather,
    "gather": check_gather,
    "scatter": check_scatter,
    "reduce_scatter": check_reduce_scatter,
    "all_to_all": check_all_to_all,
    "send/recv ring": check_send_recv_ring,
}


def collectives(rank: int, world: int, device: Any) -> dict[str, tuple[str, float, str]]:
    """Each collective with inputs whose exact result is known (small integers in float32)."""
    member = Member(rank, world, device)
    return {name: timed(functools.partial(check, member)) for name, check in COLLECTIVES.items()}


def grid_groups(world: int, tp: int) -> tuple[list[list[int]], list[list[int]]]:
    """TP x DP: TP groups are consecutive ranks, DP groups take one rank of each TP group."""
    tp_groups = [list(range(i, i + tp)) for i in range(0, world, tp)]
    dp_groups = [list(range(j, world, tp)) for j in range(tp)]
    return tp_groups, dp_groups


def check_group_sum(m: Member, members: list[int], group: Any) -> bool:
    """An all_reduce in `group` sums exactly its members' rank + 1."""
    import torch.distributed as dist

    x = m.tensor([m.rank + 1.0])
    dist.all_reduce(x, group=group)
    return x.item() == sum(r + 1 for r in members)


def subgroups(rank: int, world: int, tp: int, device: Any) -> dict[str, tuple[str, float, str]]:
    """Every rank creates every group (new_group is collective); an all_reduce in each of its
    own groups must sum exactly its members' values."""
    import torch.distributed as dist

    member = Member(rank, world, device)
    results = {}
    for kind, groups in zip(("tp", "dp"), grid_groups(world, tp), strict=True):
        handles = [dist.new_group(g) for g in groups]
        mine = next(i for i, g in enumerate(groups) if rank in g)
        check = functools.partial(check_group_sum, member, groups[mine], handles[mine])
        results[f"{kind} group {groups[mine]}"] = timed(check)
    return results


def message_sizes(max_mb: float) -> list[int]:
    """4 bytes (latency), then 4 KiB up to max_mb, x4 each step."""
    sizes, size = [4], 4096
    while size <= max_mb * 2**20:
        sizes.append(size)
        size *= 4
    return sizes


def median_all_reduce_s(nbytes: int, device: Any) -> float:
    """Median seconds of one all_reduce of `nbytes` of float32, after 2 warm-up calls; each
    timed call starts after a barrier, so every rank's clock starts together."""
    import torch
    import torch.distributed as dist

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
    return statistics.median(times)


def bandwidth(world: int, max_mb: float, device: Any) -> list[dict[str, float]]:
    """all_reduce of float32 messages from 4 KiB up to max_mb, x4 each step; busbw as defined
    by nccl-tests: algbw x 2(n-1)/n. Plus a 4-byte latency row."""
    rows = []
    for nbytes in message_sizes(max_mb):
        seconds = median_all_reduce_s(nbytes, device)
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
