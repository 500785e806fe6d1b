"""How the processes of a job start: what the launcher started (env.py), the torchrun command
line (torchrun.py), the launch script's hand-off to bash (bash_script.py). What runs inside a
rank is engine/distributed."""
