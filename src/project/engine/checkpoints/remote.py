"""Checkpoints in object storage (any fsspec URL: s3://, gs://, az://, memory://, file://):
written to a local staging folder, uploaded, then published, for both trainers.

Object stores have no atomic rename, and `last` is several files (the checkpoint and, with
PowerSGD, one state file per rank, each uploaded by its own rank from its own machine). So
`last` is never an object that is overwritten in place; each save is uploaded under a new
name, and a small manifest written last says which upload is `last`:

    <url>/last.ckpt.g000007/last.ckpt                          the checkpoint
    <url>/last.ckpt.g000007/last.comm_hook.step29.rank1.pt     rank 1's PowerSGD state
    <url>/last.ckpt.json     {"generation": 7, "step": 29, "files": [...]}   the manifest

The manifest is one small PUT, which an object store makes visible whole or not at all; it is
written by rank 0 only after every rank said its uploads completed. An upload that is cut
(a killed pod, a lost network) leaves an unpublished generation behind, never a `last` that
points at it; the next save writes a newer generation and removes the leftovers. A resume
(auto_resume) trusts the manifest alone: on another machine, with an empty local folder, it
downloads the files the manifest lists into the staging folder and resumes from them.

What stays local: the run folder (logs, config, metrics.json, step_stats.json, TensorBoard)
and the staging copies `<run>/checkpoint_staging/` (each save is written there first).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from project.engine.errors import UserError
from project.engine.store import answered, open_store, storage_missing, transferred

log = logging.getLogger(__name__)

STAGING = "checkpoint_staging"  # <run>/checkpoint_staging: local copies of a URL's checkpoints


def is_url(path: str | Path | None) -> bool:
    """Whether a checkpoint location is an fsspec URL (`s3://...`), not a local path."""
    return path is not None and "://" in str(path)


def join(url: str, *names: str) -> str:
    """`url`/name/..., whatever slashes `url` ends with."""
    return "/".join([url.rstrip("/"), *names])


def exists(path: str) -> bool:
    """Whether the file `path` (a local path or an fsspec URL) exists. A store that does not
    answer is one line, never "no": fsspec's isfile says False on any error, and a run that
    believed its `last` gone would start afresh and prune it at its first save."""
    if not is_url(path):
        return Path(path).is_file()
    fs, inner = open_url(path, "checkpoint")
    try:
        return answered(fs, path, lambda: fs.info(inner)).get("type") == "file"
    except FileNotFoundError:
        return False
    except UserError:  # a store that does not answer
        raise
    except Exception as err:
        raise UserError(f"{path} cannot be read ({short(err)}): check the credentials and the "
                        "URL") from None  # fmt: skip


def answers(url: str, what: str) -> None:
    """The store of `url` answers at all (a refusal or a missing object is an answer too), or
    one line: before look-ups the project does not watch itself (the sharded ones: fsspec's
    isfile says False on any error, after minutes of retries against a silent store)."""
    fs, inner = open_url(url, what)
    try:
        answered(fs, url, lambda: fs.info(inner))
    except UserError:
        raise
    except Exception:  # an answer all the same: what it means is for the look-ups to say
        return


def open_url(url: str, what: str) -> tuple[Any, str]:
    """(filesystem, path inside it) of `url` (store.open_store), or one line: the fsspec
    extra to install (a missing s3fs), or the scheme fsspec does not know."""
    try:
        return open_store(url)
    except ImportError as err:  # fsspec knows the class: its package is the one to install
        missing = storage_missing(url, err)
        raise UserError(f"{what}={url}: {missing} (nothing was written)") from None
    except ValueError as err:
        raise UserError(
            f"{what}={url}: {err} (fsspec knows no such storage): give a local folder or an "
            "fsspec URL such as s3://bucket/folder"
        ) from None


def short(err: BaseException) -> str:
    """An exception as part of a one-line message."""
    return " ".join(f"{type(err).__name__}: {err}".split())[:200]


def probe(url: str, what: str) -> None:
    """At start, before any process group or training: `url` can be opened, its bucket exists
    and it takes a write. One line each otherwise (exit 2)."""
    fs, root = open_url(url, what)
    split = getattr(fs, "split_path", None)  # object stores: bucket/key
    bucket = split(root)[0] if split else None
    credentials = "check the credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...)"
    if bucket:
        try:
            found = answered(fs, url, lambda: fs.exists(bucket))
        except UserError:  # an endpoint that does not answer
            raise
        except Exception as err:  # a refused request
            raise UserError(f"{what}={url}: its bucket cannot be read ({short(err)}): "
                            f"{credentials} and AWS_ENDPOINT_URL") from None  # fmt: skip
        if not found:
            raise UserError(
                f"{what}={url}: bucket {bucket!r} does not exist (or these credentials cannot "
                "see it): create it, or name an existing one"
            )
    marker = join(root, f".write-probe-{uuid.uuid4().hex[:12]}")
    try:
        answered(fs, url, lambda: write_probe(fs, root, marker))
    except UserError:
        raise
    except Exception as err:
        fix = f"{credentials} and that they may write there" if bucket else (
            "check that it is a folder this user may write to")  # fmt: skip
        raise UserError(f"{what}={url} is not writable ({short(err)}): {fix}") from None


def write_probe(fs: Any, root: str, marker: str) -> None:
    """`root` takes a write (raises otherwise): `marker`, an empty object, written and removed
    again."""
    fs.makedirs(root, exist_ok=True)  # a local or mounted folder (object stores: no-op)
    fs.pipe_file(marker, b"")
    fs.rm_file(marker)


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """The local ranks of a node take turns in `folder` (one download for all of them)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def download(fs: Any, source: str, target: Path) -> None:
    """`source` to `target`, whole or not at all (a temp file renamed over it)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.download")
    try:
        transferred(fs, source, lambda progress: fs.get_file(source, str(tmp), callback=progress))
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def download_folder(url: str, target: Path) -> None:
    """The folder `url` copied into `target`, which must not exist yet (then its files land in
    it, not in a subfolder); one line when that fails, a full disk too."""
    fs, path = open_url(url, "the checkpoint folder")
    try:
        transferred(fs, url, lambda progress: fs.get(path, str(target), recursive=True,
                                                     callback=progress))  # fmt: skip
        if not target.is_dir() or not any(target.iterdir()):  # some stores list no folder
            raise FileNotFoundError(path)
    except FileNotFoundError:
        raise UserError(
            f"{url} holds no files (removed meanwhile?): continue from another "
            "save with ckpt_path=..., or start a new run (another RUN_ID)"
        ) from None
    except UserError:  # a store that does not answer
        raise
    except Exception as err:
        raise UserError(f"{url} cannot be copied into {target.parent} ({short(err)}): check "
                        "the URL, its credentials and the free space there") from None  # fmt: skip


@dataclass
class RemoteLast:
    """The `last` checkpoint of a run whose checkpoint folder is `url` (see the module doc),
    staged in `staging`. Every rank holds one; `publish` is called by every rank."""

    url: str
    name: str  # last.ckpt (Lightning) or last.pt (the raw trainer)
    staging: Path

    def __post_init__(self) -> None:
        self.fs, self.root = open_url(self.url, "callbacks.fault_tolerance.dirpath")
        self.manifest = self.read_manifest()  # what is published now (None: nothing)
        self.generation = self.manifest["generation"] if self.manifest else 0

    @property
    def manifest_path(self) -> str:
        return join(self.root, f"{self.name}.json")

    def folder(self, generation: int) -> str:
        """Where the files of one save go: a new name per save, never one in use."""
        return join(self.root, f"{self.name}.g{generation:06d}")

    def read_manifest(self) -> dict[str, Any] | None:
        path = self.manifest_path
        try:
            return json.loads(answered(self.fs, path, lambda: self.fs.cat_file(path)))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            raise UserError(
                f"{join(self.url, self.name)}.json, the manifest that says which upload is "
                f"`last`, cannot be read ({short(err)}): check the credentials, or move it away "
                "to start over"
            ) from None

    def published_step(self) -> int | None:
        return self.manifest["step"] if self.manifest else None

    def fetch(self, wanted: list[str]) -> Path | None:
        """The published `last` in the staging folder (None: nothing published), with those
        of the `wanted` files beside it the manifest lists. The node's ranks download once."""
        if self.manifest is None:
            return None
        names = [self.name, *(n for n in wanted if n in self.manifest["files"])]
        copy = self.fetched_record
        with locked(self.staging):
            held = json.loads(copy.read_text()) if copy.is_file() else {}
            if held.get("generation") != self.generation:
                held = {"generation": self.generation, "files": []}
            source = self.folder(self.generation)
            for name in [n for n in names if n not in held["files"]]:
                try:
                    download(self.fs, join(source, name), self.staging / name)
                except UserError:  # a store that does not answer
                    raise
                except Exception as err:
                    raise UserError(
                        f"{join(self.url, self.name)}.json publishes {name}, which cannot be "
                        f"downloaded from {source} ({short(err)}): check the credentials; "
                        "if it was deleted, move the manifest away to start over"
                    ) from None
                held["files"].append(name)
                copy.write_text(json.dumps(held))
        log.info(f"Fetched {join(self.url, self.name)} (step {self.manifest['step']}) into "
                 f"{self.staging}")  # fmt: skip
        return self.staging / self.name

    @property
    def fetched_record(self) -> Path:
        """Which published files the staging folder holds (the node's ranks download once)."""
        return self.staging / f".{self.name}.fetched.json"

    def forget_fetched(self) -> None:
        """Before a save overwrites the staged files: they are no longer the published ones
        (a save cut before it is published must never be taken for them on a restart)."""
        self.fetched_record.unlink(missing_ok=True)

    def upload(self, files: list[Path]) -> None:
        """This rank's part of the next save: its staged `files` under the next generation."""
        target = self.folder(self.generation + 1)
        self.fs.makedirs(target, exist_ok=True)
        for path in files:
            self.fs.put_file(str(path), join(target, path.name))

    def publish(self, step: int, names: list[str], writer: bool) -> None:
        """After every rank's `upload` completed: the manifest names the new generation
        (rank 0, the `writer`), then older generations go. Every rank moves on to the next."""
        self.generation += 1
        self.manifest = {"generation": self.generation, "step": step, "files": names}
        if not writer:
            return
        self.fs.pipe_file(self.manifest_path, json.dumps(self.manifest).encode())
        keep, prefix = self.folder(self.generation), f"{self.name}.g"
        try:  # `last` is published: tidying that fails is a warning, not a failed save
            olds = self.fs.ls(self.root, detail=False)
        except Exception as err:
            log.warning(f"older checkpoints under {self.root} are left: listing failed ({err})")
            return
        for old in olds:  # older saves, cut uploads
            name = old.rstrip("/").rpartition("/")[2]
            if name.startswith(prefix) and name != keep.rpartition("/")[2]:
                with contextlib.suppress(OSError):  # someone else's tidying is no failure
                    self.fs.rm(old, recursive=True)


def fetch_checkpoint(url: str, staging: Path, what: str) -> Path:
    """A checkpoint given by URL (ckpt_path=s3://...), downloaded into `staging`. A URL
    naming a run's `last` (<folder>/last.ckpt, published by a manifest) reads the upload the
    manifest names."""
    fs, path = open_url(url, what)
    folder, _, name = url.rstrip("/").rpartition("/")
    with locked(staging):
        # isfile says False on any error: a store that does not answer must not read as none
        if answered(fs, url, lambda: not fs.isfile(path) and fs.isfile(f"{path}.json")):
            last = RemoteLast(folder, name, staging)
            source = join(last.folder(last.generation), name)
        else:
            source = path
        target = staging / name
        try:
            download(fs, source, target)
        except FileNotFoundError:
            raise UserError(f"{what}={url} does not exist: give a checkpoint file") from None
        except UserError:  # a store that does not answer
            raise
        except Exception as err:
            raise UserError(f"{what}={url} cannot be downloaded ({short(err)}): check the "
                            "credentials and the URL") from None  # fmt: skip
    return target
