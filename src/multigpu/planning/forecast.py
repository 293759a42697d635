"""How many images per second each layout will train, forecast before anything trains.

A step is built from each block's measured forward, backward and update time (``profile``), at the layout's
input (``Layout.timed_input``: its batch, micro-batch or slice of the batch) and, on the CPU, its processes' share of
the cores, slowed as much as processes running at once slow each other (``links``; where every process waits for
the others throughout the step, ``Layout.in_lockstep``, as much slower as the slowest of them runs). With activation
recomputation each backward pass also runs its block's forward pass again. The strategy's own layout class then
says how long its step takes from those passes and the tensors it moves at the measured latency and bandwidth of
the links (``Layout.step_seconds``, each strategy's in ``strategies/<package>/layouts.py``).
"""

from multigpu.planning.links import Links
from multigpu.planning.profile import BlockProfile
from multigpu.strategies.layout import BlockMemory, Layout

__all__ = ["forecast"]


def forecast(layout: Layout, profile: BlockProfile, links: Links, memory: BlockMemory) -> float | str:
    """Forecast images per second of ``layout``, or why its blocks cannot be timed."""
    times = profile.times(*layout.timed_input)
    if isinstance(times, str):
        return times
    times = times.scaled(links.slowdown(layout.processes, layout.in_lockstep))
    forward = times.forward
    backward = [b + (f if layout.recompute else 0.0) for f, b in zip(forward, times.backward)]
    step = layout.step_seconds(forward, backward, times.update, links, memory, profile)
    return layout.batch_size * layout.replicas / step
