"""Lightning's DDPStrategy with the template's two additions (`_target_` of configs/strategy/):

- `comm_hook`: a gradient-communication hook (project.engine.distributed.comm_hooks) registered on
  every device; Lightning's own `ddp_comm_hook` is registered on CUDA only.
- `step_timeout_s`: the collective timeout inside training steps after the first one
  (project.engine.distributed.ddp.CollectiveTimeout; `timeout` stays the one before and outside
  them).
- Every checkpoint save is booked outside the step deadline (weights-only ones too, which
  Lightning hides from the callbacks): project.engine.run.long_work.
- DDP errors about parameters that got no gradient keep torch's parameter indices (Lightning
  replaces the whole message), so the run skeleton can name the parameters
  (project.engine.distributed.ddp.unused_parameters_reported).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy

from project.engine.distributed import ddp
from project.engine.distributed import ledger as ledgers
from project.engine.distributed.comm_hooks import CommHook
from project.engine.run import long_work


class DDPStrategy(LightningDDPStrategy):
    def __init__(
        self, comm_hook: CommHook | None = None, step_timeout_s: float | None = None,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(**kwargs)
        self.comm_hook, self.step_timeout_s = comm_hook, step_timeout_s
        self.timeout = kwargs.get("timeout")

    def configure_ddp(self) -> None:
        super().configure_ddp()  # wraps the module in DistributedDataParallel
        ddp.remember_parameters(self.model)
        if self.comm_hook is not None:
            self.comm_hook.register(self.model)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        # The start of every checkpoint save, on every rank: a weights-only one too, which
        # Lightning does not announce to the callbacks. Rank 0 writes, the others wait.
        long_work.outside_steps(ledgers.CHECKPOINT)
        return super().lightning_module_state_dict()

    def on_exception(self, exception: BaseException) -> None:
        if not ddp.UNUSED.search(str(exception)):
            super().on_exception(exception)
