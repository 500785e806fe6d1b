"""What sharding a sampler of many draws costs one rank: start-up, first batches, memory.

    python -m project.bench.draws [--draws 10000000] [--world 4] [--sampler weighted|random]

A user's sampler with a length (a WeightedRandomSampler that defines an epoch by its number of
draws, a RandomSampler with replacement) is shared out draw by draw: every rank makes the
epoch's draws and keeps its own (project.engine.data.samplers.ShardedDraws). Prints the
seconds to build rank 1's loader (its checks make the draws once), the seconds to its first
10 batches and the process's peak resident memory (docs/performance.md). A
WeightedRandomSampler makes its whole epoch at once (torch.multinomial, then a list), so the
memory it needs itself is the floor; a RandomSampler with replacement draws 32 at a time.
"""

from __future__ import annotations

import argparse
import resource
import time

from torch.utils.data import DataLoader, RandomSampler, WeightedRandomSampler

from project.engine.data.sharding import shard_loader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=10**7)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--sampler", choices=("weighted", "random"), default="weighted")
    args = parser.parse_args()
    data = range(10)
    sampler = (WeightedRandomSampler([1.0] * 10, args.draws) if args.sampler == "weighted"
               else RandomSampler(data, replacement=True, num_samples=args.draws))  # fmt: skip
    began = time.perf_counter()
    loader = shard_loader(DataLoader(data, batch_size=256, sampler=sampler), "train",
                          args.world, 1, seed=0)  # fmt: skip
    built = time.perf_counter()
    batches = iter(loader)
    for _ in range(10):
        next(batches)
    first = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{args.sampler} sampler, {args.draws} draws, rank 1 of {args.world}: start-up "
          f"{built - began:.1f} s, first 10 batches {first - built:.1f} s, peak RSS "
          f"{peak:.0f} MB")  # fmt: skip


if __name__ == "__main__":
    main()
