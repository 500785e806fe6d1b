"""Write the language-model corpus as token shards for `data=chars_stream`.

    python -m project.data.prepare                       # pydoc topics -> data/chars_shards
    python -m project.data.prepare --corpus my.txt --out /shared/shards --windows-per-shard 4096

Run it from the repository root: `data=chars_stream` reads <repo>/data/chars_shards.
The corpus is split and cut into windows exactly as `data=chars` does (project.data.text);
each split goes to <out>/<split>/ as shards of whole windows (a window's last token is the
next one's first, so a shard holds windows*block_size+1 tokens). Copy the folder to shared
storage or an object store and point `data.dataset.folder` at it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from project.data.shards import write_shards
from project.data.text import CharCorpus
from project.engine.errors import UserError


def shard_tokens(tokens: np.ndarray, block_size: int, per_shard: int) -> list[np.ndarray]:
    """`tokens` as arrays of at most `per_shard` whole windows each."""
    windows = max(0, (len(tokens) - 1) // block_size)  # as many as Windows(tokens) has
    return [
        np.ascontiguousarray(tokens[a * block_size : min(a + per_shard, windows) * block_size + 1])
        for a in range(0, windows, per_shard)
    ]


def prepare(corpus: str | None, out: Path, block_size: int, per_shard: int,
            val_fraction: float, test_fraction: float) -> dict[str, int]:  # fmt: skip
    """Write every split's shards; returns the windows per split."""
    if per_shard < 1 or block_size < 1:
        raise UserError("--windows-per-shard and --block-size must be at least 1")
    text = CharCorpus(corpus, block_size, val_fraction, test_fraction)
    counts = {}
    for split, tokens in text.splits().items():
        shards = shard_tokens(tokens, block_size, per_shard)
        elements = [(len(s) - 1) // block_size for s in shards]
        write_shards(out / split, shards, elements, block_size=block_size)
        counts[split] = sum(elements)
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", help="a UTF-8 text file (default: Python's pydoc topics)")
    where = "default: where data=chars_stream reads (run from the repository root)"
    parser.add_argument("--out", type=Path, default=Path("data/chars_shards"), help=where)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--windows-per-shard", type=int, default=1024)
    parser.add_argument("--val-fraction", type=float, default=0.05)
    parser.add_argument("--test-fraction", type=float, default=0.05)
    a = parser.parse_args(argv)
    try:
        counts = prepare(a.corpus, a.out, a.block_size, a.windows_per_shard, a.val_fraction,
                         a.test_fraction)  # fmt: skip
    except UserError as err:
        raise SystemExit(f"error: {err}") from None
    print(f"{a.out}: " + ", ".join(f"{s} {n} windows" for s, n in counts.items()))


if __name__ == "__main__":
    main()
