"""What the launcher told this process, read in one place (no torch: entry points use it
before any heavy import): which launcher started us, this process's rank, local rank and the
world size, and the name of the run.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import re
import secrets
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass


def rank(env: Mapping[str, str] = os.environ) -> int:
    """Global rank: torchrun's RANK, srun's SLURM_PROCID, else 0."""
    return int(env.get("RANK", env.get("SLURM_PROCID", 0)))


def local_rank(env: Mapping[str, str] = os.environ) -> int:
    return int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", 0)))


def world_size(env: Mapping[str, str] = os.environ) -> int:
    return int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", 1)))


def local_world_size(env: Mapping[str, str] = os.environ) -> int:
    """Processes on this node: torchrun's LOCAL_WORLD_SIZE, srun's SLURM_NTASKS_PER_NODE."""
    return int(env.get("LOCAL_WORLD_SIZE", env.get("SLURM_NTASKS_PER_NODE", 1)))


def node_rank(env: Mapping[str, str] = os.environ) -> int:
    """torchrun's GROUP_RANK, Lightning's NODE_RANK, srun's SLURM_NODEID."""
    return int(env.get("GROUP_RANK", env.get("NODE_RANK", env.get("SLURM_NODEID", 0))))


@dataclass(frozen=True)
class Launcher:
    """The processes an external launcher started: `devices` per node on `num_nodes` nodes."""

    name: str  # "torchrun" | "slurm"
    devices: int
    num_nodes: int
    flags: tuple[str, str]  # its options for processes per node and nodes (for error messages)


def detect_launcher(env: Mapping[str, str] = os.environ) -> Launcher | None:
    """torchrun (TORCHELASTIC_RUN_ID, as Lightning detects it) or `srun` one task per device.

    Kubernetes PyTorchJobs run torchrun in each pod (launch/k8s), so they are torchrun here.
    """
    if "TORCHELASTIC_RUN_ID" in env:
        local, world = int(env["LOCAL_WORLD_SIZE"]), int(env["WORLD_SIZE"])
        return Launcher("torchrun", local, max(1, world // local), ("--nproc-per-node", "--nnodes"))
    if "SLURM_NTASKS" in env and "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        nodes = int(env.get("SLURM_NNODES", 1))
        return Launcher(
            "slurm", int(env["SLURM_NTASKS"]) // nodes, nodes, ("--ntasks-per-node", "--nodes")
        )
    return None


def slurm_rendezvous(env: Mapping[str, str] = os.environ) -> tuple[str, int]:
    """Node 0 of this SLURM job at the address SLURM itself uses for it (NodeAddr), and a port
    of the job's own (as launch/slurm.sbatch): two jobs on one node never share a store."""

    def scontrol(*args: str) -> str:
        try:
            return subprocess.run(["scontrol", *args], capture_output=True, text=True,
                                  timeout=60).stdout  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return ""

    nodelist = env["SLURM_JOB_NODELIST"]
    head = (scontrol("show", "hostnames", nodelist).split() or [nodelist])[0]
    found = re.search(r"NodeAddr=(\S+)", scontrol("show", "node", head))
    return (found[1] if found else head), 20000 + int(env["SLURM_JOB_ID"]) % 40000


_run_id: str | None = None


def run_id() -> str:
    """A name for this run, the same in every process of the run.

    Order: env RUN_ID (set it to resume a run, or to name one across nodes) -> the torchrun
    job id (shared by all ranks and kept across `--max-restarts`; agreed through torchrun's
    store when it has none) -> SLURM job id + a digest of the command's overrides (a requeued
    job reruns the same command and finds its folder; two different runs inside one
    allocation do not share one) -> a fresh timestamp with a random suffix (so two runs
    started in the same second never collide).
    """
    global _run_id
    if _run_id is None:
        fresh = time.strftime("%Y-%m-%d_%H-%M-%S") + "_" + secrets.token_hex(2)
        elastic = os.environ.get("TORCHELASTIC_RUN_ID")
        if os.environ.get("RUN_ID"):
            _run_id = os.environ["RUN_ID"]
        elif elastic not in (None, "", "none"):
            _run_id = f"torchrun-{elastic}"
        elif elastic is not None:  # torchrun without a job id: the ranks agree on one
            _run_id = shared_run_id(fresh)
        elif os.environ.get("SLURM_JOB_ID"):
            _run_id = f"slurm-{os.environ['SLURM_JOB_ID']}-{command_digest(sys.argv[1:])}"
        else:
            _run_id = fresh
    return _run_id


COMMAND_ENV = "PROJECT_COMMAND"  # the command as the user typed it (the launch scripts set it)


def resume_command() -> str:
    """The exact command that resumes this run: `RUN_ID=<id> <the command as typed>`."""
    typed = os.environ.get(COMMAND_ENV)
    if not typed and os.environ.get("TORCHELASTIC_RUN_ID") is not None:
        typed = "<the same torchrun command>"  # a worker cannot see torchrun's own arguments
    typed = typed or shlex.join(["python", *sys.orig_argv[1:]])
    nodes = ""
    if "NODE_RANK=" in typed:
        nodes = " (on every node, each with its NODE_RANK)"
    elif node_count() > 1:  # c10d, torchrun's own flags, srun: the same line on every node
        nodes = " (on every node)"
    return f"RUN_ID={run_id()} {typed}{nodes}"


def node_count(env: Mapping[str, str] = os.environ) -> int:
    """The nodes this job runs on now: torchrun's GROUP_WORLD_SIZE (its agents in this
    round), srun's SLURM_NNODES; 1 for any other start."""
    if "TORCHELASTIC_RUN_ID" in env:
        return int(env.get("GROUP_WORLD_SIZE", 1))
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:  # a step's task, not the batch shell
        return int(env.get("SLURM_NNODES", 1))
    return 1


def command_digest(overrides: list[str]) -> str:
    """6 hex digits naming a set of overrides (order-free; Hydra's own `hydra.*` ignored)."""
    kept = sorted(o for o in overrides if not o.startswith("hydra."))
    return hashlib.sha1("\0".join(kept).encode()).hexdigest()[:6]


def is_rank_zero() -> bool:
    """True in the process that is (or will be) global rank 0, judged from the launcher's env.

    torchrun and SLURM set RANK / SLURM_PROCID; Lightning's own launcher sets only LOCAL_RANK
    and NODE_RANK on the processes it starts.
    """
    if "RANK" in os.environ or "SLURM_PROCID" in os.environ:
        return rank() == 0
    return local_rank() == 0 and node_rank() == 0


def shared_run_id(fresh_id: str, env: Mapping[str, str] = os.environ) -> str:
    """The run id all ranks of this torchrun job agree on, via the torchrun agent's store.

    torchrun gives no usable job id with static rendezvous or a default --rdzv-id ("none"),
    and ranks start in different seconds, so timestamps would split the run folder. The
    first rank to ask stores its id; everyone (restarted workers too) reads that one.
    """
    import torch.distributed as dist  # only here: the rest of this module is torch-free

    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return f"torchrun-{env['MASTER_ADDR']}-{env['MASTER_PORT']}"
    store = dist.TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=60),
    )
    return store.compare_set("project/run_id", "", fresh_id).decode()
