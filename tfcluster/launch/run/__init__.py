"""A `train` run: its supervisor, its start, each process's attempts, the run's record and
options, and what it does when a host is lost or drained (recovery, the moves, the drain
requests, the chief's checkpoints copied here)."""
