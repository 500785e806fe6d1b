"""`torchrun ... launch/multinode.sh` without --no-python runs the script with Python; the
script's Python part (after its `exit` line) calls `exec_bash`, which replaces the process with
bash running the same script with the same arguments: what `torchrun --no-python
launch/multinode.sh` runs. Importing this module has no effect (it used to exec at import,
so any import, a test's or a tool's, became bash)."""

import os
import sys
from collections.abc import Sequence
from typing import NoReturn


def exec_bash(argv: Sequence[str] | None = None) -> NoReturn:
    """Replace this process with `bash <script> <args...>`. `argv` defaults to sys.argv: the
    script Python was asked to run, then its arguments."""
    script_and_args = list(sys.argv if argv is None else argv)
    os.execvp("bash", ["bash", *script_and_args])
