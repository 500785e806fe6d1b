"""strategy=fsdp (FSDP2, fully_shard) in both trainers: the plan of what is sharded and every
refusal before any process starts (quick tier); 2-process runs under torchrun whose per-step
losses equal between the trainers and against strategy=ddp, with accumulation, bf16, CPU
offload and clipping, a hang naming FSDP's collective, and the sharded `last` of both trainers:
a stop and a rerun resume it bitwise, and on another world size (full)."""

from __future__ import annotations

import collections
import json
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from subprocess import Popen

import pytest
import torch
from torch import nn

from project.engine.distributed.exits import EXIT_HUNG, EXIT_PREEMPTED
from project.engine.distributed.fsdp import options as fsdp_options
from project.engine.distributed.fsdp.plan import (
    check_parameters_in_net,
    check_running_statistics,
    named_blocks,
    repeated_blocks,
)
from project.engine.errors import UserError
from project.models.cnn import CNN
from project.models.gpt import GPT
from project.models.mlp import MLP
from tests.helpers import (
    FSDP,
    QUIET,
    SLOW_RANK_1,
    assert_rank_1_named_slow,
    assert_same_tensors,
    assert_same_tree,
    assert_same_weights,
    exit_check_env,  # feature:raw
    final_weights,
    finish,
    launcher,
    max_loss_diff,
    one_error_line,
    recorded_data,
    recorded_reads,
    run_script,
    run_trainer,
    sharded_entries,
    sharded_manifest,
    sharded_state,
    start,
    torchrun,
)

# --- quick: what is sharded, what is refused (no processes) ----------------------------------
# a user's plain module: its ModuleList's repeated layers are sharded, not the lone head
USER_NET = nn.ModuleDict(
    {"layers": nn.ModuleList(nn.Linear(4, 4) for _ in range(2)), "head": nn.Linear(4, 2)}
)


@pytest.mark.quick
@pytest.mark.parametrize(
    ("net", "expected"),
    [
        (GPT(n_layer=3, d_model=16, n_head=2), ["Block"] * 3),  # the transformer blocks
        (MLP(depth=2), ["Linear"] * 3),
        (CNN(), ["Conv2d", "Conv2d", "Linear", "Linear"]),
        (USER_NET, ["Linear"] * 2),
    ],
)
def test_the_default_plan_shards_each_repeated_block(net: nn.Module, expected) -> None:
    assert [type(m).__name__ for m in repeated_blocks(net)] == expected


@pytest.mark.quick
def test_named_blocks_and_a_class_the_network_lacks() -> None:
    gpt = GPT(n_layer=2, d_model=16, n_head=2)
    assert [type(m).__name__ for m in named_blocks(gpt, ["Block"])] == ["Block"] * 2
    assert len(named_blocks(gpt, "Block")) == 2  # strategy.blocks=Block, not a list
    with pytest.raises(UserError, match=r"strategy\.blocks names Blok, which model\.net \(GPT\)"):
        named_blocks(gpt, ["Blok"])


@pytest.mark.quick
def test_parameters_outside_the_network_are_refused() -> None:
    task = nn.Module()
    task.net, task.temperature = MLP(), nn.Parameter(torch.ones(1))
    with pytest.raises(UserError, match=r"outside it \(temperature\)"):
        check_parameters_in_net(task)


@pytest.mark.quick
def test_running_statistics_are_refused_as_fsdp_does_not_synchronise_buffers() -> None:
    check_running_statistics(MLP())
    check_running_statistics(nn.BatchNorm1d(4, track_running_stats=False))
    with pytest.raises(UserError, match=r"running statistics, and model.net has them \(1: Batch"):
        check_running_statistics(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))


FSDP_REFUSED = [
    (["+strategy.find_unused_parameters=true"], "strategy.find_unused_parameters is a DDP option"),
    (["+strategy.bucket_cap_mb=25"], "strategy.bucket_cap_mb is a DDP option"),
    (["+strategy.comm_hook.kind=fp16"], "strategy.comm_hook is a DDP option"),
    (["+strategy.shard_evrything=true"], "strategy.shard_evrything is not an FSDPStrategy option"),
    (["trainer.precision=16-mixed"], "trainer.precision=16-mixed is not supported"),
    (["model.compile=true"], "model.compile=true is not supported"),
    (["trainer.sync_batchnorm=true"], "trainer.sync_batchnorm=true is not supported"),
    (["strategy.start_method=spawn"], "strategy.start_method=spawn"),
    (["strategy.blocks=[Nope]"], "strategy.blocks names Nope"),
    # Set at all is refused, also to false: no value of a DDP key means anything here.
    (["+strategy.find_unused_parameters=false"], "strategy.find_unused_parameters is a DDP"),
    (["+strategy.bucket_cap_mb=0"], "strategy.bucket_cap_mb is a DDP option"),
    (["trainer.precision=bf16"], "trainer.precision=bf16 is not supported with strategy=fsdp: use"),
    (["strategy.blocks=[MLP]"], "strategy.blocks names only MLP, the network itself"),
]


@pytest.mark.quick
@pytest.mark.parametrize(("overrides", "needle"), FSDP_REFUSED, ids=[o[0] for o, _ in FSDP_REFUSED])
def test_what_fsdp_cannot_do_is_refused_in_one_line(compose_train, overrides, needle) -> None:
    cfg = compose_train(["strategy=fsdp", *overrides])
    with pytest.raises(UserError, match=re.escape(needle)):
        fsdp_options.check(cfg, 2)


@pytest.mark.quick
def test_a_one_file_last_on_several_processes_is_refused(compose_train) -> None:
    """A run folder's one-file `last` to resume is one line; best-k, a one-file ckpt_path (a
    new run), a URL folder and a sharded `last` at a URL are taken."""
    cfg = compose_train(["strategy=fsdp", "callbacks.model_checkpoint=null"])
    fsdp_options.check(cfg, 2)  # the rest is fine
    with pytest.raises(UserError, match=re.escape("last.ckpt is a one-file checkpoint")):
        fsdp_options.check_checkpoints(cfg, Path("last.ckpt"))
    fine = ["strategy=fsdp"]
    fsdp_options.check_checkpoints(compose_train(fine), None)
    fsdp_options.check_checkpoints(compose_train([*fine, "ckpt_path=x.ckpt"]), Path("x.ckpt"))
    url = compose_train([*fine, "callbacks.fault_tolerance.dirpath=s3://bucket/run"])
    fsdp_options.check_checkpoints(url, "s3://bucket/run/last-ckpt-step4")


@pytest.mark.quick
def test_the_shipped_config_with_bf16_and_offload_gives_fully_shards_options(compose_train):
    cfg = compose_train(["strategy=fsdp", "trainer.precision=bf16-mixed",
                         "strategy.cpu_offload=true"])  # fmt: skip
    fsdp_options.check(cfg, 2)
    kwargs = fsdp_options.ShardOptions.of(cfg.strategy, cfg.trainer.precision).kwargs()
    assert kwargs["mp_policy"].param_dtype == torch.bfloat16
    assert kwargs["mp_policy"].reduce_dtype == torch.float32
    assert type(kwargs["offload_policy"]).__name__ == "CPUOffloadPolicy"


# --- full tier: real runs ---------------------------------------------------------------------
def test_one_process_trains_unsharded_with_its_checkpoints(base_args, tmp_path) -> None:
    """Nothing is sharded on one process (as strategy=ddp has no wrapper there): the usual
    checkpoints are written."""
    args = [*base_args, "strategy=fsdp", "trainer.max_epochs=1", "trainer.limit_train_batches=3",
            "trainer.limit_val_batches=1", "test=false", f"hydra.run.dir={tmp_path}"]  # fmt: skip
    out = run_script("train.py", args)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    assert "sharded over" not in (tmp_path / "train.log").read_text()


@pytest.mark.distributed
def test_a_module_whose_configure_model_shards_nothing_is_refused(base_args, tmp_path) -> None:
    """Lightning checks only that configure_model is overridden: a rank per copy, never
    synchronised, would otherwise train with exit 0."""
    args = ["strategy=fsdp", *base_args, *FSDP, "model._target_=tests.user_model.OwnConfigureModel",
            "trainer.max_epochs=1", "trainer.limit_train_batches=2", *QUIET]  # fmt: skip
    cmd = torchrun(["-m", "project.train", *args, f"hydra.run.dir={tmp_path}"], 2)
    code, out = finish(start(cmd), timeout=240)
    assert code != 0, out[-3000:]
    assert "OwnConfigureModel.configure_model did not shard the network" in out, out[-3000:]


DIGITS = [*FSDP, "trainer.max_epochs=2", "trainer.limit_train_batches=9",
          "trainer.limit_val_batches=2", "step_stats=true", *QUIET]  # fmt: skip
# Accumulation and clipping: what FSDP does its own way (gradients held unsharded, the norm
# summed over shards), which both trainers share, so only the run against DDP can catch it.
WINDOWS = ["trainer.accumulate_grad_batches=3", "trainer.gradient_clip_val=0.5"]
# strategy=fsdp against strategy=ddp on digits, 2 processes: bitwise as measured (the other
# figures, e.g. the language model's with clipping, are in docs/launching.md)
FSDP_VS_DDP = 0.0


@pytest.mark.distributed
def test_both_trainers_train_bitwise_alike_under_fsdp_and_as_ddp_does(base_args, tmp_path):
    """Lightning and the raw trainer under strategy=fsdp: the same loss at every step; and
    within FSDP_VS_DDP of Lightning under strategy=ddp, accumulating and clipping. The Lightning
    run under torchrun
    finishes and writes its goodput."""
    fsdp = ["strategy=fsdp", *base_args, *DIGITS, *WINDOWS]
    lightning = run_trainer("project.train", fsdp, tmp_path / "lightning", nproc=2)
    # feature:raw
    raw = run_trainer("project.raw_train", fsdp, tmp_path / "raw", nproc=2)
    assert len(raw["losses"]) == 18 and lightning["losses"] == raw["losses"]  # bitwise
    # /feature:raw
    ddp = run_trainer("project.train", [*base_args, *DIGITS, *WINDOWS], tmp_path / "ddp", nproc=2)
    assert max_loss_diff(lightning["losses"], ddp["losses"]) <= FSDP_VS_DDP
    goodput = json.loads((tmp_path / "lightning" / "goodput.json").read_text())
    assert goodput["attempts"][-1]["how"] == "finished"
    assert "sharded over 2 ranks" in (tmp_path / "lightning" / "train.log").read_text()


# feature:raw
@pytest.mark.distributed
def test_accumulation_bf16_offload_and_clipping_stay_bitwise(base_args, tmp_path) -> None:
    args = ["strategy=fsdp", *base_args, *DIGITS, "trainer.accumulate_grad_batches=3",
            "trainer.precision=bf16-mixed", "strategy.cpu_offload=true",
            "trainer.gradient_clip_val=0.5"]  # fmt: skip
    lightning = run_trainer("project.train", args, tmp_path / "lightning", nproc=2)
    raw = run_trainer("project.raw_train", args, tmp_path / "raw", nproc=2)
    assert len(raw["losses"]) >= 6 and lightning["losses"] == raw["losses"]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("refused", "needle"),
    [
        # 271 validation rows in batches of 45: 4 batches on one rank, 3 on the other
        (["data.dataset.val_fraction=0.151", "data.batch_size=45"], "as many batches"),
        # a folder the data source's constructor refuses (Hydra wraps its UserError)
        (["paths.data_dir=/etc/hostname/data"], "cannot be written"),
    ],
)
def test_a_refusal_once_the_raw_trainers_group_is_up_closes_it(
    base_args, tmp_path, refused, needle
) -> None:
    """Refused after the process group started (setting up its data): exit 2 with one line,
    and each rank closed its group before exiting (left to interpreter shutdown, gloo can
    abort the process, exit -6)."""
    args = ["strategy=fsdp", *base_args, *FSDP, *refused, f"hydra.run.dir={tmp_path}"]
    cmd = launcher(["-m", "project.raw_train", *args])
    code, out = finish(start(cmd, **exit_check_env()), timeout=120)
    assert code == 2 and needle in one_error_line(out), out[-3000:]
    closed = [ln for ln in out.splitlines() if ln.startswith("exit check:")]
    # torchrun may end the second rank (SIGTERM, no exit hooks) once the first has exited
    assert closed and all(ln.endswith("closed") for ln in closed), closed


# /feature:raw
def _read(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


@pytest.mark.distributed
def test_a_hang_under_fsdp_names_its_all_gather(base_args, log_dir) -> None:
    args = ["strategy=fsdp", *base_args, *FSDP, "trainer.max_epochs=4", "test=false",
            "fault_injection.at_step=15", "fault_injection.rank=1", "strategy.step_timeout_s=5",
            "fault_injection.mode=hang"]  # fmt: skip
    code, out = finish(start(launcher(["-m", "project.train", *args]), RUN_ID="hang"), 240)
    assert code == EXIT_HUNG, out[-3000:]
    # rank 0 waits in the next forward's weight gather (the default group's Flight Recorder)
    assert re.search(r"rank 1 never issued collective #\d+ \(all_gather \[", out), out[-3000:]
    assert "nothing was saved" not in out, out[-3000:]  # its `last` is sharded: a resume is said


@pytest.mark.distributed
@pytest.mark.parametrize(
    "module",
    [
        "project.train",
        "project.raw_train",  # feature:raw
    ],
)
def test_a_desync_and_a_slow_rank_under_fsdp_are_named(base_args, log_dir, module) -> None:
    """The hang report and the straggler line under strategy=fsdp (under torchrun, 2
    processes): rank 1's extra all-reduce at step 15 is named as a desync against rank 0's
    all_gather of the next forward; rank 1's steps 30 ms slower from step 10 are named within
    50 steps (the wait is in FSDP's forward and backward), and its time reaches TensorBoard;
    the same run without the fault names no one."""
    args = ["strategy=fsdp", *base_args, *FSDP, "test=false", "callbacks.early_stopping=null"]
    desync = [*args, "trainer.max_epochs=4", "fault_injection.at_step=15", "fault_injection.rank=1",
              "strategy.step_timeout_s=5", "fault_injection.mode=desync"]  # fmt: skip
    code, out = finish(start(launcher(["-m", module, *desync]), RUN_ID="d"), 240)
    assert code == EXIT_HUNG, out[-3000:]
    assert "=> collective #" in out and "does not match across ranks (a desync)" in out, out[-3000:]
    assert re.search(r"rank 0: all_gather \[\d+\] .*; rank 1: all_reduce \[1\] in fault", out)
    assert re.search(r"rank 1 issued a collective the others did not", out), out[-3000:]
    balanced = [*args, "trainer.max_epochs=7"]  # FSDP's waits are not taken for slowness
    code, out = finish(start(launcher(["-m", module, *balanced, *SLOW_RANK_1]), RUN_ID="s"), 240)
    assert code == 0, out[-3000:]
    assert_rank_1_named_slow(out, log_dir / "train/runs/s")
    assert "in every forward and backward (FSDP's collectives)" in out, out[-3000:]
    code, out = finish(start(launcher(["-m", module, *balanced]), RUN_ID="b"), 240)
    assert code == 0 and "straggler:" not in out, out[-3000:]


# --- the raw trainer's sharded `last` (full tier) ---------------------------------------------
# The CNN has dropout: an exact resume also needs every rank's RNG states back.
SHARDED = ["strategy=fsdp", "callbacks.model_checkpoint=null", "test=false",
           "callbacks.early_stopping=null", "callbacks.fault_tolerance.check_every_n_steps=2",
           *QUIET]  # fmt: skip


def job(
    args: list[str], run_id: str, nproc: int = 2, module: str = "project.raw_train", **env: str
) -> Popen[str]:
    """A trainer on `nproc` processes (1: plain python), into the run folder RUN_ID."""
    target = ["-m", module, *args]
    cmd = launcher(target, nproc) if nproc > 1 else [sys.executable, *target]
    return start(cmd, RUN_ID=run_id, **env)


# The stopped runs below continue to the end of this run (the CNN has dropout), bitwise.
CNN_WHOLE = [*SHARDED, "model=cnn", "trainer.max_epochs=2"]


@pytest.fixture(scope="module")
def fsdp_whole(tmp_path_factory, data_dir) -> Callable[[str], Path]:
    """module -> the run folder of CNN_WHOLE on 2 processes, never stopped: trained once per
    trainer for the tests that end where it ends (the local and the S3 resume)."""
    done: dict[str, Path] = {}

    def run(module: str) -> Path:
        if module not in done:
            log_dir = tmp_path_factory.mktemp("fsdp-whole") / "logs"
            args = [f"paths.data_dir={data_dir}", f"paths.log_dir={log_dir}", *CNN_WHOLE]
            code, out = finish(job(args, "whole", module=module), 300)
            assert code == 0, out[-3000:]
            done[module] = log_dir / "train" / "runs" / "whole"
        return done[module]

    return run


@pytest.mark.distributed
@pytest.mark.parametrize(
    "module",
    [
        "project.train",
        "project.raw_train",  # feature:raw
    ],
)
def test_a_sharded_last_resumes_a_stopped_fsdp_run_bitwise(
    base_args, log_dir, fsdp_whole, module
) -> None:
    """2 processes, strategy=fsdp: SIGTERM mid-epoch saves a sharded `last` (every rank its
    shards, a manifest); the same command again resumes it mid-epoch and ends with the final
    weights of the run that never stopped, bitwise; a third run finds it finished. The
    stopped run saves in the background (strategy.async_save): the same weights."""
    whole = fsdp_whole(module)
    args = [*base_args, *CNN_WHOLE, "strategy.async_save=true"]
    cut = [*args, "fault_injection.at_step=13", "fault_injection.mode=sigterm"]
    cut_code, cut_out = finish(job(cut, "cut", module=module), 300)
    assert cut_code == EXIT_PREEMPTED, cut_out[-3000:]
    runs = log_dir / "train" / "runs"
    manifest = runs / "cut" / "checkpoints" / sharded_manifest(module)
    assert f"{manifest} is saved" in cut_out, cut_out[-3000:]
    saved = json.loads(manifest.read_text())
    assert saved["world"] == 2, saved
    assert f"Stopped by a signal at step {saved['step']}" in cut_out, cut_out[-3000:]
    folder = manifest.parent / saved["folder"]
    assert {"rank0.pt", "rank1.pt", "common.pt", ".metadata"} <= {p.name for p in folder.iterdir()}
    assert not list(runs.rglob("last.pt")) + list(runs.rglob("*.ckpt"))  # nothing one-file
    code, out = finish(job(args, "cut", module=module), 300)
    assert code == 0 and "skipping" in out, out[-3000:]
    assert_same_weights(whole, runs / "cut")
    goodput = json.loads((runs / "cut" / "goodput.json").read_text())
    assert goodput["attempts"][-1]["buckets"]["reload"] > 0, goodput  # the shards' load, booked
    assert sharded_entries(manifest)["common"]["project"]["finished"]
    code, out = finish(job(args, "cut", module=module), 300)
    assert code == 0 and "This run already finished" in out, out[-3000:]


def bucket_weights(url: str, manifest: str, into: Path) -> dict[str, torch.Tensor]:
    """The weights of the save the manifest at `url` publishes: downloaded into `into`, then
    gathered by torch's own reader (sharded_state), not the project's."""
    import fsspec

    fs = fsspec.filesystem("s3")
    folder = json.loads(fs.cat_file(f"{url}/{manifest}"))["folder"]
    fs.get(f"{url}/{folder}", str(into / folder), recursive=True)
    fs.get(f"{url}/{manifest}", str(into / manifest))
    return sharded_state(into / manifest)["model"]


@pytest.mark.distributed
@pytest.mark.parametrize(
    "module",
    [
        "project.train",
        "project.raw_train",  # feature:raw
    ],
)
def test_a_sharded_last_in_s3_resumes_on_another_machine_bitwise(
    base_args, log_dir, tmp_path, s3, fsdp_whole, module
) -> None:
    """callbacks.fault_tolerance.dirpath=s3://... under strategy=fsdp (the Kubernetes
    object-storage recipes): every rank writes its shards to the bucket, the manifest there
    publishes them; stopped mid-epoch, the same command in an empty run folder (another
    machine) resumes from the URL and ends bitwise where the run that never stopped does.
    The bucket keeps the newest save and its manifest only; no run folder holds a `last`.
    One process continues a copy of the stopped run's folder from its URL too, bitwise as it
    does from a local copy (Lightning copies the save into the run's staging, then removes it)."""
    import fsspec

    whole = fsdp_whole(module)
    args = [*base_args, *CNN_WHOLE]
    url, manifest = f"{s3}/run", sharded_manifest(module)
    remote = [*args, f"callbacks.fault_tolerance.dirpath={url}"]
    cut = [*remote, "fault_injection.at_step=13", "fault_injection.mode=sigterm"]
    cut_code, cut_out = finish(job(cut, "cut", module=module), 300)
    assert cut_code == EXIT_PREEMPTED, cut_out[-3000:]
    assert f"{url}/{manifest} is saved" in cut_out, cut_out[-3000:]
    fs = fsspec.filesystem("s3")
    saved = json.loads(fs.cat_file(f"{url}/{manifest}"))
    fs.copy(url, f"{s3}/one", recursive=True)  # the stopped run, for one process below
    code, out = finish(job(remote, "elsewhere", module=module), 300)
    assert code == 0, out[-3000:]
    assert f"{url}/{saved['folder']}" in out and "Resuming epoch" in out, out[-3000:]
    end = json.loads(fs.cat_file(f"{url}/{manifest}"))
    assert end["step"] > saved["step"], end
    assert sorted(p.rpartition("/")[2] for p in fs.ls(url, refresh=True)) == sorted(
        [end["folder"], manifest])  # fmt: skip
    runs = log_dir / "train" / "runs"
    assert not list(runs.rglob(manifest))  # no run folder of a URL dirpath holds a `last`
    assert not [p for p in runs.rglob("*") if "staging" in str(p) and p.is_file()]  # none
    assert_same_tensors(bucket_weights(url, manifest, tmp_path / "downloaded"),
                        final_weights(whole))  # fmt: skip
    # One process, from the URL and from a local copy of the same stopped run ("control"):
    # the global batch kept, the same steps, the same weights bitwise.
    control = runs / "control" / "checkpoints"
    control.parent.mkdir(parents=True)
    fs.get(f"{s3}/one", str(control), recursive=True)
    for run, where in (("one", [f"callbacks.fault_tolerance.dirpath={s3}/one"]), ("control", [])):
        code, out = finish(job([*args, *where], run, nproc=1, module=module), 300)
        assert code == 0 and "the global batch of 128 is kept" in out, out[-3000:]
        assert f"/{saved['folder']}" in out and "Resuming epoch" in out, out[-3000:]
    alone = json.loads(fs.cat_file(f"{s3}/one/{manifest}"))
    assert alone["step"] == end["step"], (alone, end)
    assert sorted(p.rpartition("/")[2] for p in fs.ls(f"{s3}/one", refresh=True)) == sorted(
        [alone["folder"], manifest])  # fmt: skip
    assert not [p for p in (runs / "one").rglob("*") if "staging" in str(p) and p.is_file()]
    assert_same_tensors(bucket_weights(f"{s3}/one", manifest, tmp_path / "one"),
                        final_weights(runs / "control"))  # fmt: skip
    assert json.loads(fs.cat_file(f"{url}/{manifest}")) == end  # the other run's untouched


@pytest.mark.distributed
@pytest.mark.parametrize(
    "module",
    [
        "project.train",
        "project.raw_train",  # feature:raw
    ],
)
def test_the_best_checkpoint_under_fsdp_is_one_file_as_under_ddp(base_args, log_dir, module):
    """The shipped config (best-k on, test at the end) under strategy=fsdp on 2 processes:
    the best checkpoint is one file, the whole state gathered, bitwise the one strategy=ddp
    writes (digits trains bitwise alike), and the test on it reports the same metrics."""
    args = [*base_args, "trainer.max_epochs=2", "trainer.limit_train_batches=6",
            "callbacks.early_stopping=null", *QUIET]  # fmt: skip
    jobs = [job([*args, f"strategy={s}"], s, module=module) for s in ("ddp", "fsdp")]
    for code, out in [finish(j, 300) for j in jobs]:
        assert code == 0, out[-3000:]
    runs = log_dir / "train" / "runs"
    pattern = "best.pt" if "raw" in module else "epoch_*.ckpt"
    (ddp,), (fsdp,) = (sorted((runs / r / "checkpoints").glob(pattern)) for r in ("ddp", "fsdp"))
    assert ddp.name == fsdp.name
    a, b = (torch.load(f, weights_only=True) for f in (ddp, fsdp))
    for key in ("model", "optimizer") if "raw" in module else ("state_dict", "optimizer_states"):
        assert a[key], key  # weights, and the optimizer's state in torch's own layout
        assert_same_tree(a[key], b[key], key)
    metrics = [json.loads((runs / r / "metrics.json").read_text()) for r in ("ddp", "fsdp")]
    tested = {k: v for k, v in metrics[0].items() if k.startswith("test/")}
    assert tested and tested == {k: v for k, v in metrics[1].items() if k.startswith("test/")}


@pytest.mark.distributed
@pytest.mark.parametrize(
    "module",
    [
        "project.train",
        "project.raw_train",  # feature:raw
    ],
)
def test_ckpt_path_crosses_between_ddp_and_fsdp(base_args, log_dir, module) -> None:
    """A DDP run's one-file `last` continued under strategy=fsdp (each rank keeps its shards
    of it) and an FSDP run's sharded `last` continued under strategy=ddp (gathered whole on
    each rank), 2 processes each, as ckpt_path. Each was stopped in its second epoch (mid-
    epoch, the cosine schedule's learning rate decayed); digits trains bitwise alike under
    both strategies, so both continuations end with the weights of one uninterrupted run."""
    args = [*base_args, *SHARDED[1:], "trainer.max_epochs=3", "trainer.limit_train_batches=6"]
    ddp, fsdp = [*args, "strategy=ddp"], [*args, "strategy=fsdp"]
    cut = ["fault_injection.at_step=9", "fault_injection.mode=sigterm"]  # 6 steps an epoch
    jobs = [job(ddp, "whole", module=module), job([*ddp, *cut], "ddp", module=module),
            job([*fsdp, *cut], "fsdp", module=module)]  # fmt: skip
    ended = [finish(j, 300) for j in jobs]
    for (code, out), wanted in zip(ended, (0, EXIT_PREEMPTED, EXIT_PREEMPTED), strict=True):
        assert code == wanted, out[-3000:]
    runs = log_dir / "train" / "runs"
    one_file = runs / "ddp" / "checkpoints" / ("last.pt" if "raw" in module else "last.ckpt")
    last = runs / "fsdp" / "checkpoints" / sharded_manifest(module).removesuffix(".json")
    assert 6 < sharded_entries(last.with_suffix(".json"))["step"] < 12  # mid second epoch
    to_fsdp = job([*fsdp, f"ckpt_path={one_file}"], "to_fsdp", module=module)
    to_ddp = job([*ddp, f"ckpt_path={last}"], "to_ddp", module=module)
    for code, out in [finish(to_fsdp, 300), finish(to_ddp, 300)]:
        assert code == 0, out[-3000:]
    assert (runs / "to_fsdp" / "checkpoints" / sharded_manifest(module)).is_file()
    assert_same_weights(runs / "whole", runs / "to_fsdp")
    assert_same_weights(runs / "whole", runs / "to_ddp")


# Rows of tests.user_data.RecordedSource: 2 epochs of 12 steps of a global batch of 40.
ROWS = 480


@pytest.mark.distributed
def test_lightning_refuses_a_sharded_last_under_ddp(base_args, log_dir) -> None:
    """Lightning's DDP writes one-file checkpoints, so it does not continue a run folder whose
    `last` is sharded: one line offering a new run from it (ckpt_path), exit 2, `last` kept."""
    args = [*base_args, *SHARDED, "trainer.max_epochs=3", "trainer.limit_train_batches=10"]
    cut = [*args, "fault_injection.at_step=3", "fault_injection.mode=sigterm"]
    code, out = finish(job(cut, "cut", module="project.train"), 300)
    assert code == EXIT_PREEMPTED, out[-3000:]
    manifest = log_dir / "train" / "runs" / "cut" / "checkpoints" / "last-ckpt.json"
    before = manifest.read_text()
    code, out = finish(job([*args, "strategy=ddp"], "cut", module="project.train"), 300)
    assert code == 2, out[-3000:]
    line = one_error_line(out)
    assert "continues in its run folder under strategy=fsdp or on one process" in line, line
    assert f"ckpt_path={manifest.with_suffix('')}" in line, line
    assert manifest.read_text() == before


@pytest.fixture(scope="module")
def fsdp_stopped(tmp_path_factory, data_dir) -> Callable[[str], Path]:
    """module -> a folder where WORLD_ARGS trained on 2 processes twice, at once: run "whole"
    never stopped (its reads tagged "whole"), run "cut" stopped by SIGTERM at step 4 (reads
    tagged "first"). Once per trainer: the tests continuing it on 1 and on 3 processes copy
    the stopped run folder."""
    done: dict[str, Path] = {}

    def run(module: str) -> Path:
        if module not in done:
            root = tmp_path_factory.mktemp("fsdp-stopped")
            args = world_args(root, data_dir, root / "logs")
            cut = [*args, "fault_injection.at_step=4", "fault_injection.mode=sigterm"]
            whole = job(args, "whole", module=module, RECORD_TAG="whole")
            first = job(cut, "cut", module=module, RECORD_TAG="first")
            (code, out), (cut_code, cut_out) = finish(whole, 300), finish(first, 300)
            assert code == 0, out[-3000:]
            assert cut_code == EXIT_PREEMPTED, cut_out[-3000:]
            done[module] = root
        return done[module]

    return run


def world_args(root: Path, data_dir: Path, log_dir: Path) -> list[str]:
    """ROWS recorded rows (data config and reads in `root`), 2 epochs, a check every step."""
    return [f"paths.data_dir={data_dir}", f"paths.log_dir={log_dir}", *SHARDED,
            *recorded_data(root, ROWS), "data.batch_size=30", "trainer.max_epochs=2",
            "trainer.num_sanity_val_steps=0",
            "callbacks.fault_tolerance.check_every_n_steps=1"]  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("module", "nproc"),
    [
        ("project.train", 1),
        ("project.raw_train", 1),  # feature:raw
        ("project.train", 3),
        ("project.raw_train", 3),  # feature:raw
    ],
)
def test_a_sharded_last_continues_on_another_world_size(
    data_dir, log_dir, fsdp_stopped, module, nproc
) -> None:
    """Each trainer, stopped in epoch 0 on 2 processes, continued on 1 or 3 in (a copy of) its
    run folder: the state reshards (on 1 gathered whole, on 3 into three shards), the global
    batch and every row of the epoch are kept once, the optimizer steps are those of the run
    that never stopped, the final weights within float tolerance, and the `last` it writes is
    sharded again."""
    root = fsdp_stopped(module)
    shutil.copytree(root / "logs" / "train" / "runs" / "cut", log_dir / "train" / "runs" / "cut")
    args, tag = world_args(root, data_dir, log_dir), f"second-{nproc}"
    code, out = finish(job(args, "cut", nproc=nproc, module=module, RECORD_TAG=tag), 300)
    assert code == 0 and "the global batch of 60 is kept" in out, out[-3000:]
    assert "Resuming epoch 0" in out, out[-3000:]
    runs, whole = log_dir / "train" / "runs", root / "logs" / "train" / "runs" / "whole"
    assert not list((runs / "cut").rglob("last.pt")) + list((runs / "cut").rglob("*.ckpt"))
    saved = [sharded_entries(r / "checkpoints" / sharded_manifest(module))
             for r in (runs / "cut", whole)]  # fmt: skip
    assert saved[0]["step"] == saved[1]["step"] == 16, [e["step"] for e in saved]
    assert saved[0]["world"] == nproc, saved[0]["world"]  # written sharded by the new world
    first_reads, second = recorded_reads(root, "first"), recorded_reads(root, tag)
    assert len(second) == nproc, len(second)
    rest = [i for r in second for i in r[: -(ROWS // nproc)]]  # before epoch 1's share
    counts = collections.Counter([i for r in first_reads for i in r] + rest)
    assert set(counts) == set(range(ROWS)), sorted(set(range(ROWS)) - set(counts))[:10]
    # Twice: the batch each rank had fetched when it stopped (read, never trained).
    assert sum(counts.values()) - ROWS < 2 * 30 + 1, collections.Counter(counts.values())
    a, b = final_weights(runs / "cut"), final_weights(whole)
    largest = max(float((a[key] - b[key]).abs().max()) for key in a)
    print(f"largest weight difference, 2 -> {nproc} processes, sharded: {largest:.1e}")
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=1e-5)
