"""A store that accepts connections and never answers (AWS_ENDPOINT_URL at a socket that holds
every connection): each store call at start and in the data path gives up after
PROJECT_STORE_TIMEOUT_S with one line naming the endpoint, exit 2, never a hang (it once waited
minutes: botocore's and s3fs's retries of a 15 s read timeout multiply)."""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from project.engine.checkpoints.remote import RemoteLast, exists, fetch_checkpoint, probe
from project.engine.errors import UserError
from project.engine.store import STORE_TIMEOUT_ENV
from tests.helpers import CHARLM, ROOT, S3_KEYS, finish, one_error_line, start

WAIT_S = 1  # PROJECT_STORE_TIMEOUT_S in these tests
HANG_S = 60  # a call or run still going after this is the hang this file is about


@pytest.fixture
def silent() -> Iterator[str]:
    """A server on 127.0.0.1 that accepts every connection, reads nothing and never answers,
    for as long as the test runs; yields its URL."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)  # the accept loop looks at `done` this often
    held: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                held.append(server.accept()[0])

    thread = threading.Thread(target=accept, name="silent-store", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        done.set()
        thread.join()
        for conn in [*held, server]:
            conn.close()


@pytest.fixture
def silent_store(silent: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The AWS environment pointing at `silent`, here and in every child a test starts, with a
    wait of WAIT_S; yields the endpoint."""
    import fsspec

    for key, value in {"AWS_ENDPOINT_URL": silent, **S3_KEYS}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv(STORE_TIMEOUT_ENV, str(WAIT_S))
    fsspec.filesystem("s3").clear_instance_cache()  # no client of another test's endpoint
    return silent


def answered_within(seconds: float, call: Callable[[], Any]) -> BaseException | None:
    """What `call()` raised (None: it returned), asserting it ended within `seconds` (a call
    still waiting is left behind in its daemon thread)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as err:  # reported to the test
            outcome.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still waiting for the store after {seconds} s"
    return outcome[0]


def assert_silent_line(line: str, endpoint: str, *needles: str) -> None:
    """One line that names the endpoint, the wait and the knob."""
    assert "\n" not in line and "Traceback" not in line, line
    assert f"the object store at {endpoint} did not answer within {WAIT_S} s" in line, line
    for needle in [STORE_TIMEOUT_ENV, "AWS_ENDPOINT_URL", *needles]:
        assert needle in line, line


# --- the calls themselves, in this process ---------------------------------------------------
def shard_download(tmp_path: Path) -> None:
    from project.data.shards import ShardCache

    ShardCache(tmp_path / "cache").local_copy("s3://bucket/shards/shard-00000.npy", {"bytes": 8})


def shard_index(tmp_path: Path) -> None:
    from project.data.shards import read_index

    read_index("s3://bucket/shards/train")


CALLS: dict[str, tuple[Callable[[Path], Any], str]] = {
    # callbacks.fault_tolerance.dirpath=s3://...: checked at start, then `last` is looked up
    "probe": (lambda tmp: probe("s3://bucket/run", "callbacks.fault_tolerance.dirpath"),
              "s3://bucket/run"),
    "manifest": (lambda tmp: RemoteLast("s3://bucket/run", "last.ckpt", tmp / "staging"),
                 "s3://bucket/run/last.ckpt.json"),
    "exists": (lambda tmp: exists("s3://bucket/run/last.ckpt.json"),
               "s3://bucket/run/last.ckpt.json"),
    # ckpt_path=s3://... (train.py, eval.py)
    "ckpt_path": (lambda tmp: fetch_checkpoint("s3://bucket/run/a.ckpt", tmp, "ckpt_path"),
                  "s3://bucket/run/a.ckpt"),
    # data.dataset.folder=s3://...: the index at start, each shard into the node's cache
    "shard index": (shard_index, "s3://bucket/shards/train"),
    "shard": (shard_download, "s3://bucket/shards/shard-00000.npy"),
}  # fmt: skip


@pytest.mark.quick
@pytest.mark.parametrize("call", list(CALLS))
def test_a_store_call_that_gets_no_answer_is_one_line(
    silent_store: str, tmp_path: Path, call: str
) -> None:
    run, url = CALLS[call]
    began = time.monotonic()
    err = answered_within(HANG_S, lambda: run(tmp_path))
    assert isinstance(err, UserError), repr(err)
    assert_silent_line(str(err), silent_store, url)
    assert time.monotonic() - began < WAIT_S + 10


# --- the CLIs: one line, exit 2, no traceback -------------------------------------------------
SHARDS = [a for a in CHARLM if not a.startswith("data.dataset.block_size")] + [
    "data=chars_stream", "data.dataset.folder=s3://bucket/chars_shards",
    "data.dataset.block_size=32"]  # fmt: skip
RUNS: dict[str, tuple[str, list[str], str]] = {
    "checkpoint folder": ("train.py", ["callbacks.fault_tolerance.dirpath=s3://bucket/runs/exp7"],
                          "s3://bucket/runs/exp7"),
    "shard folder": ("train.py", SHARDS, "s3://bucket/chars_shards/train"),
    "train ckpt_path": ("train.py", ["ckpt_path=s3://bucket/runs/exp7/last.ckpt"],
                        "s3://bucket/runs/exp7/last.ckpt"),
    "eval ckpt_path": ("eval.py", ["ckpt_path=s3://bucket/runs/exp7/last.ckpt"],
                       "s3://bucket/runs/exp7/last.ckpt"),
}  # fmt: skip


@pytest.mark.parametrize("run", list(RUNS))
def test_a_store_that_never_answers_stops_the_cli_at_start_in_one_line(
    silent_store: str, data_dir: Path, tmp_path: Path, run: str
) -> None:
    """A checkpoint folder, a shard folder, a checkpoint at a URL of a store that never
    answers: one line naming it within the wait (and start-up), exit 2."""
    script, args, url = RUNS[run]
    cmd = [sys.executable, str(ROOT / script), f"paths.data_dir={data_dir}",
           f"paths.log_dir={tmp_path}", "trainer.enable_progress_bar=false", *args]  # fmt: skip
    began = time.monotonic()
    code, out = finish(start(cmd), timeout=HANG_S)
    line = one_error_line(out)
    assert code == 2, out[-3000:]
    assert_silent_line(line, silent_store, url)
    assert time.monotonic() - began < HANG_S / 2, out[-3000:]  # start-up (~7 s) and the wait
