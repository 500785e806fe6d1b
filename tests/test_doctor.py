"""project.doctor with real processes on gloo: its own rendezvous, torchrun, the launch scripts,
two network namespaces as two hosts, a node that never starts, a busy port, bad input."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, finish, free_port, start, torchrun

pytestmark = pytest.mark.distributed
DOCTOR = [sys.executable, "-m", "project.doctor"]
COLLECTIVES = ["barrier", "broadcast", "all_reduce(sum)", "all_reduce(max)", "reduce",
               "all_gather", "gather", "scatter", "reduce_scatter", "all_to_all",
               "send/recv ring"]  # fmt: skip


def report(log_dir: Path) -> dict:
    (path,) = (log_dir / "doctor" / "runs").glob("*/doctor.json")
    return json.loads(path.read_text())


def assert_healthy(doc: dict, world: int) -> None:
    assert doc["problems"] == [] and doc["world_size"] == world
    assert [doc["collectives"][name][0] for name in COLLECTIVES] == ["ok"] * len(COLLECTIVES)
    assert sorted(int(r) for r in doc["ranks"]) == list(range(world))
    rows = doc["bandwidth"]
    assert rows[0]["bytes"] == 4 and rows[1]["bytes"] == 4096
    for row in rows:
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 2 * (world - 1) / world)


def test_own_rendezvous_two_processes(log_dir) -> None:
    code, out = finish(start([*DOCTOR, "--nproc", "2", "--max-mb", "1", "--log-dir",
                              str(log_dir)]), 120)  # fmt: skip
    assert code == 0, out[-3000:]
    assert "doctor: all checks passed" in out and "busbw (GB/s)" in out
    doc = report(log_dir)
    assert_healthy(doc, 2)
    assert {doc["ranks"][r]["local_rank"] for r in ("0", "1")} == {0, 1}
    assert "dp group [0, 1]" in doc["collectives"]


@pytest.mark.slow
def test_under_torchrun_with_tensor_parallel_groups(log_dir) -> None:
    cmd = torchrun(
        ["-m", "project.doctor", "--tp", "2", "--max-mb", "0.1", "--log-dir", str(log_dir)]
    )
    code, out = finish(start(cmd), 120)
    assert code == 0, out[-3000:]
    doc = report(log_dir)
    assert_healthy(doc, 2)
    assert doc["collectives"]["tp group [0, 1]"][0] == "ok"
    assert doc["collectives"]["dp group [0]"][0] == "ok"


@pytest.mark.slow
def test_two_nodes_through_the_launch_script(log_dir) -> None:
    script = str(ROOT / "launch" / "multinode.sh")
    env = {"NNODES": "2", "NPROC_PER_NODE": "1", "MASTER_PORT": str(free_port()),
           "TRAINER": "doctor"}  # fmt: skip
    args = ["--max-mb", "0.1", "--log-dir", str(log_dir)]
    procs = [start([script, *args], NODE_RANK=str(rank), **env) for rank in (0, 1)]
    for proc in procs:
        code, out = finish(proc, 120)
        assert code == 0, out[-3000:]
    doc = report(log_dir)
    assert_healthy(doc, 2)
    assert doc["nnodes"] == 2 and doc["ranks"]["1"]["node_rank"] == 1


def test_a_node_that_never_starts_is_named(log_dir) -> None:
    began = time.monotonic()
    cmd = [*DOCTOR, "--nnodes", "2", "--node-rank", "0", "--nproc", "1", "--timeout", "5",
           "--master-port", str(free_port()), "--log-dir", str(log_dir)]  # fmt: skip
    code, out = finish(start(cmd), 60)
    assert code == 1, out[-3000:]
    assert "missing ranks [1] (node ranks [1])" in out and "was not started" in out
    assert time.monotonic() - began < 30
    assert report(log_dir)["problems"]


def test_busy_master_port_is_one_line(log_dir) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, out = finish(start([*DOCTOR, "--nproc", "1", "--master-port", str(port)]), 30)
    assert code == 2 and out.strip() == (
        f"error: --master-port {port} is already in use on {socket.gethostname()} (another "
        "job, or a process left from an earlier one): pick another port"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "2", "--tp", "3"], "--tp 3 does not divide the world size 2"),
        (["--max-mb", "0"], "--max-mb 0 must be > 0"),
        (["--backend", "mpi"], "--backend 'mpi' is not one of auto, gloo, nccl"),
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2 must be one of 0..1"),
    ],
)
def test_bad_input_is_one_line(args: list[str], message: str) -> None:
    code, out = finish(start([*DOCTOR, *args]), 30)
    assert code == 2 and out.strip().startswith(f"error: {message}"), out
    assert len(out.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("wrong_interface", [False, True], ids=["right", "wrong-interface"])
def test_two_hosts_in_network_namespaces(netns_pair, log_dir, wrong_interface) -> None:
    ns, dev, addrs = netns_pair
    port = "29561"
    procs = []
    for rank in (0, 1):
        iface = "nosuch0" if wrong_interface and rank == 1 else dev[rank]
        cmd = ["ip", "netns", "exec", ns[rank], *DOCTOR, "--nnodes", "2", "--node-rank",
               str(rank), "--nproc", "1", "--master-addr", addrs[0], "--master-port", port,
               "--timeout", "20", "--max-mb", "0.1", "--log-dir", str(log_dir)]  # fmt: skip
        procs.append(start(cmd, GLOO_SOCKET_IFNAME=iface))
    began = time.monotonic()
    results = [finish(p, 90) for p in procs]
    out = results[0][1] + results[1][1]
    if not wrong_interface:
        assert [c for c, _ in results] == [0, 0], out[-3000:]
        doc = report(log_dir)
        assert_healthy(doc, 2)
        assert doc["ranks"]["1"]["env"]["GLOO_SOCKET_IFNAME"] == dev[1]
    else:
        assert all(c == 1 for c, _ in results), out[-3000:]
        assert "GLOO_SOCKET_IFNAME=nosuch0: no interface 'nosuch0' on this host" in out
        assert time.monotonic() - began < 60  # reported, not hung


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs (nccl)")
def test_nccl_on_gpus(log_dir) -> None:
    n = min(2, torch.cuda.device_count())
    code, out = finish(start([*DOCTOR, "--nproc", str(n), "--max-mb", "64", "--log-dir",
                              str(log_dir)]), 300)  # fmt: skip
    assert code == 0, out[-3000:]
    doc = report(log_dir)
    if n > 1:
        assert_healthy(doc, n)
    assert doc["backend"] == "nccl" and doc["ranks"]["0"]["device"]["type"] == "cuda"
