"""The doctor's command line: options, checked with one-line errors (exit 2)."""

from __future__ import annotations

import argparse
from typing import NoReturn

from project.engine.config.compose import ROOT_DIR
from project.engine.distributed.exits import fail

DESCRIPTION = "check the distributed set-up before a job spends hours on it"


class Args(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2 (argparse prints usage)
        fail(f"{message} (see python -m project.doctor --help)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = Args(prog="python -m project.doctor", description=DESCRIPTION)
    p.add_argument("--nproc", type=int, default=None, help="processes to start on this node")
    p.add_argument("--nnodes", type=int, default=1, help="nodes (own rendezvous)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank (own rendezvous)")
    p.add_argument("--master-addr", default="127.0.0.1", help="node 0's address")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port on node 0")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for every rank")
    p.add_argument("--max-mb", type=float, default=64.0, help="largest bandwidth message (MiB)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel group size to check")
    p.add_argument("--backend", default="auto", help="auto (nccl on GPU, else gloo) | gloo | nccl")
    p.add_argument("--log-dir", default=str(ROOT_DIR / "logs"), help="where run folders go")
    args = p.parse_args(argv)
    if args.backend not in ("auto", "gloo", "nccl"):
        p.error(f"--backend {args.backend!r} is not one of auto, gloo, nccl")
    if args.max_mb <= 0:
        p.error(f"--max-mb {args.max_mb:g} must be > 0")
    if args.timeout <= 0:
        p.error(f"--timeout {args.timeout:g} must be > 0")
    for name in ("tp", "nnodes"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.nproc is not None and args.nproc < 1:
        p.error(f"--nproc {args.nproc} must be >= 1")
    if not 0 <= args.node_rank < args.nnodes:
        p.error(f"--node-rank {args.node_rank} must be one of 0..{args.nnodes - 1}")
    return args
