"""What each rank knows about itself: device, versions, environment, network interfaces."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from typing import Any

ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_DISTRIBUTED_", "TORCH_NCCL_", "MASTER_", "CUDA_VISIBLE")


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
