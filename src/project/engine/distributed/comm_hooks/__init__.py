"""DDP gradient-communication hooks from config (`strategy.comm_hook`), the same in both trainers.

    strategy=ddp_fp16       gradients all-reduced as float16 (half the bytes), then restored
    strategy=ddp_bf16       the same in bfloat16 (float32's range, fewer mantissa bits)
    strategy=ddp_powersgd   PowerSGD: low-rank gradient compression with error feedback

Lightning's DDPStrategy registers its `ddp_comm_hook` only on CUDA and ignores it elsewhere;
the template's strategy (project.engine.lightning.strategy) and the raw trainer both call
`CommHook.register` on their DDP model on every device, so what runs on a CPU test machine is
what runs on GPUs.

    hook.py             CommHook: the kinds and options, registration, PowerSGD's per-rank
                        state (`state_dict`, `load_state_dict`, `check`)
    powersgd_layout.py  PowerSGD's state in one fixed layout whatever DDP's buckets, so that a
                        resume is exact

The per-rank state files beside the last checkpoint, which every rank saves and loads at the
same point and whose outcome the ranks agree on, are project.engine.checkpoints.comm_hook_files
(checkpoints build on distributed, never the other way: tests/test_layout.py).
"""

from project.engine.distributed.comm_hooks.hook import CommHook

__all__ = ["CommHook"]  # `_target_: project.engine.distributed.comm_hooks.CommHook` (configs)
