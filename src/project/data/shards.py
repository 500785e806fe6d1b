"""A folder of shards on disk (or in an object store): `.npy` arrays and an `index.json`.

    <folder>/index.json             {"format": ..., "shards": [{"file", "elements", "bytes"}], ...}
    <folder>/shard-00000.npy ...    one numpy array each, memory-mapped when read

The index is written last, so a folder with an index is complete. Every reader checks the
index against the files before training starts (a missing, truncated or half-copied shard is
one line on every rank, not a crash on one rank mid-epoch). A folder may be a URL that fsspec
opens (`s3://bucket/prefix` with `pip install -e .[stream]`): shards are then downloaded into
the node's `ShardCache` (project.data.remote.cache) and read from there.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from project.data.remote.cache import PREPARE, ShardCache
from project.data.source import save_array
from project.engine.errors import UserError
from project.engine.store import answered, open_store, storage_missing

INDEX = "index.json"
FORMAT = "project-shards/1"
__all__ = ["FORMAT", "INDEX", "PREPARE", "ShardCache", "load_shard", "read_index", "write_shards"]


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
    """`folder`'s index, checked against its files; a one-line UserError says what is wrong
    (also a store that refuses the credentials or cannot be reached)."""
    try:
        return _read_index(folder)
    except (UserError, ImportError):
        raise
    except Exception as err:  # the store's own errors: credentials, network, no such bucket
        raise UserError(
            f"the shard folder {folder} cannot be read ({type(err).__name__}: {err}): check the "
            "URL and the store's credentials (for s3://: AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY or AWS_PROFILE, AWS_ENDPOINT_URL)"
        ) from None


def _read_index(folder: str) -> dict[str, Any]:
    try:
        fs, root = open_store(folder)
    except ImportError as err:  # fsspec knows the store (gs://): its package is missing
        raise UserError(f"the shard folder {folder}: {storage_missing(folder, err)}") from None
    # Each call answers within the store's time or is one line (a store that never answers).
    if not answered(fs, folder, lambda: fs.exists(root)):
        raise UserError(f"the shard folder {folder} does not exist: write it with {PREPARE}")
    where = f"{root}/{INDEX}"
    try:
        index = json.loads(answered(fs, f"{folder}/{INDEX}", lambda: fs.cat_file(where)))
    except FileNotFoundError:
        raise UserError(
            f"the shard folder {folder} has no {INDEX} (empty, or its writing was cut short): "
            f"write it again with {PREPARE}"
        ) from None
    except json.JSONDecodeError as err:
        raise UserError(f"{folder}/{INDEX} is not valid JSON ({err}): write it again") from None
    if index.get("format") != FORMAT or not index.get("shards"):
        raise UserError(f"{folder}/{INDEX} lists no shards of {FORMAT}: write it with {PREPARE}")
    listed = answered(fs, folder, lambda: fs.glob(f"{root}/*.npy", detail=True))  # one listing
    sizes = {Path(p).name: info["size"] for p, info in listed.items()}
    for entry in index["shards"]:
        found = sizes.get(entry["file"])
        if found != entry["bytes"]:
            state = "is missing" if found is None else f"has {found} bytes"
            raise UserError(
                f"shard {folder}/{entry['file']} {state}, the index says {entry['bytes']}: the "
                f"folder is corrupt or half-copied; write it again with {PREPARE}"
            )
    return index


def load_shard(folder: str, entry: dict[str, Any], cache: ShardCache | None = None) -> np.ndarray:
    """One shard's array, memory-mapped; a remote shard (a URL) is first copied into `cache`
    (held while it is mapped; a stream holds it longer: project.data.text_stream)."""
    url = f"{folder}/{entry['file']}"
    if "://" not in folder:
        return map_shard(url, url)
    if cache is None:
        raise ValueError(f"shard {url} is remote: pass a ShardCache to copy it into")
    with cache.hold(url, entry) as path:
        return map_shard(path, url)


def map_shard(path: str | Path, url: str) -> np.ndarray:
    """The array in the local file `path` (a copy of `url`), memory-mapped."""
    try:
        return np.load(path, mmap_mode="r")
    except (OSError, ValueError) as err:
        raise UserError(
            f"shard {url} cannot be read ({err}): the folder is corrupt; write it again with "
            f"{PREPARE}"
        ) from None
