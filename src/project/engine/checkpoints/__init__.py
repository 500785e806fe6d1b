"""Checkpoint state (RNG, atomic writes, reading), what a run may resume from, and the one
owner of a run's checkpoints (run.py)."""

LAST_PT = "last.pt"  # the raw trainer's: its own format, whatever the config names
