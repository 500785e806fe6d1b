"""Composing a config: the config folder, resolvers, `_target_` checks, typed keys (no torch)."""
