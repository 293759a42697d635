"""One pipeline step, simulated from the schedule's own action lists.

Each process runs its actions (``compat.schedule_actions``; GPipe's and 1F1B's written out
here) in torch's order. An action starts when its process is free and its inputs are there: a
forward pass of stage ``s`` needs stage ``s - 1``'s output for that micro-batch, a backward pass
(whole, or the input-gradient half of the zero-bubble schedules) needs stage ``s + 1``'s
gradient and its own forward pass, and a tensor from a stage on another process arrives a
send's time later. A zero-bubble schedule splits a backward pass into the input gradients and
the weight gradients, each half of the backward pass it is given, times ``split``: ``plan`` gives it
the network's measured split, how much longer a backward pass takes split than whole
(``BlockProfile.split_backward``). The first stage's input needs no gradient, so its input-gradient half is
next to nothing and its weight-gradient half is its whole backward pass, where the other stages' halves add up to
more than their whole pass (a trace: docs/plan.md, "What a forecast is built from"). A whole backward
pass of these schedules (DualPipeV's are most of its) takes as long as it is given.
Each action also costs the schedule's own time per action, measured by ``plan``. The step ends
when the last process finishes.
"""

from collections.abc import Callable, Sequence

from multigpu.compat import schedule_actions
from multigpu.strategies.pipeline.stage_placement import StagePlacement

__all__ = ["simulate_step", "splits_backward"]


def simulate_step(
    pipeline: StagePlacement,
    micro_batches: int,
    forward: Sequence[float],
    backward: Sequence[float],
    send: Callable[[int], float],
    per_action: float = 0.0,
    split: float = 1.0,
) -> list[float]:
    """Seconds until each process of ``pipeline`` finishes one step, stage ``s`` taking ``forward[s]`` and
    ``backward[s]`` per micro-batch (each half of a backward pass split in two ``split`` times half of it, but
    the first stage's: nothing, then the whole), a tensor leaving stage ``s`` for a stage on another process
    ``send(s)`` (its forward output; the gradient it gets back has the same size), and each action ``per_action``
    more."""
    actions = _actions(pipeline, micro_batches)
    inputs = [0.0] + [t * split / 2 for t in backward[1:]]  # the network's input needs no gradient
    weights = [backward[0]] + [t * split / 2 for t in backward[1:]]
    durations = {
        kind: [t + per_action for t in times] for kind, times in zip("FBIW", (forward, backward, inputs, weights))
    }
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * len(actions)
    position = [0] * len(actions)
    last = pipeline.num_stages - 1
    while any(position[p] < len(actions[p]) for p in range(len(actions))):
        progressed = False
        for process, queue in enumerate(actions):
            while position[process] < len(queue):
                kind, stage, micro_batch = queue[position[process]]
                ready = _ready(kind, stage, micro_batch, last, done, pipeline, process, send)
                if ready is None:
                    break
                clock[process] = max(clock[process], ready) + durations[kind][stage]
                done[kind, stage, micro_batch] = clock[process]
                position[process] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"the simulated {pipeline.schedule} schedule waits on itself: {actions}")
    return clock


def splits_backward(pipeline: StagePlacement, micro_batches: int) -> bool:
    """Whether the schedule splits its backward passes into input and weight gradients (the zero-bubble ones)."""
    return any(kind in "IW" for queue in _actions(pipeline, micro_batches) for kind, _, _ in queue)


def _actions(pipeline: StagePlacement, micro_batches: int) -> list[list[tuple[str, int, int]]]:
    """Each process's actions in one step: torch's own lists for the multi-stage schedules; GPipe's and 1F1B's as
    torch runs them (its lists of those two number the micro-batches of the later stages wrongly)."""
    if not pipeline.is_single:
        return schedule_actions(pipeline.schedule, pipeline.processes, micro_batches, pipeline.stages_per_process)
    orders = []
    for stage in range(pipeline.processes):
        ahead = (
            micro_batches if pipeline.schedule.lower() == "gpipe" else min(micro_batches, pipeline.processes - stage)
        )
        order = [("F", stage, m) for m in range(ahead)]
        for m in range(micro_batches):  # then one backward pass, one forward pass, ...
            order.append(("B", stage, m))
            if ahead + m < micro_batches:
                order.append(("F", stage, ahead + m))
        orders.append(order)
    return orders


def _ready(kind, stage, micro_batch, last, done, pipeline, process, send) -> float | None:
    """When the inputs of an action are there, or None while one is missing."""
    needs: list[tuple[tuple[str, int, int], int | None]] = []  # (action, the stage whose output travels)
    if kind == "F" and stage > 0:
        needs.append((("F", stage - 1, micro_batch), stage - 1))
    elif kind in ("B", "I"):
        needs.append((("F", stage, micro_batch), None))
        if stage < last:
            later = (
                ("B", stage + 1, micro_batch)
                if ("B", stage + 1, micro_batch) in done
                else ("I", stage + 1, micro_batch)
            )
            needs.append((later, stage))
    elif kind == "W":
        needs.append((("I", stage, micro_batch), None))
    ready = 0.0
    for action, travelling in needs:
        if action not in done:
            return None
        other = action[1]
        crossing = travelling is not None and pipeline.process_of(other) != process
        ready = max(ready, done[action] + (send(travelling) if crossing else 0.0))
    return ready
