"""SLURM sweep jobs and the Optuna sweeper: what the Hydra plugins in src/hydra_plugins run."""
