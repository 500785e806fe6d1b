"""Training from a remote shard folder with per-request latency, against the local folder.

    python -m project.bench.remote [--latency-ms 50] [--reps 5] [--batches 200]
                                   [--windows-per-shard 256] [--prefetch 2]

Needs the dev extras (moto's S3 server, s3fs). Prepares the default corpus as shards, starts
moto's S3 server in a child process behind a delay of `--latency-ms` on every request (what
an object store far from the node costs per round trip), uploads the shards, then:

- throughput: one process trains a small GPT (d_model 32, one block, batch 32, one thread:
  a step of milliseconds, where a round trip per shard shows) on `--batches` batches of
  `data=chars_stream`, from the local folder and from the S3 URL (a fresh node cache each
  time), with prefetch 0 and 2 and 0 or 2 DataLoader workers; timed from the first batch
  (the workers' start is the same for both folders) to the last; repetitions interleaved,
  medians printed, and remote as a share of local;
- remote reads: 1, 2 and 4 processes on this node, each reading its rank's part of one
  epoch through one cache folder: GETs of shards per epoch against the number of shards.

Figures and the date they were measured go in docs/performance.md.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

KEYS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip
BUCKET = "bench"


def serve(port: int, latency_s: float) -> None:
    """moto's S3 server on 127.0.0.1:`port`, every request delayed by `latency_s` (its
    request log on stderr)."""
    from moto.moto_server.threaded_moto_server import DomainDispatcherApplication
    from moto.server import create_backend_app
    from werkzeug.serving import run_simple

    app = DomainDispatcherApplication(create_backend_app)

    def delayed(environ: dict[str, Any], start_response: Any) -> Any:
        time.sleep(latency_s)
        return app(environ, start_response)

    run_simple("127.0.0.1", port, delayed, threaded=True)


@contextlib.contextmanager
def s3_server(latency_ms: float, log: Path) -> Iterator[str]:
    """The delayed server in a child process, for as long as the block runs; its URL."""
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "project.bench.remote", "--serve", str(port),
           "--latency-ms", str(latency_ms)]  # fmt: skip
    with open(log, "a") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=out, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{url}/moto-api/", timeout=1).close()
                break
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def gets(log: Path, prefix: str) -> int:
    """GETs of shards under /<bucket>/<prefix>/ in the server's request log."""
    pattern = re.compile(rf'"GET /{BUCKET}/{re.escape(prefix)}/\S*\.npy ')
    return sum(1 for line in log.read_text().splitlines() if pattern.search(line))


def upload(folder: Path, prefix: str) -> str:
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir(BUCKET)
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    for path in sorted(files, key=lambda p: p.name == "index.json"):
        fs.put_file(str(path), f"{BUCKET}/{prefix}/{path.relative_to(folder)}")
    return f"s3://{BUCKET}/{prefix}"


def loader(folder: str, cache_dir: str, prefetch: int, workers: int, world: int, rank: int):
    """Rank `rank` of `world`'s train loader of the shards at `folder`, as training builds it."""
    from project.data.text_stream import CharStream
    from project.engine.data.loaders import plain_loader
    from project.engine.data.sharding import shard_loader

    source = CharStream(folder, block_size=64, cache_dir=cache_dir, prefetch=prefetch)
    plain = plain_loader(source.dataset("train"), "train", 32, num_workers=workers, shuffle=True)
    built = shard_loader(plain, "train", world, rank, seed=0)
    if workers:
        built.multiprocessing_context = "forkserver"
    return source, built


def train_seconds(folder: str, prefetch: int, workers: int, batches: int) -> float:
    """Seconds to train `batches` steps of the charlm GPT reading `folder` (a fresh cache)."""
    import torch

    from project.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(block_size=64, d_model=32, n_layer=1, n_head=2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with tempfile.TemporaryDirectory() as cache:
        source, data = loader(folder, f"{cache}/c", prefetch, workers, 1, 0)
        began = 0.0
        for i, (x, y) in enumerate(data):
            began = began or time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            if i + 1 == batches:
                break
        seconds = time.perf_counter() - began
        source.teardown()
        if source.cache is not None:
            source.cache.leave()
    return seconds


def read_rank(folder: str, cache_dir: str, world: int, rank: int, started: Any) -> None:
    """One rank of `world` on this node reading its part of one epoch through the cache."""
    source, data = loader(folder, cache_dir, 2, 0, world, rank)
    started.wait()
    for _ in data:
        pass
    started.wait()  # the ranks end together (as training's last collective makes them)
    source.teardown()
    if source.cache is not None:
        source.cache.leave()  # what the rank's exit does (this child skips atexit)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--windows-per-shard", type=int, default=256)
    parser.add_argument("--prefetch", type=int, default=2, help="the depth compared with 0")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.latency_ms / 1000)
        return
    import torch

    from project.data.prepare import prepare
    from project.data.shards import read_index

    torch.set_num_threads(1)
    os.environ.update(KEYS)
    with tempfile.TemporaryDirectory() as tmp:
        local, log = Path(tmp) / "shards", Path(tmp) / "requests.log"
        prepare(None, local, 64, args.windows_per_shard, val_fraction=0.05, test_fraction=0.05)
        shards = len(read_index(f"{local}/train")["shards"])
        with s3_server(args.latency_ms, log) as url:
            os.environ["AWS_ENDPOINT_URL"] = url
            remote = upload(local, "shards")
            runs = [("local", str(local), 0, w) for w in (0, 2)]
            runs += [("remote", remote, p, w) for w in (0, 2) for p in (0, args.prefetch)]
            seconds: dict[tuple[str, int, int], list[float]] = {r[::2] + r[3:]: [] for r in runs}
            for _ in range(args.reps):  # interleaved: the machine's drift hits every variant
                for where, folder, prefetch, workers in runs:
                    took = train_seconds(folder, prefetch, workers, args.batches)
                    seconds[(where, prefetch, workers)].append(took)
            print(f"{shards} train shards of {args.windows_per_shard} windows; {args.batches} "
                  f"steps of batch 32; {args.latency_ms:g} ms per request; medians of "
                  f"{args.reps}")  # fmt: skip
            for (where, prefetch, workers), times in seconds.items():
                base = statistics.median(seconds[("local", 0, workers)])
                took = statistics.median(times)
                pre = f"prefetch {prefetch}" if where == "remote" else "          "
                print(f"  {where:6} {pre} workers {workers}: {args.batches * 32 / took:7.0f} "
                      f"windows/s, {100 * base / took:5.1f}% of local")  # fmt: skip
            for world in (1, 2, 4):
                before = gets(log, "shards/train")
                ctx = multiprocessing.get_context("forkserver")
                started = ctx.Barrier(world)
                with tempfile.TemporaryDirectory() as cache:
                    shares = [(remote, f"{cache}/c", world, r, started) for r in range(world)]
                    ranks = [ctx.Process(target=read_rank, args=a) for a in shares]
                    for p in ranks:
                        p.start()
                    for p in ranks:
                        p.join()
                time.sleep(0.5)  # the log's last lines
                got = gets(log, "shards/train") - before
                print(f"  {world} process(es) on one node: {got} shard GETs in an epoch of "
                      f"{shards} shards = {got / shards:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
