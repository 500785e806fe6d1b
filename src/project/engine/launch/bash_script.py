"""`torchrun ... launch/multinode.sh` without --no-python runs the script with Python; its last
line imports this module, which replaces the process with bash running the same script with
the same arguments: what `torchrun --no-python launch/multinode.sh` runs."""

import os
import sys

os.execvp("bash", ["bash", sys.argv[0], *sys.argv[1:]])
