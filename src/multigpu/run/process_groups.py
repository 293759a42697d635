"""The end of a run's process groups: torch.distributed torn down before the interpreter.

Lightning leaves the process groups up when training ends. gloo's worker threads still
hold the tensors of the last collectives, and letting go of them takes the GIL; when the
interpreter is already shutting down, that thread exits inside C++ and the process
aborts ("terminate called without an active exception", exit status -6), after a run
that succeeded. Seen with torch 2.11 and gloo (pytorch/pytorch#190489). Destroying the
groups first waits for those threads while Python is still whole.

A group that something else still holds (FSDP2's modules keep theirs) outlives
``destroy_process_group``, and so do its threads: a gloo thread lets go of a finished
all-gather (``AsyncAllgatherCoalescedWork``) only once it gets the GIL. The barrier makes
every process's last collectives finish, and the pause hands the GIL to those threads
before the interpreter goes (seen under fsdp on torch 2.15, where runs aborted without it:
docs/measurements.md, "Process groups").

``multigpu.commands.main`` ends them in every process that runs it: the launching one, and those that Lightning's
subprocess launcher, torchrun or SLURM start. The ranks of ``ddp_spawn`` (and ``ddp_fork``) run only the Trainer's
function, and their interpreter ends as it returns: ``multigpu.run.spawned_ranks`` ends theirs as the Trainer tears
down. This module imports torch alone (``plan``'s link probe uses it).
"""

import time

import torch.distributed as dist

__all__ = ["end_process_groups"]


def end_process_groups() -> None:
    """Destroy every process group of this process, once its work is done (a no-op without any)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        time.sleep(0.2)
