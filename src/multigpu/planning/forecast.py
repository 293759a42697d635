"""How many images per second each layout will train, forecast before anything trains.

A step is built from each block's measured forward, backward and update time (``profile``), at
the layout's batch or micro-batch and, on the CPU, its processes' share of the cores, slowed
as much as processes running at once slow each other (``links``), and the tensors it moves at
the measured latency and bandwidth of the links:

- one device: the passes, then the update;
- ``ddp``: the backward pass hands DDP's buckets (the first of 1 MiB, then 25 MiB, filled
  from the last block back) to an all-reduce as each fills; the all-reduces run one after
  another beside the backward pass, and the step waits for the last;
- ``fsdp``: each block's parameters are all-gathered before its forward and backward pass (the
  next block's while this one computes) and its gradients reduce-scattered after its backward
  pass, one transfer at a time beside the computation;
- ``manual_model_parallel``: the stages one after another for the whole batch, the activations
  and their gradients sent between devices, and with several replicas ``ddp``'s all-reduce;
- ``dp``: a slice of the batch on every device at once, the parameters broadcast and the
  gradients gathered on the first every step;
- ``pipeline``: the schedule's step simulated from its action lists (``pipeline_simulation``), a
  zero-bubble schedule's backward passes in two halves timed as it runs them (in two, a pass costs more),
  its passes slowed by the processes' average concurrency over the step (they compute at once only
  between the bubbles), then, with several copies of the pipeline, an all-reduce of each process's
  gradients.

With activation recomputation each backward pass also runs its block's forward pass again.
"""

from collections.abc import Callable, Sequence
from dataclasses import replace

from multigpu.planning.layouts import Layout
from multigpu.planning.links import Links
from multigpu.planning.memory_estimate import BlockMemory
from multigpu.planning.pipeline_simulation import simulate_step
from multigpu.planning.profile import BlockProfile, PassTimes
from multigpu.strategies.partition import stage_ranges

__all__ = ["forecast", "timed_input"]

MIB = 2**20
DDP_FIRST_BUCKET, DDP_BUCKET = 1 * MIB, 25 * MIB  # DistributedDataParallel's defaults


def timed_input(layout: Layout) -> tuple[int, int, bool]:
    """The images of one input of a device of ``layout`` (a micro-batch, dp's slice of the batch), its processes,
    and whether its backward passes run in two (a zero-bubble pipeline schedule's): what its blocks are timed
    at."""
    pipeline = layout.strategy == "pipeline"
    images = layout.batch_size // layout.micro_batches if pipeline else layout.batch_size
    if layout.strategy == "dp":
        images = -(-layout.batch_size // layout.devices)
    return images, layout.processes, pipeline and layout.pipeline.splits_backward


def forecast(layout: Layout, profile: BlockProfile, links: Links, memory: BlockMemory) -> float | str:
    """Forecast images per second of ``layout``, or why its blocks cannot be timed."""
    times = profile.times(*timed_input(layout))
    if isinstance(times, str):
        return times
    times = times.scaled(links.slowdown(layout.processes))
    read = [nbytes / profile.memory_bandwidth(layout.processes) for nbytes in memory.params]  # the parameters
    forward = [f + seconds for f, seconds in zip(times.forward, read)]
    # The forward pass run again: by each backward call of a recomputed block, both halves of a pass in two.
    again = forward if layout.recompute else [0.0] * len(forward)
    passes = PassTimes(
        forward,
        [b + 3 * seconds + f for b, seconds, f in zip(times.backward, read, again)],  # + the gradients read, written
        times.update,
    )
    if times.input_half is not None and times.weight_half is not None:  # the weight gradients need no parameter
        input_half = [i + seconds + f for i, seconds, f in zip(times.input_half, read, again)]
        weight_half = [w + 2 * seconds + f for w, seconds, f in zip(times.weight_half, read, again)]
        passes = replace(passes, input_half=input_half, weight_half=weight_half)
    return layout.batch_size * layout.replicas / _STEPS[layout.strategy](layout, passes, links, memory)


def _one_device(layout: Layout, passes: PassTimes, links: Links, memory: BlockMemory) -> float:
    return sum(passes.forward) + sum(passes.backward) + sum(passes.update)


def _ddp(layout: Layout, passes: PassTimes, links: Links, memory: BlockMemory) -> float:
    reduce = lambda nbytes: links.all_reduce(nbytes, layout.processes)  # noqa: E731
    backward = overlapped_reduction(passes.backward, memory.params, reduce, links.overlap)
    return sum(passes.forward) + backward + sum(passes.update)


def overlapped_reduction(
    backward: Sequence[float], params: Sequence[int], reduce: Callable[[float], float], overlap: bool
) -> float:
    """Seconds from the start of the backward pass until its last gradient bucket is all-reduced: beside the
    backward pass when ``overlap``, else (the CPU) each bucket's all-reduce holding the computation up."""
    compute = link = 0.0
    bucket, cap = 0, DDP_FIRST_BUCKET
    for seconds, nbytes in zip(reversed(backward), reversed(params)):
        compute += seconds
        bucket += nbytes
        if bucket >= cap:
            link = max(link, compute) + reduce(bucket)
            compute = compute if overlap else link
            bucket, cap = 0, DDP_BUCKET
    if bucket:
        link = max(link, compute) + reduce(bucket)
    return max(compute, link)


def _fsdp(layout: Layout, passes: PassTimes, links: Links, memory: BlockMemory) -> float:
    group, params, forward, backward = layout.processes, memory.params, passes.forward, passes.backward
    gather = lambda block: links.all_gather(params[block], group, latency=False)  # noqa: E731
    scatter = lambda block: links.reduce_scatter(params[block], group, latency=False)  # noqa: E731
    own = [links.sharded_block / 2 if nbytes else 0.0 for nbytes in params]  # the runtime's cost, per pass
    serial, last = not links.overlap, len(params) - 1
    link = gather(0)  # the first block's parameters, before anything computes
    compute = link if serial else 0.0
    for block in range(last + 1):  # forward: block + 1's gather starts as block starts
        start = max(compute, link)
        if block < last:
            link = max(link, start) + gather(block + 1)
            start = link if serial else start
        compute = start + forward[block] + own[block]
    regather = layout.options.get("reshard_after_forward", True)
    if regather:
        link = max(link, compute) + gather(last)
        compute = link if serial else compute
    for block in range(last, -1, -1):  # backward: block - 1's gather, then block's reduce-scatter
        start = max(compute, link) if regather else compute
        if regather and block > 0:
            link = max(link, start) + gather(block - 1)
            start = link if serial else start
        compute = start + backward[block] + own[block]
        link = max(link, compute) + scatter(block)
        compute = link if serial else compute
    return max(compute, link) + sum(passes.update) / group + sum(memory.tensors) * links.sharded_update


def _boundary_bytes(memory: BlockMemory, balance: Sequence[int], images: float) -> list[float]:
    """Bytes each stage's output holds for ``images`` images (the input of the next stage's first block)."""
    stages = stage_ranges(balance)
    return [memory.inputs[stages[s + 1].start] * images if s + 1 < len(stages) else 0.0 for s in range(len(stages))]


def _model_parallel(layout: Layout, passes: PassTimes, links: Links, memory: BlockMemory) -> float:
    sends = _boundary_bytes(memory, layout.balance, layout.batch_size) if links.cuda else []  # CPU: one memory
    moved = 2 * sum(links.send(nbytes) for nbytes in sends)  # activations forward, their gradients back
    reduce = lambda nbytes: links.all_reduce(nbytes, layout.replicas)  # noqa: E731
    backward = overlapped_reduction(passes.backward, memory.params, reduce, links.overlap)
    return sum(passes.forward) + moved + backward + sum(passes.update)


def _data_parallel(layout: Layout, passes: PassTimes, links: Links, memory: BlockMemory) -> float:
    copies = 2 * links.send(sum(memory.params))  # parameters out to the devices, gradients back
    return sum(passes.forward) + sum(passes.backward) + copies + sum(passes.update)


def _pipeline(layout: Layout, passes: PassTimes, links: Links, memory: BlockMemory) -> float:
    pipeline, stages = layout.pipeline, stage_ranges(layout.balance)
    sends = _boundary_bytes(memory, layout.balance, layout.batch_size / layout.micro_batches)

    def per_stage(times: list[float]) -> list[float]:
        return [sum(times[i] for i in blocks) for blocks in stages]

    forward, backward = per_stage(passes.forward), per_stage(passes.backward)
    halves, ran = None, backward  # what a backward pass costs as the schedule runs it
    if passes.input_half is not None and passes.weight_half is not None:
        # torch's first stage computes no input gradients: nothing at its I actions, its whole pass at W.
        halves = ([0.0, *per_stage(passes.input_half)[1:]], [backward[0], *per_stage(passes.weight_half)[1:]])
        ran = [i + w for i, w in zip(*halves)]

    def simulated(scale: float) -> list[float]:
        scaled = lambda times: [scale * t for t in times]  # noqa: E731
        return simulate_step(
            pipeline,
            layout.micro_batches,
            scaled(forward),
            scaled(backward),
            lambda stage: links.send(sends[stage]),
            links.pipeline_action,
            *((scaled(halves[0]), scaled(halves[1])) if halves else ()),
        )

    finish = simulated(1.0)
    # The passes came slowed as if every process computed all the time; between the bubbles fewer do. Slow
    # them as much as the processes' average concurrency over the simulated step does instead.
    computing = layout.replicas * layout.micro_batches * (sum(forward) + sum(ran))  # every copy's processes
    everyone = links.slowdown(layout.processes)
    if everyone > 1.0:
        finish = simulated(links.slowdown(computing / max(finish)) / everyone)
    ends = []
    for process, clock in enumerate(finish):
        held = [i for stage in pipeline.stages_of(process) for i in stages[stage]]
        reduce = links.all_reduce(sum(memory.params[i] for i in held), layout.replicas)
        ends.append(clock + reduce + sum(passes.update[i] for i in held))
    return max(ends)


_STEPS = {
    "auto": _one_device,
    "ddp": _ddp,
    "fsdp": _fsdp,
    "manual_model_parallel": _model_parallel,
    "dp": _data_parallel,
    "pipeline": _pipeline,
}
