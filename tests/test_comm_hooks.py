"""DDP options users tune: gradient-communication hooks (fp16, bf16, PowerSGD) in both trainers
with bitwise parity and a resumable PowerSGD state, known-bad combinations refused in one
line, parameters without gradients named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from project.engine.errors import UserError
from project.engine.launch.comm_hooks import BucketLayouts, CommHook
from project.engine.launch.exits import EXIT_BAD_INPUT, EXIT_PREEMPTED
from project.engine.launch.torchrun import TRAINERS
from tests.helpers import assert_same_weights, finish, launcher, run_script, start

HOOKS = ["ddp_fp16", "ddp_bf16", "ddp_powersgd"]


def losses(run_dir: Path) -> list[float]:
    return json.loads((run_dir / "step_stats.json").read_text())["losses"]


# --- quick: the rules ---------------------------------------------------------------------
@pytest.mark.quick
def test_a_bad_hook_config_is_one_line() -> None:
    with pytest.raises(UserError, match="kind='fp8' is not one of fp16, bf16, powersgd"):
        CommHook("fp8")
    with pytest.raises(UserError, match=r"strategy\.comm_hook\.rank is not an option"):
        CommHook("powersgd", rank=2)
    with pytest.raises(UserError, match="matrix_approximation_rank is not an option of the fp16"):
        CommHook("fp16", matrix_approximation_rank=2)


@pytest.mark.quick
def test_powersgd_state_follows_the_parameters_when_buckets_are_laid_out_anew() -> None:
    """PowerSGD's state is laid out in parameter order with every gradient 64-byte aligned,
    whatever DDP's bucket order; when DDP regroups its buckets, each parameter's slice of the
    error, P and Q moves with it."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    state = PowerSGDState(process_group=None, matrix_approximation_rank=1)
    layouts = BucketLayouts(state, net.named_parameters())
    order = ["0.weight", "0.bias", "1.weight", "1.bias"]
    slots, length = layouts.slots(order)
    assert slots == {"0.weight": (0, 128), "0.bias": (128, 16), "1.weight": (144, 64),
                     "1.bias": (208, 4)} and length == 224  # fmt: skip
    where = layouts.slices(order)
    assert set(where["0.weight"]) == {"error", "p", "q"} and set(where["0.bias"]) == {"error"}
    state.error_dict[0] = torch.arange(length, dtype=torch.float32)
    state.p_memory_dict[0] = torch.arange(16 + 4, dtype=torch.float32)
    state.q_memory_dict[0] = torch.arange(8 + 16, dtype=torch.float32)
    before = {k: dict(d) for k, d in (("e", state.error_dict), ("p", state.p_memory_dict),
                                       ("q", state.q_memory_dict))}  # fmt: skip
    layouts.names[0] = order
    layouts.split_all()  # DDP regroups: bucket 0 holds the last layer, bucket 1 the first
    regrouped = {0: order[2:], 1: order[:2]}
    for index, names in regrouped.items():
        layouts.names[index] = names
        layouts.join(index, names)
    assert torch.equal(state.error_dict[1][:144], torch.arange(144.0))
    assert torch.equal(state.error_dict[0][:4], torch.arange(144.0, 148.0))
    assert torch.equal(state.p_memory_dict[0], torch.arange(16.0, 20.0))
    assert torch.equal(state.q_memory_dict[1], torch.arange(8.0))
    layouts.split_all()  # and back: the very same tensors
    layouts.names = {0: order}
    layouts.join(0, order)
    for first, numel in slots.values():
        saved = before["e"][0][first : first + numel]
        assert torch.equal(state.error_dict[0][first : first + numel], saved)
    assert torch.equal(state.p_memory_dict[0], before["p"][0])
    assert torch.equal(state.q_memory_dict[0], before["q"][0])


@pytest.mark.quick
def test_powersgd_state_of_another_layout_is_refused_in_one_line() -> None:
    """A state saved unaligned (the layout before 2026-12-02 evening) would be sliced wrongly."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    hook = CommHook("powersgd")
    hook.state = PowerSGDState(process_group=None, matrix_approximation_rank=1)
    hook.layouts = BucketLayouts(hook.state, net.named_parameters())
    order = ["0.weight", "0.bias", "1.weight", "1.bias"]
    unaligned = {"layouts": {0: order}, "error_dict": {0: torch.zeros(128 + 16 + 64 + 4)}}
    with pytest.raises(UserError, match="PowerSGD state beside this checkpoint has another"):
        hook.load_state_dict(unaligned)


@pytest.mark.quick
@pytest.mark.parametrize(("saved_world", "rank", "world"), [(2, 0, 1), (2, 1, 3), (1, 1, 2)])
def test_powersgd_state_of_another_world_size_starts_afresh(
    tmp_path, monkeypatch, caplog, saved_world, rank, world
) -> None:
    """An elastic restart on fewer or more nodes: every rank starts PowerSGD afresh (error
    feedback is per rank and cannot be redistributed), rank 0 says so in one warning; the same
    world size with this rank's file missing is still refused."""
    import torch.distributed as dist

    from project.engine.launch import comm_hooks

    last = tmp_path / "last.ckpt"
    for saved_rank in range(saved_world):
        torch.save({"world_size": saved_world}, comm_hooks.state_file(last, 7, saved_rank))
    monkeypatch.setattr(dist, "get_rank", lambda: rank)
    monkeypatch.setattr(dist, "get_world_size", lambda: world)
    hook = CommHook("powersgd")
    hook.load_state_dict = lambda saved: pytest.fail("restored another world size's state")
    comm_hooks.load_state(hook, last, 7, "cpu")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ([f"PowerSGD state of step 7 was written by {saved_world} processes, this "
                         f"run has {world}: PowerSGD starts afresh (its per-rank error feedback "
                         "cannot be redistributed)"] if rank == 0 else [])  # fmt: skip
    monkeypatch.setattr(dist, "get_world_size", lambda: saved_world)
    comm_hooks.state_file(last, 7, 0).unlink()
    with pytest.raises(UserError, match=r"last\.comm_hook\.step7\.rank0\.pt is missing"):
        monkeypatch.setattr(dist, "get_rank", lambda: 0)
        comm_hooks.load_state(hook, last, 7, "cpu")


@pytest.mark.quick
@pytest.mark.parametrize(
    "options, needles",
    [
        (["trainer.accelerator=cpu", "strategy=ddp_static", "trainer.accumulate_grad_batches=2"],
         ["strategy.static_graph=true", "trainer.accumulate_grad_batches=2"]),
        # On CUDA (asked for: a CPU machine says so too, nothing touches a device first).
        (["trainer.accelerator=gpu", "strategy=ddp_powersgd", "trainer.precision=16-mixed"],
         ["strategy=ddp_powersgd", "trainer.precision=bf16-mixed"]),
    ],
    ids=["static-graph-accumulation", "powersgd-float16-cuda"],
)  # fmt: skip
def test_options_that_cannot_work_together_are_refused_before_any_process_starts(
    base_args, options: list[str], needles: list[str]
) -> None:
    proc = run_script("train.py", [*base_args, "trainer.devices=2", *options], timeout=120)
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, lines
    assert all(needle in lines[0] for needle in needles), lines


# --- distributed: 2 processes under torchrun -----------------------------------------------
@pytest.mark.distributed
@pytest.mark.parametrize("preset", HOOKS)
def test_each_hook_runs_in_both_trainers_with_bitwise_equal_losses(torchrun_runs, preset) -> None:
    lightning = torchrun_runs(f"strategy={preset}")
    assert len(losses(lightning.dir)) >= 20
    assert losses(lightning.dir) != losses(torchrun_runs().dir)  # the hook is really on
    # feature:raw
    raw = torchrun_runs(f"strategy={preset}", trainer="raw")
    assert losses(lightning.dir) == losses(raw.dir)  # bitwise, every step
    # /feature:raw


def launcher_job(module: str, args: list[str], run_id: str) -> tuple[int, str]:
    return finish(start(launcher(["-m", module, *args]), RUN_ID=run_id), 240)


@pytest.mark.distributed
def test_powersgd_state_survives_a_preemption_in_both_trainers(base_args, log_dir) -> None:
    """Every rank saves its own PowerSGD state beside the last checkpoint and gets it back on
    resume; the resumed run ends bitwise where the uninterrupted one does, though DDP's first
    step of a process lays its buckets out differently (a 1.2 MB model: one bucket in the
    first step, two regrouped ones after; odd layer sizes, so that a layout's offsets are
    not all multiples of 16 bytes). A resume whose per-rank state is missing is refused in
    one line."""
    args = [*base_args, "strategy=ddp_powersgd", "model.net.hidden=511", "trainer.max_epochs=4",
            "test=false", "callbacks.early_stopping=null"]  # fmt: skip
    code, out = launcher_job("project.train", args, "whole")
    assert code == 0, out[-3000:]
    for trainer, module in TRAINERS.items():
        stop = [*args, "fault_injection.at_step=25", "fault_injection.mode=sigterm"]
        code, out = launcher_job(module, stop, trainer)
        assert code == EXIT_PREEMPTED, out[-3000:]
        ckpts = log_dir / "train/runs" / trainer / "checkpoints"
        states = sorted(p.name for p in ckpts.glob("*.comm_hook.*"))
        assert len(states) == 2 and all(".step29." in s for s in states), states
        broken = log_dir / "train/runs" / f"{trainer}-broken"
        shutil.copytree(ckpts.parent, broken)
        next((broken / "checkpoints").glob("*.rank1.pt")).unlink()
        code, out = launcher_job(module, args, f"{trainer}-broken")
        assert code == EXIT_BAD_INPUT and "rank 1 at step 29 cannot be restored" in out, out[-3000:]
        code, out = launcher_job(module, args, trainer)  # the same command: resumes
        assert code == 0, out[-3000:]
        assert_same_weights(ckpts.parent, log_dir / "train/runs/whole")


@pytest.mark.distributed
def test_parameters_without_gradients_are_named_on_every_rank(base_args, tmp_path) -> None:
    args = [*base_args, "model.net._target_=tests.user_model.TwoHeads", "trainer.max_epochs=1",
            "test=false", f"hydra.run.dir={tmp_path}/run"]  # fmt: skip
    for module in TRAINERS.values():
        code, out = launcher_job(module, args, f"unused-{module}")
        errors = [ln for ln in out.splitlines() if ln.startswith("error: ")]
        assert code == EXIT_BAD_INPUT and len(errors) == 2, out[-3000:]
        for rank, line in enumerate(sorted(errors)):
            assert line.startswith(f"error: rank {rank}: these parameters got no gradient")
            assert (
                "net.aux_head.weight, net.aux_head.bias" in line and "strategy=ddp_unused" in line
            )
        assert "Traceback" not in out
    code, out = launcher_job("project.train", [*args[:-1], f"hydra.run.dir={tmp_path}/fixed",
                                               "strategy=ddp_unused"], "fixed")  # fmt: skip
    assert code == 0, out[-3000:]
