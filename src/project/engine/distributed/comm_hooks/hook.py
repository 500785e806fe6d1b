"""The gradient-communication hook of `strategy.comm_hook`: its kinds and options, its
registration on a DDP model, and PowerSGD's per-rank state as a checkpoint carries it.

PowerSGD keeps state on every rank (its error-feedback memory, low-rank factors, step counter
and random generator) that differs between ranks: `state_dict()` / `load_state_dict()` carry
it, `check()` says whether a saved state can continue this run. Where it is stored (one file
per rank beside the last checkpoint) is the checkpoints' business:
project.engine.checkpoints.comm_hook_files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from project.engine.distributed.comm_hooks.powersgd_layout import BucketLayouts
from project.engine.errors import UserError

KINDS = ("fp16", "bf16", "powersgd")
POWERSGD_KEYS = (
    "matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate",
    "use_error_feedback", "warm_start", "orthogonalization_epsilon", "random_seed",
    "batch_tensors_with_same_shape",
)  # fmt: skip
# What a rank found when it read its state file; the ranks act on the highest of them.
OK, CHANGED, UNREADABLE, ABSENT, OTHER_WORLD = range(5)


class CommHook:
    """One hook: `kind` and, for PowerSGD, the PowerSGDState arguments."""

    def __init__(self, kind: str, **powersgd: Any) -> None:
        if kind not in KINDS:
            raise UserError(f"strategy.comm_hook.kind={kind!r} is not one of {', '.join(KINDS)}")
        unknown = sorted(set(powersgd) - set(POWERSGD_KEYS))
        if unknown or (powersgd and kind != "powersgd"):
            key = unknown[0] if unknown else sorted(powersgd)[0]
            raise UserError(
                f"strategy.comm_hook.{key} is not an option of the {kind} hook: see "
                "configs/strategy/ddp_powersgd.yaml"
            )
        self.kind, self.powersgd = kind, powersgd
        self.state: Any = None  # PowerSGD's per-rank state, once registered
        self.device: Any = None  # the model's device, once registered

    def register(self, model: Any) -> None:
        """Register on a DistributedDataParallel model (before its first backward)."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        self.device = next(model.parameters()).device
        if self.kind == "fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif self.kind == "bf16":
            hook = default_hooks.bf16_compress_hook if self.device.type == "cuda" else _bf16_gloo
            model.register_comm_hook(None, hook)
        else:
            self.state = powerSGD_hook.PowerSGDState(process_group=None, **self.powersgd)
            self.layouts = BucketLayouts(self.state, model.module.named_parameters())
            model.register_comm_hook(self.state, self.layouts.hook)

    @property
    def stateful(self) -> bool:
        """Whether this hook has per-rank state a checkpoint must carry (PowerSGD)."""
        return self.kind == "powersgd"

    def config(self) -> dict[str, Any]:
        """Every PowerSGDState argument as this run uses it (torch's default where not set)."""
        import inspect

        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        defaults = inspect.signature(PowerSGDState.__init__).parameters
        return {key: self.powersgd.get(key, defaults[key].default) for key in POWERSGD_KEYS}

    def state_dict(self) -> dict[str, Any]:
        """This rank's PowerSGD state as it is in memory (its `rng` numpy's own state: the
        checkpoint layer stores it, project.engine.checkpoints.comm_hook_files)."""
        if self.state is None:
            return {}
        from project.engine.private_api import powersgd_slots

        slots = [s for s in powersgd_slots(self.state) if s not in ("process_group", "rng")]
        state = {s: getattr(self.state, s) for s in slots} | {"rng": self.state.rng.get_state()}
        return state | {"config": self.config(), "layouts": self.layouts.saved()}

    def check(self, saved: dict[str, Any], last: Path | None = None) -> tuple[int, str]:
        """(OK, "") when `saved` can continue this run; else (CHANGED or UNREADABLE, the
        problem + "\\n" + its fix)."""
        where = f"beside {last.name}" if last else "beside this checkpoint"
        ckpt = f"ckpt_path={last or '...'}"
        new_run = f"start a new run from its weights ({ckpt} with another RUN_ID)"
        layouts = {int(i): list(n) for i, n in saved.get("layouts", {}).items()}
        for index, names in layouts.items():
            error = saved.get("error_dict", {}).get(index)
            unknown = any(n not in self.layouts.shapes for n in names)  # another model
            if unknown or (error is not None and len(error) != self.layouts.slots(names)[1]):
                return UNREADABLE, (
                    f"the PowerSGD state {where} has another layout (written by an older "
                    f"template, or for another model)\n{new_run}"
                )
        # Saved before `config` was: the hyperparameters are PowerSGDState's own slots.
        before = {k: saved[k] for k in POWERSGD_KEYS if k in saved} | saved.get("config", {})
        for key, now in self.config().items():
            if key in before and before[key] != now:
                return CHANGED, (
                    f"strategy.comm_hook.{key}={now!r} differs from the {before[key]!r} the "
                    f"PowerSGD state {where} was saved with\nresume with "
                    f"strategy.comm_hook.{key}={before[key]!r}, or {new_run}; PowerSGD starts "
                    "afresh there"
                )
        return OK, ""

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue from a `state_dict()` this rank saved (one line if it cannot)."""
        code, problem = self.check(saved)
        if code != OK:
            raise UserError(problem.replace("\n", "; "))
        saved = dict(saved)
        saved.pop("config", None)
        layouts = {int(i): tuple(n) for i, n in saved.pop("layouts", {}).items()}
        self.state.rng.set_state(saved.pop("rng"))
        for key, value in saved.items():
            setattr(self.state, key, value)
        self.layouts.restore(layouts)


def _bf16_gloo(state, bucket):  # no annotations: DDP checks them against dist.GradBucket
    """torch's bf16 hook, off CUDA: DDP refuses `bf16_compress_hook` by name unless it runs on
    CUDA with NCCL >= 2.10, but gloo all-reduces bfloat16 on CPU (tests/test_comm_hooks.py)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)
