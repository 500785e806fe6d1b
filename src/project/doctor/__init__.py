"""`python -m project.doctor`: check the distributed set-up before a job spends hours on it.

    python -m project.doctor --nproc 2                        # a local group of 2 processes
    torchrun --nproc-per-node=8 -m project.doctor --tp 2      # under torchrun (any launcher)
    TRAINER=doctor NNODES=2 NODE_RANK=0 MASTER_ADDR=... launch/multinode.sh --max-mb 256
    python -m project.doctor --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29510
                       # its own rendezvous, for when torchrun itself is what hangs

Every rank checks in at a rendezvous store with a deadline (`--timeout`), so a node that never
starts is reported by number instead of waited on. Then: the rank table (host, ranks, device,
versions), every collective checked for its exact result, tensor-parallel x data-parallel
sub-groups (`--tp`), all_reduce bandwidth and latency, and the environment and network of
every host. Rank 0 prints the report and writes doctor.json into logs/doctor/runs/<run id>/.
Exit code (project.engine.distributed.exits): 0 all checks passed, 1 a check failed (the report
says which), 2 bad input.

The package: args (the command line), host (what each rank knows about itself), rendezvous,
checks, report, worker (one rank), spawn (starting the ranks on this node).
"""

from __future__ import annotations

import os
import sys

from project.doctor.args import parse_args
from project.doctor.spawn import slurm_env, spawn
from project.doctor.worker import worker


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ and "SLURM_STEP_ID" in os.environ:
        os.environ.update(slurm_env(dict(os.environ)))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by a launcher
        sys.exit(worker(args))
    sys.exit(spawn(args, argv))
