"""PyTorch Lightning + Hydra project starter.

Kept import-free on purpose: `python train.py --help` must not pay for torch or Lightning.
"""
