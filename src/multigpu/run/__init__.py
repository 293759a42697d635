"""The training run: what a run writes, where it stands, and the processes it runs in.

callbacks        the console line, throughput, checkpoints every N steps and on SIGTERM
checkpoints      finding a run's checkpoint files, and Lightning's loop counters of a resumed run
checkpoint_io    atomic checkpoint saves
elastic          torchrun's restarts and node count
process_groups   process groups that end cleanly
replicas         who reads which data: data-parallel replicas, ranks and micro-batches of a strategy
"""

__all__ = ["callbacks", "checkpoint_io", "checkpoints", "elastic", "process_groups", "replica_statistics", "replicas"]
