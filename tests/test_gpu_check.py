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
