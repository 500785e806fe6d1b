"""A text corpus as next-character prediction windows (for `experiment=charlm`).

The default corpus ships inside Python itself: `pydoc_data.topics` (the text of `help()`
topics, ~465 KB of English prose and code), so it works offline. Any UTF-8 text file works
too (`data.dataset.path=/my/corpus.txt`). Text is encoded as UTF-8 bytes (vocabulary 256:
one token per character for ASCII text, no tokenizer to train or ship). The split is
contiguous: the first part trains, the next validates, the last tests, so no window of
val/test text was seen in training.

    python -m project.data.text      # corpus size and the unigram baseline to beat
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from project.data.source import SPLITS, DataSource, least_fraction
from project.engine.errors import UserError

VOCAB_SIZE = 256  # bytes


def read_corpus(path: str | None) -> bytes:
    """The corpus as UTF-8 bytes: `path`, or Python's own pydoc topics when None."""
    if path is None:
        from pydoc_data.topics import topics  # 465 KB of text: only when it is the corpus

        return "\n\n".join(topics[k] for k in sorted(topics)).encode()
    try:
        return Path(path).read_text(encoding="utf-8").encode()
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(
            f"data.dataset.path={path} cannot be read as UTF-8 text ({err.__class__.__name__}: "
            f"{getattr(err, 'strerror', None) or err}): point it at a text file"
        ) from None


def file_holds(path: Path, corpus: bytes) -> bool:
    """Whether the file's bytes are `corpus`: reading a file as text turns its \\r\\n and \\r
    line ends into \\n, and the tokens are what was read."""
    return path.stat().st_size == len(corpus) and path.read_bytes() == corpus


class Windows(Dataset):
    """Non-overlapping windows of `block_size + 1` tokens: (input, input shifted by one).

    `tokens` is any sliceable sequence of token ids (an array, a memory map, a CorpusSlice),
    kept as it is stored: a window becomes int64 when it is read, so the dataset holds (and
    pickles to each DataLoader worker) one byte a token, not eight."""

    def __init__(self, tokens: Sequence[int] | np.ndarray, block_size: int) -> None:
        self.tokens, self.block_size = tokens, block_size

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.block_size)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block_size
        window = self.tokens[start : start + self.block_size + 1]
        chunk = torch.from_numpy(np.array(window, dtype=np.int64))
        return chunk[:-1], chunk[1:]


class CorpusSlice:
    """Tokens [start, stop) of a corpus that pickle as where they come from, not as tokens.

    A DataLoader worker gets its dataset pickled every epoch. This slice travels as (path,
    start, stop) and the worker reads the tokens itself on first use: memory-mapped from the
    file when the file's bytes are the tokens (`mapped`), else by reading the corpus again
    (Python's pydoc topics: ~6 ms; a file whose newlines reading as text changes)."""

    _tokens: np.ndarray | None = None  # never pickled

    def __init__(
        self, path: str | None, start: int, stop: int, mapped: bool,
        tokens: np.ndarray | None = None,
    ) -> None:  # fmt: skip
        self.path, self.start, self.stop, self.mapped = path, start, stop, mapped
        self._tokens = tokens  # the rank's own copy: no second read in the rank

    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            if self.mapped:
                self._tokens = np.memmap(self.path, np.uint8, "r", self.start, (len(self),))
            else:
                corpus = np.frombuffer(read_corpus(self.path), dtype=np.uint8)
                self._tokens = corpus[self.start : self.stop]
        return self._tokens

    def __getstate__(self) -> dict[str, object]:
        return {k: v for k, v in vars(self).items() if k != "_tokens"}

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: int | slice) -> np.ndarray:
        return self.tokens()[index]


class CharCorpus(DataSource):
    """Byte-level windows of a text corpus with a contiguous train/val/test split."""

    def __init__(
        self,
        path: str | None = None,
        block_size: int = 64,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
    ) -> None:
        if not (
            0 < val_fraction < 1 and 0 < test_fraction < 1 and val_fraction + test_fraction < 1
        ):
            raise UserError(
                f"data.dataset val_fraction={val_fraction} and test_fraction={test_fraction} "
                "must be in (0, 1) and sum to less than 1"
            )
        self.path, self.block_size = path, block_size
        self.fractions = (val_fraction, test_fraction)
        # Read once, here: an unreadable corpus fails before any process starts.
        corpus = read_corpus(path)
        self.tokens = np.frombuffer(corpus, dtype=np.uint8)
        # DataLoader workers map the file itself when its bytes are the tokens.
        self.mapped = path is not None and file_holds(Path(path), corpus)

    def bounds(self) -> dict[str, tuple[int, int]]:
        """Each split's [start, stop) in the corpus's tokens."""
        n = len(self.tokens)
        n_val, n_test = (round(n * f) for f in self.fractions)
        n_train = n - n_val - n_test
        return {"train": (0, n_train), "val": (n_train, n_train + n_val),
                "test": (n_train + n_val, n)}  # fmt: skip

    def larger(self, split: str, elements: int) -> str | None:
        if split == "train":
            return None
        fraction = least_fraction(len(self.tokens), elements * self.block_size + 1)  # Windows
        return fraction and f"data.dataset.{split}_fraction={fraction} or more"

    def splits(self) -> dict[str, np.ndarray]:
        return {s: self.tokens[a:b] for s, (a, b) in self.bounds().items()}

    def dataset(self, split: str) -> Dataset:
        start, stop = self.bounds()[split]
        tokens = CorpusSlice(self.path, start, stop, self.mapped, self.tokens[start:stop])
        windows = Windows(tokens, self.block_size)
        if len(windows) == 0:
            raise UserError(
                f"the {split} split of the corpus is shorter than one window of "
                f"block_size={self.block_size}: use a longer corpus or a larger {split} fraction"
            )
        return windows


def unigram_baseline(train: np.ndarray, other: np.ndarray) -> float:
    """Cross-entropy (nats per token) of `other` under the train split's byte frequencies
    (add-one smoothed): what a model that ignores context scores."""
    counts = np.bincount(train, minlength=VOCAB_SIZE).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(-log_p[other].mean())


def main() -> None:
    corpus = CharCorpus()
    splits = corpus.splits()
    sizes = ", ".join(f"{s} {len(splits[s])}" for s in SPLITS)
    print(f"pydoc_data.topics: {sum(map(len, splits.values()))} bytes ({sizes})")
    for split in ("val", "test"):
        loss = unigram_baseline(splits["train"], splits[split])
        print(f"unigram baseline on {split}: loss {loss:.3f} nats, perplexity {math.exp(loss):.2f}")


if __name__ == "__main__":
    main()
