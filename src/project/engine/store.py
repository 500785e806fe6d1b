"""Object stores (fsspec URLs: s3://, gs://, ...): where the project opens them, and the
calls that must answer or end in one line (a store missing its package, or never answering).

The checkpoints' URL folders (engine/checkpoints/remote.py) and a remote shard folder
(project/data: shards.py, remote/cache.py) go through here.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from project.engine.errors import UserError

R = TypeVar("R")

STORE_TIMEOUT_ENV = "PROJECT_STORE_TIMEOUT_S"  # how long an object store may take to answer
STORE_TIMEOUT_S = 60.0  # its default: a real S3 answers in well under a second


def storage_missing(url: str, err: ImportError) -> str:
    """Why fsspec cannot open `url` and the fix, when fsspec knows its store but the store's
    package is not installed: "fsspec cannot open gs:// URLs here (...): pip install gcsfs"
    (the package named by fsspec's own registry)."""
    from fsspec.registry import known_implementations

    scheme = url.split("://")[0]
    package = known_implementations.get(scheme, {}).get("class", "").split(".")[0]
    fix = f"pip install {package}" if package else "install the fsspec extra for it"
    return f"fsspec cannot open {scheme}:// URLs here ({err}): {fix}"


def store_timeout_s() -> float:
    """How long a store may take to answer a request: PROJECT_STORE_TIMEOUT_S, else 60 s."""
    value = os.environ.get(STORE_TIMEOUT_ENV, "").strip()
    if not value:
        return STORE_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise UserError(f"{STORE_TIMEOUT_ENV}={value}: give the seconds an object store may "
                        f"take to answer (default {STORE_TIMEOUT_S:g})")  # fmt: skip
    return seconds


def open_store(url: str) -> tuple[Any, str]:
    """(filesystem, path inside it) of `url`: fsspec.core.url_to_fs, the one place the project
    makes its filesystems. s3fs waits 5 s for a connection and 15 s for each read of an answer
    (per read, not per transfer: a large upload or download is never cut); a shorter
    PROJECT_STORE_TIMEOUT_S shortens those too, unless FSSPEC_S3's config_kwargs set them.
    ImportError: fsspec knows the store, its package is missing (storage_missing)."""
    import fsspec

    options: dict[str, Any] = {}
    if url.startswith(("s3://", "s3a://")):
        wait, s3 = store_timeout_s(), fsspec.get_filesystem_class("s3")
        config = dict(fsspec.config.conf.get("s3", {}).get("config_kwargs", {}))
        shorter = {key: wait for key in ("connect_timeout", "read_timeout")
                   if key not in config and wait < getattr(s3, key, 0)}  # fmt: skip
        if shorter:  # the default changes nothing: the same cached filesystem as before
            options["config_kwargs"] = {**config, **shorter}
    return fsspec.core.url_to_fs(url, **options)


def answered(fs: Any, path: str, call: Callable[[], R]) -> R:
    """`call()`, a request to the store `fs` about `path` (a short one: a look-up, a small
    object), or one UserError when the store gives no answer within store_timeout_s(). The
    clients' own timeouts do not bound it: s3fs (5 tries) and botocore (5) each retry a read
    that timed out after 15 s, minutes per call (and s3fs's `exists` then says False)."""
    return _watched(fs, path, lambda heard: call(), transfer=False)


def transferred(fs: Any, path: str, call: Callable[[Any], R]) -> R:
    """`call(callback)`, a download of `path` from the store `fs` that reports its progress to
    the fsspec `callback`: one UserError when the store gives no answer within
    store_timeout_s(). Once it answered (the first progress), the download takes as long as
    it takes: each read of it is bounded by the store's client."""
    return _watched(fs, path, call, transfer=True)


def _watched(fs: Any, path: str, call: Callable[[Any], R], transfer: bool) -> R:
    from fsspec.callbacks import Callback

    heard = threading.Event()  # the store answered (a transfer's first progress)
    progress = Callback(hooks={"heard": lambda size, value, **_: heard.set()})
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if {"file", "local", "memory"} & set(protocols):  # no store to wait for
        return call(progress)
    wait = store_timeout_s()
    done, outcome = threading.Event(), list[tuple[bool, Any]]()

    def run() -> None:
        try:
            outcome.append((True, call(progress)))
        except BaseException as err:  # raised in the caller's thread below
            outcome.append((False, err))
        finally:
            done.set()

    # A thread, so the caller can give up: the request itself cannot be cut from outside
    # (it ends with the store client's own timeouts; a process that gives up exits anyway).
    threading.Thread(target=run, name="store-call", daemon=True).start()
    deadline = time.monotonic() + wait
    while not done.wait(max(0.0, deadline - time.monotonic())):
        if transfer and heard.is_set():
            done.wait()
        elif time.monotonic() >= deadline:
            raise UserError(_silent(fs, path, wait))
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _silent(fs: Any, path: str, wait: float) -> str:
    """The line for a store that did not answer: its endpoint, what was asked, the fix."""
    url = path if "://" in path else fs.unstrip_protocol(path)
    s3 = url.startswith(("s3://", "s3a://"))
    endpoint = getattr(fs, "endpoint_url", None) or (getattr(fs, "client_kwargs", None) or {}
                                                     ).get("endpoint_url")  # fmt: skip
    if s3 and not endpoint:  # botocore's own order: the S3-specific variable first
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    endpoint = endpoint or "/".join(url.split("/")[:3])  # s3://bucket: AWS itself
    check = "AWS_ENDPOINT_URL / the network" if s3 else "the URL and the network"
    return (f"the object store at {endpoint} did not answer within {wait:g} s ({url}): check "
            f"{check}, or wait longer with {STORE_TIMEOUT_ENV}=<seconds>")  # fmt: skip
