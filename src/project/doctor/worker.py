"""One rank of the doctor: check in, build the group, run the checks, report (rank 0)."""

from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path
from typing import Any

from project.doctor.checks import bandwidth, collectives, nccl_transports, subgroups
from project.doctor.host import self_report
from project.doctor.rendezvous import Rendezvous, missing_report
from project.doctor.report import network_notes, rank_table_problems, render, write_doc
from project.engine.distributed.exits import EXIT_FAILED, EXIT_OK, close_process_group, fail
from project.engine.launch import env as launcher_env
from project.engine.launch.env import run_id


class Rank:
    """Who this process is, from the launcher's environment (torchrun, srun, our own spawn)."""

    def __init__(self, env: os._Environ[str] | dict[str, str], backend: str) -> None:
        import torch

        self.rank, self.world = launcher_env.rank(env), launcher_env.world_size(env)
        self.local_rank, self.node_rank = launcher_env.local_rank(env), launcher_env.node_rank(env)
        self.local_world = launcher_env.local_world_size(env)
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl" and not torch.cuda.is_available():
            fail("--backend nccl needs CUDA GPUs; use gloo on CPU")
        self.backend = backend
        self.device = torch.device(f"cuda:{self.local_rank}" if backend == "nccl" else "cpu")
        if backend == "nccl":
            torch.cuda.set_device(self.device)

    def doc(self, ranks: dict[int, Any] | None, problems: list[str]) -> dict[str, Any]:
        """The skeleton of doctor.json."""
        return {"world_size": self.world, "nnodes": self.world // self.local_world,
                "backend": self.backend, "ranks": ranks or {}, "problems": problems,
                "collectives": {}, "bandwidth": [], "notes": [], "nccl_transports": []}  # fmt: skip


def gate(me: Rank, rdzv: Rendezvous, args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    """Check in; go on only when every rank arrived and no host names a missing interface
    (gloo would hang or fail building the group). Returns every rank's report (rank 0)."""
    report = self_report(me.rank, me.local_rank, me.local_world, me.node_rank, me.backend)
    arrived = rdzv.check_in(report) or {}
    if me.rank == 0:
        if len(arrived) < me.world:
            reason = missing_report(arrived, me.world, me.local_world)
            rdzv.verdict(f"stop: not every rank arrived within {args.timeout:g} s: {reason}")
        else:
            interfaces_wrong = [p for p in rank_table_problems(arrived) if "interface" in p]
            rdzv.verdict("stop: " + "; ".join(interfaces_wrong) if interfaces_wrong else "go")
    verdict = rdzv.verdict()
    if verdict == "go":
        return arrived
    reason = verdict.removeprefix("stop: ")
    if me.rank == 0:
        fail(f"{reason} ({write_doc(me.doc(arrived, [reason]), args.log_dir)})", code=EXIT_FAILED)
    fail(f"rank {me.rank}: rank 0 stopped the check: {reason}", code=EXIT_FAILED)


def nccl_debug_file(me: Rank, env: os._Environ[str], log_dir: str) -> Path:
    """Where NCCL logs its choices, for the report's transports. Switched on (NCCL_DEBUG=INFO)
    only on nccl and when the user has not set NCCL_DEBUG: their setting wins."""
    debug_file = Path(log_dir) / "doctor" / "runs" / run_id() / "nccl.%h.%p.log"
    if me.backend == "nccl" and "NCCL_DEBUG" not in env:
        debug_file.parent.mkdir(parents=True, exist_ok=True)
        env.update(NCCL_DEBUG="INFO", NCCL_DEBUG_FILE=str(debug_file))
    return debug_file


def open_rendezvous(me: Rank, env: os._Environ[str], timeout: float) -> Rendezvous:
    """The doctor's store. Under torchrun MASTER_PORT may be the agent's own store: join it,
    in a key space of this attempt. Otherwise rank 0 hosts the store."""
    attempt = f"{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return Rendezvous(env["MASTER_ADDR"], int(env["MASTER_PORT"]), me.rank, me.world, timeout,
                      host_store=env.get("TORCHELASTIC_USE_AGENT_STORE") != "True",
                      prefix=f"doctor/{attempt}")  # fmt: skip


def run_checks(me: Rank, args: argparse.Namespace) -> tuple[dict[str, Any], list[dict]]:
    """This rank's collective and sub-group results, then the bandwidth rows: none when a
    collective failed, since the group may then fail or hang in the bandwidth loop."""
    results = collectives(me.rank, me.world, me.device)
    results.update(subgroups(me.rank, me.world, args.tp, me.device))
    failed = any(status == "failed" for status, _, _ in results.values())
    rows = [] if failed else bandwidth(me.world, args.max_mb, me.device)
    return results, rows


def collective_problems(by_rank: dict[int, dict[str, Any]]) -> list[str]:
    """One line per collective that failed or gave a wrong result, on every rank."""
    return [f"{name} on rank {r}: {status} {detail}".strip()
            for r, res in sorted(by_rank.items())
            for name, (status, _, detail) in res.items()
            if status in ("failed", "wrong")]  # fmt: skip


def rank0_verdict(rdzv: Rendezvous, timeout: float) -> int:
    """A rank other than 0 exits with rank 0's verdict on every rank's results."""
    rdzv.store.wait(["final"], datetime.timedelta(seconds=timeout + 60))
    return EXIT_OK if rdzv.store.get("final") == b"ok" else EXIT_FAILED


def worker(args: argparse.Namespace) -> int:
    """The checks in one process; rank 0 reports, the others exit with its verdict."""
    import torch.distributed as dist

    env = os.environ
    me = Rank(env, args.backend)
    if me.world % args.tp:
        fail(f"--tp {args.tp} does not divide the world size {me.world}")
    debug_file = nccl_debug_file(me, env, args.log_dir)
    rdzv = open_rendezvous(me, env, args.timeout)
    arrived = gate(me, rdzv, args)
    dist.init_process_group(me.backend, store=dist.PrefixStore("pg", rdzv.store), rank=me.rank,
                            world_size=me.world,
                            timeout=datetime.timedelta(seconds=args.timeout))  # fmt: skip
    try:
        results, rows = run_checks(me, args)
        rdzv.post("result", {k: list(v) for k, v in results.items()})
        if me.rank != 0:
            return rank0_verdict(rdzv, args.timeout)
        problems = rank_table_problems(arrived) + collective_problems(rdzv.collect("result"))
        doc = me.doc(arrived, problems)
        doc.update(collectives=results, bandwidth=rows, args=vars(args),
                   notes=network_notes(arrived, doc["nnodes"]),
                   nccl_transports=nccl_transports(debug_file))  # fmt: skip
        rdzv.store.set("final", "problems" if problems else "ok")
        print(f"{render(doc)}\nreport: {write_doc(doc, args.log_dir)}", flush=True)
        return EXIT_FAILED if problems else EXIT_OK
    finally:
        close_process_group()
