"""Starting the doctor's ranks on this node (its own rendezvous), or reading them from srun."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

from project.doctor.host import interfaces
from project.engine.distributed.exits import EXIT_BAD_INPUT, EXIT_FAILED, fail
from project.engine.launch import env as launcher_env
from project.engine.launch.env import run_id


def slurm_env(env: dict[str, str]) -> dict[str, str]:
    """Under `srun` (one task per device) the ranks come from SLURM's variables; node 0 is
    reached at the address SLURM itself uses for it (NodeAddr)."""
    addr, port = launcher_env.slurm_rendezvous(env)
    return {
        "RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"],
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": str(int(env["SLURM_NTASKS"]) // int(env.get("SLURM_NNODES", "1"))),
        "GROUP_RANK": env.get("SLURM_NODEID", "0"), "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
    }  # fmt: skip


def port_busy(addr: str, port: int) -> bool:
    """Whether `port` is taken on this host (only checked when node 0 is this host)."""
    with socket.socket() as s:
        try:
            s.bind((addr if addr.startswith("127.") else "", port))
        except OSError:
            return True
    return False


def is_local(addr: str) -> bool:
    try:
        resolved = socket.gethostbyname(addr)
    except OSError:
        fail(f"--master-addr {addr} does not resolve on {socket.gethostname()}")
    mine = {a.split("/")[0] for addrs in interfaces().values() for a in addrs}
    return resolved.startswith("127.") or resolved in mine


def rendezvous_port(args: argparse.Namespace) -> int:
    """--master-port, else a free one (one node) or 29510 (every node must name the same).
    A port already taken on node 0 is refused in one line, before any rank starts."""
    port = args.master_port
    if port is None:
        port = free_port() if args.nnodes == 1 else 29510
    if args.node_rank == 0 and is_local(args.master_addr) and port_busy(args.master_addr, port):
        fail(
            f"--master-port {port} is already in use on {socket.gethostname()} (another job, or "
            "a process left from an earlier one): pick another port"
        )
    return port


def wait_bounded(procs: list[subprocess.Popen[bytes]], seconds: float) -> list[int]:
    """The ranks' exit codes, waiting at most `seconds` for all of them: a rank still running
    then is killed (and the list gets a failure code)."""
    deadline = time.monotonic() + seconds
    codes = []
    try:
        for proc in procs:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        print("error: the doctor's ranks did not finish in time: stopped them", file=sys.stderr)
        codes.append(EXIT_FAILED)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return codes


def spawn(args: argparse.Namespace, argv: list[str]) -> int:
    """Start this node's ranks (our own rendezvous) and wait for them, bounded."""
    import torch

    nproc = args.nproc or max(1, torch.cuda.device_count())
    world = nproc * args.nnodes
    if world % args.tp:
        fail(f"--tp {args.tp} does not divide the world size {world} ({args.nnodes} x {nproc})")
    base = {
        **os.environ,
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": str(args.node_rank),
        "MASTER_ADDR": args.master_addr,
        "MASTER_PORT": str(rendezvous_port(args)),
        "RUN_ID": os.environ.get("RUN_ID") or run_id(),
    }
    base.setdefault("OMP_NUM_THREADS", "1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "project.doctor", *argv],
            env={**base, "RANK": str(args.node_rank * nproc + i), "LOCAL_RANK": str(i)},
        )
        for i in range(nproc)
    ]
    codes = wait_bounded(procs, 3 * args.timeout + 120)
    return EXIT_BAD_INPUT if EXIT_BAD_INPUT in codes else int(any(codes))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
