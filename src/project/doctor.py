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
Exit code: 0 all checks passed, 1 a check failed (the report says which), 2 bad input.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from project.engine.config.compose import ROOT_DIR, run_id
from project.engine.launch import env as launcher_env

ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_DISTRIBUTED_", "TORCH_NCCL_", "MASTER_", "CUDA_VISIBLE")
CAUSES = (
    "that node was not started (or crashed before the rendezvous)",
    "a wrong MASTER_ADDR or port: every node must name node 0's address",
    "a firewall between the nodes blocks the port",
    "the wrong network interface (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)",
)


class Args(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2 (argparse prints usage)
        die(f"{message} (see python -m project.doctor --help)")


def die(message: str, code: int = 2) -> NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = Args(prog="python -m project.doctor", description=__doc__.split("\n\n")[0])
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


# --- what each rank knows about itself --------------------------------------------------------
def interfaces() -> dict[str, list[str]]:
    """Network interfaces of this host and their addresses (names only without `ip`)."""
    found: dict[str, list[str]] = {name: [] for _, name in socket.if_nameindex()}
    try:
        out = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, timeout=5)
        for line in out.stdout.splitlines():
            parts = line.split()
            if len(parts) > 3 and parts[2] in ("inet", "inet6"):
                found.setdefault(parts[1], []).append(parts[3])
    except (OSError, subprocess.SubprocessError):
        pass
    return found


def missing_ifnames(env: dict[str, str], names: set[str]) -> list[str]:
    """`*_SOCKET_IFNAME` values naming no interface here (NCCL: comma list, prefixes, ^excl)."""
    problems = []
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        value = env.get(var)
        if not value or value.startswith("^"):
            continue
        exact = var == "GLOO_SOCKET_IFNAME"  # gloo takes exact names; NCCL also prefixes
        for want in value.lstrip("=").split(","):
            if not any(n == want or (not exact and n.startswith(want)) for n in names):
                problems.append(f"{var}={value}: no interface {want!r} on this host")
    return problems


def self_report(
    rank: int, local_rank: int, local_world: int, node_rank: int, backend: str
) -> dict[str, Any]:
    import torch

    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
    device: dict[str, Any] = {"type": "cpu"}
    if backend == "nccl":
        props = torch.cuda.get_device_properties(local_rank)
        device = {
            "type": "cuda",
            "index": local_rank,
            "name": props.name,
            "pci_bus_id": getattr(props, "pci_bus_id", None),
            "uuid": str(getattr(props, "uuid", "")),
        }
    nics = interfaces()
    return {
        "rank": rank,
        "local_rank": local_rank,
        "local_world_size": local_world,
        "node_rank": node_rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device": device,
        "backend": backend,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "env": env,
        "interfaces": nics,
        "problems": missing_ifnames(env, set(nics)),
    }


# --- the rendezvous ---------------------------------------------------------------------------
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
            die(
                f"rank {rank}: cannot reach the rendezvous store at {addr}:{port} within "
                f"{timeout:g} s ({type(err).__name__}): node rank 0 is missing or unreachable. "
                f"Likely causes: {causes}",
                code=1,
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


# --- the checks -------------------------------------------------------------------------------
def timed(fn: Callable[[], Any]) -> tuple[str, float, str]:
    """(status, milliseconds, detail): ok | wrong | unsupported | failed."""
    began = time.perf_counter()
    try:
        good = fn()
    except Exception as err:  # a failing collective is the finding
        text = " ".join(str(err).split())[:200]
        unsupported = "not supported" in text.lower() or "unsupported" in text.lower()
        return ("unsupported" if unsupported else "failed", 0.0, f"{type(err).__name__}: {text}")
    ms = (time.perf_counter() - began) * 1e3
    return ("ok", ms, "") if good else ("wrong", ms, "unexpected result")


def collectives(rank: int, world: int, device: Any) -> dict[str, tuple[str, float, str]]:
    """Each collective with inputs whose exact result is known (small integers in float32)."""
    import torch
    import torch.distributed as dist

    def t(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    def same(a: torch.Tensor, values: list[float]) -> bool:
        return torch.equal(a.cpu(), torch.tensor(values, dtype=torch.float32))

    tri = world * (world + 1) / 2

    def barrier() -> bool:
        dist.barrier()
        return True

    def broadcast() -> bool:
        x = t([42.0, 7.0] if rank == 0 else [0.0, 0.0])
        dist.broadcast(x, src=0)
        return same(x, [42.0, 7.0])

    def all_reduce(op: Any, expected: float) -> Callable[[], bool]:
        def run() -> bool:
            x = t([rank + 1.0])
            dist.all_reduce(x, op=op)
            return same(x, [expected])

        return run

    def reduce() -> bool:
        x = t([rank + 1.0])
        dist.reduce(x, dst=0)
        return rank != 0 or same(x, [tri])

    def all_gather() -> bool:
        out = [t([0.0]) for _ in range(world)]
        dist.all_gather(out, t([float(rank)]))
        return same(torch.cat(out), [float(r) for r in range(world)])

    def gather() -> bool:
        out = [t([0.0]) for _ in range(world)] if rank == 0 else None
        dist.gather(t([float(rank)]), out, dst=0)
        return rank != 0 or same(torch.cat(out), [float(r) for r in range(world)])

    def scatter() -> bool:
        x = t([0.0])
        dist.scatter(x, [t([10.0 * r]) for r in range(world)] if rank == 0 else None, src=0)
        return same(x, [10.0 * rank])

    def reduce_scatter() -> bool:
        x = t([0.0])
        dist.reduce_scatter(x, [t([float(rank + r)]) for r in range(world)])
        return same(x, [float(sum(s + rank for s in range(world)))])  # sum_s (s + r)

    def all_to_all() -> bool:
        out = [t([0.0]) for _ in range(world)]
        dist.all_to_all(out, [t([100.0 * rank + r]) for r in range(world)])
        return same(torch.cat(out), [100.0 * s + rank for s in range(world)])

    def ring() -> bool:
        if world == 1:
            return True
        got = t([-1.0])
        ops = [
            dist.P2POp(dist.isend, t([float(rank)]), (rank + 1) % world),
            dist.P2POp(dist.irecv, got, (rank - 1) % world),
        ]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        return same(got, [float((rank - 1) % world)])

    checks = {
        "barrier": barrier,
        "broadcast": broadcast,
        "all_reduce(sum)": all_reduce(dist.ReduceOp.SUM, tri),
        "all_reduce(max)": all_reduce(dist.ReduceOp.MAX, float(world)),
        "reduce": reduce,
        "all_gather": all_gather,
        "gather": gather,
        "scatter": scatter,
        "reduce_scatter": reduce_scatter,
        "all_to_all": all_to_all,
        "send/recv ring": ring,
    }
    return {name: timed(fn) for name, fn in checks.items()}


def grid_groups(world: int, tp: int) -> tuple[list[list[int]], list[list[int]]]:
    """TP x DP: TP groups are consecutive ranks, DP groups take one rank of each TP group."""
    tp_groups = [list(range(i, i + tp)) for i in range(0, world, tp)]
    dp_groups = [list(range(j, world, tp)) for j in range(tp)]
    return tp_groups, dp_groups


def subgroups(rank: int, world: int, tp: int, device: Any) -> dict[str, tuple[str, float, str]]:
    """Every rank creates every group (new_group is collective); an all_reduce in each of its
    own groups must sum exactly its members' values."""
    import torch
    import torch.distributed as dist

    results = {}
    tp_groups, dp_groups = grid_groups(world, tp)
    for kind, groups in (("tp", tp_groups), ("dp", dp_groups)):
        handles = [dist.new_group(g) for g in groups]
        mine = next(i for i, g in enumerate(groups) if rank in g)

        def run(members: list[int] = groups[mine], group: Any = handles[mine]) -> bool:
            x = torch.tensor([rank + 1.0], device=device)
            dist.all_reduce(x, group=group)
            return x.item() == sum(m + 1 for m in members)

        results[f"{kind} group {groups[mine]}"] = timed(run)
    return results


def bandwidth(world: int, max_mb: float, device: Any) -> list[dict[str, float]]:
    """all_reduce of float32 messages from 4 KiB up to max_mb, x4 each step; busbw as defined
    by nccl-tests: algbw x 2(n-1)/n. Plus a 4-byte latency row."""
    import torch
    import torch.distributed as dist

    rows = []
    sizes, size = [4], 4096
    while size <= max_mb * 2**20:
        sizes.append(size)
        size *= 4
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        iters = 50 if nbytes <= 65536 else max(3, min(20, int(2**26 / nbytes)))
        for _ in range(2):
            dist.all_reduce(x)
        times = []
        for _ in range(iters):
            dist.barrier()
            began = time.perf_counter()
            dist.all_reduce(x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - began)
        seconds = statistics.median(times)
        algbw = nbytes / seconds / 1e9
        rows.append(
            {
                "bytes": nbytes,
                "time_us": seconds * 1e6,
                "algbw_GBps": algbw,
                "busbw_GBps": algbw * 2 * (world - 1) / world,
            }
        )
    return rows


def nccl_transports(debug_file: Path) -> list[str]:
    """The transports NCCL reported choosing (NCCL_DEBUG=INFO lines "... via P2P/IPC")."""
    found = set()
    for path in debug_file.parent.glob(debug_file.name.replace("%h.%p", "*")):
        for line in path.read_text(errors="replace").splitlines():
            if " via " in line:
                found.add(line.split(" via ", 1)[1].split()[0])
    return sorted(found)


# --- the report -------------------------------------------------------------------------------
def table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def rank_table_problems(reports: dict[int, dict[str, Any]]) -> list[str]:
    problems = []
    for r, rep in sorted(reports.items()):
        expected = rep["node_rank"] * rep["local_world_size"] + rep["local_rank"]
        if r != expected:
            problems.append(
                f"rank {r} on {rep['host']}: expected node_rank x local_world_size "
                f"+ local_rank = {expected}"
            )
        problems += [f"rank {r} on {rep['host']}: {p}" for p in rep["problems"]]
    seats: dict[tuple[str, str], list[int]] = {}
    for r, rep in reports.items():
        dev = rep["device"]
        if dev["type"] == "cuda":
            key = (rep["host"], dev.get("uuid") or dev.get("pci_bus_id") or str(dev["index"]))
            seats.setdefault(key, []).append(r)
    for (host, dev), ranks in seats.items():
        if len(ranks) > 1:
            problems.append(
                f"ranks {ranks} share one GPU ({dev}) on {host}: set the device by "
                "LOCAL_RANK (torch.cuda.set_device)"
            )
    versions = {rep["torch"] for rep in reports.values()}
    if len(versions) > 1:
        problems.append(f"different torch versions across ranks: {sorted(versions)}")
    return problems


def network_notes(reports: dict[int, dict[str, Any]], nnodes: int) -> list[str]:
    notes = []
    addr = reports[0]["env"].get("MASTER_ADDR", "")
    try:
        resolved = socket.gethostbyname(addr) if addr else ""
    except OSError:
        resolved = "?"
    if nnodes > 1 and resolved.startswith("127."):
        notes.append(
            f"MASTER_ADDR={addr} resolves to a loopback address ({resolved}): other "
            "nodes cannot reach it; give node 0's network address"
        )
    for var in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE"):
        if reports[0]["env"].get(var) == "1":
            notes.append(f"{var}=1: a diagnostic switch that costs speed; unset it for training")
    return notes


def size_text(nbytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def device_text(device: dict[str, Any]) -> str:
    if device["type"] != "cuda":
        return "cpu"
    return f"{device['name']} #{device['index']} {device.get('pci_bus_id') or ''}".strip()


RANK_COLUMNS = ["rank", "host", "node", "local", "pid", "device", "CUDA_VISIBLE", "threads"]


def render(doc: dict[str, Any]) -> str:
    """The report rank 0 prints: tables, then one line per problem and the verdict."""
    reports = {int(r): rep for r, rep in doc["ranks"].items()}
    ranks = [
        [r, rep["host"], rep["node_rank"], rep["local_rank"], rep["pid"],
         device_text(rep["device"]), rep["cuda_visible_devices"] or "-", rep["threads"]]
        for r, rep in sorted(reports.items())
    ]  # fmt: skip
    checks = [[name, status, f"{ms:.2f}", detail]
              for name, (status, ms, detail) in doc["collectives"].items()]  # fmt: skip
    speeds = [[size_text(row["bytes"]), f"{row['time_us']:.1f}", f"{row['algbw_GBps']:.3f}",
               f"{row['busbw_GBps']:.3f}"] for row in doc["bandwidth"]]  # fmt: skip
    out = [
        f"project.doctor: {doc['world_size']} rank(s) on {doc['nnodes']} node(s), backend "
        f"{doc['backend']}, torch {reports[0]['torch']}",
        "\nRanks\n" + table(ranks, RANK_COLUMNS),
        "\nCollectives (exact results; ms on rank 0)\n"
        + table(checks, ["collective", "status", "ms", "detail"]),
    ]
    if speeds:
        columns = ["size", "time (us)", "algbw (GB/s)", "busbw (GB/s)"]
        title = "all_reduce bandwidth (median; busbw = algbw x 2(n-1)/n, as nccl-tests)"
        out.append(f"\n{title}\n{table(speeds, columns)}")
    for host, rep in {rep["host"]: rep for rep in reports.values()}.items():
        nics = ", ".join(f"{n} {' '.join(a)}".strip() for n, a in rep["interfaces"].items())
        env = ", ".join(f"{k}={v}" for k, v in sorted(rep["env"].items())) or "(none set)"
        out.append(f"\nHost {host}: interfaces: {nics}\n  environment: {env}")
    if doc["nccl_transports"]:
        out.append(f"\nNCCL transports: {', '.join(doc['nccl_transports'])}")
    out += ["", *(f"note: {n}" for n in doc["notes"]), *(f"PROBLEM: {p}" for p in doc["problems"])]
    verdict = f"{len(doc['problems'])} problem(s) found" if doc["problems"] else "all checks passed"
    out.append(f"doctor: {verdict}")
    return "\n".join(out)


def write_doc(doc: dict[str, Any], log_dir: str) -> Path:
    folder = Path(log_dir) / "doctor" / "runs" / run_id()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "doctor.json"
    path.write_text(json.dumps(doc, indent=2, sort_keys=True, default=str))
    return path


def missing_report(arrived: dict[int, Any], world: int, local_world: int) -> str:
    missing = [r for r in range(world) if r not in arrived]
    nodes = sorted({r // local_world for r in missing})
    return (
        f"missing ranks {missing} (node ranks {nodes}); arrived: {sorted(arrived)}. "
        f"Likely causes, in order: {'; '.join(CAUSES)}"
    )


# --- one rank ---------------------------------------------------------------------------------
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
            die("--backend nccl needs CUDA GPUs; use gloo on CPU")
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
        die(f"{reason} ({write_doc(me.doc(arrived, [reason]), args.log_dir)})", code=1)
    die(f"rank {me.rank}: rank 0 stopped the check: {reason}", code=1)


def worker(args: argparse.Namespace) -> int:
    """The checks in one process; rank 0 reports, the others exit with its verdict."""
    import torch.distributed as dist

    env = os.environ
    me = Rank(env, args.backend)
    if me.world % args.tp:
        die(f"--tp {args.tp} does not divide the world size {me.world}")
    debug_file = Path(args.log_dir) / "doctor" / "runs" / run_id() / "nccl.%h.%p.log"
    if me.backend == "nccl" and "NCCL_DEBUG" not in env:  # to read the transports NCCL picks
        debug_file.parent.mkdir(parents=True, exist_ok=True)
        env.update(NCCL_DEBUG="INFO", NCCL_DEBUG_FILE=str(debug_file))
    # Under torchrun MASTER_PORT may be the agent's own store: join it, in a key space of
    # this attempt. Otherwise rank 0 hosts the store.
    attempt = f"{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    rdzv = Rendezvous(env["MASTER_ADDR"], int(env["MASTER_PORT"]), me.rank, me.world,
                      args.timeout, host_store=env.get("TORCHELASTIC_USE_AGENT_STORE") != "True",
                      prefix=f"doctor/{attempt}")  # fmt: skip
    arrived = gate(me, rdzv, args)
    dist.init_process_group(me.backend, store=dist.PrefixStore("pg", rdzv.store), rank=me.rank,
                            world_size=me.world,
                            timeout=datetime.timedelta(seconds=args.timeout))  # fmt: skip
    try:
        results = collectives(me.rank, me.world, me.device)
        results.update(subgroups(me.rank, me.world, args.tp, me.device))
        failed = any(status == "failed" for status, _, _ in results.values())
        rows = [] if failed else bandwidth(me.world, args.max_mb, me.device)
        rdzv.post("result", {k: list(v) for k, v in results.items()})
        if me.rank != 0:
            rdzv.store.wait(["final"], datetime.timedelta(seconds=args.timeout + 60))
            return 0 if rdzv.store.get("final") == b"ok" else 1
        problems = rank_table_problems(arrived)
        for r, res in sorted(rdzv.collect("result").items()):
            problems += [f"{name} on rank {r}: {status} {detail}".strip()
                         for name, (status, _, detail) in res.items()
                         if status in ("failed", "wrong")]  # fmt: skip
        doc = me.doc(arrived, problems)
        doc.update(collectives=results, bandwidth=rows, args=vars(args),
                   notes=network_notes(arrived, doc["nnodes"]),
                   nccl_transports=nccl_transports(debug_file))  # fmt: skip
        rdzv.store.set("final", "problems" if problems else "ok")
        print(f"{render(doc)}\nreport: {write_doc(doc, args.log_dir)}", flush=True)
        return 1 if problems else 0
    finally:
        time.sleep(0.1)  # let gloo's worker threads finish (see raw_train.RawTrainer.close)
        dist.destroy_process_group()


# --- starting the ranks -----------------------------------------------------------------------
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
        die(f"--master-addr {addr} does not resolve on {socket.gethostname()}")
    mine = {a.split("/")[0] for addrs in interfaces().values() for a in addrs}
    return resolved.startswith("127.") or resolved in mine


def spawn(args: argparse.Namespace, argv: list[str]) -> int:
    """Start this node's ranks (our own rendezvous) and wait for them, bounded."""
    import torch

    nproc = args.nproc or max(1, torch.cuda.device_count())
    world = nproc * args.nnodes
    if world % args.tp:
        die(f"--tp {args.tp} does not divide the world size {world} ({args.nnodes} x {nproc})")
    port = args.master_port
    if port is None:
        port = free_port() if args.nnodes == 1 else 29510
    if args.node_rank == 0 and is_local(args.master_addr) and port_busy(args.master_addr, port):
        die(
            f"--master-port {port} is already in use on {socket.gethostname()} (another job, or "
            "a process left from an earlier one): pick another port"
        )
    base = {
        **os.environ,
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": str(args.node_rank),
        "MASTER_ADDR": args.master_addr,
        "MASTER_PORT": str(port),
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
    deadline = time.monotonic() + 3 * args.timeout + 120
    codes = []
    try:
        for proc in procs:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        print("error: the doctor's ranks did not finish in time: stopped them", file=sys.stderr)
        codes.append(1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return 2 if 2 in codes else int(any(codes))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ and "SLURM_STEP_ID" in os.environ:
        os.environ.update(slurm_env(dict(os.environ)))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by a launcher
        sys.exit(worker(args))
    sys.exit(spawn(args, argv))


if __name__ == "__main__":
    main()
