"""Checkpoints in object storage (project.engine.checkpoints.remote): `last` is published only
once every file of it is uploaded, a resume on another machine with an empty local folder
continues from the URL, a URL that cannot be used is one line at start. The quick tests use
fsspec's memory:// and file:// URLs; the end-to-end ones a real S3 server (moto)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import fsspec
import pytest
import torch

from project.engine.checkpoints.remote import RemoteLast, fetch_checkpoint, probe
from project.engine.distributed.exits import EXIT_PREEMPTED
from project.engine.errors import UserError
from tests.helpers import ROOT, SHORT_NO_TEST, finish, one_error_line, start


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
def test_ckpt_path_url_reads_what_the_manifest_publishes(url, tmp_path) -> None:
    save(RemoteLast(url, "last.ckpt", tmp_path / "a"), 7)
    path = fetch_checkpoint(f"{url}/last.ckpt", tmp_path / "b", "ckpt_path")
    assert torch.load(path, weights_only=True)["step"] == 7
    with pytest.raises(UserError, match=r"ckpt_path=.*/nothing.ckpt does not exist"):
        fetch_checkpoint(f"{url}/nothing.ckpt", tmp_path / "b", "ckpt_path")


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
