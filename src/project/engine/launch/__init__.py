"""What the launcher started and how a worker ends: env, topology/DDP, signals, exit codes."""
