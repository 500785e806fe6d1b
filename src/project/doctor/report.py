"""The report rank 0 prints and writes (doctor.json): rank table, problems, notes."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

from project.engine.launch.env import run_id


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
