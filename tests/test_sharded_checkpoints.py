"""Sharded checkpoints of FSDP2 models (project.engine.checkpoints.sharded) and their
consolidation into one file (project.consolidate), with real torchrun jobs (gloo, CPU) of
tests/fsdp_mlp.py: 8 steps of an MLP sharded per block, `last` every 2 steps."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from project.engine.distributed.exits import EXIT_TEMPFAIL
from tests.helpers import (
    ROOT,
    assert_same_tensors,
    assert_same_tree,
    exit_check_env,
    finish,
    fsdp_mlp,
    launcher,
    logged_metrics,
    one_error_line,
    run_script,
    start,
    torchrun,
)

pytestmark = pytest.mark.xdist_group("sharded")  # the module's runs: built once

DROPOUT = ["--dropout", "0.1"]  # each rank's RNG stream must be restored for a bitwise resume


# --- no processes: bad input (the quick tier) ---------------------------------------------------
@pytest.mark.quick
def test_what_is_no_published_sharded_checkpoint_is_one_line(tmp_path: Path) -> None:
    from project.engine.checkpoints.sharded import resolve
    from project.engine.errors import UserError

    manifest = tmp_path / "last.json"
    cases = [
        (None, "is not a sharded checkpoint (no .metadata and common.pt inside"),
        ("{not json", "the manifest " + str(manifest) + " cannot be read (JSONDecodeError"),
        ('{"step": 4}', "is not a manifest of sharded checkpoints (it lacks ['folder', 'format'"),
        ('{"format": "zip", "step": 4, "folder": "x", "world": 2}', "publishes a 'zip' checkpoint"),
        ('{"format": "dcp", "step": 4, "folder": "last-step4", "world": 2}',
         "publishes last-step4, which is missing or incomplete"),
    ]  # fmt: skip
    for text, needle in cases:
        if text is not None:
            manifest.write_text(text)
        with pytest.raises(UserError) as err:
            resolve(tmp_path / "last", "ckpt_path")
        assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.quick
def test_consolidate_refuses_bad_input_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from project.consolidate import main

    (tmp_path / "taken.pt").write_bytes(b"")
    cases = [
        ([str(tmp_path / "nothing"), str(tmp_path / "o.pt")], "is not a sharded checkpoint"),
        ([str(tmp_path), str(tmp_path / "taken.pt")], "taken.pt exists: give a new file name"),
        (["s3://bucket/run/last", str(tmp_path / "o.pt")], "is a URL: copy the save folder"),
        ([str(tmp_path), str(tmp_path / "no" / "o.pt")], "is not a folder: create it first"),
    ]
    for argv, needle in cases:
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and err.startswith("error: "), err
        assert needle in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken.pt"]  # nothing written


@pytest.mark.quick
def test_consolidate_names_the_sharded_last_that_exists(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The docs and --help said `<folder>/last`; Lightning's sharded last is `last-ckpt` (the
    raw trainer's `last-pt`): what they document now, and a `last` that nothing publishes is
    refused with the name its folder's manifest publishes."""
    import re

    from project.consolidate import main

    manifest = {"format": "dcp", "step": 4, "folder": "last-ckpt-step4", "world": 2}
    (tmp_path / "last-ckpt.json").write_text(json.dumps(manifest))
    assert main([str(tmp_path / "last"), str(tmp_path / "o.pt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"publishes last-ckpt: CKPT={tmp_path}/last-ckpt" in err, err
    with pytest.raises(SystemExit):
        main(["--help"])
    usage = capsys.readouterr().out
    assert "<run>/checkpoints/last-ckpt" in usage and "/last\n" not in usage, usage
    page = (ROOT / "docs" / "fault-tolerance.md").read_text()
    documented = re.findall(r"-m \w+\.consolidate (\S+)", page)  # the package's name
    assert documented and all(c.endswith("/last-ckpt") for c in documented), documented


# --- torchrun jobs (the full tier) ---------------------------------------------------------------
@pytest.mark.quick
def test_one_process_without_a_group_saves_and_loads_quietly(tmp_path: Path) -> None:
    """A run continued on one process (no process group) keeps its `last` sharded: an async
    save asked for is written at once (DCP's async save needs a group), nothing is warned,
    and the save loads back bitwise, with what it holds beside the weights."""
    import warnings

    from project.engine.checkpoints.sharded import ShardedLast, load

    torch.manual_seed(0)
    net = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(net.parameters())
    net(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        last = ShardedLast(tmp_path, "last", "test")
        last.save(1, net, optimizer, {"epoch": 3}, {"rng": None}, asynchronous=True)
        assert last.pending is None and last.manifest()["step"] == 1
        last.close()
        copy = torch.nn.Linear(4, 4)
        copy_optimizer = torch.optim.AdamW(copy.parameters())
        loaded = load(str(tmp_path / "last"), copy, copy_optimizer)
    assert loaded.common == {"epoch": 3} and loaded.own and loaded.world == 1
    assert_same_tensors(net.state_dict(), copy.state_dict())
    assert_same_tree(optimizer.state_dict(), copy_optimizer.state_dict())


@pytest.mark.quick
def test_a_save_whose_shards_cannot_be_written_is_one_line_and_last_stays(tmp_path: Path) -> None:
    """DCP's failures are CheckpointException, a BaseException that `except Exception` let
    through: ~400 lines, the agreement ("`last` stays step N") skipped. A save cut partway
    (its small files written, its shards not) is one line naming DCP's error; the previous
    `last` stays published and loads; closing after it lets the group go."""
    from project.engine.checkpoints.sharded import ShardedLast, load, resolve
    from project.engine.distributed.exits import TemporaryFailure

    class Blocked(ShardedLast):
        def write_own(self, folder: str, per_rank: dict, step: int) -> None:
            super().write_own(folder, per_rank, step)
            if step == 2:  # a folder where DCP writes this rank's shards: its write fails
                (Path(folder) / f"__{self.rank}_0.distcp").mkdir()

    net = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(net.parameters())
    last = Blocked(tmp_path, "last", "test")
    last.save(1, net, optimizer, {"epoch": 1}, {})
    with pytest.raises(TemporaryFailure) as err:  # one line, exit 75: a restart may pass
        last.save(2, net, optimizer, {"epoch": 2}, {})
    line = str(err.value)
    assert line.startswith("rank 0 could not save step 2 (rank 0: IsADirectoryError: "), line
    assert line.endswith("; `last` stays step 1") and "\n" not in line, line
    assert resolve(tmp_path / "last", "ckpt_path") == str(tmp_path / "last-step1")
    last.close()
    assert last.group is None and last.pending is None
    assert load(str(tmp_path / "last"), net, optimizer).common == {"epoch": 1}


@pytest.mark.quick
def test_a_consolidated_optimizer_starts_its_schedule_afresh() -> None:
    from project.engine.checkpoints.whole import numbered

    # After 6 of 10 cosine epochs the saved groups hold a decayed lr: a run built on the file
    # must begin at the schedule's start (its new scheduler scales whatever lr it is given).
    net = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    for _ in range(6):
        opt.step()
        sched.step()
    saved = opt.state_dict()["param_groups"][0]
    assert saved["lr"] < 5e-4
    named = {"state": {}, "param_groups": [{**saved, "params": ["weight", "bias"]}]}
    fresh = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1e-3)
    restarted = torch.optim.lr_scheduler.CosineAnnealingLR(fresh, T_max=10)
    fresh.load_state_dict(numbered(named))  # Lightning's order: scheduler built, then loaded
    assert fresh.param_groups[0]["lr"] == 1e-3
    fresh.step()
    restarted.step()
    assert fresh.param_groups[0]["lr"] == pytest.approx(1e-3 * (1 + math.cos(math.pi / 10)) / 2)


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Uninterrupted runs, synchronous saves: with dropout (2 processes) and without."""
    folder = tmp_path_factory.mktemp("whole")
    runs = {}
    for name, args in (("dropout", DROPOUT), ("plain", [])):
        fsdp_mlp(folder / name, *args, "--out", str(folder / f"{name}.pt"))
        runs[name] = folder / name
    return runs


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def published(folder: Path) -> dict:
    return json.loads((folder / "last.json").read_text())


@pytest.mark.distributed
def test_resume_on_the_same_world_size_is_bitwise(whole: dict[str, Path], tmp_path: Path) -> None:
    """Rank 1 of the resumed run sees no manifest (a stale view of the folder): every rank
    acts on rank 0's view, so both load step 4 and save beside it alike."""
    fsdp_mlp(tmp_path / "ckpt", *DROPOUT, "--exit-at", "5")
    assert published(tmp_path / "ckpt")["step"] == 4
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["last-step4", "last.json"]
    _, out = fsdp_mlp(tmp_path / "ckpt", *DROPOUT, "--stale-rank", "1",
                      "--out", str(tmp_path / "resumed.pt"))  # fmt: skip
    assert out.count("resumed at step 4 saved by 2 (own True)") == 2, out[-3000:]
    assert_same_tensors(
        weights(whole["dropout"].with_suffix(".pt")), weights(tmp_path / "resumed.pt")
    )


@pytest.mark.distributed
def test_resume_on_one_process_reshards(whole: dict[str, Path], tmp_path: Path) -> None:
    """2 processes save, 1 loads: DCP reshards; the same samples, reduced in another order."""
    fsdp_mlp(tmp_path / "ckpt", "--exit-at", "4")
    _, out = fsdp_mlp(tmp_path / "ckpt", "--out", str(tmp_path / "one.pt"), nproc=1)
    assert "resumed at step 4 saved by 2 (own False)" in out, out[-3000:]
    worst = assert_same_tensors(weights(whole["plain"].with_suffix(".pt")),
                                weights(tmp_path / "one.pt"), atol=1e-6)  # fmt: skip
    print(f"largest difference after a 2 -> 1 resume: {worst:.2e}")


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["sigkill", "exception"])
def test_a_save_cut_midway_never_becomes_last(
    whole: dict[str, Path], tmp_path: Path, mode: str
) -> None:
    """Rank 1 dies (or fails) in the save of step 6, writing its own file: `last` stays
    step 4, which the next run resumes from, ending bitwise as the uninterrupted run."""
    folder = tmp_path / "ckpt"
    code, out = fsdp_mlp(folder, *DROPOUT, "--fail-at", "6", "--fail-mode", mode, ok=False)
    assert code != 0, out[-3000:]
    assert published(folder) == {"format": "dcp", "step": 4, "folder": "last-step4",
                                 "world": 2, "trainer": "test"}  # fmt: skip
    assert (folder / "last-step4").is_dir() and (folder / "last-step6").is_dir()  # the leftover
    if mode == "exception":  # every rank stops with the failing rank's line
        assert out.count("rank 1 could not save step 6 (OSError: injected failure); `last` "
                         "stays step 4") >= 2, out[-3000:]  # fmt: skip
    _, out = fsdp_mlp(folder, *DROPOUT, "--out", str(tmp_path / "resumed.pt"))
    assert "resumed at step 4" in out
    assert sorted(p.name for p in folder.iterdir()) == ["last-step8", "last.json"]  # tidied
    assert_same_tensors(
        weights(whole["dropout"].with_suffix(".pt")), weights(tmp_path / "resumed.pt")
    )


@pytest.mark.distributed
def test_async_saves_give_the_sync_result(whole: dict[str, Path], tmp_path: Path) -> None:
    """Interrupted at step 7: the async save of step 6 was written while step 7 trained
    (DCP staged a copy), and published at the end; the resume ends as the sync run."""
    fsdp_mlp(tmp_path / "ckpt", *DROPOUT, "--async", "--exit-at", "7")
    assert published(tmp_path / "ckpt")["step"] == 6
    _, out = fsdp_mlp(tmp_path / "ckpt", *DROPOUT, "--async", "--out", str(tmp_path / "a.pt"))
    assert "resumed at step 6" in out
    assert_same_tensors(weights(whole["dropout"].with_suffix(".pt")), weights(tmp_path / "a.pt"))


@pytest.mark.distributed
def test_consolidate_gives_one_weights_only_file(whole: dict[str, Path], tmp_path: Path) -> None:
    from project.consolidate import main

    full = weights(whole["plain"].with_suffix(".pt"))  # gathered from the shards by FSDP
    assert main([str(whole["plain"] / "last"), str(tmp_path / "w.pt")]) == 0
    plain = torch.load(tmp_path / "w.pt", weights_only=True)
    assert set(plain) == {"state_dict", "consolidated_from", "pytorch-lightning_version"}
    assert_same_tensors({f"task.{k}": v for k, v in full.items()}, plain["state_dict"])
    assert main([str(whole["plain"] / "last-step8"), str(tmp_path / "o.pt"), "--optimizer"]) == 0
    both = torch.load(tmp_path / "o.pt", weights_only=True)
    assert both["consolidated_from"]["step"] == 8 and both["lr_schedulers"] == []
    # The optimizer state loads into a plain (unsharded) copy of the network.
    net = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(16, 16)) for _ in range(3)))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    optimizer.load_state_dict(both["optimizer_states"][0])
    first = optimizer.state[next(iter(net.parameters()))]
    assert len(optimizer.state) == 6 and int(first["step"]) == 8


@pytest.mark.distributed
def test_a_consolidated_template_module_is_taken_by_eval_and_train(
    tmp_path: Path, base_args: list[str]
) -> None:
    """The template's own LightningModule sharded on 2 processes, saved, consolidated: eval.py
    tests the weights-only file, and the sharded save itself on 1 and 2 processes with the
    same metrics; train.py starts a run from the --optimizer one."""
    from project.consolidate import main

    fsdp_mlp(tmp_path / "ckpt", "--template")
    assert main([str(tmp_path / "ckpt" / "last"), str(tmp_path / "w.pt")]) == 0
    proc = run_script("eval.py", [f"ckpt_path={tmp_path / 'w.pt'}", *base_args])
    assert proc.returncode == 0, proc.stderr[-3000:]
    consolidated = logged_metrics(proc.stdout + proc.stderr)
    assert "test/acc" in consolidated, consolidated
    (folder,) = (tmp_path / "ckpt").glob("last-step*")  # the save the manifest publishes
    for ckpt, nproc in ((tmp_path / "ckpt" / "last", 1), (folder, 2)):
        cmd = torchrun([str(ROOT / "eval.py"), f"ckpt_path={ckpt}", *base_args,
                        f"hydra.run.dir={tmp_path / f'eval{nproc}'}"], nproc)  # fmt: skip
        code, out = finish(start(cmd), timeout=240)
        assert code == 0, out[-3000:]
        assert logged_metrics(out) == pytest.approx(consolidated, rel=1e-6), (nproc, out[-2000:])
    assert main([str(tmp_path / "ckpt" / "last"), str(tmp_path / "o.pt"), "--optimizer"]) == 0
    args = [f"ckpt_path={tmp_path / 'o.pt'}", "trainer.max_epochs=1", "test=false",
            "trainer.limit_train_batches=4", "trainer.limit_val_batches=1", *base_args]  # fmt: skip
    proc = run_script("train.py", args)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Restored all states from the checkpoint" in out, out[-3000:]


@pytest.mark.distributed
def test_a_url_folder_saves_publishes_and_resumes(
    whole: dict[str, Path], tmp_path: Path, s3: str
) -> None:
    """The same interrupted run with its folder on a real S3 server (moto): DCP writes and
    reads through fsspec, the manifest is one object, the older save is removed."""
    import fsspec

    url = f"{s3}/run"
    fsdp_mlp(url, *DROPOUT, "--exit-at", "5")
    fs = fsspec.filesystem("s3")
    assert json.loads(fs.cat_file(f"{url}/last.json"))["step"] == 4
    _, out = fsdp_mlp(url, *DROPOUT, "--out", str(tmp_path / "resumed.pt"))
    assert "resumed at step 4" in out
    fs.invalidate_cache()
    assert sorted(p.rpartition("/")[2] for p in fs.ls(url)) == ["last-step8", "last.json"]
    assert_same_tensors(
        weights(whole["dropout"].with_suffix(".pt")), weights(tmp_path / "resumed.pt")
    )


# feature:raw
@pytest.mark.distributed
def test_a_failed_background_save_of_a_sharded_last_is_one_line(
    tmp_path: Path, base_args: list[str]
) -> None:
    """The raw trainer under strategy=fsdp, saving in the background, on 2 processes: the
    save of step 6 cannot be written (a file where its folder goes), and DCP's thread fails
    with a CheckpointException. It was ~400 lines, and `close()` re-raised it before
    destroying its group. Now: one line, exit 75 (restarted like a crash: a full disk or a
    store's refusal may pass), `last` still step 3, every group closed."""
    from project.engine.checkpoints.sharded import resolve

    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "last-pt-step6").write_text("")  # the folder of the end's save (step 6)
    args = [*base_args, "strategy=fsdp", "strategy.async_save=true", "test=false",
            "callbacks.model_checkpoint=null", "callbacks.early_stopping=null",
            "trainer.max_epochs=2", "trainer.limit_train_batches=3",
            "trainer.limit_val_batches=1", f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    code, out = finish(start(launcher(["-m", "project.raw_train", *args]), **exit_check_env()))
    assert code == EXIT_TEMPFAIL, out[-3000:]
    line = one_error_line(out)
    assert line.startswith("error: rank 0 could not save step 6 (") and line.endswith(
        "; `last` stays step 3"
    ), line
    assert resolve(checkpoints / "last-pt", "ckpt_path") == str(checkpoints / "last-pt-step3")
    closed = [ln for ln in out.splitlines() if ln.startswith("exit check:")]
    # torchrun may end the second rank (SIGTERM, no exit hooks) once the first has exited
    assert closed and all(ln.endswith("closed") for ln in closed), closed


# /feature:raw
