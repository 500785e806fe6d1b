"""Checkpoints in object storage (project.engine.checkpoints.remote): `last` is published only
once every file of it is uploaded, a resume on another machine with an empty local folder
continues from the URL, a URL that cannot be used is one line at start. The quick tests use
fsspec's memory:// and file:// URLs; the end-to-end ones a real S3 server (moto)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import fsspec
import pytest
import torch
from omegaconf import OmegaConf

from project.engine.checkpoints.remote import RemoteLast, download_folder, fetch_checkpoint, probe
from project.engine.checkpoints.resume import Resume, find_resume
from project.engine.checkpoints.sharded import names_save
from project.engine.distributed.exits import EXIT_PREEMPTED
from project.engine.errors import UserError
from project.engine.launch.torchrun import TRAINERS
from project.engine.run.skeleton import Run, checkpoint_to_test
from tests.helpers import (
    POWERSGD,
    QUIET,
    ROOT,
    SHORT_NO_TEST,
    exit_check_env,
    finish,
    launcher,
    logged_metrics,
    one_error_line,
    recorded_data,
    start,
)


def staged(folder: Path, step: int, *names: str) -> list[Path]:
    """Files of one save in a staging folder, each holding its step."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / name for name in names]
    for path in paths:
        torch.save({"step": step, "name": path.name}, path)
    return paths


def save(last: RemoteLast, step: int, names: tuple[str, ...] = ("last.ckpt",)) -> None:
    """One save as the trainers make it: stage, upload, then publish."""
    last.upload(staged(last.staging, step, *names))
    last.publish(step, list(names), writer=True)


@pytest.fixture
def url() -> str:
    """An empty memory:// folder of its own."""
    import uuid

    return f"memory://ckpt-{uuid.uuid4().hex[:8]}/run"


@pytest.mark.quick
def test_a_cut_upload_never_becomes_last(url, tmp_path) -> None:
    names = ("last.ckpt", "last.comm_hook.step5.rank0.pt", "last.comm_hook.step5.rank1.pt")
    writer = RemoteLast(url, "last.ckpt", tmp_path / "a")
    save(writer, 5, names)
    fs = fsspec.filesystem("memory")
    put = fs.put_file
    calls = []

    def cut(source: str, target: str, *args: object, **kwargs: object) -> None:
        calls.append(target)
        if len(calls) == 2:  # the second file of the next save: the pod dies here
            raise ConnectionError("connection reset")
        put(source, target, *args, **kwargs)

    fs.put_file = cut
    try:
        with pytest.raises(ConnectionError):
            writer.upload(staged(writer.staging, 9, *names))
    finally:
        del fs.put_file
    # Another machine, an empty staging folder: `last` is still step 5, whole.
    reader = RemoteLast(url, "last.ckpt", tmp_path / "b")
    assert reader.published_step() == 5
    fetched = reader.fetch([names[2]])
    assert torch.load(fetched, weights_only=True)["step"] == 5
    assert torch.load(fetched.parent / names[2], weights_only=True)["step"] == 5
    # Its next save reuses the unpublished generation's name (never the published one's).
    save(reader, 13, names)
    assert RemoteLast(url, "last.ckpt", tmp_path / "c").published_step() == 13
    folders = [p.rpartition("/")[2] for p in fs.ls(url.removeprefix("memory://"), detail=False)]
    assert sorted(folders) == ["last.ckpt.g000002", "last.ckpt.json"], folders


@pytest.mark.quick
def test_the_manifest_is_written_after_every_file(url, tmp_path) -> None:
    """Until the manifest names a generation its files are not `last`, even when all are up."""
    last = RemoteLast(url, "last.pt", tmp_path / "a")
    last.upload(staged(last.staging, 3, "last.pt"))
    assert RemoteLast(url, "last.pt", tmp_path / "b").fetch([]) is None
    last.publish(3, ["last.pt"], writer=True)
    fetched = RemoteLast(url, "last.pt", tmp_path / "c").fetch([])
    assert fetched is not None and torch.load(fetched, weights_only=True)["step"] == 3


@pytest.mark.quick
def test_a_staged_save_that_was_not_published_is_never_resumed(url, tmp_path) -> None:
    """A node fetched `last`, then began a save that was cut before it was published: the
    restart on that node downloads the published `last` again, not the staged file."""
    save(RemoteLast(url, "last.ckpt", tmp_path / "a"), 5)
    node = RemoteLast(url, "last.ckpt", tmp_path / "node")
    node.fetch([])
    node.forget_fetched()  # RunCheckpoints.save_hook: the first thing of every save
    staged(node.staging, 9, "last.ckpt")  # the save's local write; its upload never happens
    fetched = RemoteLast(url, "last.ckpt", tmp_path / "node").fetch([])
    assert torch.load(fetched, weights_only=True)["step"] == 5


@pytest.mark.quick
def test_ckpt_path_url_reads_what_the_manifest_publishes(url, tmp_path) -> None:
    save(RemoteLast(url, "last.ckpt", tmp_path / "a"), 7)
    path = fetch_checkpoint(f"{url}/last.ckpt", tmp_path / "b", "ckpt_path")
    assert torch.load(path, weights_only=True)["step"] == 7
    with pytest.raises(UserError, match=r"ckpt_path=.*/nothing.ckpt does not exist"):
        fetch_checkpoint(f"{url}/nothing.ckpt", tmp_path / "b", "ckpt_path")


@pytest.mark.quick
def test_a_save_folder_at_a_url_is_copied_whole_or_refused_in_one_line(url, tmp_path) -> None:
    """A sharded save at a URL read on one process (whole.gathered) is copied first: its files
    land in the target itself; a folder that is gone is one line, not DCP's traceback."""
    fs = fsspec.filesystem("memory")
    fs.pipe(f"{url}/save/.metadata", b"index")
    fs.pipe(f"{url}/save/__0_0.distcp", b"shards")
    download_folder(f"{url}/save", tmp_path / "copy")
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == [".metadata", "__0_0.distcp"]
    with pytest.raises(UserError, match=r"/gone holds no files \(removed meanwhile\?\)"):
        download_folder(f"{url}/gone", tmp_path / "none")


@pytest.mark.quick
def test_a_sharded_save_as_a_ckpt_path_url_is_one_line(url, tmp_path) -> None:
    """strategy=fsdp's `last` in a store: its folder, its manifest or the `last` the manifest
    publishes given as ckpt_path (train.py, eval.py) says to copy it here (it used to say
    the file does not exist); a one-file `last` published beside it still downloads."""
    fs = fsspec.filesystem("memory")
    fs.pipe(f"{url}/last-ckpt-step4/.metadata", b"index")
    fs.pipe(f"{url}/last-ckpt.json", json.dumps({"format": "dcp", "step": 4,
            "folder": "last-ckpt-step4", "world": 2}).encode())  # fmt: skip
    for name in ("last-ckpt-step4", "last-ckpt-step4/", "last-ckpt.json", "last-ckpt"):
        with pytest.raises(UserError, match=r"is a sharded save .*copy the save folder here"):
            find_resume({"ckpt_path": f"{url}/{name}"}, None, "state_dict", staging=tmp_path)
    save(RemoteLast(url, "last.ckpt", tmp_path / "a"), 7)
    assert not names_save(f"{url}/last.ckpt")
    path = fetch_checkpoint(f"{url}/last.ckpt", tmp_path / "b", "ckpt_path")
    assert torch.load(path, weights_only=True)["step"] == 7


@pytest.mark.quick
def test_the_probe_refuses_a_folder_it_cannot_write(tmp_path) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(UserError, match="is not writable"):
        probe(f"file://{tmp_path}/a-file/ckpt", "callbacks.fault_tolerance.dirpath")
    probe(f"file://{tmp_path}/ckpt", "callbacks.fault_tolerance.dirpath")  # writable: silent


@pytest.mark.quick
@pytest.mark.parametrize(
    "module, url, needles",
    [
        ("project.train", "gs://bkt/ckpt/r1", ["pip install gcsfs", "gs://"]),
        ("project.raw_train", "az://bkt/ckpt/r1", ["pip install adlfs"]),  # feature:raw
        ("project.train", "nosuch://bkt/ckpt", ["Protocol not known: nosuch"]),
    ],
)
def test_a_url_fsspec_cannot_open_is_one_line_and_no_local_folder(
    base_args, tmp_path, module, url, needles
) -> None:
    """It once wrote into a local folder named `s3:` and exited 0."""
    cmd = [sys.executable, "-m", module, *base_args, *SHORT_NO_TEST,
           f"callbacks.fault_tolerance.dirpath={url}",
           f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    code, out = finish(start(cmd), 120)
    assert code == 2, out[-3000:]
    line = one_error_line(out)
    assert "callbacks.fault_tolerance.dirpath" in line
    for needle in needles:
        assert needle in line, line
    scheme = url.split("://")[0] + ":"
    assert not (ROOT / scheme).exists() and not (tmp_path / "run" / scheme).exists()
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_checkpoints_go_to_a_url_folder_and_resume_from_it_elsewhere(base_args, tmp_path) -> None:
    """A file:// URL folder: `last` is published there (nothing beside it but the manifest
    and its generation); the run stopped, the same command in an empty run folder continues
    from it."""
    remote = tmp_path / "remote"
    args = [*base_args, "model=cnn", "test=false", "trainer.max_epochs=2",
            "trainer.limit_train_batches=4", "trainer.limit_val_batches=2",
            "callbacks.fault_tolerance.check_every_n_steps=1",
            f"callbacks.fault_tolerance.dirpath=file://{remote}"]  # fmt: skip
    cut = [*args, "fault_injection.at_step=5", "fault_injection.mode=sigterm"]
    first = [*cut, f"hydra.run.dir={tmp_path / 'one'}"]
    code, out = finish(start([sys.executable, "-m", "project.train", *first]), 180)
    assert code == EXIT_PREEMPTED, out[-3000:]
    assert f"Stopped by a signal at step 5; file://{remote}/last.ckpt is saved" in out
    manifest = json.loads((remote / "last.ckpt.json").read_text())
    assert manifest == {"generation": manifest["generation"], "step": 5, "files": ["last.ckpt"]}
    assert sorted(os.listdir(remote)) == [f"last.ckpt.g{manifest['generation']:06d}",
                                          "last.ckpt.json"]  # fmt: skip
    assert not (tmp_path / "one" / "checkpoints" / "last.ckpt").exists()  # only the best
    second = [*args, f"hydra.run.dir={tmp_path / 'two'}"]
    code, out = finish(start([sys.executable, "-m", "project.train", *second]), 180)
    assert code == 0, out[-3000:]
    assert f"Fetched file://{remote}/last.ckpt (step 5)" in out
    assert f"Saved file://{remote}/last.ckpt at step 8" in out
    # A new run from its weights, by URL: the manifest's `last` (step 8), one more epoch.
    third = [*base_args, "model=cnn", "test=false", "trainer.max_epochs=3",
             "trainer.limit_train_batches=4", "trainer.limit_val_batches=2",
             f"ckpt_path=file://{remote}/last.ckpt",
             f"hydra.run.dir={tmp_path / 'three'}"]  # fmt: skip
    code, out = finish(start([sys.executable, "-m", "project.train", *third]), 180)
    assert code == 0, out[-3000:]
    staged = tmp_path / "three" / "checkpoint_staging" / "ckpt_path" / "last.ckpt"
    assert torch.load(staged, weights_only=True)["global_step"] == 8
    last = torch.load(tmp_path / "three" / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 12


# --- end to end on a real S3 server (moto): preempted here, continued on another machine ----
BOTH = tuple(TRAINERS.values())  # every trainer's module
ROWS = 480  # rows that 1 and 2 processes share out in whole global batches (test_world_size)


def published(url: str, name: str, folder: Path) -> dict:
    """The checkpoint a URL folder publishes as `last`, downloaded into `folder`."""
    path = RemoteLast(url, name, folder).fetch([])
    assert path is not None, f"nothing published at {url}"
    return torch.load(path, weights_only=True)


def weights(ckpt: dict) -> dict[str, torch.Tensor]:
    """The network's weights of either trainer's checkpoint, keyed alike."""
    if "model" in ckpt:
        return ckpt["model"]
    return {k.removeprefix("task."): v for k, v in ckpt["state_dict"].items()
            if k.startswith("task.")}  # fmt: skip


def job(module: str, nproc: int, args: list[str], run: str, tag: str = "") -> tuple[int, str]:
    """`module` on `nproc` processes (the launchers' torchrun) with run id `run`."""
    cmd = launcher(["-m", module, *args], nproc) if nproc > 1 else [sys.executable, "-m", module,
                                                                     *args]  # fmt: skip
    env = {"RUN_ID": run, **({"RECORD_TAG": tag} if tag else {})}
    return finish(start(cmd, **(exit_check_env() if nproc > 1 else {}), **env), 300)


@pytest.mark.distributed
@pytest.mark.parametrize("module", BOTH)
def test_preempted_on_two_processes_continued_on_one_elsewhere_from_s3(
    tmp_path: Path, s3: str, module: str
) -> None:
    """Stopped mid-epoch on 2 processes whose checkpoints go to S3, continued on 1 process in
    another, empty run folder (another machine): it finds `last` at the URL and ends at the
    step and with the weights of the run that never stopped (within the world-size change's
    tolerance, tests/test_world_size.py). Nothing of `last` stays in the local folders but the
    staging copies."""
    log_dir = tmp_path / "logs"
    args = [f"paths.log_dir={log_dir}", *QUIET, *recorded_data(tmp_path, ROWS),
            "data.batch_size=20", "trainer.max_epochs=2", "test=false",
            "callbacks.early_stopping=null", "trainer.num_sanity_val_steps=0",
            "callbacks.fault_tolerance.check_every_n_steps=1"]  # fmt: skip
    url, name = f"{s3}/ckpt/r1", "last.pt" if module == "project.raw_train" else "last.ckpt"
    code, out = job(module, 2, args, "whole")
    assert code == 0, out[-3000:]
    remote = [*args, f"callbacks.fault_tolerance.dirpath={url}"]
    cut = [*remote, "fault_injection.at_step=4", "fault_injection.mode=sigterm"]
    code, out = job(module, 2, cut, "one")
    assert code == EXIT_PREEMPTED, out[-3000:]
    assert f"{url}/{name} is saved. Resume with: " in out, out[-3000:]
    runs = log_dir / "train" / "runs"
    assert not (runs / "one" / "checkpoints" / name).exists()
    stopped = published(url, name, tmp_path / "check-stop")["global_step"]
    code, out = job(module, 1, remote, "two")  # another machine: an empty run folder
    assert code == 0, out[-3000:]
    assert f"Fetched {url}/{name} (step {stopped})" in out and "Resuming epoch 0" in out
    whole = torch.load(runs / "whole" / "checkpoints" / name, weights_only=True)
    last = published(url, name, tmp_path / "check-end")
    assert last["global_step"] == whole["global_step"] > stopped
    a, b = weights(last), weights(whole)
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=1e-5)
    fs = fsspec.filesystem("s3")
    assert sorted(p.rpartition("/")[2] for p in fs.ls(url, refresh=True)) == [
        f"{name}.g{json.loads(fs.cat_file(f'{url}/{name}.json'))['generation']:06d}",
        f"{name}.json",
    ]


@pytest.mark.distributed
def test_powersgd_state_goes_through_s3_in_both_trainers(
    base_args, tmp_path: Path, s3: str, powersgd_whole: Path
) -> None:
    """Every rank uploads its own PowerSGD state; the manifest lists them all, and a run in
    another empty folder fetches its rank's file and ends bitwise where the uninterrupted
    run does (tests/test_comm_hooks.py's preemption test, across machines)."""
    args = [*base_args, *POWERSGD]
    whole = torch.load(powersgd_whole / "checkpoints/last.ckpt", weights_only=True)
    for module in BOTH:
        url = f"{s3}/{module}"
        name = "last.pt" if module == "project.raw_train" else "last.ckpt"
        remote = [*args, f"callbacks.fault_tolerance.dirpath={url}"]
        stop = [*remote, "fault_injection.at_step=25", "fault_injection.mode=sigterm"]
        code, out = job(module, 2, stop, f"{module}-one")
        assert code == EXIT_PREEMPTED, out[-3000:]
        manifest = json.loads(fsspec.filesystem("s3").cat_file(f"{url}/{name}.json"))
        stem = name.split(".")[0]
        assert manifest["files"] == [name, f"{stem}.comm_hook.step29.rank0.pt",
                                     f"{stem}.comm_hook.step29.rank1.pt"]  # fmt: skip
        code, out = job(module, 2, remote, f"{module}-two")  # both ranks on a new machine
        assert code == 0, out[-3000:]
        a, b = weights(published(url, name, tmp_path / module)), weights(whole)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_eval_reads_a_checkpoint_from_s3(base_args, tmp_path: Path, s3: str) -> None:
    """eval.py ckpt_path=s3://.../last.ckpt: the run's published `last`, tested."""
    url = f"{s3}/ckpt"
    train = [*base_args, *SHORT_NO_TEST, "trainer.max_epochs=1", "trainer.limit_train_batches=4",
             f"callbacks.fault_tolerance.dirpath={url}",
             f"hydra.run.dir={tmp_path / 'train'}"]  # fmt: skip
    code, out = finish(start([sys.executable, "-m", "project.train", *train]), 180)
    assert code == 0, out[-3000:]
    evaluate = [*base_args, f"ckpt_path={url}/last.ckpt", "trainer.limit_test_batches=2",
                f"hydra.run.dir={tmp_path / 'eval'}"]  # fmt: skip
    code, out = finish(start([sys.executable, "-m", "project.eval", *evaluate]), 180)
    assert code == 0, out[-3000:]
    assert "test/loss" in logged_metrics(out)
    assert (tmp_path / "eval" / "checkpoint_staging" / "last.ckpt").is_file()
    code, out = finish(start([sys.executable, "-m", "project.eval", *evaluate[:1],
                              f"ckpt_path={s3}/nothing/last.ckpt"]), 120)  # fmt: skip
    assert code == 2 and "does not exist" in one_error_line(out), out[-3000:]


def test_a_missing_bucket_is_one_line_at_start(base_args, tmp_path: Path, s3: str) -> None:
    cmd = [sys.executable, "-m", "project.train", *base_args, *SHORT_NO_TEST,
           "callbacks.fault_tolerance.dirpath=s3://no-such-bucket-here/ckpt"]  # fmt: skip
    code, out = finish(start(cmd), 120)
    assert code == 2, out[-3000:]
    assert "bucket 'no-such-bucket-here' does not exist" in one_error_line(out)


# --- best checkpoints at a URL (callbacks.model_checkpoint.dirpath=s3://...) -----------------
# Two short epochs. `mode=max`: the best is the first epoch's weights (the val loss falls), not
# the ones in memory at the end, so a test of those in its place shows.
BEST = ["trainer.max_epochs=2", "trainer.limit_train_batches=4", "trainer.limit_val_batches=2",
        "callbacks.early_stopping=null", "callbacks.model_checkpoint.mode=max"]  # fmt: skip


@pytest.mark.quick
def test_a_best_checkpoint_at_a_url_is_tested_from_a_fetched_copy(url, tmp_path) -> None:
    """test_ckpt=best with the best at a URL: downloaded into the staging folder and tested
    from there, also by a finished run that is only tested (its best read from its `last`);
    none at the URL falls back to the weights in memory, as a missing local best does."""
    fsspec.filesystem("memory").pipe_file(f"{url}/epoch_001.ckpt", b"best")
    cfg = OmegaConf.create({"train": True, "test_ckpt": "best"})
    fresh, finished = Resume(), Resume(tmp_path / "last.ckpt", finished=True)
    runs = [Run(cfg, tmp_path, None, resume, SimpleNamespace(last=None))  # type: ignore[arg-type]
            for resume in (fresh, finished)]  # fmt: skip
    for run in runs:
        chosen = checkpoint_to_test(run, f"{url}/epoch_001.ckpt")
        assert chosen == tmp_path / "checkpoint_staging" / "best" / "epoch_001.ckpt"
        assert chosen.read_bytes() == b"best"
    assert checkpoint_to_test(runs[0], f"{url}/epoch_009.ckpt") is None


def best_of_run(out: str, url: str, run_dir: Path) -> tuple[str, float]:
    """A run whose best checkpoints go to `url` tested its best: the URL holds it (one file,
    nothing in a local folder named `s3:`), the run downloaded it into its staging folder and
    tested that copy. Returns its name and the run's test/loss."""
    fs = fsspec.filesystem("s3")
    (name,) = [p.rpartition("/")[2] for p in fs.ls(url, refresh=True)]
    assert not (ROOT / "s3:").exists() and not (run_dir / "s3:").exists()
    assert f"Fetched {url}/{name} into " in out, out[-3000:]
    assert "Testing the current weights" not in out
    staged = run_dir / "checkpoint_staging" / "best" / name
    assert staged.read_bytes() == fs.cat_file(f"{url}/{name}")
    return name, json.loads((run_dir / "metrics.json").read_text())["test/loss"]


def eval_loss(base_args: list[str], ckpt: str, run_dir: Path) -> float:
    """The test/loss eval.py gives the checkpoint `ckpt` (a URL), on one process."""
    cmd = [sys.executable, "-m", "project.eval", *base_args, f"ckpt_path={ckpt}",
           f"hydra.run.dir={run_dir}"]  # fmt: skip
    code, out = finish(start(cmd), 180)
    assert code == 0, out[-3000:]
    return logged_metrics(out)["test/loss"]  # printed to 5 significant digits


def test_the_best_checkpoint_at_a_url_is_the_one_tested_in_both_trainers(
    base_args, tmp_path: Path, s3: str
) -> None:
    """callbacks.model_checkpoint.dirpath=s3://... on one process: each trainer writes its
    best to the bucket, and test_ckpt=best (the default) tests that checkpoint, fetched. The
    test/loss is the one eval.py gives it (the raw trainer's: Lightning's, the two train
    alike), not that of the weights in memory."""
    tested = {}
    for module in BOTH:
        url, run_dir = f"{s3}/{module}", tmp_path / module
        cmd = [sys.executable, "-m", module, *base_args, *BEST,
               f"callbacks.model_checkpoint.dirpath={url}", f"hydra.run.dir={run_dir}"]  # fmt: skip
        code, out = finish(start(cmd), 180)
        assert code == 0, out[-3000:]
        tested[module] = best_of_run(out, url, run_dir)
    name, loss = tested["project.train"]
    assert name == "epoch_000.ckpt" and tested["project.raw_train"][0] == "best.pt"
    assert loss == pytest.approx(tested["project.raw_train"][1], abs=1e-6)
    evaluated = eval_loss(base_args, f"{s3}/project.train/{name}", tmp_path / "eval")
    assert loss == pytest.approx(evaluated, rel=1e-4)


@pytest.mark.distributed
def test_the_best_checkpoint_at_a_url_under_fsdp_is_written_there_and_tested(
    base_args, log_dir: Path, tmp_path: Path, s3: str
) -> None:
    """strategy=fsdp on 2 processes: the best checkpoint (one file, the whole state gathered)
    goes to the URL, never to a local folder named `s3:`, and is the one tested (eval.py
    gives it the same test/loss on one process)."""
    url = f"{s3}/best"
    args = [*base_args, *BEST, "strategy=fsdp", f"callbacks.model_checkpoint.dirpath={url}"]
    code, out = job("project.train", 2, args, "fsdp")
    assert not (ROOT / "s3:" / url.removeprefix("s3://")).exists(), "written to a local folder"
    assert code == 0, out[-3000:]
    name, loss = best_of_run(out, url, log_dir / "train" / "runs" / "fsdp")
    assert name == "epoch_000.ckpt"
    assert loss == pytest.approx(eval_loss(base_args, f"{url}/{name}", tmp_path / "eval"), rel=1e-4)
