"""The doctor's own rendezvous: every rank checks in with a deadline, so a node that never
starts is reported by number instead of waited on."""

from __future__ import annotations

import datetime
import json
import time
from typing import Any

from project.engine.distributed.exits import EXIT_FAILED, fail

CAUSES = (
    "that node was not started (or crashed before the rendezvous)",
    "a wrong MASTER_ADDR or port: every node must name node 0's address",
    "a firewall between the nodes blocks the port",
    "the wrong network interface (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)",
)


class Rendezvous:
    """Every rank checks in at a TCPStore on node 0; rank 0 waits until `timeout` for all of
    them and then tells everyone to go on or to stop (naming who is missing)."""

    def __init__(
        self,
        addr: str,
        port: int,
        rank: int,
        world: int,
        timeout: float,
        host_store: bool,
        prefix: str,
    ) -> None:
        import torch.distributed as dist

        self.rank, self.world, self.timeout = rank, world, timeout
        try:
            store = dist.TCPStore(
                addr,
                port,
                is_master=host_store and rank == 0,
                timeout=datetime.timedelta(seconds=timeout),
                wait_for_workers=False,
            )
        except Exception as err:  # any failure to reach it is the finding
            causes = "; ".join(CAUSES[:3])
            fail(
                f"rank {rank}: cannot reach the rendezvous store at {addr}:{port} within "
                f"{timeout:g} s ({type(err).__name__}): node rank 0 is missing or unreachable. "
                f"Likely causes: {causes}",
                code=EXIT_FAILED,
            )
        self.store = dist.PrefixStore(prefix, store)

    def check_in(self, report: dict[str, Any]) -> dict[int, dict[str, Any]] | None:
        """Rank 0: every rank's report, or None after the deadline. Others: None."""
        self.store.set(f"arrive/{self.rank}", json.dumps(report))
        if self.rank != 0:
            return None
        deadline = time.monotonic() + self.timeout
        arrived: dict[int, dict[str, Any]] = {}
        while time.monotonic() < deadline and len(arrived) < self.world:
            for r in range(self.world):
                if r not in arrived and self.store.check([f"arrive/{r}"]):
                    arrived[r] = json.loads(self.store.get(f"arrive/{r}"))
            time.sleep(0.05)
        return arrived

    def verdict(self, value: str | None = None) -> str:
        """Rank 0 sets it ("go" or the reason to stop); the others wait for it."""
        if value is not None:
            self.store.set("verdict", value)
            return value
        self.store.wait(["verdict"], datetime.timedelta(seconds=self.timeout + 30))
        return self.store.get("verdict").decode()

    def post(self, key: str, value: Any) -> None:
        self.store.set(f"{key}/{self.rank}", json.dumps(value))

    def collect(self, key: str) -> dict[int, Any]:
        keys = [f"{key}/{r}" for r in range(self.world)]
        self.store.wait(keys, datetime.timedelta(seconds=self.timeout + 30))
        return {r: json.loads(self.store.get(k)) for r, k in enumerate(keys)}


def missing_report(arrived: dict[int, Any], world: int, local_world: int) -> str:
    missing = [r for r in range(world) if r not in arrived]
    nodes = sorted({r // local_world for r in missing})
    return (
        f"missing ranks {missing} (node ranks {nodes}); arrived: {sorted(arrived)}. "
        f"Likely causes, in order: {'; '.join(CAUSES)}"
    )
