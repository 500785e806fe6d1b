"""Every place the template reaches into a private Lightning or torch API, in one module.

Each override says in one line what it buys. `USED` names every private attribute relied on
here or elsewhere in the template; tests/test_private_api.py checks that each one still exists
in the installed versions, so an upgrade that renames one fails a quick test instead of a run.
What each override saves per step is measured in docs/performance.md.

Only the standard library is imported at the top: project.launcher imports this module.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

# (module, dotted attribute) of every private name the template uses.
USED = (
    ("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop._broadcast_sigterm_tensor"),
    ("lightning.pytorch.core.module", "LightningModule._current_fx_name"),
    ("lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher.kill"),
    ("lightning.pytorch.trainer.trainer", "Trainer._run_sanity_check"),  # feature:raw
    # feature:tracking
    ("lightning.fabric.utilities.logger", "_convert_params"),
    ("lightning.fabric.utilities.logger", "_flatten_dict"),
    ("lightning.pytorch.loggers.mlflow", "MLFlowLogger._run_id"),
    ("lightning.pytorch.loggers.mlflow", "MLFlowLogger._initialized"),
    ("lightning.pytorch.loggers.mlflow", "MLFlowLogger._mlflow_client"),
    # /feature:tracking
    (
        "torch.distributed.elastic.agent.server.local_elastic_agent",
        "LocalElasticAgent._monitor_workers",
    ),
    ("torch.distributed.elastic.multiprocessing.api", "_terminate_process_handler"),
)


class DirectHookName:
    """Mixin for a LightningModule: Lightning sets `_current_fx_name` before and after every
    hook it calls, dozens of times a step; nn.Module's __setattr__ first looks for a
    parameter, buffer or submodule of that name, which a hook's name never is."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_current_fx_name":
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)


def skip_sigterm_broadcast(trainer: Any) -> bool:
    """Drop the blocking broadcast Lightning runs before every training step when world size
    > 1 (Lightning issue #21487); the FaultTolerance callback's check every few steps does its
    job. False when this Lightning has no such broadcast."""
    epoch_loop = trainer.fit_loop.epoch_loop
    if not hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
        return False
    epoch_loop._broadcast_sigterm_tensor = lambda: None
    return True


def kill_launched_ranks(trainer: Any, signum: int) -> None:
    """Lightning's own launcher starts ranks > 0 as children of rank 0 and kills them only on
    KeyboardInterrupt: on any other failure of rank 0 they would be left behind."""
    from lightning.pytorch.strategies.launchers.subprocess_script import (
        _SubprocessScriptLauncher,
    )

    launcher = trainer.strategy.launcher
    if isinstance(launcher, _SubprocessScriptLauncher):
        launcher.kill(signum)


# feature:tracking
def flat_params(params: Any) -> dict[str, Any]:
    """Hyperparameters as the flat {dotted key: value} dict Lightning's loggers log."""
    from lightning.fabric.utilities.logger import _convert_params, _flatten_dict

    return _flatten_dict(_convert_params(params))


# /feature:tracking
def restart_only_crashes(agent_cls: Any, no_restart: Collection[int]) -> None:
    """Make torchrun's agent give up instead of restarting a group whose failure was one of
    `no_restart` (bad input, a coordinated stop): `--max-restarts` is for crashes. The agent
    restarts while `_remaining_restarts > 0`."""
    monitor = agent_cls._monitor_workers

    def _monitor_workers(self: Any, worker_group: Any) -> Any:
        result = monitor(self, worker_group)
        codes = {f.exitcode for f in (getattr(result, "failures", None) or {}).values()}
        if codes & set(no_restart):
            self._remaining_restarts = 0
        return result

    agent_cls._monitor_workers = _monitor_workers


def signals_once(mp_api: Any, state: dict[str, Any]) -> None:
    """torchrun's handler raises on every signal: a second one (Ctrl-C and the scheduler's
    TERM, or the launch script forwarding what torchrun also got) would interrupt the
    workers' graceful shutdown, and one after the job ended would be a traceback. Only the
    first one during the job counts (`state`: {"signal": None, "done": False})."""
    raise_signal = mp_api._terminate_process_handler

    def handler(signum: int, frame: Any) -> None:
        if state["signal"] is not None or state["done"]:
            return
        state["signal"] = signum
        raise_signal(signum, frame)

    mp_api._terminate_process_handler = handler
