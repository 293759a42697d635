"""How much of a pipeline step each process sits idle, measured, against its schedule's ideal."""

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache, wraps
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage

from multigpu.compat import time_stage_actions
from multigpu.strategies.pipeline.simulation import simulate_step
from multigpu.strategies.pipeline.stage_placement import StagePlacement

__all__ = ["ScheduleClock", "ideal_idle_share"]


@cache
def ideal_idle_share(placement: StagePlacement, micro_batches: int) -> float:
    """The share of a step a process of ``placement``'s schedule sits idle when every stage computes alike (a
    backward pass twice a forward pass) and tensors travel in no time: its bubble, ``(S - 1) / (M + S - 1)`` for
    GPipe and 1F1B, less for the interleaved and zero-bubble schedules."""
    stages = placement.num_stages
    step = max(simulate_step(placement, micro_batches, [1.0] * stages, [2.0] * stages, lambda stage: 0.0))
    busy = 3.0 * micro_batches * placement.stages_per_process  # each process's passes add up alike
    return max(0.0, 1.0 - busy / step)


class ScheduleClock:
    """Times the steps of the schedule run ``timing()`` on this process's ``stages``: the whole step, and each of its
    computations (forward, backward and weight-gradient passes: ``compat.STAGE_ACTIONS``); the rest is idle, waiting
    for another stage's tensors. CUDA events on a GPU, read once the device has been waited for (``idle_share``); the
    host's clock on the CPU. Untimed steps cost a flag's test per computation."""

    def __init__(self, stages: list[PipelineStage], device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._timing = False
        self._depth = 0
        self._computing: list[tuple[Any, Any]] = []
        self._step: tuple[Any, Any] | None = None
        for stage in stages:
            time_stage_actions(stage, self._timed)

    def _now(self) -> Any:
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _seconds(self, span: tuple[Any, Any]) -> float:
        start, end = span
        return start.elapsed_time(end) / 1000 if self._cuda else end - start

    def _timed(self, part: str, method: Callable) -> Callable:
        @wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self._timing or self._depth:  # a computation inside another counts once
                return method(*args, **kwargs)
            start = self._now()
            self._depth += 1
            try:
                return method(*args, **kwargs)
            finally:
                self._depth -= 1
                self._computing.append((start, self._now()))

        return timed

    @contextmanager
    def timing(self) -> Iterator[None]:
        """Time the schedule step run inside."""
        self._computing, self._timing = [], True
        start = self._now()
        try:
            yield
        finally:
            self._step, self._timing = (start, self._now()), False

    def idle_share(self) -> float | None:
        """The share of the last timed step this process computed nothing (``None`` before one; once read, until
        the next). Reads CUDA events: after the device has finished the step."""
        if self._step is None:
            return None
        whole = self._seconds(self._step)
        busy = sum(self._seconds(span) for span in self._computing)
        self._step, self._computing = None, []
        return min(max(1.0 - busy / whole, 0.0), 1.0) if whole > 0 else None
