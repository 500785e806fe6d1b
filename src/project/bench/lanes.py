"""What the stream's lane layout buys: mixing per global batch, shards per rank, at any scale.

    python -m project.bench.lanes [--shards 100000] [--rows 1000] [--shard-mb 64] [--per-node 8]

Computed in one process from the order alone (project.data.lanes: the order is a pure function
of the seed, epoch and layout, so a rank's reads need no run), through the same
`ShardedStream` code a training run iterates (docs/performance.md):

- one-class shards (64 shards of 50 rows, shard s holds class s % 10; the case where shards
  are written per source or label): distinct classes per global batch of 64 and shards each
  rank reads, at 1, 2 and 4 processes, in the shard-major order streams had before the lanes
  (shards in a seeded order, rows shuffled inside each) and in lanes;
- the same layout for W = 64 and 1,000 ranks over a big synthetic dataset (`--shards` of
  `--rows` rows, `--shard-mb` each; `--per-node` ranks a node): shards a rank reads and bytes
  a node reads in an epoch (its ranks' union), for the first and last rank and node;
- `shuffle_block` against mixing: classes and shards per global batch, and the rows a rank
  keeps within reach (its lanes x one block), for shards of 50 and of 2,000 rows.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from project.data.lanes import default_lanes
from project.data.stream import ShardedStream


class Sized(ShardedStream):
    """Shards of given lengths whose row i of shard s reads as s (what a bench counts)."""

    def read(self, shard: int) -> list[int]:
        return [shard] * self.lengths[shard]


def stream(lengths: list[int], world: int, rank: int, batch: int, lanes: int | None = None,
           block: int | None = None, shard_major: bool = False) -> Sized:  # fmt: skip
    """Rank `rank` of `world`'s stream of epoch 0 (`shard_major`: the order before the lanes:
    one lane, no block shuffle)."""
    s = Sized(lengths, shuffle=True, lanes=lanes, shuffle_block=block)
    s.shard(world, rank, batch, seed=0, pad=True)
    if shard_major:
        s.lay_out(1, 0)
    return s


def per_batch(lengths: list[int], world: int, global_batch: int, classes: int = 10,
              **layout: object) -> tuple[float, float]:  # fmt: skip
    """Mean distinct classes and shards per global batch of one epoch on `world` ranks."""
    batch = global_batch // world
    ranks = [list(stream(lengths, world, r, batch, **layout)) for r in range(world)]  # type: ignore[arg-type]
    steps = len(ranks[0]) // batch
    shards = [{s for rank in ranks for s in rank[i * batch : (i + 1) * batch]}
              for i in range(steps)]  # fmt: skip
    return (float(np.mean([len({s % classes for s in step}) for step in shards])),
            float(np.mean([len(step) for step in shards])))  # fmt: skip


def shards_per_rank(lengths: list[int], world: int, **layout: object) -> list[int]:
    s = stream(lengths, world, 0, 1, **layout)  # type: ignore[arg-type]
    return [len(s.shards_of(r)) for r in range(world)]


def one_class_shards(args: argparse.Namespace) -> None:
    lengths = [50] * 64
    print("64 one-class shards of 50 rows (10 classes), global batch 64, epoch 0:")
    print("  processes | classes/batch shard-major -> lanes | shards/rank shard-major -> lanes")
    for world in (1, 2, 4):
        old, new = per_batch(lengths, world, 64, shard_major=True), per_batch(lengths, world, 64)
        reads = [max(shards_per_rank(lengths, world, **k)) for k in ({"shard_major": True}, {})]
        print(f"  {world:9d} | {old[0]:.2f} -> {new[0]:.2f} ({default_lanes(world)} lanes)"
              f"{'':14s}| {reads[0]} -> {reads[1]}")  # fmt: skip


def at_scale(args: argparse.Namespace) -> None:
    lengths = [args.rows] * args.shards
    tb = args.shards * args.shard_mb / 1e6
    print(f"\n{args.shards:,} shards of {args.rows:,} rows ({args.shard_mb} MB each, {tb:.1f} "
          f"TB), {args.per_node} ranks a node:")  # fmt: skip
    for world in (64, 1000):
        began, nodes = time.perf_counter(), world // args.per_node
        s = stream(lengths, world, 0, 1)
        ranks = {r: s.shards_of(r) for n in (0, nodes - 1)
                 for r in range(n * args.per_node, (n + 1) * args.per_node)}  # fmt: skip
        node = [set().union(*(ranks[r] for r in range(n * args.per_node, (n + 1) * args.per_node)))
                for n in (0, nodes - 1)]  # fmt: skip
        rank_counts = sorted({len(v) for v in ranks.values()})
        print(f"  W={world}: {default_lanes(world)} lanes; shards a rank reads "
              f"{'/'.join(map(str, rank_counts))} (shard-major: {args.shards:,}, "
              f"all); a node (first, last) reads {len(node[0])}, {len(node[1])} shards = "
              f"{len(node[0]) * args.shard_mb / 1e3:.1f}, {len(node[1]) * args.shard_mb / 1e3:.1f}"
              f" GB (shard-major: {args.shards * args.shard_mb / 1e6:.1f} TB a node; computed in "
              f"{time.perf_counter() - began:.0f} s)")  # fmt: skip


def blocks(args: argparse.Namespace) -> None:
    print("\nshuffle_block (1 process, 8 lanes, global batch 64, one class a shard):")
    print("  shard rows | block | classes/batch | shards/batch | rows within reach a rank")
    for rows, sizes in ((50, (50, 100, 200, 400, 4096)), (2000, (2000, 4096, 16384, 65536))):
        lengths = [rows] * 64
        for block in sizes:
            classes, shards = per_batch(lengths, 1, 64, block=block)
            print(f"  {rows:10d} | {block:5d} | {classes:13.2f} | {shards:12.2f} | "
                  f"{8 * min(block, rows * 8):,} (8 lanes x a block)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=100_000)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--shard-mb", type=int, default=64)
    parser.add_argument("--per-node", type=int, default=8)
    args = parser.parse_args()
    one_class_shards(args)
    at_scale(args)
    blocks(args)


if __name__ == "__main__":
    main()
