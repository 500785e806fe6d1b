"""Iterable data in shards (project.data.stream, project.data.shards): split across ranks and
DataLoader workers, every rank the same number of steps, exact mid-epoch resume, the language
model read back streaming (`data=chars_stream`), and broken shard folders refused in one line."""

from __future__ import annotations

import collections
import contextlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from project.data.prepare import prepare
from project.data.shards import load_shard, read_index
from project.data.source import SPLITS
from project.data.text import CharCorpus, read_corpus
from project.data.text_stream import CharStream
from project.engine.data.loaders import plain_loader
from project.engine.data.sharding import resume_at, set_epoch, shard_loader
from project.engine.distributed.exits import EXIT_PREEMPTED
from project.engine.errors import UserError
from project.engine.launch.torchrun import TRAINERS
from tests.helpers import (
    CHARLM,
    QUIET,
    assert_one_line_error,
    assert_same_training,  # feature:raw
    assert_same_weights,
    final_weights,
    finish,
    launcher,
    logged_metrics,
    run_script,
    run_trainer,
    s3_gets,
    s3_server,
    start,
    user_data,
)
from tests.user_data import ShardFiles

LENGTHS = (37, 61, 23)  # 121 samples in 3 shards of different lengths


def shard_files(folder: Path) -> Path:
    """3 .npy files of sample ids 0..120, of LENGTHS."""
    folder.mkdir(parents=True, exist_ok=True)
    start = 0
    for i, n in enumerate(LENGTHS):
        np.save(folder / f"part-{i}.npy", np.arange(start, start + n))
        start += n
    return folder


def ids(loader) -> list[list[int]]:
    """The loader's batches as lists of sample ids."""
    return [batch[0][:, -1].long().tolist() for batch in loader]


def loaders(
    folder: Path, record: Path, stage: str, world: int, workers: int, shuffle: bool
) -> list[DataLoader]:
    """Each rank's loader of a ShardFiles stream, as the machinery builds it."""
    out = []
    for rank in range(world):
        stream = ShardFiles(stage, str(folder), str(record))
        plain = plain_loader(stream, stage, batch_size=8, num_workers=workers, shuffle=shuffle)
        out.append(shard_loader(plain, stage, world, rank, seed=3))
    return out


def read_ids(record: Path) -> list[int]:
    """The sample ids the streams recorded reading (then forgotten)."""
    read = [
        int(line.split()[1])
        for f in record.glob("reads-*")
        for line in f.read_text().split("\n")
        if line
    ]
    for f in record.glob("reads-*"):
        f.unlink()
    return read


@pytest.mark.quick
@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_is_split_across_ranks_and_workers(tmp_path: Path, workers: int) -> None:
    """2 ranks x 2 workers over 3 uneven shards: validation reads every sample exactly once,
    training gives both ranks the same number of batches (the short rank wraps to the epoch's
    first samples), and the batches are the same whatever the number of workers."""
    folder, record = shard_files(tmp_path / "shards"), tmp_path / "record"
    record.mkdir()
    val = loaders(folder, record, "val", 2, workers, shuffle=False)
    val_batches = [ids(v) for v in val]
    assert collections.Counter(read_ids(record)) == collections.Counter(range(121))
    train = loaders(folder, record, "train", 2, workers, shuffle=True)
    per_rank = [ids(t) for t in train]
    assert len(per_rank[0]) == len(per_rank[1]) == len(train[0]) == len(train[1]) == 8
    seen = collections.Counter(read_ids(record))
    assert set(seen) == set(range(121)) and sum(seen.values()) == 122  # one sample twice
    sequential = [ids(t) for t in loaders(folder, record, "train", 2, 0, shuffle=True)]
    assert per_rank == sequential  # the same batches in the same order with any workers
    assert val_batches == [ids(v) for v in loaders(folder, record, "val", 2, 0, shuffle=False)]
    for t in train:
        set_epoch(t, 1)
    second = [ids(t) for t in train]
    assert second != per_rank  # a new order every epoch
    assert resume_at(train[1], 0, 3 * 8 * 2) and ids(train[1]) == per_rank[1][3:]
    set_epoch(train[1], 1)
    assert ids(train[1]) == second[1]  # the resume was for that epoch only


@pytest.mark.quick
def test_a_stream_keeping_its_workers_is_refused(tmp_path: Path) -> None:
    stream = ShardFiles("train", str(shard_files(tmp_path / "s")), str(tmp_path))
    plain = plain_loader(stream, "train", 8, num_workers=1, persistent_workers=True)
    with pytest.raises(UserError, match=r"set data\.persistent_workers=false"):
        shard_loader(plain, "train", 2, 0, 0)


@pytest.fixture(scope="module")
def chars_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default corpus prepared as shards of 200 windows of 32 characters."""
    out = tmp_path_factory.mktemp("chars") / "shards"
    prepare(None, out, block_size=32, per_shard=200, val_fraction=0.05, test_fraction=0.05)
    return out


@pytest.mark.quick
def test_prepared_shards_hold_the_windows_of_data_chars(chars_shards: Path) -> None:
    corpus, stream = CharCorpus(block_size=32), CharStream(str(chars_shards), block_size=32)
    for split in ("train", "test"):
        windows, streamed = corpus.dataset(split), stream.dataset(split)
        assert (
            len(streamed) == len(windows)
            and len(read_index(f"{chars_shards}/{split}")["shards"]) > 0
        )
        got = [x for x, _ in streamed]
        assert all(torch.equal(got[i], windows[i][0]) for i in range(len(windows)))


def broken(folder: Path, how: str) -> Path:
    """A copy of a prepared split, broken as `how` says."""
    import shutil

    target = folder.parent / f"broken-{how}"
    shutil.copytree(folder, target, dirs_exist_ok=True)
    train = target / "train"
    first = train / "shard-00000.npy"
    if how == "empty":
        for f in train.iterdir():
            f.unlink()
    elif how == "truncated":
        first.write_bytes(first.read_bytes()[:-100])
    elif how == "garbage":
        first.write_bytes(b"\x00" * first.stat().st_size)
    elif how == "missing":
        shutil.rmtree(train)
    return target


@pytest.mark.quick
@pytest.mark.parametrize(
    "how, needle",
    [
        ("missing", "does not exist: write it with python -m project.data.prepare"),
        ("empty", r"has no index\.json \(empty, or its writing was cut short\)"),
        ("truncated", r"shard-00000\.npy has \d+ bytes, the index says \d+: the folder"),
    ],
)
def test_a_broken_shard_folder_is_one_line(chars_shards: Path, how: str, needle: str) -> None:
    with pytest.raises(UserError, match=needle) as err:
        CharStream(str(broken(chars_shards, how)), block_size=32)
    assert "\n" not in str(err.value)


@pytest.mark.quick
def test_a_shard_of_garbage_is_one_line_when_read(chars_shards: Path) -> None:
    folder = f"{broken(chars_shards, 'garbage')}/train"
    entry = read_index(folder)["shards"][0]  # the size is right: only reading can tell
    corrupt = r"shard-00000\.npy cannot be read .* the folder is corrupt"
    with pytest.raises(UserError, match=corrupt):
        load_shard(folder, entry)


@pytest.mark.quick
def test_another_block_size_than_the_shards_is_one_line(chars_shards: Path) -> None:
    mismatch = r"windows of block_size=32 but data\.dataset\.block_size=64"
    with pytest.raises(UserError, match=mismatch):
        CharStream(str(chars_shards), block_size=64)


@pytest.mark.quick
def test_a_shard_cache_that_cannot_be_a_local_folder_is_one_line(
    chars_shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file where the cache would go used to stop the run with `FileExistsError(17, 'File
    exists')`, naming no path; a URL made a local folder named `gs:` in the working folder."""
    monkeypatch.chdir(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cases = [(str(blocker), f"cannot be made a folder (File exists: {blocker})"),
             (f"{blocker}/cache", "cannot be made a folder (Not a directory: "),
             ("gs://bucket/x", "is a URL, but the shards of a remote data.dataset.folder are "
                               "cached on each node's own disk: give a local folder")]  # fmt: skip
    for cache_dir, needle in cases:
        with pytest.raises(UserError) as err:
            CharStream(f"file://{chars_shards}", block_size=32, cache_dir=cache_dir)
        assert str(err.value).startswith(f"data.dataset.cache_dir={cache_dir} "), err.value
        assert needle in str(err.value), err.value
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.quick
def test_a_gs_shard_folder_without_gcsfs_is_the_pip_install_line(monkeypatch) -> None:
    """As for a checkpoint folder at gs:// (project.engine.checkpoints.remote), not fsspec's
    ImportError wrapped twice in Hydra's instantiation errors."""
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # not installed (an import fails)
    with pytest.raises(UserError) as err:
        CharStream("gs://bucket/x", block_size=32)
    line = str(err.value)  # fsspec's own words in the brackets
    assert line.startswith("the shard folder gs://bucket/x/train: fsspec cannot open gs:// URLs")
    assert line.endswith("): pip install gcsfs") and "\n" not in line, line


def test_a_shard_cache_on_a_file_stops_train_py_in_one_line(
    chars_shards: Path, tmp_path: Path, base_args
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    args = [*base_args, *stream_args(f"file://{chars_shards}"), f"data.dataset.cache_dir={blocker}"]
    proc = run_script("train.py", args)
    assert_one_line_error(proc, f"data.dataset.cache_dir={blocker} cannot be made a folder",
                          "give a local folder this user may write to")  # fmt: skip
    assert "Error in call to target" not in proc.stderr


def stream_args(folder: Path | str) -> list[str]:
    charlm = [a for a in CHARLM if not a.startswith("data.dataset.block_size")]
    return [*charlm, "data=chars_stream", f"data.dataset.folder={folder}",
            "data.dataset.block_size=32"]  # fmt: skip


def test_data_chars_stream_trains_like_data_chars_in_the_same_order(
    chars_shards: Path, base_args
) -> None:
    """One process, no shuffling: the streamed shards give the losses of the in-memory corpus
    (the same windows in the same order), with or without DataLoader workers."""
    same = [*base_args, "data.shuffle=false", "test=false", "trainer.max_epochs=1"]
    chars = run_script("train.py", [*same, *CHARLM])
    streamed = run_script("train.py", [*same, *stream_args(chars_shards), "data.num_workers=2"])
    assert chars.returncode == streamed.returncode == 0, streamed.stderr[-3000:]
    a, b = logged_metrics(chars.stdout, "val/"), logged_metrics(streamed.stdout, "val/")
    assert a == b and a


def test_a_shard_folder_url_trains_alike_and_its_cache_goes_with_the_run(
    chars_shards: Path, base_args, log_dir: Path
) -> None:
    """The same shards as a `file://` URL (the object-store path: shards are copied to the
    run folder's shard_cache/rank0/ when first read, by 2 DataLoader workers, over 2 epochs)
    give the losses of the local folder, and no copy is left in the run folder."""
    same = [*base_args, *stream_args(chars_shards), "data.num_workers=2", "trainer.max_epochs=2"]
    local = run_script("train.py", same, RUN_ID="local")
    cache = "++data.dataset.cache_dir=${paths.output_dir}/shard_cache"
    url = run_script("train.py", [*same, f"data.dataset.folder=file://{chars_shards}", cache],
                     RUN_ID="url")  # fmt: skip
    assert local.returncode == url.returncode == 0, url.stderr[-3000:]
    losses = [{k: v for k, v in logged_metrics(p.stdout, "").items() if "loss" in k}
              for p in (local, url)]  # fmt: skip
    assert losses[0] == losses[1] and "test/loss" in losses[0]
    assert not (log_dir / "train/runs/url/shard_cache").exists()


def test_a_missing_shard_folder_stops_train_py_in_one_line(tmp_path: Path, base_args) -> None:
    proc = run_script("train.py", [*base_args, *stream_args(tmp_path / "nowhere")])
    assert_one_line_error(proc, f"{tmp_path}/nowhere/train does not exist", "project.data.prepare")
    assert not (tmp_path / "nowhere").exists()


# --- distributed: 2 processes ----------------------------------------------------------------
@pytest.mark.distributed
def test_a_user_stream_over_uneven_shards_trains_on_2_ranks_x_2_workers(
    tmp_path: Path, base_args
) -> None:
    """A user's ShardedStream over 3 shard files of different lengths, 2 epochs: every sample
    is read each epoch, validation reads each exactly once, both ranks read the same number
    (the same steps: nobody waits in a collective for a rank that ran out), and it ends. The
    workers were forked by the fork server, not by their rank (project.engine.data.
    worker_start: a rank forked beside gloo's threads can leave its worker hung in os.fork)."""
    data = user_data(tmp_path, "StreamDataModule", folder=shard_files(tmp_path / "shards"))
    cmd = [*launcher(["-m", "project.train"]), *base_args, *data, "trainer.max_epochs=2",
           "trainer.num_sanity_val_steps=0", "test=false"]  # fmt: skip
    code, out = finish(start(cmd), timeout=180)
    assert code == 0, out[-3000:]
    reads = {r: [ln.split() for f in tmp_path.glob(f"reads-rank{r}-worker*.txt")
                 for ln in f.read_text().splitlines()] for r in (0, 1)}  # fmt: skip
    assert all(len(list(tmp_path.glob(f"reads-rank{r}-worker*.txt"))) == 2 for r in (0, 1))
    train = [collections.Counter(int(v) for s, v in reads[r] if s == "train") for r in (0, 1)]
    assert sum(train[0].values()) == sum(train[1].values()) == 2 * 61  # 61 a rank an epoch
    both = train[0] + train[1]
    assert set(both) == set(range(121)) and min(both.values()) >= 2  # every sample, each epoch
    val = collections.Counter(int(v) for r in (0, 1) for s, v in reads[r] if s == "val")
    assert val == collections.Counter({i: 2 for i in range(121)})  # once per validation
    parents = [f.read_text().split() for f in tmp_path.glob("parents-rank*-worker*.txt")]
    assert len(parents) == 4 and all(forked_by != rank for forked_by, rank in parents), parents


STREAM_2X2 = ["data.num_workers=2", "trainer.max_epochs=3", "step_stats=true"]


@pytest.fixture(scope="module")
def stream_runs(
    chars_shards: Path, data_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """module -> its run folder of STREAM_2X2 over chars_shards on 2 processes, trained once:
    the parity test reads both trainers' runs, the S3 test and the resume test Lightning's."""
    done: dict[str, Path] = {}

    def run(module: str) -> Path:
        if module not in done:
            root = tmp_path_factory.mktemp("stream")
            args = [f"paths.data_dir={data_dir}", f"paths.log_dir={root / 'logs'}", *QUIET,
                    *stream_args(chars_shards), *STREAM_2X2]  # fmt: skip
            run_trainer(module, args, root / "run", nproc=2)
            done[module] = root / "run"
        return done[module]

    return run


# feature:raw
@pytest.mark.distributed
def test_data_chars_stream_trains_bitwise_alike_in_both_trainers(stream_runs) -> None:
    """2 processes x 2 DataLoader workers, shuffled shards: the same loss at every step."""
    assert_same_training(stream_runs("project.train"), stream_runs("project.raw_train"))


@pytest.mark.slow
@pytest.mark.distributed
def test_a_stream_gets_its_epoch_without_any_callback(
    chars_shards: Path, base_args, tmp_path: Path
) -> None:
    """callbacks=none (no FaultTolerance, which once set a stream's epoch): both trainers still
    read a new order every epoch, so their losses stay bitwise alike over 3 epochs."""
    args = [*base_args, *stream_args(chars_shards), *STREAM_2X2, "callbacks=none"]
    losses = [run_trainer(module, args, tmp_path / name, nproc=2)["losses"]
              for name, module in TRAINERS.items()]  # fmt: skip
    assert len(losses[0]) >= 30 and losses[0] == losses[1]


# /feature:raw
@pytest.mark.distributed
def test_data_chars_stream_resumes_exactly_after_a_mid_epoch_preemption(
    chars_shards: Path, base_args, log_dir: Path, stream_runs
) -> None:
    """Each trainer stopped mid-epoch (2 processes x 2 DataLoader workers) and rerun ends with
    the weights of the uninterrupted run (Lightning's of stream_runs: the trainers end bitwise
    alike; neither the test stage nor early stopping, which never stops it, changes them): the
    stream's position is (epoch, batches done), nothing more, whatever the workers had read
    ahead."""
    args = [*base_args, *stream_args(chars_shards), *STREAM_2X2, "test=false",
            "callbacks.early_stopping=null"]  # fmt: skip
    whole = stream_runs("project.train")
    for module in TRAINERS.values():
        cut = [*args, "fault_injection.at_step=17", "fault_injection.mode=sigterm"]
        code, out = finish(start(launcher(["-m", module, *cut]), RUN_ID=module), 240)
        assert code == EXIT_PREEMPTED, out[-3000:]
        code, out = finish(start(launcher(["-m", module, *args]), RUN_ID=module), 240)
        assert code == 0 and "skipping" in out, out[-3000:]
        assert_same_weights(whole, log_dir / "train/runs" / module)


@pytest.mark.distributed
def test_a_stream_preempted_on_2_processes_continues_on_1_in_its_lanes(
    chars_shards: Path, base_args, log_dir: Path
) -> None:
    """Each trainer stopped mid-epoch on 2 processes (8 lanes) and continued on 1 (8 lanes,
    from the checkpoint): the same optimizer steps and the final weights of the run that never
    stopped (the same global batches: within float rounding of 2 ranks' averaged gradients;
    dropout off, as its masks are drawn per rank)."""
    args = [*base_args, *stream_args(chars_shards), "test=false", "callbacks.early_stopping=null",
            "callbacks.fault_tolerance.check_every_n_steps=1", "model.net.dropout=0.0"]  # fmt: skip
    code, out = finish(start(launcher(["-m", "project.train", *args]), RUN_ID="whole"), 240)
    assert code == 0, out[-3000:]
    runs = log_dir / "train" / "runs"
    for name, module in TRAINERS.items():
        cut = [*args, "fault_injection.at_step=9", "fault_injection.mode=sigterm"]
        code, out = finish(start(launcher(["-m", module, *cut]), RUN_ID=name), 240)
        assert code == EXIT_PREEMPTED, out[-3000:]
        code, out = finish(start([sys.executable, "-m", module, *args], RUN_ID=name), 240)
        assert code == 0 and "Resuming epoch 0" in out and "skipping" in out, out[-3000:]
        saved = [torch.load(next((runs / r / "checkpoints").glob("last.*t")), weights_only=True)
                 for r in ("whole", name)]  # fmt: skip
        assert saved[0]["global_step"] == saved[1]["global_step"] == 24
        assert saved[1]["data_position"]["lanes"] == [8]
        a, b = final_weights(runs / "whole"), final_weights(runs / name)
        for key in a:
            # AdamW carries the rounding of other groupings along (seen: 1e-5; with dropout's
            # per-rank masks: 3e-2)
            torch.testing.assert_close(a[key], b[key], atol=1e-4, rtol=1e-3)


def test_a_stream_resumed_on_a_world_size_its_lanes_do_not_admit_is_one_line(
    chars_shards: Path, base_args, log_dir: Path
) -> None:
    """Stopped on 1 process with data.lanes=3, continued on 2: one line naming the world sizes
    that work, exit 2 on every rank, the checkpoint untouched."""
    args = [*base_args, *stream_args(chars_shards), "test=false", "data.lanes=3",
            "trainer.max_epochs=1"]  # fmt: skip
    cut = [*args, "fault_injection.at_step=5", "fault_injection.mode=sigterm"]
    code, out = finish(start([sys.executable, "-m", "project.train", *cut], RUN_ID="one"), 240)
    assert code == EXIT_PREEMPTED, out[-3000:]
    last = log_dir / "train" / "runs" / "one" / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    code, out = finish(start(launcher(["-m", "project.train", *args]), RUN_ID="one"), 240)
    errors = [ln for ln in out.splitlines() if ln.startswith("error: ")]
    assert code == 2 and errors and "Traceback" not in out, out[-3000:]
    assert all(e.endswith("laid out in 3 lanes and 2 processes do not divide them: run on 1, 3 "
                          "process(es)") for e in errors), errors  # fmt: skip
    assert last.read_bytes() == before


# --- a remote folder on a real S3 server (moto: tests/conftest.py's `s3` fixture) -------------
def upload(folder: Path, url: str) -> str:
    """Copy a prepared shard folder to `url` (s3://bucket/prefix), index last; returns it."""
    import fsspec

    fs = fsspec.filesystem("s3")
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    for path in sorted(files, key=lambda p: p.name == "index.json"):
        fs.put_file(str(path), f"{url}/{path.relative_to(folder)}".removeprefix("s3://"))
    return url


@pytest.fixture(scope="module")
def few_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short corpus as shards of 50 windows of 32 characters: 12 train shards, a whole
    epoch in seconds."""
    root = tmp_path_factory.mktemp("few")
    corpus = root / "corpus.txt"
    corpus.write_bytes(read_corpus(None)[:20000])
    prepare(str(corpus), root / "shards", 32, 50, val_fraction=0.05, test_fraction=0.05)
    return root / "shards"


WHOLE_EPOCHS = ["trainer.limit_train_batches=1.0", "trainer.limit_val_batches=1.0",
                "trainer.limit_test_batches=1.0", "trainer.max_epochs=2"]  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_remote_folder_is_downloaded_once_per_node_whatever_the_ranks(
    few_shards: Path, s3: str, s3_log: Path, base_args, log_dir: Path, nproc: int
) -> None:
    """2 whole epochs from an S3 server on 1 and on 2 processes (x 2 DataLoader workers):
    every split's shards are each downloaded once (GETs = shards, 1.00x, not once per rank or
    per epoch), and the node's cache goes with the run."""
    url = upload(few_shards, f"{s3}/shards")
    args = [*base_args, *stream_args(url), *WHOLE_EPOCHS, "data.num_workers=2"]
    code, out = finish(start(launcher(["-m", "project.train", *args], nproc), RUN_ID="s3"), 240)
    assert code == 0, out[-3000:]
    for split in SPLITS:
        shards = len(read_index(f"{few_shards}/{split}")["shards"])
        assert s3_gets(s3_log, f"{url}/{split}") == shards, split
    assert not list(log_dir.rglob("shard_cache"))


# feature:raw
@pytest.mark.distributed
def test_data_chars_stream_from_s3_trains_like_the_local_folder_in_both_trainers(
    chars_shards: Path, s3: str, base_args, tmp_path: Path, stream_runs
) -> None:
    """2 processes x 2 DataLoader workers, shuffled, prefetching: the shards read from an S3
    server give the local folder's loss at every step, in both trainers."""
    url = upload(chars_shards, f"{s3}/chars")
    local = stream_runs("project.train") / "step_stats.json"
    losses = [json.loads(local.read_text())["losses"]]
    for name, module in TRAINERS.items():
        args = [*base_args, *stream_args(url), *STREAM_2X2]
        losses.append(run_trainer(module, args, tmp_path / name, nproc=2)["losses"])
    assert len(losses[0]) >= 30 and losses[0] == losses[1] == losses[2]


# /feature:raw
@pytest.mark.parametrize("how", ["credentials", "bucket", "shard"])
def test_a_remote_folder_that_cannot_be_read_is_one_line(
    few_shards: Path, s3: str, base_args, how: str
) -> None:
    """Bad credentials, a missing bucket, a missing shard: one line naming it, exit 2."""
    import fsspec

    url, env = f"{s3}/shards", dict[str, str]()
    if how == "shard":
        upload(few_shards, url)
        fsspec.filesystem("s3").rm_file(f"{url}/train/shard-00003.npy".removeprefix("s3://"))
        needles = [f"shard {url}/train/shard-00003.npy is missing, the index says"]
    elif how == "bucket":
        url = f"{s3}-missing/shards"
        needles = [f"the shard folder {url}/train does not exist"]
    else:
        needles = [f"the shard folder {url}/train cannot be read (PermissionError", "credentials"]
    with contextlib.ExitStack() as stack:
        if how == "credentials":  # a server that checks keys, and knows none
            env = stack.enter_context(s3_server(auth=True))
        proc = run_script("train.py", [*base_args, *stream_args(url)], timeout=120, **env)
    assert_one_line_error(proc, *needles)
