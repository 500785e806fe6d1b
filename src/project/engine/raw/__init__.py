"""The raw PyTorch DDP trainer (no Lightning) and the config keys it reads."""
