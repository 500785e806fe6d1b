"""DDP options users tune: gradient-communication hooks (fp16, bf16, PowerSGD) in both trainers
with bitwise parity and a resumable PowerSGD state (its layout, its state files agreed on by
every rank, its settings), known-bad combinations refused in one line, parameters without
gradients named."""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from project.engine.checkpoints import comm_hook_files
from project.engine.checkpoints.comm_hook_files import state_file, stored
from project.engine.distributed.comm_hooks import CommHook
from project.engine.distributed.comm_hooks.powersgd_layout import BucketLayouts
from project.engine.distributed.exits import EXIT_BAD_INPUT, EXIT_PREEMPTED
from project.engine.errors import UserError
from project.engine.launch.torchrun import TRAINERS
from tests.helpers import (
    POWERSGD,
    assert_same_weights,
    finish,
    free_port,
    launcher,
    run_script,
    start,
)

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


class FakeBucket:
    """The `dist.GradBucket` methods the template's hook calls: `named` (name, tensor) pairs in
    DDP's order, their gradients as views of one flat buffer, as DDP lays them out."""

    def __init__(
        self, named: list[tuple[str, torch.Tensor]], grads: list[torch.Tensor], last: bool = True
    ) -> None:
        self.params, self.last = [p for _, p in named], last
        self.flat = torch.cat([g.reshape(-1) for g in grads])
        self.views, offset = [], 0
        for g in grads:
            self.views.append(self.flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def parameters(self) -> list[torch.Tensor]:
        return self.params

    def gradients(self) -> list[torch.Tensor]:
        return self.views

    def buffer(self) -> torch.Tensor:
        return self.flat

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return self.last


def net_and_layouts(
    dtype: torch.dtype = torch.float32, **powersgd: object
) -> tuple[torch.nn.Module, object, BucketLayouts]:
    """A two-layer net, PowerSGD's state for it and the template's layouts (no DDP model)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(dtype)
    state = PowerSGDState(process_group=None, **{"matrix_approximation_rank": 1, **powersgd})
    return net, state, BucketLayouts(state, net.named_parameters())


def bucket_of(net: torch.nn.Module, seed: int = 0) -> FakeBucket:
    """All of `net`'s parameters in one bucket, in DDP's reversed (gradient-ready) order."""
    named = list(net.named_parameters())[::-1]
    gen = torch.Generator().manual_seed(seed)
    return FakeBucket(named, [torch.randn(p.shape, generator=gen, dtype=p.dtype) for _, p in named])


def powersgd_hook(net: torch.nn.Module, **powersgd: object) -> CommHook:
    """A PowerSGD CommHook as `register` leaves it, without a DDP model."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    hook = CommHook("powersgd", **powersgd)
    hook.state = PowerSGDState(process_group=None, **powersgd)
    hook.layouts = BucketLayouts(hook.state, net.named_parameters())
    return hook


class Done:
    """A future that records whether the hook waited on it."""

    def __init__(self) -> None:
        self.waited = False

    def wait(self) -> None:
        self.waited = True

    def then(self, fn: object) -> Done:
        return self


@pytest.fixture
def one_process_group() -> Iterator[None]:
    """A gloo process group of this process alone: what torch's powerSGD_hook all-reduces on.

    The hook's callbacks run on gloo's worker thread and hold the group: were the last of
    them freed there, after destroy_process_group, the group's destructor would join that
    very thread and abort the test process ("Resource deadlock avoided"). So the group is
    freed here, on this thread, once nothing else holds it."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_group

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = _get_default_group()
    yield
    dist.destroy_process_group()
    alone = sys.getrefcount(probe := object())  # what a name held only here counts
    deadline = time.monotonic() + 10
    while sys.getrefcount(group) > alone and time.monotonic() < deadline:
        time.sleep(0.01)
    del probe
    del group


@pytest.mark.quick
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_every_gradient_starts_on_a_64_byte_boundary(dtype) -> None:
    """The fixed layout aligns in bytes, whatever the gradients' dtype (bf16: 32 elements)."""
    _, _, layouts = net_and_layouts(dtype)
    order = ["0.weight", "0.bias", "1.weight", "1.bias"]
    slots, length = layouts.slots(order)
    size = torch.empty(0, dtype=dtype).element_size()
    assert all(at * size % 64 == 0 for at, _ in slots.values()) and length * size % 64 == 0
    assert [numel for _, numel in slots.values()] == [128, 16, 64, 4]
    if dtype == torch.float32:
        assert slots == {"0.weight": (0, 128), "0.bias": (128, 16), "1.weight": (144, 64),
                         "1.bias": (208, 4)} and length == 224  # fmt: skip
    assert layouts.slots(order) is layouts.slots(order)  # worked out once per layout


@pytest.mark.quick
def test_steps_before_compression_all_reduce_ddps_own_bucket(monkeypatch) -> None:
    """Before start_powerSGD_iter torch's hook gets DDP's own bucket (its plain all-reduce is
    element-wise: no copies); from then on the fixed layout, worked out once per layout."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    net, state, layouts = net_and_layouts(start_powerSGD_iter=2)
    handed = []
    monkeypatch.setattr(powerSGD_hook, "powerSGD_hook", lambda s, b: handed.append(b) or Done())
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    bucket = bucket_of(net)
    state.iter = 1
    layouts.hook(state, bucket)
    assert handed[-1] is bucket
    state.iter = 2
    layouts.hook(state, bucket)
    assert handed[-1] is not bucket and handed[-1].buffer().numel() == 224
    assert layouts.layout_of(bucket) is layouts.layout_of(bucket_of(net, seed=1))


@pytest.mark.quick
@pytest.mark.parametrize(
    ("backend", "waits"),
    [("gloo", True), ("nccl", False), ("cpu:gloo,cuda:nccl", True), ("cpu:nccl,cuda:gloo", False)],
)
def test_one_bucket_at_a_time_is_decided_by_the_backend(monkeypatch, backend, waits) -> None:
    """PowerSGD's callbacks issue collectives from gloo's own threads, which hung with two
    buckets in flight: the hook waits for each bucket whenever gloo runs the collectives (also
    for CUDA tensors, `process_group_backend=gloo` on GPUs), and only then; CPU tensors here."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    net, state, layouts = net_and_layouts(start_powerSGD_iter=2)
    done = Done()
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(powerSGD_hook, "powerSGD_hook", lambda s, b: done)
    state.iter = 2
    layouts.hook(state, bucket_of(net))
    assert done.waited == waits


@pytest.mark.quick
def test_powersgd_reseeds_no_cuda_generator(one_process_group, monkeypatch) -> None:
    """torch's hook draws new factors after `torch.manual_seed`, which reseeds every CUDA
    generator (its `fork_rng(devices=[])` restores only the CPU's): the template's hook puts
    them back, so GPU dropout after a resume is the uninterrupted run's. A fake torch.cuda
    stands in for a GPU."""
    cuda = {"states": [torch.tensor([1, 2, 3], dtype=torch.uint8)], "seeds": []}

    def manual_seed_all(seed: int) -> None:
        cuda["seeds"].append(seed)
        cuda["states"] = [torch.full((3,), seed % 251, dtype=torch.uint8)]

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: list(cuda["states"]))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda s: cuda.update(states=list(s)))
    monkeypatch.setattr(torch.cuda, "manual_seed_all", manual_seed_all)
    net, state, layouts = net_and_layouts(start_powerSGD_iter=2)
    state.iter, cpu = 2, torch.get_rng_state()
    layouts.hook(state, bucket_of(net)).wait()
    assert cuda["seeds"], "torch's hook drew no new factors: this test checks nothing"
    assert torch.equal(cuda["states"][0], torch.tensor([1, 2, 3], dtype=torch.uint8))
    assert torch.equal(torch.get_rng_state(), cpu)


@pytest.mark.quick
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("rank", [1, 2])
def test_the_state_slices_are_where_a_real_powersgd_hook_puts_them(
    one_process_group, batched, rank
) -> None:
    """`BucketLayouts.slices` (which parameter's part of the error, P and Q is where: how the
    state moves when DDP regroups) against a real `powerSGD_hook` call: each compressed
    gradient comes out as its P times its Q transposed, the error is what it lost."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    shapes = {"a": (16, 8), "bias": (16,), "b": (8, 32), "c": (16, 8), "small": (3, 3),
              "conv": (6, 2, 3, 3)}  # same shapes apart, one too small to compress  # fmt: skip
    named = [(n, torch.nn.Parameter(torch.zeros(s))) for n, s in shapes.items()]
    state = PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                          batch_tensors_with_same_shape=batched)  # fmt: skip
    layouts = BucketLayouts(state, named)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=gen) for _, p in named[::-1]]
    bucket, state.iter = FakeBucket(named[::-1], [g.clone() for g in grads]), 2
    layouts.hook(state, bucket).wait()
    key, where = layouts.whole[tuple(shapes)], layouts.slices(shapes)
    assert {n for n, w in where.items() if "p" in w} == {"a", "b", "c", "conv"}
    for (name, _), before, after in zip(named[::-1], grads, bucket.views, strict=True):
        at, numel = where[name]["error"]
        lost = state.error_dict[key][at : at + numel]
        assert torch.equal(lost, (before - after).reshape(-1)), name
        if "p" not in where[name]:
            assert torch.equal(after, before), name  # all-reduced as it is
            continue
        n, m = before.shape[0], before.numel() // before.shape[0]
        r = min(n, m, rank)
        (p0, p_len), (q0, q_len) = where[name]["p"], where[name]["q"]
        p = state.p_memory_dict[key][p0 : p0 + p_len].view(1, n, r)
        q = state.q_memory_dict[key][q0 : q0 + q_len].view(1, m, r)
        torch.testing.assert_close(torch.bmm(p, q.transpose(1, 2)).view_as(after), after)


@pytest.mark.quick
def test_powersgd_state_follows_the_parameters_when_buckets_are_laid_out_anew() -> None:
    """PowerSGD's state is laid out in parameter order with every gradient 64-byte aligned,
    whatever DDP's bucket order; when DDP regroups its buckets, each parameter's slice of the
    error, P and Q moves with it, and once every bucket of the step went through the hook
    nothing is left pending (what a checkpoint between steps saves is complete)."""
    _, state, layouts = net_and_layouts()
    order = ("0.weight", "0.bias", "1.weight", "1.bias")
    where = layouts.slices(order)
    assert set(where["0.weight"]) == {"error", "p", "q"} and set(where["0.bias"]) == {"error"}
    assert layouts.key(order) == 0
    state.error_dict[0] = torch.arange(224, dtype=torch.float32)
    state.p_memory_dict[0] = torch.arange(16 + 4, dtype=torch.float32)
    state.q_memory_dict[0] = torch.arange(8 + 16, dtype=torch.float32)
    before = {t: dict(d) for t, d in layouts.tables().items()}
    # DDP regroups: the last layer first, then the first layer.
    last, first = layouts.key(order[2:]), None
    assert last == 1 and 0 in state.error_dict  # bucket 0's state still holds the first layer
    with pytest.raises(RuntimeError, match="split mid-regrouping"):
        layouts.saved()  # never at a checkpoint: every bucket goes through the hook each step
    first = layouts.key(order[:2])
    assert layouts.saved() == {1: list(order[2:]), 2: list(order[:2])}
    assert torch.equal(state.error_dict[2][:144], torch.arange(144.0))
    assert torch.equal(state.error_dict[1][:4], torch.arange(144.0, 148.0))
    assert torch.equal(state.p_memory_dict[1], torch.arange(16.0, 20.0))
    assert torch.equal(state.q_memory_dict[first], torch.arange(8.0))
    assert layouts.key(order[2:]) == last  # the same members: the same key, no copies
    back = layouts.key(order)  # and back: the very same tensors
    assert layouts.saved() == {back: list(order)}
    for at, numel in layouts.slots(order)[0].values():
        span = slice(at, at + numel)
        assert torch.equal(state.error_dict[back][span], before["error"][0][span])
    assert torch.equal(state.p_memory_dict[back], before["p"][0])
    assert torch.equal(state.q_memory_dict[back], before["q"][0])


def powersgd_steps(layouts_per_step: list[list[list[int]]]) -> list[list[torch.Tensor]]:
    """Every parameter's all-reduced gradient at each step of a one-process PowerSGD run whose
    DDP buckets hold the parameters (by number, in DDP's order) that `layouts_per_step` says."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    shapes = [(16, 8), (16,), (8, 32), (16, 8), (6, 2, 3, 3)]
    named = [(f"p{i}", torch.nn.Parameter(torch.zeros(s))) for i, s in enumerate(shapes)]
    state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2)
    layouts, gen, outputs = BucketLayouts(state, named), torch.Generator().manual_seed(0), []
    state.iter = 2
    for buckets in layouts_per_step:
        grads = [torch.randn(s, generator=gen) for s in shapes]
        out = [torch.empty(0)] * len(shapes)
        for number, members in enumerate(buckets):
            bucket = FakeBucket([named[i] for i in members], [grads[i].clone() for i in members],
                                last=number == len(buckets) - 1)  # fmt: skip
            layouts.hook(state, bucket).wait()
            for i, view in zip(members, bucket.views, strict=True):
                out[i] = view
        layouts.saved()  # nothing pending between steps
        outputs.append(out)
    return outputs


@pytest.mark.quick
def test_powersgd_continues_bitwise_when_ddp_regroups_its_buckets(one_process_group) -> None:
    """Real powerSGD_hook calls: a run whose buckets DDP regroups twice (every bucket's members
    change, in an order where one bucket's new key takes state from a key another bucket of
    the same step still holds) gives every parameter the same result, bitwise, at every
    step, as a run that keeps one layout."""
    kept = [[[3, 4], [0, 1, 2]]] * 7
    regrouped = [[[3, 4], [0, 1, 2]]] * 3 + [[[4], [2, 3], [1, 0]]] * 2 + [[[0, 1, 2, 3, 4]]] * 2
    for step, (a, b) in enumerate(
        zip(powersgd_steps(kept), powersgd_steps(regrouped), strict=True)
    ):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(x, y), f"parameter {i} differs at step {step}"


@pytest.mark.quick
def test_powersgd_state_of_another_layout_is_refused_in_one_line() -> None:
    """A state saved unaligned (the layout before 2026-12-02 evening) would be sliced wrongly."""
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    hook = powersgd_hook(net)
    order = ["0.weight", "0.bias", "1.weight", "1.bias"]
    unaligned = {"layouts": {0: order}, "error_dict": {0: torch.zeros(128 + 16 + 64 + 4)}}
    with pytest.raises(UserError, match="PowerSGD state beside this checkpoint has another"):
        hook.load_state_dict(unaligned)


@pytest.mark.quick
@pytest.mark.parametrize(
    ("key", "saved", "new"),
    [("matrix_approximation_rank", 1, 2), ("start_powerSGD_iter", 10, 20),
     ("random_seed", 0, 7), ("warm_start", True, False)],
)  # fmt: skip
def test_a_changed_powersgd_setting_on_resume_is_refused_in_one_line(
    tmp_path, monkeypatch, caplog, key, saved, new
) -> None:
    """The saved state would silently override the new setting: a resume of the same run
    refuses it naming the key and both values; a new run from the checkpoint (an explicit
    ckpt_path) starts PowerSGD afresh with one warning."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    net, last = torch.nn.Sequential(torch.nn.Linear(8, 16)), tmp_path / "last.ckpt"
    old = powersgd_hook(net, **{key: saved})
    old.state.iter = 12
    comm_hook_files.save_state(old, last, 12)
    comm_hook_files.load_state(powersgd_hook(net, **{key: saved}), last, 12, "cpu")  # unchanged
    changed = powersgd_hook(net, **{key: new})
    with pytest.raises(UserError) as refused:
        comm_hook_files.load_state(changed, last, 12, "cpu")
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"strategy.comm_hook.{key}={new!r} differs ")
    assert f"{saved!r} the PowerSGD state beside last.ckpt was saved with" in line
    assert f"resume with strategy.comm_hook.{key}={saved!r}, or start a new run" in line
    comm_hook_files.load_state(changed, last, 12, "cpu", required=False)
    assert changed.state.iter == 0 and changed.config()[key] == new  # afresh, as configured
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0].endswith("was saved with: PowerSGD starts afresh")


@pytest.mark.quick
@pytest.mark.parametrize(("saved_world", "rank", "world"), [(2, 0, 1), (2, 1, 3), (1, 1, 2)])
def test_powersgd_state_of_another_world_size_starts_afresh(
    tmp_path, monkeypatch, caplog, saved_world, rank, world
) -> None:
    """An elastic restart on fewer or more nodes: every rank starts PowerSGD afresh (error
    feedback is per rank and cannot be redistributed), rank 0 says so in one warning; the same
    world size with this rank's file missing is still refused."""
    import torch.distributed as dist

    last = tmp_path / "last.ckpt"
    for saved_rank in range(saved_world):
        torch.save({"world_size": saved_world}, state_file(last, 7, saved_rank))
    monkeypatch.setattr(dist, "get_rank", lambda: rank)
    monkeypatch.setattr(dist, "get_world_size", lambda: world)
    hook = CommHook("powersgd")
    hook.load_state_dict = lambda saved: pytest.fail("restored another world size's state")
    comm_hook_files.load_state(hook, last, 7, "cpu")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ([f"PowerSGD state of step 7 was written by {saved_world} processes, this "
                         f"run has {world}: PowerSGD starts afresh (its per-rank error feedback "
                         "cannot be redistributed)"] if rank == 0 else [])  # fmt: skip
    monkeypatch.setattr(dist, "get_world_size", lambda: saved_world)
    state_file(last, 7, 0).unlink()
    with pytest.raises(UserError, match=r"last\.comm_hook\.step7\.rank0\.pt is missing"):
        monkeypatch.setattr(dist, "get_rank", lambda: 0)
        comm_hook_files.load_state(hook, last, 7, "cpu")


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
def test_powersgd_state_survives_a_preemption_in_both_trainers(
    base_args, log_dir, powersgd_whole
) -> None:
    """Every rank saves its own PowerSGD state beside the last checkpoint and gets it back on
    resume; the resumed run ends bitwise where the uninterrupted one does, though DDP's first
    step of a process lays its buckets out differently (a 1.2 MB model: one bucket in the
    first step, two regrouped ones after; odd layer sizes, so that a layout's offsets are
    not all multiples of 16 bytes). A resume whose per-rank state is missing is refused in
    one line."""
    args = [*base_args, *POWERSGD]
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
        assert_same_weights(ckpts.parent, powersgd_whole)


# Two ranks that save or load PowerSGD state files beside `last` (argv: last, save|load) and
# print the line a UserError becomes.
STATE_FILES = textwrap.dedent("""
    import sys
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    from project.engine.checkpoints import comm_hook_files
    from project.engine.distributed.comm_hooks import CommHook
    from project.engine.distributed.comm_hooks.powersgd_layout import BucketLayouts
    from project.engine.errors import UserError

    dist.init_process_group("gloo")
    hook = CommHook("powersgd")
    hook.state = PowerSGDState(process_group=None)
    hook.layouts = BucketLayouts(hook.state, torch.nn.Linear(8, 16).named_parameters())
    last, code = Path(sys.argv[1]), 0
    try:
        if sys.argv[2] == "save":
            comm_hook_files.save_state(hook, last, 7)
        else:
            comm_hook_files.load_state(hook, last, 7, "cpu")
    except UserError as err:
        print(f"error: {err}", flush=True)
        code = 2
    dist.destroy_process_group()
    sys.exit(code)
""")


@pytest.mark.distributed
@pytest.mark.parametrize("broken", ["unwritable", "unreadable"])
def test_one_ranks_bad_state_file_stops_every_rank_with_the_same_line(tmp_path, broken) -> None:
    """Rank 1 cannot write its state file (a folder is in the way), or cannot read it back:
    both ranks stop with the same one line naming that file, instead of rank 1 alone."""
    last = tmp_path / "last.ckpt"
    if broken == "unwritable":
        state_file(last, 7, 1).mkdir()
    else:
        net = torch.nn.Linear(8, 16)
        torch.save({"world_size": 2, **stored(powersgd_hook(net).state_dict())},
                   state_file(last, 7, 0))  # fmt: skip
        state_file(last, 7, 1).write_bytes(b"not a checkpoint")
    action, port = "save" if broken == "unwritable" else "load", str(free_port())
    rank_env = [{"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_PORT": port} for rank in range(2)]
    cmd = [sys.executable, "-c", STATE_FILES, str(last), action]
    procs = [start(cmd, MASTER_ADDR="127.0.0.1", **env) for env in rank_env]
    ends = [finish(proc, 60) for proc in procs]
    lines = [[ln for ln in out.splitlines() if ln.startswith("error: ")] for _, out in ends]
    assert [code for code, _ in ends] == [EXIT_BAD_INPUT] * 2, ends
    assert len(lines[0]) == 1 and lines[0] == lines[1], ends
    lines = lines[0]
    needle = {
        "unwritable": "the PowerSGD state of rank 1 could not be written to",
        "unreadable": "last.comm_hook.step7.rank1.pt beside last.ckpt cannot be read (",
    }[broken]
    assert lines[0].startswith(f"error: {needle}"), lines


@pytest.mark.distributed
def test_a_missing_state_file_stops_every_rank_of_a_resume_at_once(base_args, log_dir) -> None:
    """Under Lightning's own launcher (nothing ends the other ranks when one fails, unlike
    torchrun) one rank's PowerSGD file is deleted before the resume: every rank stops at once
    with the same line, exit 2, instead of rank 1 alone and rank 0 on a collective error."""
    args = [*base_args, "strategy=ddp_powersgd", "trainer.accelerator=cpu", "trainer.devices=2",
            "trainer.max_epochs=4", "test=false", "callbacks.early_stopping=null"]  # fmt: skip
    train = [sys.executable, "-m", "project.train", *args]
    stop = ["fault_injection.at_step=25", "fault_injection.mode=sigterm"]
    code, out = finish(start([*train, *stop], RUN_ID="lost"), 120)
    assert code == EXIT_PREEMPTED, out[-3000:]
    next((log_dir / "train/runs/lost/checkpoints").glob("*.comm_hook.step29.rank1.pt")).unlink()
    began = time.monotonic()
    code, out = finish(start(train, RUN_ID="lost"), 120)
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert code == EXIT_BAD_INPUT and len(set(errors)) == 1 and "Traceback" not in out, out[-3000:]
    assert errors[0].startswith("error: last.comm_hook.step29.rank1.pt is missing beside last.ckpt")
    assert time.monotonic() - began < 90  # well inside strategy.timeout (600 s)


@pytest.mark.distributed
def test_the_copy_cost_command_times_each_variant() -> None:
    """`python -m project.bench.powersgd_copies` (docs/performance.md): copies only where the
    fixed layout is used, none before PowerSGD compresses."""
    args = ["--repeats", "1", "--steps", "2", "--hidden", "32", "--layers", "2"]
    proc = run_script("-m project.bench.powersgd_copies", args, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {ln.split(" | ")[0].strip("| "): ln.split(" | ")[1:] for ln in proc.stdout.splitlines()
            if ln.startswith("| ") and "variant" not in ln}  # fmt: skip
    assert len(rows) == 5, proc.stdout
    for variant, (step_ms, copies_ms) in rows.items():
        assert float(step_ms) > 0
        assert (float(copies_ms.strip(" |")) > 0) == ("fixed layout" in variant), variant


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
