"""A folder of shards on disk (or in an object store): `.npy` arrays and an `index.json`.

    <folder>/index.json             {"format": ..., "shards": [{"file", "elements", "bytes"}], ...}
    <folder>/shard-00000.npy ...    one numpy array each, memory-mapped when read

The index is written last, so a folder with an index is complete. Every reader checks the
index against the files before training starts (a missing, truncated or half-copied shard is
one line on every rank, not a crash on one rank mid-epoch). A folder may be a URL that fsspec
opens (`s3://bucket/prefix` with `pip install -e .[stream]`): shards are then downloaded to a
`ShardCache` when first read (per rank, under the run folder; removed at the end of the run).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np

from project.data.source import save_array
from project.engine.errors import UserError

INDEX = "index.json"
FORMAT = "project-shards/1"
PREPARE = "python -m project.data.prepare"


def write_shards(folder: Path, arrays: list[np.ndarray], elements: list[int], **meta: Any) -> None:
    """Write `arrays` as shards of `folder` (array i holds `elements[i]` elements), then the
    index with `meta`. Files are written atomically; the index goes last."""
    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    for i, (array, n) in enumerate(zip(arrays, elements, strict=True)):
        path = folder / f"shard-{i:05d}.npy"
        save_array(path, array)
        entries.append({"file": path.name, "elements": int(n), "bytes": path.stat().st_size})
    index = {"format": FORMAT, "shards": entries, **meta}
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{INDEX}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(index, f, indent=1)
    os.replace(tmp, folder / INDEX)


def read_index(folder: str) -> dict[str, Any]:
    """`folder`'s index, checked against its files; a one-line UserError says what is wrong."""
    fs, root = fsspec.core.url_to_fs(folder)
    if not fs.exists(root):
        raise UserError(f"the shard folder {folder} does not exist: write it with {PREPARE}")
    try:
        with fs.open(f"{root}/{INDEX}") as f:
            index = json.load(f)
    except FileNotFoundError:
        raise UserError(
            f"the shard folder {folder} has no {INDEX} (empty, or its writing was cut short): "
            f"write it again with {PREPARE}"
        ) from None
    except json.JSONDecodeError as err:
        raise UserError(f"{folder}/{INDEX} is not valid JSON ({err}): write it again") from None
    if index.get("format") != FORMAT or not index.get("shards"):
        raise UserError(f"{folder}/{INDEX} lists no shards of {FORMAT}: write it with {PREPARE}")
    sizes = {Path(p).name: s for p, s in ((p, fs.size(p)) for p in fs.glob(f"{root}/*.npy"))}
    for entry in index["shards"]:
        found = sizes.get(entry["file"])
        if found != entry["bytes"]:
            state = "is missing" if found is None else f"has {found} bytes"
            raise UserError(
                f"shard {folder}/{entry['file']} {state}, the index says {entry['bytes']}: the "
                f"folder is corrupt or half-copied; write it again with {PREPARE}"
            )
    return index


class ShardCache:
    """Local copies of remote shards, one folder per rank: <root>/rank<R>/<folder>/<file>,
    where <folder> is the remote folder's name and a hash of its URL (every split's first
    shard is shard-00000.npy).

    Every epoch starts fresh DataLoader workers that get the stream pickled; this folder is
    what they share: a shard is fetched once per rank and read from here by every later epoch
    and worker. A copy is downloaded under a temp name and renamed only when complete and of
    the index's size, so a worker killed mid-download leaves a temp file nothing reads; a lock
    per shard makes a rank's workers fetch it once between them. `remove(ranks)` deletes the
    ranks' folders (the data source's teardown, at the end of the run).
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @staticmethod
    def downloading(url: str) -> contextlib.AbstractContextManager[Any]:
        """Around every download: the engine books it outside the step deadline (it sets
        this in every rank and DataLoader worker: project.engine.run.long_work)."""
        return contextlib.nullcontext()

    def folder(self, rank: int) -> Path:
        return self.root / f"rank{rank}"

    def local_copy(self, url: str, entry: dict[str, Any], rank: int) -> Path:
        """The local path of the shard at `url` (`entry`: its index entry), fetched unless
        this rank has it already."""
        remote = url.rsplit("/", 1)[0]
        digest = hashlib.sha256(remote.encode()).hexdigest()[:12]
        target = self.folder(rank) / f"{remote.rsplit('/', 1)[-1]}-{digest}" / entry["file"]
        if not _complete(target, entry["bytes"]):
            target.parent.mkdir(parents=True, exist_ok=True)
            with _locked(target.parent / f".{target.name}.lock"):
                if not _complete(target, entry["bytes"]):  # another worker may have fetched it
                    self._download(url, target, entry["bytes"])
        return target

    def _download(self, url: str, target: Path, size: int) -> None:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        os.close(fd)
        try:
            with self.downloading(url):
                self.fetch(url, tmp)
            if os.path.getsize(tmp) != size:
                raise UserError(
                    f"shard {url} arrived with {os.path.getsize(tmp)} bytes, the index says "
                    f"{size}: the folder changed while it was read; write it again with {PREPARE}"
                )
            os.replace(tmp, target)  # atomic: the name appears only once the copy is whole
        finally:
            Path(tmp).unlink(missing_ok=True)

    def fetch(self, url: str, local: str) -> None:
        """Download `url` to the local file `local` (one fetch of a shard)."""
        fs, path = fsspec.core.url_to_fs(url)
        fs.get_file(path, local)

    def ranks_from(self, first: int) -> set[int]:
        """The ranks >= `first` that have a folder here."""
        folders = self.root.glob("rank*") if self.root.is_dir() else ()
        found = {int(f.name[4:]) for f in folders if f.name[4:].isdigit()}
        return {rank for rank in found if rank >= first}

    def remove(self, ranks: Iterable[int]) -> None:
        """Delete the copies of `ranks`; the root too once no rank's folder is left in it."""
        for rank in ranks:
            shutil.rmtree(self.folder(rank), ignore_errors=True)
        with contextlib.suppress(OSError):  # other ranks' folders still there: theirs to remove
            self.root.rmdir()


def _complete(path: Path, size: int) -> bool:
    return path.is_file() and path.stat().st_size == size


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path`, released by the OS also when its holder is killed."""
    with open(path, "a") as f:
        # A filesystem without locks (Lustre mounted without `flock`) only costs duplicate
        # fetches: each copy is still renamed into place whole.
        with contextlib.suppress(OSError):
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def load_shard(
    folder: str, entry: dict[str, Any], cache: ShardCache | None = None, rank: int = 0
) -> np.ndarray:
    """One shard's array, memory-mapped; a remote shard (a URL) is first copied into `cache`
    (rank `rank`'s folder)."""
    url = f"{folder}/{entry['file']}"
    if "://" in folder and cache is None:
        raise ValueError(f"shard {url} is remote: pass a ShardCache to copy it into")
    path = cache.local_copy(url, entry, rank) if "://" in folder else url
    try:
        return np.load(path, mmap_mode="r")
    except (OSError, ValueError) as err:
        raise UserError(
            f"shard {url} cannot be read ({err}): the folder is corrupt; write it again with "
            f"{PREPARE}"
        ) from None
