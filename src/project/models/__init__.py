"""Your networks: plain `torch.nn` modules, selected by the `model.net` config (`_target_`).

Nothing here knows about Lightning or distributed training; both trainers build the same
network from the same config.
"""
