"""The machinery you normally leave alone, grouped by who uses it.

- `config/`: composing a config (resolvers, paths, `_target_` checks) and its typed keys.
- `run/`: one run from start to end for both trainers: preflight, dispatch, the stop, the
  final metrics, one-line errors and the Hydra wrapper.
- `launch/`: what the launcher started (env, topology, DDP), stop signals, exit codes,
  the torchrun command line, fault injection.
- `checkpoints/`: checkpoint state, atomic writes, what may be resumed.
- `shared/`: what both trainers build from: loaders and sharding, optimizer, metrics,
  per-step statistics.
- `lightning/`: the Lightning adapters and callbacks; `raw/`: the raw PyTorch DDP trainer.
- `cluster/`: SLURM sweep jobs and the Optuna sweeper behind the Hydra plugins.
- `errors.py`: the one exception your code may raise for bad input.
- `private_api.py`: every override of a private Lightning/torch API, in one place.
"""
