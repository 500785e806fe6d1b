"""Topology, strategy and hardware checks from config + environment (no processes started)."""

from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

from project.engine.distributed import ddp
from project.engine.errors import UserError

TORCHRUN_2x1 = {"TORCHELASTIC_RUN_ID": "abc", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}
TORCHRUN_1x2 = {"TORCHELASTIC_RUN_ID": "none", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "2"}


pytestmark = pytest.mark.quick  # the fast tier: `make test`


def trainer_cfg(**kw):
    return OmegaConf.create({"devices": "auto", "num_nodes": "auto", "accelerator": "cpu", **kw})


def test_no_launcher_auto_means_one_process() -> None:
    cfg = trainer_cfg()
    topo = ddp.resolve_topology(cfg, env={})
    assert (topo.devices, topo.num_nodes, topo.launcher) == (1, 1, None)
    assert (cfg.devices, cfg.num_nodes) == (1, 1)  # written back for Lightning and the log


def test_no_launcher_explicit_devices_kept() -> None:
    assert ddp.resolve_topology(trainer_cfg(devices=4), env={}).world_size == 4


@pytest.mark.parametrize(("env", "devices", "nodes"), [(TORCHRUN_2x1, 2, 1), (TORCHRUN_1x2, 1, 2)])
def test_torchrun_topology_followed(env, devices: int, nodes: int) -> None:
    topo = ddp.resolve_topology(trainer_cfg(), env=env)
    assert (topo.devices, topo.num_nodes, topo.launcher.name) == (devices, nodes, "torchrun")


def test_slurm_srun_per_task_topology() -> None:
    env = {"SLURM_NTASKS": "8", "SLURM_NNODES": "2", "SLURM_PROCID": "3", "SLURM_STEP_ID": "0"}
    topo = ddp.resolve_topology(trainer_cfg(), env=env)
    assert (topo.devices, topo.num_nodes, topo.launcher.name) == (4, 2, "slurm")


def test_sbatch_script_itself_is_not_a_launcher() -> None:
    # Inside an allocation but not inside an srun step: plain python, no SLURM topology.
    assert ddp.detect_launcher({"SLURM_NTASKS": "8", "SLURM_JOB_ID": "1"}) is None


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ({"devices": 1}, "trainer.devices=1 but torchrun started 2 processes per node"),
        ({"num_nodes": 2}, "trainer.num_nodes=2 but torchrun started 1 node(s)"),
    ],
)
def test_explicit_value_contradicting_launcher_is_refused(override, needle: str) -> None:
    with pytest.raises(UserError, match=re.escape(needle)) as err:
        ddp.resolve_topology(trainer_cfg(**override), env=TORCHRUN_2x1)
    assert "drop the" in str(err.value) and "--n" in str(err.value)


def test_matching_explicit_value_is_fine() -> None:
    assert ddp.resolve_topology(trainer_cfg(devices=2), env=TORCHRUN_2x1).world_size == 2


@pytest.mark.parametrize("devices", [1, 2, "auto"])
def test_several_nodes_without_a_launcher_are_refused(devices) -> None:
    """Plain python starts processes on one node only: num_nodes=2 would wait for the other
    node's ranks, which nothing starts (issue 53), in both trainers (the check they share)."""
    needle = "trainer.num_nodes=2 needs a launcher on every node"
    with pytest.raises(UserError, match=re.escape(needle)) as err:
        ddp.resolve_topology(trainer_cfg(devices=devices, num_nodes=2), env={})
    assert "launch/multinode.sh" in str(err.value)
    assert ddp.resolve_topology(trainer_cfg(devices=devices, num_nodes=1), env={}).num_nodes == 1
    # Lightning's own multi-node start: NODE_RANK and MASTER_ADDR set by hand on each node
    by_hand = {"NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert ddp.resolve_topology(trainer_cfg(devices=devices, num_nodes=2), env=by_hand)


@pytest.mark.parametrize("bad", ["two", 0, -3])
def test_bad_device_counts(bad) -> None:
    with pytest.raises(UserError, match=r"trainer\.devices"):
        ddp.resolve_topology(trainer_cfg(devices=bad), env={})


def strategy_cfg(**kw):
    base = OmegaConf.load("configs/strategy/ddp.yaml")
    return OmegaConf.merge(base, kw)


def test_single_process_gets_no_ddp_wrapper() -> None:
    topo = ddp.Topology(1, 1, None)
    assert ddp.build_strategy(strategy_cfg(), topo) == "auto"


def test_multi_process_gets_configured_ddp() -> None:
    from lightning.pytorch.strategies import DDPStrategy

    cfg = strategy_cfg(static_graph=True, bucket_cap_mb=5, find_unused_parameters=True)
    strategy = ddp.build_strategy(cfg, ddp.Topology(2, 1, None))
    assert isinstance(strategy, DDPStrategy)
    assert strategy._ddp_kwargs == {
        "find_unused_parameters": True, "gradient_as_bucket_view": False,
        "static_graph": True, "bucket_cap_mb": 5,
    }  # fmt: skip
    assert strategy._timeout.total_seconds() == 600


@pytest.mark.parametrize(
    ("strategy", "trainer", "needle"),
    [
        ({}, {"sync_batchnorm": True}, "sync_batchnorm=true needs CUDA"),
        ({"process_group_backend": "nccl"}, {}, "process_group_backend=nccl needs CUDA"),
        ({"bucket_cap": 5}, {}, "strategy.bucket_cap is not a DDPStrategy"),
    ],
)
def test_hardware_and_option_checks_on_cpu(strategy, trainer, needle: str) -> None:
    with pytest.raises(UserError, match=needle):
        ddp.check_options(strategy_cfg(**strategy), trainer_cfg(**trainer))


def test_threads_default_to_cores_per_process() -> None:
    import os

    import torch

    before = torch.get_num_threads()
    try:
        check_threads(os.cpu_count() or 1)
    finally:
        torch.set_num_threads(before)


def check_threads(cpus: int) -> None:
    env: dict[str, str] = {}
    threads = ddp.configure_threads(ddp.Topology(1, 2, None), env)
    assert threads == cpus and env["OMP_NUM_THREADS"] == str(threads)
    env = {}
    assert ddp.configure_threads(ddp.Topology(64, 1, None), env) == 1  # never 0
    assert ddp.configure_threads(ddp.Topology(1, 1, None), {"OMP_NUM_THREADS": "3"}) == 3
