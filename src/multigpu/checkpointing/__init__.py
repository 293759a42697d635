"""Checkpoints, resume and stops, one room: what a checkpoint holds and how a run goes on from it, how its files are
written, and how a run stops (a signal, the time limit, a fault) with nothing lost and nothing hung.

position            the training position (epoch, images of its order trained, seed, global batch): its only writer and
                    reader in a checkpoint; the data module is given the order to follow
resume              what a checkpoint says of its run (ResumePoint, read once); RunMetadata, the callback that writes it
                    and, on resume, gives it to the data module and the loop counters
loop_position       where a run stands in Lightning's loop counters, and whether it is finished
files               finding and checking a run's checkpoint files
saving              which checkpoint files a run writes, and when: the best ones, last.ckpt every N steps
checkpoint_io       checkpoint files written in the background and atomically; a failed write named in one line
sharded_checkpoints fsdp's checkpoints as each process holds them, and put together again
stop_signals        every process stops after the same step on SIGTERM, SIGUSR1, Ctrl-C or the time limit, last.ckpt
                    written; the others killed when the launching process fails
stop_votes          the processes' agreement, every step and without a wait, on a stop signal or the time limit
watchdog            a stalled process named and its job ended; a failed background write raised after its step
elastic             torchrun's restarts and node count
"""

__all__ = [
    "checkpoint_io",
    "elastic",
    "files",
    "loop_position",
    "position",
    "resume",
    "saving",
    "sharded_checkpoints",
    "stop_signals",
    "stop_votes",
    "watchdog",
]
