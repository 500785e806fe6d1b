"""Checkpoint state (RNG, atomic writes, reading) and what a run may resume from."""

LAST_CKPT = "last.ckpt"  # FaultTolerance's resume point (Lightning's checkpoint format)
LAST_PT = "last.pt"  # the raw trainer's: its own format, whatever the config names
