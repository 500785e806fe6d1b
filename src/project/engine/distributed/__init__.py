"""The distributed runtime inside a rank, for both trainers: topology, DDP and collective
timeouts (ddp.py), gradient-communication hooks (comm_hooks/), the coordinated stop
(signals.py), how a run ends (exits.py), fault injection for drills (faults.py), the ledger
and the hang report (ledger.py, hangs.py; a worker's stacks: engine/distributed/worker_stacks.py;
work booked outside the step deadline: engine/run/long_work.py). How the processes are
started is engine/launch."""
