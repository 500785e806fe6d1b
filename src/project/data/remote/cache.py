"""One cache per node for the shards of a remote folder (`s3://...`, any URL fsspec opens).

    <root>/<folder>-<hash>/<file>        a shard's copy (<folder>: the remote folder's name,
                                         <hash>: of its URL; every split has a shard-00000.npy)
    <root>/<folder>-<hash>/.<file>.lock  its lock: shared while a process reads or downloads
                                         the copy, exclusive while one evicts it
    <root>/<folder>-<hash>/.<file>.fetch.lock  exclusive while a process downloads it: the
                                         others needing it wait there, then find it whole
    <root>/.readers/<pid>-<n>            the shards a reader (a rank or DataLoader worker
                                         iterating a stream) still has ahead this epoch
    <root>/.incoming/<pid>-<n>           the size of a download under way (under a limit)
    <root>/.users.lock                   shared by every process using the cache: the last one
                                         out (an exclusive lock succeeds) removes the cache

`root` is `data.dataset.cache_dir`: the ranks of a node (and their DataLoader workers) that
name the same folder share one copy of each shard, whatever their number, coordinated only
by file locks (fcntl.flock: released by the OS also when the holder is killed), so no rank
leads and nothing waits at a barrier. A copy is downloaded under a temp name and renamed into
place only when whole and of the index's size: no process ever opens a truncated shard. A
download that fails or arrives cut is tried `tries` times with a doubling wait, then is one
UserError naming the shard and its URL.

With a size limit, room for a download is made by evicting the copies no reader on this node
still has ahead (least recently used first), never one a process holds; when the shards
ahead alone exceed the limit, a prefetch waits and a read downloads anyway (the limit is
exceeded by what the ranks need now rather than stopping them).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from project.engine.errors import UserError
from project.engine.store import open_store, transferred

PREPARE = "python -m project.data.prepare"
READERS = ".readers"
INCOMING = ".incoming"
USERS = ".users.lock"

_reader_ids = itertools.count()


class Hold:
    """A shard's local copy, held (shared lock) until `release()`: no process evicts it."""

    def __init__(self, path: Path, lock: IO[str]) -> None:
        self.path, self._lock = path, lock

    def release(self) -> None:
        self._lock.close()  # closing the file releases its lock

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc: object) -> None:
        self.release()


class ShardCache:
    """The node's copies of remote shards under `root`, at most `limit_mb` MiB of them
    (None: unbounded). Picklable: DataLoader workers get it with their stream."""

    tries = 4  # downloads of a shard before it is an error
    backoff_s = 0.5  # the wait after the first failed try; doubled after each

    def __init__(self, root: str | Path, limit_mb: float | None = None) -> None:
        self.root = Path(root)
        self.limit = None if limit_mb is None else int(float(limit_mb) * 2**20)
        self._users: IO[str] | None = None  # this process's share of .users.lock

    def __getstate__(self) -> dict[str, Any]:
        # A DataLoader worker joins on its own when it first holds a shard (its lock is released
        # by the OS when it ends); the rank's share stays with the rank.
        return {**vars(self), "_users": None}

    @staticmethod
    def downloading(url: str) -> contextlib.AbstractContextManager[Any]:
        """Around a download (or a wait for one) a reader cannot go on without: the engine
        books it outside the step deadline (project.engine.run.long_work sets this)."""
        return contextlib.nullcontext()

    # --- where things are ----------------------------------------------------------------------
    def path(self, url: str) -> Path:
        """Where the copy of the shard at `url` lives."""
        remote, name = url.rsplit("/", 1)
        digest = hashlib.sha256(remote.encode()).hexdigest()[:12]
        return self.root / f"{remote.rsplit('/', 1)[-1]}-{digest}" / name

    def copies(self) -> list[Path]:
        """Every complete copy in the cache."""
        return [
            p
            for p in self.root.glob("[!.]*/[!.]*")  # not .readers/, .incoming/, locks, temps
            if p.is_file()
        ]

    # --- using a shard ---------------------------------------------------------------------------
    def hold(self, url: str, entry: dict[str, Any]) -> Hold:
        """The shard at `url` (`entry`: its index entry) copied here (downloaded unless the
        node has it), held until released. Waits for another process fetching it."""
        self.join()
        target = self.path(url)
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = open(_lock_path(target), "a")  # noqa: SIM115 (the Hold closes it)
        try:
            # Shared from here on: no eviction removes the copy (an evictor only tries, briefly).
            _flock(lock, fcntl.LOCK_SH)
            if not _complete(target, entry["bytes"]):
                # The download takes a lock of its own rather than upgrading this one: a peer
                # holding the shard (as long as its iterator lives, which may wait on this
                # one's batches) would block an upgrade for good.
                with self.downloading(url), open(_fetch_lock_path(target), "a") as fetching:
                    _flock(fetching, fcntl.LOCK_EX)  # a download under way: wait for it
                    if not _complete(target, entry["bytes"]):  # nobody fetched it meanwhile
                        with self._room(entry["bytes"], needed_now=True):
                            self._download(url, target, entry["bytes"])
            os.utime(target)  # the time of last use: eviction goes least recently used first
        except BaseException:
            lock.close()
            raise
        return Hold(target, lock)

    def local_copy(self, url: str, entry: dict[str, Any]) -> Path:
        """The shard's local copy, not held (a later eviction may remove it)."""
        with self.hold(url, entry) as path:
            return path

    def fetch_ahead(self, url: str, entry: dict[str, Any]) -> bool:
        """Download the shard at `url` unless the node has it or another process is fetching
        it (a background prefetch: it never waits on a lock). False: no room under the limit
        (the shards ahead fill it); try again later."""
        self.join()
        target = self.path(url)
        if _complete(target, entry["bytes"]):
            return True
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(_lock_path(target), "a") as lock, open(_fetch_lock_path(target), "a") as fetching:
            if not _try(lock, fcntl.LOCK_SH) or not _try(fetching, fcntl.LOCK_EX):
                return True  # evicted or downloaded by another process now: the reader sees to it
            if _complete(target, entry["bytes"]):
                return True
            with self._room(entry["bytes"], needed_now=False) as fits:
                if not fits:
                    return False
                self._download(url, target, entry["bytes"])
        return True

    def _download(self, url: str, target: Path, size: int) -> None:
        """`tries` downloads at most, each to a temp name renamed into place only once whole;
        then one UserError naming the shard and its URL."""
        problem = ""
        for attempt in range(self.tries):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
            os.close(fd)
            try:
                self.fetch(url, tmp)
                got = os.path.getsize(tmp)
                if got == size:
                    os.replace(tmp, target)  # atomic: the name appears only once the copy is whole
                    return
                problem = f"it arrived with {got} bytes, the index says {size}"
            except UserError:  # a store that gave no answer: its client has retried already
                raise
            except Exception as err:  # the store, the network, credentials: tried again
                problem = f"{type(err).__name__}: {err}"
            finally:
                Path(tmp).unlink(missing_ok=True)
        raise UserError(
            f"shard {target.name} could not be downloaded from {url} after {self.tries} tries "
            f"({problem}): check that the folder is whole (write it again with {PREPARE}), the "
            f"credentials and the network"
        )

    def fetch(self, url: str, local: str) -> None:
        """Download `url` to the local file `local` (one try; one UserError when the store does
        not answer)."""
        fs, path = open_store(url)
        transferred(fs, url, lambda progress: fs.get_file(path, local, callback=progress))

    # --- what the node still needs, and eviction -------------------------------------------------
    def reader(self) -> Path:
        """A new reader's file (what it has ahead): one per iterator, removed when it ends."""
        folder = self.root / READERS
        folder.mkdir(parents=True, exist_ok=True)
        return folder / f"{os.getpid()}-{next(_reader_ids)}"

    def ahead(self, reader: Path, urls: list[str]) -> None:
        """`reader` still has the shards at `urls` ahead of it this epoch."""
        text = "".join(f"{self.path(url).relative_to(self.root)}\n" for url in urls)
        fd, tmp = tempfile.mkstemp(dir=reader.parent, prefix=".", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, reader)

    def needed(self) -> set[Path]:
        """The copies some live reader on this node still has ahead."""
        needed: set[Path] = set()
        for file in (self.root / READERS).glob("[0-9]*"):
            if not _alive(int(file.name.split("-")[0])):
                file.unlink(missing_ok=True)  # its process died: it reads nothing any more
                continue
            with contextlib.suppress(OSError):
                needed.update(self.root / line for line in file.read_text().split())
        return needed

    @contextlib.contextmanager
    def _room(self, size: int, needed_now: bool) -> Iterator[bool]:
        """Room for a download of `size` bytes under the limit, reserved while the block runs
        (downloads under way count): evicts copies no reader has ahead, least recently used
        first, never one a process holds. Yields whether it fits; one `needed_now` (a reader
        waits for it) is made also when it does not."""
        if self.limit is None:
            yield True
            return
        incoming = self.root / INCOMING
        incoming.mkdir(parents=True, exist_ok=True)
        mine = incoming / f"{os.getpid()}-{next(_reader_ids)}"
        with open(self.root / ".room.lock", "a") as room:
            _flock(room, fcntl.LOCK_EX)  # one reservation at a time on the node
            copies = {p: p.stat() for p in self.copies() if p.exists()}
            used = sum(s.st_size for s in copies.values()) + _reserved(incoming)
            needed = self.needed()
            spare = sorted((p for p in copies if p not in needed), key=lambda p: copies[p].st_mtime)
            for path in spare:
                if used + size * (1 if needed_now else 2) <= self.limit:
                    break
                with open(_lock_path(path), "a") as lock:
                    if _try(lock, fcntl.LOCK_EX):  # nobody reads or fetches it
                        path.unlink(missing_ok=True)
                        used -= copies[path].st_size
            # A prefetch leaves room for one more shard: the one a reader may need next, which
            # would otherwise be downloaded past the limit while prefetches fill it.
            fits = used + size * (1 if needed_now else 2) <= self.limit
            if fits or needed_now:
                mine.write_text(str(size))
        try:
            yield fits
        finally:
            mine.unlink(missing_ok=True)

    # --- the run's end ---------------------------------------------------------------------------
    def join(self) -> None:
        """This process uses the cache (a shared lock on .users.lock until `leave`)."""
        if self._users is not None:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        while True:
            users = open(self.root / USERS, "a")  # noqa: SIM115 (kept until leave)
            _flock(users, fcntl.LOCK_SH)
            with contextlib.suppress(OSError):
                # The last user out may have removed the cache while we waited for the lock:
                # then this lock is on a deleted file; take one on the new file instead.
                if os.fstat(users.fileno()).st_ino == os.stat(self.root / USERS).st_ino:
                    self._users = users
                    return
            users.close()
            self.root.mkdir(parents=True, exist_ok=True)

    def leave(self) -> None:
        """This process is done with the cache; the last one out of the node removes it
        (also when this process had left before: a rank whose workers did the reading)."""
        if self._users is not None:
            self._users.close()
            self._users = None
        if not self.root.is_dir():
            return
        with open(self.root / USERS, "a") as users:
            try:  # no other process uses it (without locks, nobody can tell: left as it is)
                fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return
            self._remove_own()

    def _remove_own(self) -> None:
        """What the cache made under `root`, nothing else: `cache_dir` may be a folder that
        holds other files (a node's scratch space); it goes only if it is left empty."""
        for entry in self.root.iterdir():
            own_folder = entry.is_dir() and re.fullmatch(r".+-[0-9a-f]{12}", entry.name)
            if own_folder or entry.name in (READERS, INCOMING):
                shutil.rmtree(entry, ignore_errors=True)
            elif entry.name in (".room.lock", USERS):
                entry.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.root.rmdir()


def _reserved(incoming: Path) -> int:
    """The bytes of the downloads under way on the node (of live processes)."""
    total = 0
    for file in incoming.glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError):
            if _alive(int(file.name.split("-")[0])):
                total += int(file.read_text())
            else:
                file.unlink(missing_ok=True)
    return total


def _lock_path(target: Path) -> Path:
    return target.parent / f".{target.name}.lock"


def _fetch_lock_path(target: Path) -> Path:
    return target.parent / f".{target.name}.fetch.lock"


def _complete(path: Path, size: int) -> bool:
    return path.is_file() and path.stat().st_size == size


def _flock(f: IO[str], how: int) -> None:
    # A filesystem without locks (Lustre mounted without `flock`) only costs duplicate
    # fetches: each copy is still renamed into place whole.
    with contextlib.suppress(OSError):
        fcntl.flock(f, how)


def _try(f: IO[str], how: int) -> bool:
    """The lock `how` without waiting; False: another process holds a conflicting one."""
    try:
        fcntl.flock(f, how | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return True  # no locks on this filesystem (see _flock)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
