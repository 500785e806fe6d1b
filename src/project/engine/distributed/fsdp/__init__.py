"""Fully sharded data parallel (FSDP2, `torch.distributed.fsdp.fully_shard`) from
`strategy=fsdp`, the same in both trainers.

    options.py  the strategy config checked before any process group (one line per refusal),
                and what `fully_shard` gets from it and from trainer.precision
    plan.py     which modules of the task's network get their own `fully_shard`; the
                accumulation window's held gradients (DDP's no_sync)

Lightning shards in TaskModule.configure_model (project.engine.lightning.module), the raw
trainer in its `wrap_model`: both call `plan.shard` on the same network with the same options.
"""
