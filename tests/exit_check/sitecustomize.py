"""Imported at start-up by every Python process a test starts with this folder on PYTHONPATH
(tests/conftest.py: exit_check_env). At exit, a distributed worker (RANK set) says whether
its process group was closed (left open, gloo can abort the process after a finished run: see
project.engine.distributed.ddp.close_process_group), and whether it was forked from the
launcher's warm process (project.engine.launch.warm) or started as a new process."""

import atexit
import os
import sys


def _report() -> None:
    dist = sys.modules.get("torch.distributed")
    if "RANK" not in os.environ or dist is None or sys.argv[0] == "-c":
        return  # not a rank (`-c`: a rank's fork server or resource tracker, RANK inherited)
    state = "left open" if dist.is_available() and dist.is_initialized() else "closed"
    sys.stderr.write(f"exit check: rank {os.environ['RANK']} process group {state}\n")
    try:  # forked from the launcher's warm process, or started as a new one
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as parent:
            how = "forked warm" if b"launch.warm" in parent.read() else "started cold"
    except OSError:
        how = "parent gone"
    sys.stderr.write(f"start check: rank {os.environ['RANK']} {how}\n")


atexit.register(_report)  # registered first, so it runs after every other atexit handler
