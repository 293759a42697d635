"""How the processes of a run agree, after every optimizer step and without waiting for one another, whether one of
them got a stop signal, or ran out of its time (``--trainer.max_time``): each step every process starts a
non-blocking all-reduce (MAX) of what it has seen on a gloo group of its own, and reads the one it started ``LAG``
steps before, which has long ended.

Why this channel (docs/fault-tolerance.md, "Stop signals"): the vote of step ``s`` is the ``s``-th collective of that
group in every process, so every process reads the same answer at the same step and all stop after it; gloo works on
CPU tensors in its own threads, so the training thread never waits for the device, and never for another process
unless that one is ``LAG`` steps behind, which the gradients' all-reduce already rules out. A TCPStore key would
reach every process too, but at different steps; a per-step all-reduce on the device (Lightning's) is a wait for it.
"""

from collections import deque

import torch
import torch.distributed as dist

__all__ = ["StopVotes", "Vote"]

Vote = tuple[int, ...]


class StopVotes:
    """The votes of this process, one per optimizer step; ``open`` in every process of the run, in the same order.

    ``lag`` is how many steps later a step's answer is read: 1 where steps are short (a signal then stops the run
    after the step in flight and the next), 0 where they are long (after the step in flight: waiting for that
    step's vote, a few milliseconds on the host, is nothing beside the step). The processes choose it together, from
    an earlier vote (``cast``'s ``lag``), so every process reads the same votes at the same step."""

    def __init__(self) -> None:
        self._group: dist.ProcessGroup | None = None
        self._rounds: deque[tuple[torch.Tensor, dist.Work]] = deque()

    def open(self) -> None:
        """Make the vote's group, when this process is one of several (a collective call: every process makes it)."""
        self._rounds.clear()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            group = dist.new_group(backend="gloo")
            assert isinstance(group, dist.ProcessGroup)  # every process is a member
            self._group = group

    @property
    def is_open(self) -> bool:
        return self._group is not None

    def _start(self, vote: Vote) -> None:
        flag = torch.tensor(vote, dtype=torch.int32)
        self._rounds.append((flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)))

    @staticmethod
    def _result(round_: tuple[torch.Tensor, dist.Work]) -> Vote:
        flag, work = round_
        work.wait()
        return tuple(flag.tolist())

    def cast(self, vote: Vote, lag: int = 1) -> Vote:
        """Vote ``vote`` (a few numbers) for this step; the highest of each over every process and over the votes
        read now: those of ``lag`` steps ago and before (zeros where none is read)."""
        self._start(vote)
        highest = (0,) * len(vote)
        while len(self._rounds) > lag:
            highest = tuple(map(max, highest, self._result(self._rounds.popleft())))
        return highest

    def settle(self, vote: Vote) -> Vote:
        """Vote ``vote`` and wait for every vote still open, this one included: the highest of them all (an epoch's
        end, and a stop, leave nothing open behind them)."""
        return self.cast(vote, lag=0)

    def close(self, wait: bool = True) -> None:
        """Drop the group; with ``wait``, once the votes still open have ended (after a failure, another process may
        never vote again: nothing is waited for)."""
        if wait and self._rounds:
            self.settle((0,) * len(self._rounds[0][0]))
        self._rounds.clear()
        if self._group is not None and wait:
            dist.destroy_process_group(self._group)
        self._group = None
