"""`make gpu-check` (project.gpu_check) on a machine without CUDA: one line, exit 0, so CI
without a GPU can run it. Its checks themselves need a GPU."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT, child_env


def test_without_cuda_it_says_so_in_one_line_and_passes() -> None:
    # CUDA hidden: the same answer on a GPU machine.
    proc = subprocess.run(
        [sys.executable, "-m", "project.gpu_check"],
        cwd=ROOT, env=child_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [
        "gpu-check: no CUDA device on this machine (torch.cuda.is_available() is False): "
        "nothing checked"
    ]


def test_the_fsdp_round_trip_passes_on_the_cpu(tmp_path) -> None:
    """The FSDP2 check's own code (make gpu-check runs it on the GPU) on the CPU with gloo."""
    code = ("import sys; from pathlib import Path; from project.gpu_check import "
            "fsdp_round_trip; print(fsdp_round_trip('cpu', Path(sys.argv[1])))")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "fsdp")], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "16 tensors equal after a sharded save and load on cpu" in proc.stdout, proc.stdout
    assert (tmp_path / "fsdp" / "last.json").is_file()
