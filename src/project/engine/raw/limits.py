"""When the raw trainer stops training: Lightning's max_epochs / max_steps / fast_dev_run rules.

Lightning (loops/utilities.py `_parse_loop_limits`, trainer/setup.py, loops/fit_loop.py
`done`) reads them so: `max_steps` counts optimizer steps (`global_step`), -1 is no limit;
`max_epochs=-1` is no limit, an unset `max_epochs` is 1000 epochs, or no limit when
`max_steps` is set; `fast_dev_run=N` (true: 1) runs one epoch of at most N steps. Whichever
limit is reached first ends `fit`, in the middle of an epoch too.
"""

from __future__ import annotations

from typing import Any

LIGHTNING_DEFAULT_EPOCHS = 1000  # Lightning's max_epochs when neither limit is set


def fast_dev_batches(trainer: Any) -> int:
    """fast_dev_run's batch count (0: off)."""
    value = trainer.get("fast_dev_run")
    return 1 if value is True else int(value or 0)


def max_steps(trainer: Any) -> int | None:
    """The optimizer steps `fit` may reach (None: no limit)."""
    if fast := fast_dev_batches(trainer):
        return fast
    steps = trainer.get("max_steps")
    return None if steps is None or int(steps) == -1 else int(steps)


def max_epochs(trainer: Any) -> int | None:
    """The epochs `fit` may reach (None: no limit)."""
    if fast_dev_batches(trainer):
        return 1
    epochs = trainer.get("max_epochs")
    if epochs is None:
        return None if max_steps(trainer) is not None else LIGHTNING_DEFAULT_EPOCHS
    return None if int(epochs) == -1 else int(epochs)


def reached(limit: int | None, value: int) -> bool:
    """Whether `value` (epochs or optimizer steps done) reached `limit` (None: never)."""
    return limit is not None and value >= limit
