"""A network that does not fit its data, said in one line instead of a traceback from deep
inside torch (both trainers run every `task.step` through `checked_step`).

A model/data mismatch (`model.net.in_features=32` on 64-feature digits, a vocabulary smaller
than the tokens, fewer outputs than classes) fails in the first forward with torch's own
message ("mat1 and mat2 shapes cannot be multiplied (64x64 and 32x256)"). That is bad input:
the line names torch's shapes, the batch's and the sizes the network was built with.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

import torch

from project.engine.errors import UserError

log = logging.getLogger(__name__)

# torch's messages for an input the network's sizes do not take (matmul, conv, broadcast,
# embedding indices), counted only when raised inside the network's forward: the same texts
# from the task's own code are bugs, and keep their traceback.
MISMATCH = (
    "shapes cannot be multiplied",
    "must match the size of tensor",
    "Given groups=",
    "but got input of size",
    "to have the same size",
    "index out of range in self",
)
# The loss's: a label the network has no output for (fewer classes than the data).
TARGET = re.compile(r"Target -?\d+ is out of bounds")


def checked_step(task: Any, batch: Any, metrics: Any, net: Mapping[str, Any]) -> torch.Tensor:
    """`task.step(batch, metrics)`; a network that does not fit the data becomes one
    UserError line, its traceback kept in the log file. (A try that raises nothing costs
    nothing per step.)"""
    try:
        return task.step(batch, metrics)
    except (RuntimeError, IndexError) as err:
        text = str(err)
        in_net = any(m in text for m in MISMATCH) and _raised_in(err, task.net)
        if not (in_net or TARGET.match(text)):
            raise
        log.debug("the step's error, in full", exc_info=err)
        raise UserError(mismatch_line(err, batch, net)) from err


def _raised_in(err: BaseException, module: Any) -> bool:
    """Whether `err` went through `module`'s own call (a frame whose `self` is it)."""
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_locals.get("self") is module:
            return True
        tb = tb.tb_next
    return False


def mismatch_line(err: BaseException, batch: Any, net: Mapping[str, Any]) -> str:
    """The one line: torch's message, the batch's shapes and the network's size keys."""
    tensors = batch if isinstance(batch, (tuple, list)) else [batch]
    shapes = ", ".join(
        f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"
        for t in tensors if isinstance(t, torch.Tensor)
    )  # fmt: skip
    sizes = ", ".join(
        f"{k}={v}" for k, v in net.items()
        if isinstance(v, int) and not isinstance(v, bool) and k != "depth"
    )  # fmt: skip
    torch_says = str(err).strip().splitlines()[0].rstrip(".")
    return (
        f"the network does not fit the data: {torch_says}, on a batch of {shapes} with "
        f"model.net {sizes or 'as configured'}: set model.net's sizes to the data's (input "
        "features/channels, vocabulary, classes)"
    )
